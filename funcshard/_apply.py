"""apply: run the planned module on sharded state, with FSDP's memory behaviour."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from funcshard._collectives import check_transforms
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
    loss. ``state`` and the module's parameters are not modified.

    Buffers are not part of ``state``: they stay the module's own (not sharded, not synced across ranks, not saved
    by ``funcshard.checkpoint``), and a forward that updates them in place (BatchNorm's running statistics in train
    mode) updates the module's buffers, as the module would on its own, under plain autograd and
    ``funcshard.value_and_grad``; ``torch.func`` transforms refuse such updates (a RuntimeError that says so and names
    the buffers): use eval mode or ``track_running_stats=False`` there.
    """
    check_state(plan, state)
    check_mesh(plan.mesh)
    check_transforms("funcshard.apply")
    return Step(plan, dict(state)).run(args, kwargs)
