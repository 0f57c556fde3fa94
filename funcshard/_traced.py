"""The fully traced mode: ``traced_apply``, the whole step one graph (SimpleFSDP's approach, arXiv 2411.00284).

``apply`` runs a Python runtime around the module (hooks, buffers, async collectives, a schedule it keeps itself);
``torch.compile`` can only compile the code between its calls. ``traced_apply`` has no runtime at all: it is a pure
function of the shards made of traceable ops, so ``torch.compile(step, fullgraph=True)`` takes the whole step
(gathers, forward, loss, backward, reduce-scatters) into one graph:

- per group of the plan and dtype, one all-gather of the group's shards concatenated (a traceable functional
  collective, ``c10d_functional.all_gather_into_tensor``), split back into the parameters (padding dropped);
- ``torch.func.functional_call`` of the module with those parameters;
- backward: autograd's transpose of the all-gather, a reduce-scatter (sum) per group and dtype, then the plan's
  divide factor (``Plan.divide_factor_of``).

What the Plan still decides: which collectives exist (one all-gather and one reduce-scatter per group and dtype, the
plan's groups and their divide factors) and the order they are issued in the program (the plan's group order). What
the compiler decides: when each runs and when gathered parameters are freed (inductor may reorder and bucket; the
plan's prefetch depth, ``reshard_after_forward`` and ``reshard_after_backward`` are not applied: autograd saves the
gathered parameters for backward, as ``reshard_after_forward=False`` does). Eagerly (not compiled) it runs too, with
blocking collectives and no overlap: a reference, not the fast path.

Not built here: ``layout="flat"``, mixed precision (``mp_policy``), frozen parameters (every shard gets a gradient).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from funcshard._compat import all_gather_autograd
from funcshard._plan import Plan
from funcshard._shard import check_state


class _DivideGrad(torch.autograd.Function):
    """Identity whose backward divides the gradient by ``factor`` (the data-parallel mean, once)."""

    @staticmethod
    def forward(x: torch.Tensor, factor: float) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g / ctx.factor, None


def _check(plan: Plan) -> None:
    problems = []
    if plan.layout != "per_param":
        problems.append(f"layout={plan.layout!r} (use layout='per_param')")
    if any(g.param_dtype is not None or g.reduce_dtype is not None for g in plan.groups):
        problems.append("a mixed precision policy (mp_policy)")
    frozen = [s.fqn for s in plan.specs.values() if not s.requires_grad]
    if frozen:
        problems.append(f"frozen parameters {frozen[:5]}")
    if problems:
        raise NotImplementedError(f"funcshard.traced_apply does not support {', '.join(problems)} yet; use "
                                  f"funcshard.apply for these")


@torch.compiler.assume_constant_result  # (run at trace time: the plan is static data, no graph ops)
def _buckets(plan: Plan) -> tuple:
    """Per group and dtype: (divide factor, world, ((path, local numel, local shape, dim, padded shape), ...))."""
    out = []
    for g in plan.groups:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for p in g.params:
            by_dtype.setdefault(plan.specs[p].dtype, []).append(p)
        for names in by_dtype.values():
            specs = [plan.specs[p] for p in names]
            for s in specs:  # (computed here, read from the specs' own dicts while tracing: ShardSpec.unpad)
                s.size, s.padding  # noqa: B018
            out.append((plan.divide_factor_of(g), specs[0].world,
                        tuple((s.fqn, s.local_numel, s.local_shape, s.dim, s.padded_shape) for s in specs)))
    return tuple(out)


def gathered(plan: Plan, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full parameters (every alias of a tied one), gathered with one traceable all-gather per group and dtype;
    differentiable: each shard's gradient is the reduce-scatter of the full gradient divided by the group's factor."""
    pg = plan.mesh.get_group(plan.shard_axis)
    out: dict[str, torch.Tensor] = {}
    for factor, world, params in _buckets(plan):
        flat = torch.cat([state[p].reshape(-1) for p, *_ in params])
        flat = _DivideGrad.apply(flat, factor)
        full = all_gather_autograd(flat, 0, pg).view(world, -1)  # rank-major
        k = 0
        for p, n, local_shape, dim, padded_shape in params:
            piece = full[:, k : k + n].reshape(world, *local_shape)  # (W, *local_shape): every rank's shard
            k += n
            spec = plan.specs[p]
            param = spec.unpad(piece.movedim(0, dim).reshape(padded_shape))
            for alias in spec.aliases:
                out[alias] = param
    return out


def traced_apply(plan: Plan, state: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """``plan.module(*args, **kwargs)`` on the full parameters gathered from ``state``, as traceable ops only: compile
    the step that calls it with ``torch.compile(step, fullgraph=True)`` and the whole step is one graph, its
    collectives included (see the module docstring for what the plan decides and what the compiler does).

    Same values and gradients as :func:`funcshard.apply` (gradients reduce-scattered and divided by the plan's
    factor; under ``funcshard.value_and_grad``, ``torch.func.grad`` or plain autograd), same restrictions on
    ``state``; without apply's memory bound when not compiled.
    """
    check_state(plan, state)  # (under torch.compile: traced once, the guards keep the shapes it saw)
    _check(plan)
    return torch.func.functional_call(plan.module, gathered(plan, state), args, kwargs, tie_weights=False)
