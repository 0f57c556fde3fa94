"""apply: run the planned module on sharded state, with FSDP's memory behaviour."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from funcshard._primitives import check_transforms
from funcshard._compile import runtime_boundary
from funcshard._mesh import check_mesh
from funcshard._plan import Plan
from funcshard._runtime import Step
from funcshard._runtime.step import buffer_update_error
from funcshard._shard import check_state


def apply(plan: Plan, state: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """Run ``plan.module(*args, **kwargs)`` with the parameters in ``state`` (local shards).

    Each group is all-gathered just before its first module runs (the next ``plan.forward_prefetch``
    groups' all-gathers are issued then, to overlap), freed after its forward when the plan says so, gathered
    again before its backward, and its gradient reduce-scattered as soon as it is complete.

    Differentiable with respect to ``state`` under ``torch.func.grad`` / ``grad_and_value`` / ``vjp`` / ``jvp`` and
    plain autograd (``loss.backward()`` with ``requires_grad`` shards); one ``torch.func`` level at most (nested
    transforms, ``vmap`` included, raise ``NotImplementedError``). Gradients have the keys and local
    shapes of ``state`` and are divided once by ``plan.divide_factor`` (default: the number of data-parallel
    ranks), so each rank computing the mean loss of its local batch yields the gradient of the global mean
    loss. ``state`` and the module's parameters are not modified.

    Buffers are not part of ``state``: they stay the module's own (not sharded, not synced across ranks, not saved
    by ``funcshard.checkpoint``), and a forward that updates them in place (BatchNorm's running statistics in train
    mode) updates the module's buffers, as the module would on its own, under plain autograd and
    ``funcshard.value_and_grad``; ``torch.func`` transforms refuse such updates (a RuntimeError that says so and names
    the buffers): use eval mode or ``track_running_stats=False`` there.

    Under ``torch.compile`` the module's forward is traced (each group's modules between its hooks) and the
    runtime is not: a graph break on entry, one at each group's hooks, one on exit (``funcshard._compile``). So
    ``torch.compile(..., fullgraph=True)`` cannot trace it (dynamo's error carries the way out):
    :func:`funcshard.traced_apply` is the fully traced mode, with the same arguments.

    Args:
        plan: from :func:`funcshard.plan`.
        state: this rank's shards, keyed like ``plan.specs`` (:func:`funcshard.shard`'s result, or what an optimizer
            made of it).
        *args: the module's positional inputs (this rank's batch).
        **kwargs: the module's keyword inputs.
    """
    step, args, kwargs = _enter(plan, state, args, kwargs)
    try:
        out = plan.module(*args, **kwargs)
    except BaseException as e:
        explained = _failed(step, e)
        if explained is not None:
            raise explained from e
        raise
    return _exit(step, out)


@runtime_boundary
def _enter(plan: Plan, state: Mapping[str, torch.Tensor], args: tuple, kwargs: dict) -> tuple[Step, tuple, dict]:
    check_state(plan, state)
    check_mesh(plan.mesh)
    check_transforms("funcshard.apply")
    step = Step(plan, dict(state))
    return step, *step.open_forward(args, kwargs)


@runtime_boundary
def _failed(step: Step, error: BaseException) -> RuntimeError | None:
    step.forward_failed()
    return buffer_update_error(step.plan, error)


@runtime_boundary
def _exit(step: Step, out: Any) -> Any:
    return step.close_forward(out)
