"""Policies and their defaults, each resolved in one place.

``MixedPrecisionPolicy`` / ``OffloadPolicy`` / ``CPUOffloadPolicy`` have torch's fields and defaults (the
adapter accepts torch's classes too). ``reshard_after_forward_default``: the one rule for ``None``.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy", "reshard_after_forward_default"]


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch's fields and defaults. Only the default (no casts) is built; other values raise."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass
class OffloadPolicy:
    """No offloading (the default)."""


@dataclasses.dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Offload parameters, gradients and optimizer state to CPU. Not built yet: ``fully_shard`` raises."""

    pin_memory: bool = True


def reshard_after_forward_default(value: bool | None, *, is_root: bool) -> bool:
    """``None`` means True for every group but the root, which backward uses again at once (FSDP2's rule)."""
    return (not is_root) if value is None else bool(value)
