"""Policies and their defaults, each resolved in one place.

``MixedPrecisionPolicy`` / ``OffloadPolicy`` / ``CPUOffloadPolicy`` have torch's fields and defaults (the
adapter accepts torch's classes too). ``reshard_after_forward_default``: the one rule for ``None``.

Mixed precision, FSDP2's rules (torch 2.13), one function each:
- ``compute_dtype``: a parameter is all-gathered and used in ``param_dtype`` if it is floating point (its shard,
  what the optimizer updates, keeps its own dtype);
- ``reduce_dtype_of``: its gradient is reduce-scattered in ``reduce_dtype``, default the compute dtype, then cast to
  the shard's dtype;
- ``divide_factors``: the divide by the gradient divide factor, all after the reduce-scatter in fp32 and bf16 (what
  gloo's AVG and FSDP2's SUM + divide give, bit for bit), split before and after it for other reduce dtypes (fp16:
  overflow), as FSDP2 splits it;
- ``cast_floating``: forward inputs and outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from funcshard._compat import apply_to_tensors

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy", "cast_floating", "check_mp_policy",
           "compute_dtype", "divide_factors", "reduce_dtype_of", "reshard_after_forward_default",
           "resolve_reshard_after_forward"]


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch's fields and defaults (``torch.distributed.fsdp.MixedPrecisionPolicy``). Sharded parameters and their
    gradients keep the parameters' own dtype.

    Attributes:
        param_dtype: the dtype of the all-gather and of the forward and backward compute (None: the parameters' own).
        reduce_dtype: the dtype of the gradient reduce-scatter (None: ``param_dtype``).
        output_dtype: the dtype floating forward outputs are cast to (None: no cast).
        cast_forward_inputs: cast floating forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass
class OffloadPolicy:
    """No offloading (the default)."""


@dataclasses.dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Offload parameters, gradients and optimizer state to CPU (FSDP2's semantics; ``funcshard/_offload.py``):
    sharded parameters and gradients on the host, pinned if ``pin_memory`` (needs an accelerator).

    Attributes:
        pin_memory: keep the host copies in pinned memory (needs an accelerator; False on a CPU-only machine).
    """

    pin_memory: bool = True


def reshard_after_forward_default(value: bool | int | None, *, is_root: bool) -> bool | int:
    """``None`` means True for every group but the root, which backward uses again at once (FSDP2's rule); an int
    (the ranks to reshard to after forward) stays an int, checked against the mesh by the plan."""
    if value is None:
        return not is_root
    return value if isinstance(value, int) else bool(value)


def resolve_reshard_after_forward(value: bool | int, world: int, where: str) -> bool | int:
    """An int ``reshard_after_forward`` checked against the shard axis size ``world`` and normalized (FSDP2's rule): 1
    means False (keep unsharded), ``world`` means True; otherwise it must divide ``world``. Bools pass unchanged."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, int) or value < 1 or value > world or world % value:
        divisors = [d for d in range(2, world) if world % d == 0]
        raise ValueError(
            f"{where}: reshard_after_forward={value!r} must be a bool or an int that divides the shard axis size "
            f"{world} (the ranks to keep the parameters sharded over after forward); pick "
            f"{f'one of {divisors}' if divisors else 'True or False (no block size between 1 and ' + str(world) + ')'}"
        )
    return False if value == 1 else True if value == world else value


_MP_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def check_mp_policy(policy: Any, where: str) -> None:
    """Raise a clear error for a policy that is not a MixedPrecisionPolicy (ours or torch's) or names a dtype that
    is not floating point. ``where``: the unit or group, for the message."""
    if (not any(c.__name__ == "MixedPrecisionPolicy" for c in type(policy).__mro__)
            or not all(hasattr(policy, f) for f in _MP_FIELDS)):
        raise TypeError(f"{where}: mp_policy must be a MixedPrecisionPolicy (funcshard's or "
                        f"torch.distributed.fsdp's), got {type(policy).__name__}; e.g. "
                        f"MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    for f in _MP_FIELDS[:3]:
        dt = getattr(policy, f)
        if dt is not None and (not isinstance(dt, torch.dtype) or not dt.is_floating_point):
            raise ValueError(f"{where}: mp_policy.{f}={dt} is not a floating point dtype; mixed precision computes "
                             f"and reduces in torch.bfloat16, torch.float16 or torch.float32 (None: no cast)")


def compute_dtype(orig: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a parameter of dtype ``orig`` is all-gathered and used in."""
    return param_dtype if param_dtype is not None and orig.is_floating_point else orig


def reduce_dtype_of(compute: torch.dtype, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the gradient of a parameter computed in ``compute`` is reduce-scattered in."""
    return reduce_dtype if reduce_dtype is not None and compute.is_floating_point else compute


def divide_factors(factor: float, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """``(before, after)`` the reduce-scatter (sum), whose product is ``factor``. fp32 and bf16: all after. Other
    dtypes (fp16) risk overflow: FSDP2's split, the largest power of two ``before`` with ``before <= factor /
    before`` that divides ``factor``, the rest after."""
    if reduce_dtype in (torch.float32, torch.bfloat16) or factor == 1.0:
        return 1.0, factor
    before = 1
    while factor % before == 0 and factor / before > before:
        before *= 2
    return float(before), factor / before


def cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    """``tree`` with every floating point tensor of another dtype cast to ``dtype``: FSDP2's input/output cast, with
    its walk (dataclasses, dicts, namedtuples, lists, tuples, sets)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return apply_to_tensors(cast, tree)
