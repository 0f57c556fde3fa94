"""The Step: one forward/backward of a Plan: one ``GroupRun`` per group, and what spans groups.

    group.GroupRun          one group's life in the step: gather and free, swap in / out, its entry into autograd,
                            its outputs' pre-backward hooks, its reduce-scatter (every gather and free goes through it)
    buffers.GroupBuffers    a group's unsharded buffers and gather state (SHARDED -> GATHERING -> GATHERED)
    binding.Slots           which tensor each parameter slot of a group holds (swap in / out, placeholders)
    binding.ForwardTracker  when a group's forward pass starts and ends (groups of one or several modules)
    hooks                   a group module's forward hooks routed: this step's forward, a recomputation, or neither
    prefetch.Prefetcher     which groups to gather early; the order the forwards ran in
    strategies.Nodes/Relay/Fused   how a group's gather enters autograd (plain, relayed, whole-step)
    backward.ReduceQueue    the reduce-scatters in flight and where their shards go
    backward.FrozenRelease  when a group with frozen parameters may be freed in backward
    backward.Recompute      activation-checkpoint recomputation inside backward
    check.Checks            the ranks agree on which parameters take gradients (always), on the collectives (check mode)

Failures: every wait is bounded by the plan's timeout (``_collectives.wait_work``); a collective that fails, times
out, or a check that finds the ranks diverged raises a ``CollectiveError`` through ``Step.fail``, which puts the
module's own parameters back and drops what is in flight without waiting for it (``part.failing`` marks the methods
that may raise one). ``apply`` is pure, so its state is untouched; ``fully_shard``'s parameters are its sharded DTensors
again.

The Step itself keeps what spans groups (the order and prefetch, the reduce queue, the divergence checks) and routes
module hooks and autograd hooks to the groups' runs; ``open_forward`` / ``close_forward`` wrap
``apply``'s call of the module.
``fully_shard`` drives the same Step from its module hooks (``begin_forward`` / ``module_pre_forward`` /
``module_post_forward`` / ``end_forward``) and receives gradients through a sink.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from typing import Any

import torch

from funcshard._collectives import Bound, CollectiveError, Where, broken, pg_desc, resolve_timeout
from funcshard._compile import runtime_boundary
from funcshard._compat import current_graph_task_id, get_interpreter_stack, queue_callback
from funcshard._layout import layouts
from funcshard._mesh import device_of
from funcshard._plan import ROOT, Plan
from funcshard._policy import cast_floating
from funcshard._runtime.backward import FrozenRelease, Recompute, ReduceQueue
from funcshard._runtime.binding import ForwardTracker, NotGathered, Slots, presents, slots
from funcshard._runtime.buffers import GroupBuffers, Status
from funcshard._runtime.check import Checks
from funcshard._runtime.group import GroupRun, single_grad_level
from funcshard._runtime.hooks import module_post_forward, module_pre_forward
from funcshard._runtime.part import failing
from funcshard._runtime.prefetch import Prefetcher
from funcshard._runtime.saved import SavedViews, regather
from funcshard._runtime.strategies import Fused, Nodes, Relay

_PRE_BACKWARD_SEQ = itertools.count()  # orders the pre-backwards of all steps (Step.last_pre_backward)

_graph_task_id = current_graph_task_id


class _PlanFacts:
    """What every step of one plan needs, computed once per plan (``Plan.derived``)."""

    def __init__(self, plan: Plan):
        self.slots = {g.name: slots(plan, g) for g in plan.groups}
        self.present = {g.name: presents(plan, g) for g in plan.groups}
        self.placeholders = {g.name: [NotGathered(plan.specs[g.params[i]], g.name) for _, _, i in self.slots[g.name]]
                             for g in plan.groups}
        self.members = {g.name: frozenset(id(plan.module.get_submodule(m)) for m in g.modules) for g in plan.groups}
        self.steps: weakref.WeakSet = weakref.WeakSet()  # apply's steps (a backward that raised is finished later)
        self.order_warned = False
        self.seconds = resolve_timeout(plan.timeout)  # the bound on every wait (None: unbounded)
        bound = "none" if self.seconds is None else f"{self.seconds:g} s"
        self.desc = (f"{type(plan.module).__name__} in {len(plan.groups)} groups, timeout {bound}"
                     f"{', check mode' if plan.check else ''}")
        self.masks: dict = {}  # requires-grad masks -> their packed words (check.packed_mask)
        self.mesh = plan.mesh
        self._device: torch.device | None = None

    def device(self, api: str) -> torch.device:
        """The device the plan's steps compute on (``_mesh.device_of``), looked up by its first step; ``api``: what
        the user called, for the error."""
        if self._device is None:
            self._device = device_of(self.mesh, api)
        return self._device


def _facts(plan: Plan) -> _PlanFacts:
    return plan.derived("runtime", _PlanFacts)


class Step:
    """One forward/backward of ``plan`` over ``state`` (the local shards, as given).

    ``sink``: where deferred reduce-scatters deliver the shards (``collect(name, grads) -> (grads | None, extra)``
    and ``deliver(name, shards, extra)``); None: ``apply``'s own paths (relays, or shards returned to autograd).
    ``recompute_nested``: recompute a group inside any backward (``fully_shard``), not only this step's.
    """

    def __init__(self, plan: Plan, state: dict[str, torch.Tensor], *, sink: Any = None,
                 recompute_nested: bool = False):
        self.plan = plan
        self.pg, self.rank = plan.shard_group()
        self.replicate_pg = plan.replicate_group()  # HSDP: gradients all-reduced over it after the reduce-scatter
        self.api = "funcshard.apply" if sink is None else "fully_shard"  # what the user called (for messages)
        for pg in (self.pg, self.replicate_pg):
            if pg is not None and (cause := broken(pg)) is not None:
                raise CollectiveError(
                    f"funcshard: {pg_desc(pg)} cannot be used: {cause} in an earlier step, so its collectives may "
                    f"still be pending and no longer pair up across ranks. Restart the job (or destroy the process "
                    f"group and make a new one, with a new mesh, plan and state) (in a step of {self.api})",
                    repeat=True)
        self.state = state
        self.sink = sink
        self.recompute_nested = recompute_nested
        facts = self.facts = _facts(plan)
        self.bound = Bound(self.pg, facts.seconds, facts.desc, self.api)
        self.device = facts.device(self.api)
        self.failed: str | None = None  # what failed this step (Step.fail), as text
        lay = layouts(plan)
        self.groups = {g.name: GroupBuffers(g, lay[g.name], state, plan, self.device) for g in plan.groups}
        if sink is not None:  # (fully_shard: its parameters, whose in-place changes GroupBuffers.unmark_freed sees)
            for gb in self.groups.values():
                gb.watch = sink.watched(gb.group.params)
        # one group's life in this step: its buffers, module slots, gather node, fused state, frozen-release counts
        self.runs = {name: GroupRun(self, gb, Slots(facts.slots[name], facts.present[name]))
                     for name, gb in self.groups.items()}
        self.tracker = ForwardTracker(facts.members)
        self.prefetcher = Prefetcher(self)
        self.nodes, self.relay, self.fused, self.saved = Nodes(self), Relay(self), Fused(self), SavedViews(self)
        self.reduce_queue, self.frozen, self.recompute = ReduceQueue(self), FrozenRelease(self), Recompute(self)
        self.fused_on = False  # open_forward(): one _StepGather for the step (under a torch.func grad transform)
        self.in_forward = False
        self.backward_started = False
        self.backward_task = -1
        self.graph = False  # a forward of this step recorded autograd history
        self.done = False  # a backward of this step completed
        # apply: a backward with create_graph=True ran, whose graph reads the unsharded parameters again when it is
        # differentiated: no group is freed after backward from then on (GroupRun.free_after_backward)
        self.second_order = False
        # apply, under one torch.func grad level: the call's tensors plain autograd records below it (None: not
        # apply's step; strategies._tracked_below)
        self.below: list | None = None
        self.backward_in_level = False  # apply: this step's backward ran inside its torch.func grad level
        self.hook_handles: list = []
        self.no_backward = False  # open_forward: no autograd, the hooks go when the forward ends
        self.pre_backward_ran: set[str] = set()  # groups whose pre-backward ran in this backward
        # when its latest pre-backward ran (of all steps'): a recomputation inside backward belongs to the step whose
        # pre-backward ran last, as the gradient hook on a checkpointed region's output fires just before the
        # region's first backward node unpacks (recomputes) it
        self.last_pre_backward = -1
        self.ran_early: set[str] = set()  # groups whose pre-backward ran ahead of their own hook (pre_backward)
        self.checks = Checks(self)

    def regather(self, name: str) -> None:
        """A backward reaches group ``name``'s operations by a way its output hooks do not see (apply's gradients under
        one torch.func.grad level, differentiated below the transform: ``strategies.differentiated_below``): gather
        it if it is not (``saved.regather``: its pre-backward)."""
        regather(self, name)

    def phase(self) -> str:
        return "backward" if self.backward_started else "forward"

    def where(self, kind: str, name: str) -> Where:
        """What a collective's wait names and is bounded by."""
        return Where(kind, name, self.phase(), self.bound)

    def fail(self, error: CollectiveError) -> None:
        """A collective of this step failed or timed out, or the ranks diverged: put the module's own parameters back,
        free what is gathered, drop what is in flight without waiting (its buffers stay with the backend's work)."""
        if self.failed is not None:
            return
        self.failed = f"{type(error).__name__}: {error}"  # (text, not the error: its traceback's frames hold the
        # graph, which holds the step: a cycle through autograd's C++ nodes that gc cannot break; steps leaked)
        self.reduce_queue.clear()
        self.in_forward = False
        for run in self.runs.values():
            run.drop()

    def retarget(self, plan: Plan) -> None:
        """Take the settings of an edited plan of the same groups (``fully_shard``'s ``set_*`` calls while a step
        runs: they apply at once, as FSDP2 reads them when it uses them)."""
        mine = [g.name for g in self.plan.groups]
        if {g.name: g.params for g in plan.groups} != {g.name: g.params for g in self.plan.groups}:
            raise ValueError("Step.retarget: the plan has other groups; a new step is needed")
        if [g.name for g in plan.groups] != mine:  # (the step keeps its order: the whole-step gather's inputs)
            plan = plan.with_order(mine[1:])
        self.plan = plan
        for g in plan.groups:
            self.groups[g.name].group = g

    def carry_over(self, old: Step) -> None:
        """Groups the last step left gathered (the root after forward, reshard_after_backward=False, unshard())
        move to this step without a second all-gather once that step's graph is done with them."""
        old.reduce_queue.drop()  # a backward that raised half-way: its gradients are not delivered
        reuse = old.done or not old.graph
        for name, run in old.runs.items():
            if reuse and run.buffers.status is not Status.SHARDED and name in self.runs:
                self.runs[name].take_over(run)
            else:
                run.release()

    def abandon(self) -> None:
        """After a forward or backward raised: drop what is in flight, free every group."""
        self.reduce_queue.drop()
        for run in self.runs.values():
            run.release()

    # ---- forward ------------------------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self.in_forward = True

    # a module hook of a group, routed (this step's forward, a recomputation in its backward, or neither): written in
    # ``_runtime.hooks``, called as the step's methods by apply's hooks (below) and fully_shard's (``fsdp._api``)
    module_pre_forward = module_pre_forward
    module_post_forward = module_post_forward

    @failing
    def end_forward(self) -> None:
        """Groups whose modules did not all run finish now; prefetched groups the forward never used are freed."""
        self.in_forward = False
        self.checks.collective("end of forward")
        self.checks.post()
        for name in self.tracker.unfinished():
            self.prefetcher.closed(name)
            self.runs[name].swap_out()
            self.runs[name].reshard_after_forward()
        for name in self.prefetcher.unused():
            if self.groups[name].group.reshard_after_forward:
                self.runs[name].reshard()
        self.graph = self.graph or torch.is_grad_enabled()

    # ---- backward -----------------------------------------------------------------------------------------------
    @failing
    def begin_backward(self) -> None:
        task = _graph_task_id()
        if self.backward_task != task:  # by task: a backward that raised half-way never ran its callback
            self.backward_started, self.backward_task = True, task
            self.pre_backward_ran.clear()
            self.ran_early.clear()
            queue_callback(self.end_of_backward)

    def note_backward(self) -> None:
        """A gradient reached this step's outputs: its backward runs, and recomputations in it are this step's until
        another step's pre-backward runs (``last_pre_backward``)."""
        self.begin_backward()
        self.last_pre_backward = next(_PRE_BACKWARD_SEQ)

    def recomputing(self) -> bool:
        """Inside this step's running backward (a backward that raised half-way leaves backward_started set; a
        later forward must not take this step's hooks for recomputation)."""
        return self.backward_started and _graph_task_id() == self.backward_task

    def pre_backward(self, name: str) -> None:
        """The gradient reached the group's outputs: gather it (and prefetch). The groups enclosing it (the root, and
        those whose forward pass was open when its own opened) run theirs first if they have not yet in this
        backward: a group nested in another returns the tensor its parent returns, and the child's hook, registered
        first, fires first there; the parent is gathered before it either way, the schedule's order (and the reverse
        of the order the passes closed in, which backward prefetch follows)."""
        self.note_backward()
        gb = self.groups[name]
        if name in self.ran_early:  # ran before a nested group's: done, unless freed since (another use)
            self.ran_early.discard(name)
            if not (gb.shards and gb.group.unshard_in_backward and gb.status is Status.SHARDED):
                return
        if name != ROOT:
            for outer in (ROOT, *self.prefetcher.enclosing.get(name, ())):
                if outer not in self.pre_backward_ran:
                    self.ran_early.add(outer)
                    self.runs[outer].pre_backward()
        self.runs[name].pre_backward()

    @runtime_boundary  # (autograd's end-of-backward callback, under torch.compile too)
    @failing
    def end_of_backward(self, cleanup: bool = False) -> None:
        """``cleanup``: a backward that raised half-way, finished by a later step (no checks: the ranks may not all
        be here)."""
        if cleanup:
            self.reduce_queue.drop()
        self.reduce_queue.finish()  # (apply: its shards are dropped when nobody asked for them in this backward)
        if not cleanup and self.failed is None:
            self.checks.collective("end of backward")
        for run in self.runs.values():
            run.end_backward()
        self.backward_started, self.done = False, True
        if not self.recompute.reentrant:
            _remove(self.hook_handles)  # (a reentrant recomputation runs them again in a later backward)

    # ---- apply's forward ----------------------------------------------------------------------------------------
    def open_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Hook the group modules, gather the root group onto the module; returns the module's (cast) inputs.
        ``apply`` runs ``open_forward``, the module, then ``close_forward`` (or ``forward_failed``): three calls, so
        that ``torch.compile`` can trace the module's forward between two runtime calls it does not look into."""
        plan, facts = self.plan, self.facts
        # The group modules' hooks live until the end of backward (or until the step is garbage collected, e.g.
        # when no backward comes): activation checkpointing recomputes forwards during backward, and a region
        # spanning several groups needs each of them gathered again.
        handles = self.hook_handles
        for g in plan.groups[1:]:
            pre, post = _make_pre_hook(self, g.name), _make_post_hook(self, g.name)
            for path in g.modules:
                mod = plan.module.get_submodule(path)
                handles.append(mod.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
                handles.append(mod.register_forward_hook(post, always_call=True))
        weakref.finalize(self, _remove, handles)
        if _graph_task_id() == -1:  # not a recomputation inside some backward
            for old in list(facts.steps):
                if old.backward_started:  # its backward raised half-way: finish it (free, unhook) now
                    old.end_of_backward(cleanup=True)
                    old.relay.drop()  # and what its relays did not hand on
        facts.steps.add(self)
        self.no_backward = not torch.is_grad_enabled()  # then the hooks go when the forward ends
        try:
            for g in plan.groups[1:]:
                self.runs[g.name].slots.set_rest(facts.placeholders[g.name])
            self.fused_on = single_grad_level() and any(t.requires_grad for t in self.state.values())
            self.relay.on = (not self.fused_on and torch.is_grad_enabled()
                             and not get_interpreter_stack())
            if self.fused_on:
                self.fused.begin()
            self.runs[ROOT].gather_for_forward()
            self.runs[ROOT].swap_in()
            self.begin_forward()
            self.saved.begin()  # (a freed group gathered when backward reads its saved parameters)
            root = plan.groups[0]
            if root.param_dtype is not None and root.cast_forward_inputs:
                args, kwargs = cast_floating(root.param_dtype, (args, kwargs))
        except BaseException:
            self.forward_failed()
            raise
        return args, kwargs

    def forward_failed(self) -> None:
        """The module's forward (or ``open_forward``) raised: unhook, put the module's parameters back."""
        _remove(self.hook_handles)
        self._leave_forward()

    def _leave_forward(self) -> Any:
        """Leave the forward; returns what must live as long as the root output's backward hook (``Fused``: the
        graph's parameter views, held by the graph, not by the step)."""
        self.in_forward = False
        self.saved.pop()
        self.relay.end_forward()
        if self.no_backward:
            _remove(self.hook_handles)
        for name, run in self.runs.items():
            run.swap_out()
            run.slots.set_rest(None)
            self.nodes.loosen(name)
        return self.fused.end_forward()

    def close_forward(self, out: Any) -> Any:
        """The module's forward returned ``out``: finish the forward, hook ``out`` for backward."""
        plan = self.plan
        keeper = self._leave_forward()
        self.runs[ROOT].reshard_after_forward()
        self.end_forward()
        if plan.order_differs(self.prefetcher.order):
            _warn_order(plan, self.facts, self.prefetcher.order)
        out = self.runs[ROOT].wrap_for_backward(out, keeper)
        dtype = plan.groups[0].output_dtype
        return out if dtype is None else cast_floating(dtype, out)


def _warn_order(plan: Plan, facts: _PlanFacts, order: list[str]) -> None:
    """Once per plan: its groups ran out of the plan's order, so the default prefetch gathers the wrong ones."""
    if facts.order_warned:
        return
    facts.order_warned = True
    warnings.warn(
        f"funcshard.apply: the groups' forwards ran in the order {tuple(order)}, not in the plan's order "
        f"{tuple(g.name for g in plan.groups[1:])}; prefetching follows the plan, so it gathers groups early that "
        f"are not next (more memory, less overlap). Use plan = plan.with_order({tuple(order)!r})",
        stacklevel=3,
    )


def buffer_update_error(plan: Plan, error: BaseException) -> RuntimeError | None:
    """The error to raise instead of ``error`` from the module's forward, if any: torch.func's refusal of an
    in-place buffer update, explained."""
    if isinstance(error, RuntimeError) and "mutate a captured Tensor" in str(error) and get_interpreter_stack():
        return RuntimeError(_buffer_update_message(plan))
    return None


def _buffer_update_message(plan: Plan) -> str:
    """torch.func refused an in-place update of a captured tensor in the module's forward: in practice a buffer
    (BatchNorm's running statistics in train mode). Buffers are the module's own, not part of the state."""
    bufs = [n for n, b in plan.module.named_buffers() if b.is_floating_point()]
    shown = f"{bufs[:6]}{' ...' if len(bufs) > 6 else ''}" if bufs else "none found"
    return ("funcshard.apply: the module updated a tensor in place that the torch.func transform did not get as an "
            f"input (torch: 'mutate a captured Tensor'), in practice a buffer (its floating buffers: {shown}), e.g. "
            "BatchNorm's running statistics in train mode. Buffers are not part of funcshard's state: they stay the "
            "module's own (not sharded, not synced across ranks, not saved by funcshard.checkpoint), and "
            "torch.func cannot update them. Fix: train with funcshard.value_and_grad or loss.backward() (plain "
            "autograd: the module updates its buffers as it would on its own), or put those modules in eval mode "
            "(or build them with track_running_stats=False) under torch.func")


@runtime_boundary  # (also weakref.finalize's callback: it may run at any allocation, inside compiled code too)
def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


@runtime_boundary  # (its name is the graph break's, as test_compile pins it)
def pre_hook(ref, name: str, module, args, *kwargs):
    step = ref()
    if step is None:
        return None
    if not kwargs:  # (torch calls a hook removed while the module's hooks run without kwargs: args only)
        new = step.module_pre_forward(name, module, args, {})
        return None if new is None else new[0]
    return step.module_pre_forward(name, module, args, kwargs[0])


@runtime_boundary
def post_hook(ref, name: str, module, args, output):
    step = ref()
    if step is None:
        return None
    out = step.module_post_forward(name, module, output)
    return None if out is output else out


def _make_pre_hook(step: Step, name: str):
    # (a partial of one marked function: marking a closure per group and step cost ~35 us each)
    return functools.partial(pre_hook, weakref.ref(step), name)  # the hooks outlive the forward: a weak step


def _make_post_hook(step: Step, name: str):
    return functools.partial(post_hook, weakref.ref(step), name)
