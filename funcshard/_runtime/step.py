"""The Step: one forward/backward of a Plan, composed of parts that each own one job.

    buffers.GroupBuffers    a group's unsharded buffers and gather state (SHARDED -> GATHERING -> GATHERED)
    binding.Binding         which tensor each parameter slot of the module holds (swap in / out, placeholders)
    binding.ForwardTracker  when a group's forward pass starts and ends (groups of one or several modules)
    prefetch.Prefetcher     which groups to gather early; the order the forwards ran in
    strategies.Nodes/Relay/Fused   how a group's gather enters autograd (plain, relayed, whole-step)
    backward.ReduceQueue    the reduce-scatter in flight and where its shards go
    backward.FrozenRelease  when a group with frozen parameters may be freed in backward
    backward.Recompute      activation-checkpoint recomputation inside backward
    check.Checks            the ranks agree on which parameters take gradients (always), on the collectives (check mode)

Failures: every wait is bounded by the plan's timeout (``_collectives.wait_work``); a collective that fails, times
out, or a check that finds the ranks diverged raises a ``CollectiveError`` through ``Step.fail``, which puts the
module's own parameters back and drops what is in flight without waiting for it (``_failing`` marks the methods that
may raise one). ``apply`` is pure, so its state is untouched; ``fully_shard``'s parameters are its sharded DTensors
again.

The Step itself routes module hooks and autograd hooks to them; ``open_forward`` / ``close_forward`` wrap
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

from funcshard._collectives import (
    Bound,
    CollectiveError,
    Where,
    broken,
    no_functorch,
    pg_desc,
    raw_grads,
    resolve_timeout,
)
from funcshard._compile import runtime_boundary
from funcshard._compat import (
    TransformType,
    current_graph_task_id,
    get_interpreter_stack,
    maybe_current_level,
    queue_callback,
)
from funcshard._layout import layouts
from funcshard._mesh import device_of
from funcshard._plan import ROOT, Plan
from funcshard._policy import cast_floating
from funcshard._runtime.backward import FrozenRelease, Recompute, ReduceQueue, grad_inputs
from funcshard._runtime.binding import Binding, ForwardTracker, NotGathered, presents, slots
from funcshard._runtime.buffers import GroupBuffers, Status
from funcshard._runtime.check import Checks
from funcshard._runtime.observe import LISTENERS, emit
from funcshard._runtime.prefetch import Prefetcher
from funcshard._runtime.strategies import Fused, Nodes, Relay

_PRE_BACKWARD_SEQ = itertools.count()  # orders the pre-backwards of all steps (Step.last_pre_backward)

_graph_task_id = current_graph_task_id
_functorch_level = maybe_current_level


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


def _failing(method):
    """A Step method that may raise a CollectiveError: the step fails first (``Step.fail``)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except CollectiveError as e:
            self.fail(e)
            raise

    return wrapper


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
        for pg in (self.pg, self.replicate_pg):
            if pg is not None and (cause := broken(pg)) is not None:
                raise CollectiveError(
                    f"funcshard: {pg_desc(pg)} cannot be used: {cause} in an earlier step, so its collectives may "
                    f"still be pending and no longer pair up across ranks. Restart the job (or destroy the process "
                    f"group and make a new one, with a new mesh, plan and state)", repeat=True)
        self.state = state
        self.sink = sink
        self.recompute_nested = recompute_nested
        facts = self.facts = _facts(plan)
        self.bound = Bound(self.pg, facts.seconds, facts.desc)
        self.device = device_of(plan.mesh, "funcshard.apply" if sink is None else "fully_shard")
        self.failed: str | None = None  # what failed this step (Step.fail), as text
        lay = layouts(plan)
        self.groups = {g.name: GroupBuffers(g, lay[g.name], state, plan, self.device) for g in plan.groups}
        self.binding = Binding(facts.slots, facts.present)
        self.tracker = ForwardTracker(facts.members)
        self.prefetcher = Prefetcher(self)
        self.nodes, self.relay, self.fused = Nodes(self), Relay(self), Fused(self)
        self.reduce_queue, self.frozen, self.recompute = ReduceQueue(self), FrozenRelease(self), Recompute(self)
        self._pre_backward_hooks = {g.name: _pre_backward_hook(self, g.name) for g in plan.groups}
        self.fused_on = False  # open_forward(): one _StepGather for the step (under a torch.func grad transform)
        self.in_forward = False
        self.backward_started = False
        self.backward_task = -1
        self.graph = False  # a forward of this step recorded autograd history
        self.done = False  # a backward of this step completed
        self.hook_handles: list = []
        self.no_backward = False  # open_forward: no autograd, the hooks go when the forward ends
        self.pre_backward_ran: set[str] = set()  # groups whose pre-backward ran in this backward
        # when its latest pre-backward ran (of all steps'): a recomputation inside backward belongs to the step whose
        # pre-backward ran last, as the gradient hook on a checkpointed region's output fires just before the
        # region's first backward node unpacks (recomputes) it
        self.last_pre_backward = -1
        self.ran_early: set[str] = set()  # groups whose pre-backward ran ahead of their own hook (pre_backward)
        self.checks = Checks(self)

    # ---- the group lifecycle (every gather and free goes through these) ----------------------------------------
    def unshard(self, name: str) -> None:
        """Issue the group's all-gather (async) unless it is gathered or in flight."""
        if self.backward_started and not self.groups[name].group.unshard_in_backward:
            return  # the user promised its backward reads no parameters (set_unshard_in_backward(False))
        self.issue(name)

    def phase(self) -> str:
        return "backward" if self.backward_started else "forward"

    def where(self, kind: str, name: str) -> Where:
        """What a collective's wait names and is bounded by."""
        return Where(kind, name, self.phase(), self.bound)

    @_failing
    def issue(self, name: str) -> None:
        """Issue the group's all-gather (async) unless it is gathered or in flight (whatever unshard_in_backward
        says). Check mode: the ranks agree on it first."""
        gb = self.groups[name]
        if gb.status is not Status.SHARDED:
            return
        if gb.shards:
            self.reduce_queue.before_gather()
        if gb.shards and self.checks.sequence:
            kind = "re-gather" if gb.post is not None else "all-gather"
            self.checks.collective(f"{kind} of group {name!r} ({self.phase()})")
        gb.issue(self.pg, self.rank, self.where("all-gather", name))

    def fail(self, error: CollectiveError) -> None:
        """A collective of this step failed or timed out, or the ranks diverged: put the module's own parameters back,
        free what is gathered, drop what is in flight without waiting (its buffers stay with the backend's work)."""
        if self.failed is not None:
            return
        self.failed = f"{type(error).__name__}: {error}"  # (text, not the error: its traceback's frames hold the
        # graph, which holds the step: a cycle through autograd's C++ nodes that gc cannot break; steps leaked)
        self.reduce_queue.item = None
        self.in_forward = False
        for name, gb in self.groups.items():
            self.binding.swap_out(name)
            if gb.status is Status.GATHERING:
                gb.drop()
            else:
                gb.free()
            gb.post = None
            self.nodes.loosen(name)

    @_failing
    def wait(self, name: str) -> None:
        gb = self.groups[name]
        if gb.status is Status.SHARDED:
            self.unshard(name)
        gb.wait()

    @_failing
    def reshard(self, name: str) -> None:
        """Free the group's unsharded parameters (the module never keeps views of freed storage)."""
        self.binding.swap_out(name)
        self.groups[name].free()

    @_failing
    def reshard_after_forward(self, name: str) -> None:
        """Free the group after forward if its plan says so, or keep it sharded over fewer ranks (an int
        ``reshard_after_forward``: its next gather runs within that block)."""
        group = self.groups[name].group
        k = self.plan.post_forward_world(group)
        if k is None:
            if group.reshard_after_forward:
                self.reshard(name)
            return
        self.binding.swap_out(name)
        self.groups[name].reshard_to(*self.plan.post_forward_group(k), k)

    def free_after_backward(self, name: str) -> None:
        if self.groups[name].group.reshard_after_backward:
            self.reshard(name)

    def release(self, name: str) -> None:
        """Free the group and put the module's own parameters back (outside forward and backward)."""
        self.reshard(name)  # (it swaps the module's own parameters back in)
        self.nodes.loosen(name)

    def swap_in(self, name: str) -> None:
        b = self.binding.groups[name]
        if not b.swapped and b.views is None and self.nodes.saved_views(name) is None:
            return
        self.binding.swap_in(name)

    def swap_out(self, name: str) -> None:
        self.binding.swap_out(name)

    def register_unsharded(self, name: str) -> None:
        """Put the gathered (unpadded) parameters on the module, outside autograd (``unshard()``)."""
        gb = self.groups[name]
        if gb.status is Status.GATHERED and not self.binding.groups[name].swapped:
            ns = self.nodes.groups[name]
            self.binding.groups[name].views, ns.node = gb.views(), None
            ns.views_grad = False  # (no autograd history: a use with grad gathers through a node again)
            self.swap_in(name)

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
        for name, gb in old.groups.items():
            if reuse and gb.status is not Status.SHARDED and name in self.groups:
                swapped = old.binding.groups[name].swapped
                old.swap_out(name)
                self.groups[name].take_from(gb)
                old.binding.groups[name].views = None
                if swapped:
                    self.register_unsharded(name)
            else:
                old.release(name)

    def abandon(self) -> None:
        """After a forward or backward raised: drop what is in flight, free every group."""
        self.reduce_queue.drop()
        for name in self.groups:
            self.release(name)

    # ---- forward ------------------------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self.in_forward = True

    def module_pre_forward(self, name: str, module: Any, args: tuple, kwargs: dict | None = None
                           ) -> tuple[tuple, dict] | None:
        """A module of group ``name`` starts its forward. Returns new ``(args, kwargs)`` (or None: unchanged):
        floating inputs cast to the group's ``param_dtype`` (``cast_forward_inputs``), inputs watched for a group
        with frozen parameters."""
        group = self.groups[name].group
        # (only this step's own forward and recomputation: its hooks outlive the forward until backward ends)
        cast = (group.param_dtype is not None and group.cast_forward_inputs
                and (self.in_forward or (_graph_task_id() != -1 and (self.recomputing() or self.recompute_nested))))
        if cast:
            args, kwargs = cast_floating(group.param_dtype, (args, kwargs or {}))
        if self.in_forward:
            first = name not in self.tracker.used
            opened = self.tracker.enter(name)
            if opened:
                self.prefetcher.opened(name, [n for n in self.tracker.running if self.tracker.is_open(n)])
            if (first or self.groups[name].status is not Status.GATHERED  # first use, or again after a reshard
                    or (torch.is_grad_enabled() and not self.nodes.groups[name].views_grad)):  # or used under no_grad
                self.gather_for_forward(name)
            elif opened:  # used again, still gathered: its forward prefetch runs again as on its first use
                self.prefetcher.after(name, backward=False)
            self.swap_in(name)
            watched = self.frozen.watch_inputs(name, args)
            if watched is not None:
                return watched, kwargs or {}
        elif _graph_task_id() != -1:
            if self.recomputing() or self.recompute_nested:  # activation-checkpoint recomputation in backward
                self.recompute.run(name, args)
            elif self.backward_started:
                raise NotImplementedError(
                    f"group {name!r} is recomputed inside a nested backward (an activation checkpoint inside a "
                    f"reentrant one: torch.utils.checkpoint(..., use_reentrant=True) runs a backward of its own); "
                    f"funcshard.apply supports reentrant checkpointing around or over whole groups, not nested in "
                    f"another checkpointed region: use use_reentrant=False for the outer one")
        return (args, kwargs) if cast else None

    def module_post_forward(self, name: str, module: Any, output: Any) -> Any:
        """A module of group ``name`` finished its forward. Returns the output (hooked for backward, then cast to
        the group's ``output_dtype``)."""
        if self.in_forward:
            if self.tracker.exit(name, module):
                output = self.post_forward(name, output)
            else:
                output = self.wrap_for_backward(name, output)
        elif self.recomputing():  # recomputation: the group stays gathered until its post-backward
            self.swap_out(name)
        elif not (self.recompute_nested and _graph_task_id() != -1):
            return output  # (another call of the module while this step's hooks live: not this step's)
        dtype = self.groups[name].group.output_dtype
        return output if dtype is None else cast_floating(dtype, output)

    def gather_for_forward(self, name: str) -> None:
        self.swap_out(name)  # (parameters registered by unshard() make way for autograd-visible ones)
        self.prefetcher.used(name)
        self.unshard(name)
        self.wait(name)
        self.prefetcher.after(name, backward=False)
        gb, ns = self.groups[name], self.nodes.groups[name]
        grad = torch.is_grad_enabled()
        if not self.fused_on and ns.views_grad and not grad and gb.shards:
            # used again under no_grad after a use with grad: keep the views with autograd history (refilled in
            # place), which activation checkpointing recomputes with in backward
            return
        ns.views_grad, ns.node = grad, None
        if not gb.shards:
            self.binding.groups[name].views = ()
        elif self.fused_on:
            self.binding.groups[name].views = self.fused.views(name)
        elif _functorch_level() is not None:  # torch.func.jvp: the new-style Function (it has the jvp rule)
            self.nodes.gather_jvp(name)
        else:
            relayed = self.relay.on and gb.trainable and grad  # (a no-grad use needs no relay)
            self.nodes.gather(name, self.relay.tokens_for(name) if relayed else None)

    def post_forward(self, name: str, output: Any) -> Any:
        self.prefetcher.closed(name)
        self.swap_out(name)
        self.nodes.loosen(name)
        self.reshard_after_forward(name)
        return self.wrap_for_backward(name, output)

    @_failing
    def end_forward(self) -> None:
        """Groups whose modules did not all run finish now; prefetched groups the forward never used are freed."""
        self.in_forward = False
        self.checks.collective("end of forward")
        self.checks.post()
        for name in self.tracker.unfinished():
            self.prefetcher.closed(name)
            self.swap_out(name)
            self.reshard_after_forward(name)
        for name in self.prefetcher.unused():
            if self.groups[name].group.reshard_after_forward:
                self.reshard(name)
        self.graph = self.graph or torch.is_grad_enabled()

    def wrap_for_backward(self, name: str, output: Any, keeper: list | None = None) -> Any:
        """Hook the group's outputs so the group is gathered again before its backward runs: a gradient hook on
        the outputs fires once the first output gradient is ready, before any backward op of the group. The hooks
        of a fused forward hold its ``keeper`` (``Fused.end_forward``: the graph's views live as long as they do)."""
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor):  # (the usual case, without a pytree walk)
            tensors = [output] if output.requires_grad else []
        else:
            tensors = grad_inputs(output)
        if not tensors:
            return output
        # A group without trainable parameters has no gather node in the graph to keep the step alive until its
        # backward: its hooks hold the step themselves (made per call, not kept by the step: no reference cycle).
        strong = not self.groups[name].trainable
        keeper = self.fused.keeper if keeper is None else keeper
        if len(tensors) > 1 and _single_grad_level():
            # one hook per tensor (a multi-grad hook cannot replace gradients); pre_backward once per call
            hook = _pre_backward_hook(self, name, once=True, strong=strong, keeper=keeper)
            for t in tensors:
                t.register_hook(hook)
            return output
        if strong or keeper is not None:
            hook = _pre_backward_hook(self, name, strong=strong, keeper=keeper)
        else:
            hook = self._pre_backward_hooks[name]
        if len(tensors) == 1:
            tensors[0].register_hook(hook)
        else:
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        return output

    # ---- backward -----------------------------------------------------------------------------------------------
    @_failing
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
                    self._pre_backward(outer)
        self._pre_backward(name)

    def _pre_backward(self, name: str) -> None:
        self.pre_backward_ran.add(name)
        self.unshard(name)
        self.wait(name)
        gb = self.groups[name]
        if ((self.binding.groups[name].views is None or not self.nodes.groups[name].views_grad) and gb.trainable
                and not self.fused_on and gb.status is Status.GATHERED and self.nodes.saved_views(name) is None):
            # The module holds no views with autograd history: no recorded op used the group's parameters (reentrant
            # checkpointing inside the group's forward ran them under no_grad), or the group stayed gathered after
            # forward with its parameters registered without history (reshard_after_forward=False). A recomputation
            # that runs no hook of ours (torch.utils.checkpoint inside the unit: checkpoint_wrapper) reads these: with
            # grad, as in the forward (or it saves fewer tensors: CheckpointError); a reentrant one's backward reaches
            # their node (the group's post-backward).
            self.swap_out(name)  # (the registered views make way)
            with torch.enable_grad():
                self.nodes.gather(name, None, count=False)  # (the forward's node was counted)
        if gb.status is Status.SHARDED:  # not gathered (unshard_in_backward=False): no views
            self.swap_out(name)
        else:
            self.swap_in(name)  # activation-checkpoint recomputation reads the module's attributes
        self.prefetcher.after(name, backward=True)

    def divide_factor(self, name: str) -> float:
        return self.plan.divide_factor_of(self.groups[name].group)

    @_failing
    def post_backward(self, name: str, grads: list) -> list:
        """The group's gradients are complete: free it, then reduce-scatter them (consumes ``grads``; FSDP2's order,
        so the unsharded parameters are gone before the reduce-scatter's buffers are allocated). Returns the
        shards, or (with a sink) Nones: the shards go to the sink."""
        if self.sink is not None:
            n = len(grads)
            self.reduce_later(name, grads, self.sink)
            return [None] * n
        pending = self.reduce_queue.start(name, grads)
        if LISTENERS:
            emit("reduce-scatter wait", name, pending)
        with no_functorch():
            shards = pending.finish()
        if LISTENERS:
            emit("reduce-scatter done", name, pending)
        return shards

    @_failing
    def reduce_later(self, name: str, grads: list, sink: Any) -> None:
        """``post_backward`` whose reduce-scatter is taken later: in the next group's post-backward or at the end of
        backward, so it runs while that group's backward computes; its shards go to ``sink``."""
        raw_grads(grads)
        grads, extra = sink.collect(name, grads)
        if grads is None:  # the sink keeps them (accumulation without sync): no reduce-scatter now
            self.frozen.grads_done(name)
            return
        pending = self.reduce_queue.start(name, grads)
        self.reduce_queue.defer(name, pending, sink, extra)

    @runtime_boundary  # (autograd's end-of-backward callback, under torch.compile too)
    @_failing
    def end_of_backward(self, cleanup: bool = False) -> None:
        """``cleanup``: a backward that raised half-way, finished by a later step (no checks: the ranks may not all
        be here)."""
        if cleanup:
            self.reduce_queue.drop()
        self.reduce_queue.finish()  # (apply: its shards are dropped when nobody asked for them in this backward)
        if not cleanup and self.failed is None:
            self.checks.collective("end of backward")
        for name in self.groups:
            self.free_after_backward(name)
            self.swap_out(name)
            self.nodes.loosen(name)
            self.frozen.backward_ended(name)
            self.fused.end_backward(name)
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
                self.binding.rest(g.name, facts.placeholders[g.name])
            self.fused_on = _single_grad_level() and any(t.requires_grad for t in self.state.values())
            self.relay.on = (not self.fused_on and torch.is_grad_enabled()
                             and not get_interpreter_stack())
            if self.fused_on:
                self.fused.begin()
            self.gather_for_forward(ROOT)
            self.swap_in(ROOT)
            self.begin_forward()
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
        self.relay.end_forward()
        if self.no_backward:
            _remove(self.hook_handles)
        for name in self.groups:
            self.swap_out(name)
            self.binding.rest(name, None)
            self.nodes.loosen(name)
        return self.fused.end_forward()

    def close_forward(self, out: Any) -> Any:
        """The module's forward returned ``out``: finish the forward, hook ``out`` for backward."""
        plan = self.plan
        keeper = self._leave_forward()
        self.reshard_after_forward(ROOT)
        self.end_forward()
        if plan.order_differs(self.prefetcher.order):
            _warn_order(plan, self.facts, self.prefetcher.order)
        out = self.wrap_for_backward(ROOT, out, keeper)
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


def _single_grad_level() -> bool:
    stack = get_interpreter_stack()
    return stack is not None and len(stack) == 1 and stack[0].key() == TransformType.Grad


def _pre_backward_hook(step: Step, name: str, once: bool = False, strong: bool = False, keeper: list | None = None):
    # Weakly held: the step keeps its hooks. The autograd graph keeps the step alive through its gather nodes while
    # a backward can come; ``strong``: a hook the step does not keep holds it (for a group without such a node);
    # ``keeper``: a fused forward's views (Fused.end_forward), held by the hook for as long as the graph holds it.
    ref = (lambda: step) if strong else weakref.ref(step)
    fired = [None]  # the backward (graph task) in which a once-per-call hook last fired

    def hook(grad):
        step = ref()
        if step is None:
            return None
        task = _graph_task_id()
        if not once or fired[0] != task:
            fired[0] = task
            step.pre_backward(name)
        if _single_grad_level():
            # torch.func.grad differentiates with create_graph=True (so transforms can nest); with a single grad
            # level nothing differentiates the gradients again, and the graph that made them would keep every
            # finished group's saved activations and full gradients alive until backward ends.
            return grad.detach()
        return None  # the gradient passes unchanged

    hook.keeper = keeper  # (held for as long as autograd holds the hook)
    wrapped = runtime_boundary(hook)
    wrapped.keeper = keeper
    return wrapped


def _make_pre_hook(step: Step, name: str):
    ref = weakref.ref(step)  # the hooks outlive the forward; the module must not keep the step alive

    def pre_hook(module, args, *kwargs):
        step = ref()
        if step is None:
            return None
        if not kwargs:  # (torch calls a hook removed while the module's hooks run without kwargs: args only)
            new = step.module_pre_forward(name, module, args, {})
            return None if new is None else new[0]
        return step.module_pre_forward(name, module, args, kwargs[0])

    return runtime_boundary(pre_hook)


def _make_post_hook(step: Step, name: str):
    ref = weakref.ref(step)

    def post_hook(module, args, output):
        step = ref()
        if step is None:
            return None
        out = step.module_post_forward(name, module, output)
        return None if out is output else out

    return runtime_boundary(post_hook)
