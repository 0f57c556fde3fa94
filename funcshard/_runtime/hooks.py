"""A group module's forward hooks routed to the step: its own forward, a recomputation in its backward, or neither.

``module_pre_forward`` and ``module_post_forward`` are what the hooks call, as the step's methods
(``Step.module_pre_forward``, ``Step.module_post_forward``): ``apply``'s (registered by ``Step.open_forward``) and
``fully_shard``'s (``fsdp._api``). In the step's forward a group's pass opens and closes (``ForwardTracker``) and its
run gathers, swaps in, frees and hooks its outputs (``GroupRun.gather_for_forward``, ``GroupRun.post_forward``);
inside the step's backward a module call is an activation-checkpoint recomputation (``Recompute``); any other call is
not the step's. Floating inputs and outputs are cast as the group's precision says in the step's forward and
recomputation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from funcshard._compat import current_graph_task_id
from funcshard._policy import cast_floating
from funcshard._runtime.buffers import Status

if TYPE_CHECKING:
    from funcshard._runtime.step import Step

_graph_task_id = current_graph_task_id


def module_pre_forward(step: Step, name: str, module: Any, args: tuple, kwargs: dict | None = None
                       ) -> tuple[tuple, dict] | None:
    """A module of group ``name`` starts its forward. Returns new ``(args, kwargs)`` (or None: unchanged):
    floating inputs cast to the group's ``param_dtype`` (``cast_forward_inputs``), inputs watched for a group
    with frozen parameters."""
    run = step.runs[name]
    group = run.buffers.group
    # (only this step's own forward and recomputation: its hooks outlive the forward until backward ends)
    cast = (group.param_dtype is not None and group.cast_forward_inputs
            and (step.in_forward or (_graph_task_id() != -1 and (step.recomputing() or step.recompute_nested))))
    if cast:
        args, kwargs = cast_floating(group.param_dtype, (args, kwargs or {}))
    if step.in_forward:
        first = name not in step.tracker.used
        opened = step.tracker.enter(name)
        if opened:
            step.prefetcher.opened(name, [n for n in step.tracker.running if step.tracker.is_open(n)])
        if (first or run.buffers.status is not Status.GATHERED  # first use, or again after a reshard
                or (torch.is_grad_enabled() and not run.node.views_grad)):  # or used under no_grad
            run.gather_for_forward()
        elif opened:  # used again, still gathered: its forward prefetch runs again as on its first use
            step.prefetcher.after(name, backward=False)
        run.swap_in()
        watched = step.frozen.watch_inputs(name, args)
        if watched is not None:
            return watched, kwargs or {}
    elif _graph_task_id() != -1:
        if step.recomputing() or step.recompute_nested:  # activation-checkpoint recomputation in backward
            step.recompute.run(name, args)
        elif step.backward_started:
            raise NotImplementedError(
                f"group {name!r} is recomputed inside a nested backward (an activation checkpoint inside a "
                f"reentrant one: torch.utils.checkpoint(..., use_reentrant=True) runs a backward of its own); "
                f"funcshard.apply supports reentrant checkpointing around or over whole groups, not nested in "
                f"another checkpointed region: use use_reentrant=False for the outer one")
    return (args, kwargs) if cast else None


def module_post_forward(step: Step, name: str, module: Any, output: Any) -> Any:
    """A module of group ``name`` finished its forward. Returns the output (hooked for backward, then cast to
    the group's ``output_dtype``)."""
    if step.in_forward:
        run = step.runs[name]
        output = run.post_forward(output) if step.tracker.exit(name, module) else run.wrap_for_backward(output)
    elif step.recomputing():  # recomputation: the group stays gathered until its post-backward
        step.runs[name].swap_out()
    elif not (step.recompute_nested and _graph_task_id() != -1):
        return output  # (another call of the module while this step's hooks live: not this step's)
    dtype = step.groups[name].group.output_dtype
    return output if dtype is None else cast_floating(dtype, output)
