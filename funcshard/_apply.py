"""apply: run the planned module on sharded state, with FSDP's memory behaviour."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from funcshard._collectives import check_transforms
from funcshard._compile import runtime_boundary
from funcshard._mesh import check_mesh
from funcshard._plan import Plan
from funcshard._runtime import Step
from funcshard._shard import check_state


def apply(plan: Plan, state: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """Run ``plan.module(*args, **kwargs)`` with the parameters in ``state`` (local shards).

    Each group is all-gathered just before its first module runs (the next ``plan.forward_prefetch``
    groups' all-gathers are issued then, to overlap), freed after its forward when the plan says so, gathered
    again before its backward, and its gradient reduce-scattered as soon as it is complete.

    Differentiable with respect to ``state`` under ``torch.func.grad`` / ``grad_and_value`` / ``vjp`` and
    plain autograd (``loss.backward()`` with ``requires_grad`` shards). Gradients have the keys and local
    shapes of ``state`` and are divided once by ``plan.divide_factor`` (default: the number of data-parallel
    ranks), so each rank computing the mean loss of its local batch yields the gradient of the global mean
    loss. Pure: neither ``state`` nor the module's own tensors are modified.

    Under ``torch.compile`` the module's forward is traced (each group's modules between its hooks) and the
    runtime is not: a graph break on entry, one at each group's hooks, one on exit (``funcshard._compile``).
    """
    step, args, kwargs = _enter(plan, state, args, kwargs)
    try:
        out = plan.module(*args, **kwargs)
    except BaseException:
        _failed(step)
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
def _failed(step: Step) -> None:
    step.forward_failed()


@runtime_boundary
def _exit(step: Step, out: Any) -> Any:
    return step.close_forward(out)
