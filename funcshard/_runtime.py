"""Executes a Plan for one forward/backward: just-in-time all-gather, free, prefetch, reduce-scatter.

One :class:`Step` per ``apply`` call. It owns the unsharded (padded) parameter tensors as raw buffers, so
that freeing them (``untyped_storage().resize_(0)``) and refilling them before backward works under
``torch.func`` transforms too, where autograd only ever sees wrapped views of them.

Autograd nodes per group:
- under plain autograd and ``torch.func.jvp``, ``_GroupGather``: shards -> unsharded parameters. Its backward
  is the group's post-backward: the unsharded parameters are freed, then one reduce-scatter per dtype of the
  parameters' gradients, divided once by ``plan.divide_factor``. Under plain autograd ``apply`` also passes
  the group a token from the group's ``_Relay`` node (its trainable shards -> a scalar): ``_GroupGather``
  returns no shard gradients, the relay's backward returns them. The relay is made during the forward of
  the group before it (in the plan's order), so autograd runs it after that group's backward: a group's
  reduce-scatter is taken only in the next group's post-backward and runs while that group's backward
  computes. (``fully_shard`` takes it there too and puts the shards on the parameters' ``.grad``.)
- under a ``torch.func`` grad transform, one ``_StepGather`` for the whole step instead (each
  ``autograd.Function`` call costs ~1 ms there: functorch builds a class and flattens pytrees per call). Its
  outputs are the unsharded parameters of every group, with storage only while the group is gathered; each
  parameter is used through a view whose gradient hook collects the gradient and hands autograd back
  zeros (no storage), and the group's last hook runs the post-backward. ``_StepGather``'s backward, at the
  end of backward, returns the reduce-scattered shards.
- a gradient hook on the group's forward outputs: it fires before any backward op of the group, gathers
  the group again (if it was resharded) and issues the backward prefetches.

The graph keeps its Step alive (each node's context holds it); the Step never keeps the graph alive past the
forward or backward that uses it: that would be a reference cycle through autograd nodes, which Python's
collector cannot break (every step leaked). ``_GroupGather`` saves its outputs, so a later use (activation
checkpointing recomputing in a backward, possibly a second one through a retained graph) gets them back.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from funcshard._collectives import (
    Buckets,
    PendingGather,
    check_backward_transforms,
    check_batched_grads,
    free_buffers,
    jvp_of_gather,
    no_functorch,
    no_grad,
    raw_grads,
    start_gather,
    start_reduce_scatter,
    unwrapped,
)
from funcshard._compat import (
    DisableTorchFunctionSubclass,
    TransformType,
    current_graph_task_id,
    function_base_apply,
    get_interpreter_stack,
    make_subclass,
    maybe_current_level,
    param_slots,
    queue_callback,
    top_saved_tensors_default_hooks,
    unsafe_preserve_version_counter,
    unwrap_if_dead,
    will_engine_execute_node,
)
from funcshard._plan import ROOT, Group, Plan
from funcshard._spec import ShardingError
from funcshard._tree import module_io_leaves


class _Status(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class _GroupRuntime:
    """One group's buffers and state within a step."""

    __slots__ = ("group", "layout", "reduce_layout", "shards", "flat_shards", "bases", "copy_to", "views", "status",
                 "pending", "slots", "originals", "fwd_started", "fwd_done", "swapped", "frozen", "versions", "rest",
                 "trainable", "uses", "inputs_left", "nodes", "nodes_left", "unwatched", "counters", "fused", "hooked",
                 "views_grad", "task", "expect", "grads", "got", "grad_shards", "ran", "node", "reentrant")

    def __init__(self, plan: Plan, group: Group, layout: Buckets, slots: list, state: dict[str, torch.Tensor]):
        self.group = group
        self.layout = layout
        self.shards = [state[p] for p in group.params]  # (as given: the gathers read them under no_grad)
        grad = [t.requires_grad for t in self.shards]
        self.flat_shards: list | None = None  # the copy-in's views of the shards (Buckets.flat_shards), made once
        # The unsharded parameters' raw buffers (Buckets.new_buffers: the padded parameters, or the flat layout's
        # one per dtype), and the copy-out's views of them (Buckets.copy_targets, made once per set of buffers).
        self.bases: list[torch.Tensor] | None = None
        self.copy_to: list | None = None
        self.views: tuple[torch.Tensor, ...] | None = None  # autograd-visible unsharded parameters
        self.views_grad = False  # whether the views were made with grad enabled (carry autograd history)
        # The _GroupGather node that made the views (weakly), when the views carry autograd history. The step
        # holds such views only while it uses them (see _loosen): they reference the node, whose context holds
        # the step, a cycle Python's collector cannot see through. The node saved them, so they come back.
        self.node: weakref.ref | None = None
        self.status = _Status.SHARDED
        self.pending: PendingGather | None = None
        self.slots = slots
        self.originals: list[Any] | None = None
        self.fwd_started = 0
        self.fwd_done = 0
        self.swapped = False
        self.versions = None
        self.rest: list | None = None
        # A group with a shard that takes no gradient: backward ops may read its unsharded parameters after
        # the group's reduce-scatter, so it is freed only once its inputs' gradients are complete too.
        self.frozen = not all(grad)
        self.trainable = any(grad)
        # the reduce-scatter's layout: the parameters that take a gradient (decided by the shards, as every rank
        # sees them; a trainable parameter without a gradient on this rank is sent as zeros, so the ranks agree)
        self.reduce_layout = layout.only(tuple(i for i, g in enumerate(grad) if g)) if self.frozen else layout
        # A frozen group is freed in backward once every use's input gradients are done (inputs_left: watched
        # uses still to go; unwatched: a use whose inputs could not be watched, so only the end of backward)
        # and its post-backward ran for every gather that made autograd history (nodes_left).
        self.uses = self.inputs_left = self.nodes = self.nodes_left = 0
        self.unwatched = False
        self.counters: list[list[int]] = []  # per watched use: [input gradients to go, inputs]
        # the whole-step gather (under a torch.func grad transform): this group's outputs of _StepGather,
        # the gradients collected by the views' hooks in the current backward, the reduce-scattered shards
        self.fused: tuple[torch.Tensor, ...] | None = None
        self.hooked: tuple | None = None  # the hooked views (weak references once a backward has ended)
        self.task = -1  # the backward (graph task) that expect/grads/got/grad_shards belong to
        self.expect: int | None = None
        self.grads: list | None = None
        self.got = 0
        self.grad_shards: list | None = None
        self.ran: list[bool] | None = None  # which hooked views received a gradient in the last backward
        self.reentrant = False  # recomputed by reentrant checkpointing (gathered anew by each backward)


def _slots(plan: Plan, group: Group) -> list[tuple[nn.Module, str, int]]:
    """(module, attribute, param index) for every path of the group's parameters."""
    out = []
    for i, p in enumerate(group.params):
        for path in plan.specs[p].aliases:
            mod_path, _, attr = path.rpartition(".")
            out.append((plan.module.get_submodule(mod_path), attr, i))
    return out


class Step:
    """The runtime of one ``apply`` call."""

    def __init__(self, plan: Plan, state: dict[str, torch.Tensor]):
        self.plan = plan
        self.pg = plan.mesh.get_group(plan.shard_axis)
        self.rank = plan.mesh.get_local_rank(plan.shard_axis)
        self.state = state
        layouts, slots, _ = _derived(plan)
        self.groups = {g.name: _GroupRuntime(plan, g, layouts[g.name], slots[g.name], state) for g in plan.groups}
        self.backward_started = False
        self.backward_task = -1
        self.in_forward = False
        self.hook_handles: list = []
        self._pre_backward_hooks = {g.name: _pre_backward_hook(self, g.name) for g in plan.groups}
        self._take_grads_hooks = {g.name: _take_grads_hook(self, g.name) for g in plan.groups}
        self.fused = False  # set by run(): one _StepGather for the step (under a torch.func grad transform)
        self.order: list[str] = []  # the non-root groups in the order their forward first ran
        self.prefetched: set[str] = set()  # groups gathered early by the forward prefetch
        self._zeros: dict = {}
        # Plain autograd (apply's own forward): each group's shard gradients come back through its _Relay
        # node, so that its reduce-scatter can finish while the next group's backward runs.
        self.relaying = False  # this forward makes relays (run() sets it)
        self.relays: dict[str, torch.Tensor] = {}  # group -> its relay's token, held only while forward runs
        self.token_zero: torch.Tensor | None = None  # each group's gradient for its token
        self._names = tuple(self.groups)  # the plan's order
        self._position = {n: i for i, n in enumerate(self._names)}
        self.reducing: tuple | None = None  # the reduce-scatter in flight: (group, PendingReduce, factor, extra)

    # ---- the group lifecycle: SHARDED -> GATHERING -> GATHERED -> SHARDED ----------------------
    def unshard(self, name: str) -> None:
        """Issue the group's all-gather (async) unless it is gathered or in flight."""
        gr = self.groups[name]
        if gr.status is not _Status.SHARDED:
            return
        if not gr.shards:  # e.g. a root group when every parameter is in a child group
            gr.bases, gr.views, gr.status = [], (), _Status.GATHERED
            return
        with no_functorch(), no_grad():
            flat = gr.flat_shards
            if flat is None:
                plain = list(map(unwrapped, gr.shards))
                flat = gr.layout.flat_shards(plain)
                if all(t.is_contiguous() for t in plain):  # views, kept for the step (a copy would be stale later)
                    gr.flat_shards = flat
            if gr.layout.flat:  # the all-gather writes straight into the parameters' storage
                self._allocate(gr)
                # Autograd may have saved views of these buffers: hide the refill from its version check.
                # The collective may bump the version from its own thread until waited, so the versions are
                # restored after the wait, in wait().
                gr.versions = _preserve_versions(gr.bases)
                gr.pending = start_gather(gr.layout, flat, self.pg, self.rank, outs=gr.bases)
            else:
                gr.pending = start_gather(gr.layout, flat, self.pg, self.rank)
        gr.status = _Status.GATHERING

    @staticmethod
    def _allocate(gr: _GroupRuntime) -> None:
        if gr.bases is None:
            gr.bases = gr.layout.new_buffers(gr.shards[0].device)
            gr.copy_to = gr.layout.copy_targets(gr.bases)
        else:  # storage freed by reshard: allocate it again (autograd's views stay valid)
            for t in gr.bases:
                t.untyped_storage().resize_(t.numel() * t.element_size())

    def wait(self, name: str) -> None:
        gr = self.groups[name]
        if gr.status is _Status.SHARDED:
            self.unshard(name)
        if gr.status is _Status.GATHERING:
            with no_functorch(), no_grad():
                fresh = gr.bases is None  # new buffers: nothing can have saved them yet
                if not gr.layout.flat:
                    self._allocate(gr)
                if fresh:
                    gr.pending.finish(gr.copy_to)
                else:  # refilling tensors autograd saved for backward: their version must not change
                    with _preserve_versions(gr.bases):
                        gr.pending.finish(gr.copy_to)
                if gr.versions is not None:
                    gr.versions.__exit__(None, None, None)
                    gr.versions = None
            gr.pending = None
            gr.status = _Status.GATHERED

    def reshard(self, name: str) -> None:
        """Free the group's unsharded parameters (their storage; autograd's references stay valid)."""
        gr = self.groups[name]
        self.swap_out(name)  # the modules never keep views of freed storage
        if gr.status is _Status.SHARDED:
            return
        if gr.status is _Status.GATHERING:  # never free memory a collective still writes to
            self.wait(name)
        with no_functorch():
            free_buffers(gr.bases)
        gr.status = _Status.SHARDED

    def prefetch(self, name: str, *, backward: bool) -> None:
        if backward and self.order and name not in self.plan.backward_prefetch_lists:
            # the groups this forward ran, in reverse of the order they ran in (as FSDP2 records it)
            ran = self.order[::-1]
            depth = self.plan.backward_prefetch
            i = ran.index(name) + 1 if name in ran else 0
            others = ran[i : i + depth]
        else:
            others = self.plan.prefetch_after(name, backward=backward)
        for other in others:
            if not backward and self.groups[other].status is _Status.SHARDED:
                self.prefetched.add(other)
            self.unshard(other)

    def free_unused_prefetches(self) -> None:
        """At the end of forward: groups the forward prefetch gathered but the forward never used (skipped
        blocks, another order) go back to sharded now, not at the end of backward."""
        for name in self.prefetched:  # (a group's own forward takes it off the set)
            if self.groups[name].group.reshard_after_forward:
                self.reshard(name)
        self.prefetched.clear()

    # ---- module attributes -----------------------------------------------------------------------
    def swap_in(self, name: str) -> None:
        gr = self.groups[name]
        if gr.swapped or (gr.views is None and self._saved_views(gr) is None):
            return
        if gr.originals is None:
            gr.originals = [param_slots(mod)[attr] for mod, attr, _ in gr.slots]
        views = gr.views
        for mod, attr, i in gr.slots:
            param_slots(mod)[attr] = views[i]
        gr.swapped = True

    @staticmethod
    def _saved_views(gr: _GroupRuntime) -> tuple[torch.Tensor, ...] | None:
        """The group's autograd-visible views again, from the node that made them (None: its graph is gone or
        was freed by a backward, so no forward or backward can use them any more)."""
        node = gr.node() if gr.node is not None else None
        if node is None:
            return None
        try:
            gr.views = node.saved_tensors
        except RuntimeError:  # freed by a backward without retain_graph
            gr.node = None
        return gr.views

    @staticmethod
    def _loosen(gr: _GroupRuntime) -> None:
        """Let go of views that carry autograd history once the forward (or backward) is done with them: they
        would keep the graph, and through it this step, alive (see ``_GroupRuntime.node``)."""
        if gr.node is not None and not gr.swapped:
            gr.views = None

    def swap_out(self, name: str) -> None:
        gr = self.groups[name]
        if not gr.swapped:
            return
        for (mod, attr, _), orig in zip(gr.slots, gr.rest or gr.originals):
            param_slots(mod)[attr] = orig
        gr.swapped = False

    def _rest(self, name: str, placeholders: list | None) -> None:
        """What a group's slots hold while it is not swapped in: placeholders during ``run`` (a read from
        outside the group's forward raises instead of silently using the module's stale parameters), the
        module's own parameters otherwise."""
        gr = self.groups[name]
        if gr.originals is None:
            gr.originals = [param_slots(mod)[attr] for mod, attr, _ in gr.slots]
        gr.rest = placeholders
        if not gr.swapped:
            for (mod, attr, _), t in zip(gr.slots, placeholders or gr.originals):
                param_slots(mod)[attr] = t

    # ---- forward ---------------------------------------------------------------------------------
    def gather_for_forward(self, name: str) -> tuple[torch.Tensor, ...]:
        gr = self.groups[name]
        if name != ROOT and name not in self.order:
            self.order.append(name)
        self.prefetched.discard(name)
        self.unshard(name)
        self.wait(name)
        self.prefetch(name, backward=False)
        state = self.state
        if not self.fused and gr.views_grad and not torch.is_grad_enabled() and gr.shards:
            # used again under no_grad after a use with grad: keep the views with autograd history (refilled in
            # place), which activation checkpointing recomputes with in backward
            return gr.views
        gr.views_grad = torch.is_grad_enabled()
        gr.node = None
        if not gr.shards:
            pass
        elif self.fused:
            if not torch.is_grad_enabled():  # e.g. a no-grad recycling pass: no history, no hooks
                gr.views = gr.fused
            else:  # once per step: a group used again later reuses its views (gradients add up)
                if gr.hooked is None:
                    gr.hooked = self._hooked_views(name)
                    gr.nodes += 1  # one post-backward per backward for the whole step
                    gr.nodes_left += 1
                gr.views = tuple(o if v is None else v for o, v in zip(gr.fused, gr.hooked))
        elif maybe_current_level() is not None:  # torch.func.jvp: the new-style Function (it has the jvp rule)
            gr.views = _GroupGather.apply(self, name, None, *[state[p] for p in gr.group.params])
        else:
            token = None
            if self.relaying and gr.trainable and torch.is_grad_enabled():  # (a no-grad use needs no relay)
                token = self._relay(name)
                self._relay(self._next_trainable(name))  # made now: autograd runs it after this group's backward
            self._gather_node(name, token)
        return gr.views

    def _gather_node(self, name: str, token: torch.Tensor | None, count: bool = True) -> None:
        """The group's unsharded parameters as outputs of a new _GroupGather node (its backward runs the
        group's post-backward), from the gathered buffers. ``count``: a new post-backward to wait for (not when
        the node replaces one that died unused)."""
        gr = self.groups[name]
        shards = map(unwrap_if_dead, [self.state[p] for p in gr.group.params])
        if _no_saved_hooks():  # autograd saves the outputs plainly
            gr.views = _apply(_GroupGatherEager, self, name, token, *shards)
        else:
            with _saving_views():
                gr.views = _apply(_GroupGatherEager, self, name, token, *shards)
        node = next((v.grad_fn for v in gr.views if v.grad_fn is not None), None)
        if node is not None:
            gr.node = weakref.ref(node)
            node.register_prehook(self._take_grads_hooks[name])
            if count:
                gr.nodes += 1  # this gather's node runs the group's post-backward once
                gr.nodes_left += 1

    def _hooked_views(self, name: str) -> tuple[torch.Tensor, ...]:
        """The group's parameters as views of its _StepGather outputs, each with the gradient hook that
        collects it. The hook fires when the parameter's gradient is complete (before the view's backward
        node runs), unlike a hook on the Function's outputs, which would wait for the end of backward."""
        ref = weakref.ref(self)
        views = []
        for i, out in enumerate(self.groups[name].fused):
            if out.requires_grad:
                out = torch.ops.aten.alias(out)  # AliasBackward passes any gradient on (sparse too)
                out.register_hook(_param_grad_hook(ref, name, i))
                views.append(out)
            else:
                views.append(None)
        return tuple(views)

    def param_grad(self, name: str, i: int, grad: torch.Tensor) -> torch.Tensor:
        """One parameter's complete gradient (fused step). The group's last one runs its post-backward; the
        gradient goes on to _StepGather's backward as zeros without storage, so the full gradients are freed
        as soon as the reduce-scatter has read them."""
        gr = self.groups[name]
        task = current_graph_task_id()
        if gr.task != task:  # the group's first gradient in this backward (what an aborted one left is dropped)
            check_backward_transforms("funcshard.apply")
            gr.task, gr.grad_shards, gr.got = task, None, 0
            gr.expect = self._expected(gr)
            gr.grads = [_UNSET] * len(gr.group.params)
        gr.grads[i] = grad
        gr.got += 1
        if gr.got == gr.expect:
            gr.ran = [g is not _UNSET for g in gr.grads]
            grads, gr.grads = [None if g is _UNSET else g for g in gr.grads], None
            gr.grad_shards = self.post_backward(name, grads)
        return None if grad is None else self._zeros_like(grad)  # None: undefined (e.g. a custom Function's)

    def _zeros_like(self, grad: torch.Tensor) -> torch.Tensor:
        """Zeros without storage, one per shape and dtype: handed to autograd in place of a full gradient that
        funcshard took over (the backward never writes to them; a tensor hook cannot return None for that)."""
        if grad.layout is not torch.strided:  # e.g. nn.Embedding(sparse=True): sparse zeros (nothing stored)
            return torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device, layout=grad.layout)
        key = (grad.shape, grad.dtype)
        zeros = self._zeros.get(key)
        if zeros is None:
            zero = self._zeros.get(grad.dtype)  # one element per dtype, expanded to every shape
            if zero is None:
                zero = self._zeros[grad.dtype] = grad.new_zeros(())
            zeros = self._zeros[key] = zero.expand(grad.shape)
        return zeros

    def take_grads(self, name: str, grads: tuple) -> tuple:
        """_GroupGather's node pre-hook: keep the group's full gradients and hand autograd undefined ones, so
        that the reduce-scatter in the node's backward holds the only reference and frees each gradient once
        it is copied into the reduce-scatter input, before the output is allocated (FSDP2's order)."""
        self.groups[name].grads = list(grads)
        return (None,) * len(grads)

    def given_grads(self, name: str, grads: tuple) -> list:
        """The gradients for the group's post-backward: those take_grads kept, or (no pre-hook) these."""
        gr = self.groups[name]
        kept, gr.grads = gr.grads, None
        return kept if kept is not None else list(grads)

    @staticmethod
    def _expected(gr: _GroupRuntime) -> int:
        """How many of the group's hooked views get a gradient in the running backward."""
        n = 0
        for k, ref in enumerate(gr.hooked):
            if ref is None:  # no hook (the parameter takes no gradient)
                continue
            v = ref() if isinstance(ref, weakref.ref) else ref
            if v is not None:
                n += will_engine_execute_node(v.grad_fn)
            else:  # a later backward through the same graph, and the view object is gone: as in the last one
                n += gr.ran is None or gr.ran[k]
        return n

    def fused_outputs(self) -> list[torch.Tensor]:
        """_StepGather's forward: every group's unsharded parameters as views of padded buffers that have no
        storage until the group is gathered (allocated one group at a time, views taken, storage freed)."""
        outs = []
        for gr in self.groups.values():
            if not gr.shards:
                continue
            with no_functorch(), no_grad():
                gr.bases = gr.layout.new_buffers(gr.shards[0].device)
                gr.copy_to = gr.layout.copy_targets(gr.bases)
                views = gr.layout.views(gr.bases)
                free_buffers(gr.bases)
            outs.extend(views)
        return outs

    def fused_inputs(self) -> list[torch.Tensor]:
        """_StepGather's inputs (and outputs) in order: every group's shards, group by group."""
        return [self.state[p] for g in self.plan.groups for p in g.params]

    def fused_shard_grads(self) -> list[torch.Tensor | None]:
        out = []
        task = current_graph_task_id()
        for gr in self.groups.values():
            if gr.shards:
                done = gr.grad_shards is not None and gr.task == task
                out.extend(gr.grad_shards if done else [None] * len(gr.shards))
                gr.grad_shards = None
        return out

    def post_forward(self, name: str, output: Any) -> Any:
        gr = self.groups[name]
        self.swap_out(name)
        self._loosen(gr)
        if gr.group.reshard_after_forward:
            self.reshard(name)
        return self.wrap_for_backward(name, output)

    def wrap_for_backward(self, name: str, output: Any) -> Any:
        """Hook the group's outputs so the group is gathered again before its backward runs.

        A gradient hook on the outputs (not an autograd.Function: under torch.func each Function call pays
        a pytree flatten and a generated class) fires once the first output gradient is ready, which is
        before any backward op of the group."""
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor):  # (the usual case, without a pytree walk)
            tensors = [output] if output.requires_grad else []
        else:
            tensors = _grad_inputs(output)
        if not tensors:
            return output
        # A group without trainable parameters has no gather node in the graph to keep the step alive until its
        # backward (when no group has, e.g. a frozen model differentiated for its input): its hooks hold the
        # step themselves (made per call, not kept by the step: no reference cycle).
        strong = not self.groups[name].trainable
        if len(tensors) > 1 and _single_grad_level():
            # one hook per tensor (a multi-grad hook cannot replace gradients); pre_backward once per call
            hook = _pre_backward_hook(self, name, once=True, strong=strong)
            for t in tensors:
                t.register_hook(hook)
            return output
        hook = _pre_backward_hook(self, name, strong=True) if strong else self._pre_backward_hooks[name]
        if len(tensors) == 1:
            tensors[0].register_hook(hook)
        else:
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        return output

    # ---- backward --------------------------------------------------------------------------------
    def recomputing(self) -> bool:
        """Inside this step's running backward (a backward that raised half-way leaves backward_started set;
        a later forward must not take this step's hooks for recomputation)."""
        return self.backward_started and current_graph_task_id() == self.backward_task

    def recompute(self, name: str, args: tuple = ()) -> None:
        """The group's forward runs again inside backward (activation checkpointing), on ``args``."""
        gr = self.groups[name]
        if torch.is_grad_enabled() and (gr.reentrant or not gr.views_grad):  # reentrant: the forward had no grad
            self.gather_in_backward(name)
            if not gr.trainable:  # no post-backward frees it: once its inputs' gradients are done
                inputs = _grad_inputs(args)
                if inputs:
                    torch.autograd.graph.register_multi_grad_hook(
                        inputs, lambda _g, step=weakref.ref(self): (s := step()) and s._recomputed(name))
        else:  # the group's pre-backward gathered it
            self.wait(name)
            self.swap_in(name)

    def _begin_backward(self) -> None:
        task = current_graph_task_id()
        if self.backward_task != task:  # by task: a backward that raised half-way never ran its callback
            self.backward_started, self.backward_task = True, task
            queue_callback(self.end_of_backward)

    def pre_backward(self, name: str) -> None:
        self._begin_backward()
        self.unshard(name)
        self.wait(name)
        gr = self.groups[name]
        if (gr.views is None and gr.trainable and not self.fused and gr.status is _Status.GATHERED
                and self._saved_views(gr) is None):
            # The forward's node is gone: no recorded op used the group's parameters (reentrant checkpointing
            # inside the group's forward ran them under no_grad). Its recomputation uses these, and the backward
            # the checkpoint runs on the recomputed graph reaches their node (the group's post-backward).
            with torch.enable_grad():
                self._gather_node(name, None, count=False)  # (the forward's node was counted)
        self.swap_in(name)  # activation-checkpoint recomputation reads the module's attributes
        self.prefetch(name, backward=True)

    def gather_in_backward(self, name: str) -> None:
        """Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``): the group's
        parameters are about to be used with grad enabled inside backward, by a recomputation whose first run
        recorded no autograd history for them (it ran under no_grad). Gather the group through a new node, so
        that the backward the checkpoint runs on the recomputed graph runs the group's post-backward (it
        reduce-scatters and frees the group), as FSDP2's unsharded parameters collect that backward's
        gradients."""
        gr = self.groups[name]
        self._begin_backward()
        Step.unshard(self, name)  # (the forward reads the parameters, whatever a subclass skips in backward)
        self.wait(name)
        self.prefetch(name, backward=True)
        self.swap_out(name)
        if gr.shards:
            with torch.enable_grad():
                self._gather_node(name, None)
        gr.views_grad = gr.reentrant = True
        self.swap_in(name)

    def _recomputed(self, name: str) -> None:
        """A group without trainable parameters recomputed reentrantly: its nested backward is done."""
        self.reshard(name)

    def post_backward(self, name: str, grads: list) -> list[torch.Tensor]:
        """Free the group, then reduce-scatter its full gradients (consumes ``grads``): FSDP2's order, so that
        the unsharded parameters are gone before the reduce-scatter's buffers are allocated."""
        pending = self._start_reduce_scatter(name, grads)
        with no_functorch():
            return pending.finish(self.plan.divide_factor)

    def post_backward_deferred(self, name: str, grads: list, extra: Any = None,
                               factor: float | None = None) -> None:
        """``post_backward`` whose reduce-scatter is taken later: in the next group's post-backward or when the
        gradients are asked for (``finish_reduce_scatter``), so that it runs while that group's backward
        computes (FSDP2 does the same on CUDA with its reduce-scatter stream)."""
        pending = self._start_reduce_scatter(name, grads)
        self.reducing = (name, pending, self.plan.divide_factor if factor is None else factor, extra)

    def _start_reduce_scatter(self, name: str, grads: list):
        """Free the group (``_grads_done``), then issue its reduce-scatter (consumes ``grads``). The one still in
        flight (it ran during this group's backward) is taken first, so its buffers are gone before this one's
        are allocated: only one reduce-scatter's buffers live at a time."""
        gr = self.groups[name]
        raw_grads(grads)
        self._grads_done(name)
        self.finish_reduce_scatter()
        with no_functorch():
            return start_reduce_scatter(gr.reduce_layout, grads, self.pg, gr.shards[0].device)

    def _take_reduce_scatter(self) -> tuple | None:
        """Wait for the reduce-scatter in flight, if any: (group, its shards, extra)."""
        if self.reducing is None:
            return None
        name, pending, factor, extra = self.reducing
        self.reducing = None
        with no_functorch():
            return name, pending.finish(factor), extra

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter in flight, if any, and hand its shards to ``_reduced``."""
        if (taken := self._take_reduce_scatter()) is not None:
            self._reduced(*taken)

    def drop_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter in flight, if any, and drop its result (what an aborted backward left)."""
        self._take_reduce_scatter()

    def _relay(self, name: str | None) -> torch.Tensor | None:
        """The token of ``name``'s relay, made on first request."""
        if name is None:
            return None
        token = self.relays.get(name)
        if token is None:
            params = self.groups[name].group.params
            index = tuple(i for i, p in enumerate(params) if self.state[p].requires_grad)  # (fixed now)
            token = self.relays[name] = _apply(_Relay, self, name, index,
                                               *map(unwrap_if_dead, [self.state[params[i]] for i in index]))
            if self.token_zero is None:
                self.token_zero = torch.zeros((), device=token.device)
        return token

    def _next_trainable(self, name: str) -> str | None:
        """The trainable group after ``name`` in the plan's order that has no relay yet (the forward runs in
        the plan's order unless warned; if not, a relay is just made later, and waits a little longer)."""
        names = self._names
        for k in range(self._position[name] + 1, len(names)):
            if self.groups[names[k]].trainable and names[k] not in self.relays:
                return names[k]
        return None

    def relay_grads(self, name: str, index: tuple[int, ...]) -> list[torch.Tensor | None]:
        """``name``'s relay backward: the reduce-scattered gradients of its inputs, the group's parameters at
        ``index`` (None: none came)."""
        gr = self.groups[name]
        task = current_graph_task_id()
        if self.reducing is not None and self.reducing[0] == name and self.reducing[3] == task:
            self.finish_reduce_scatter()  # (the relay ran before the next group's post-backward took it)
        got = gr.grad_shards if gr.grad_shards is not None and gr.task == task else None
        gr.grad_shards = None  # autograd owns them now (no second reference: .grad can take them over)
        return [None if got is None else got[i] for i in index]

    def _reduced(self, name: str, out: list, task: Any) -> None:
        """apply: keep the group's gradient shards for its relay's backward (summed over the group's uses)."""
        gr = self.groups[name]
        if gr.grad_shards is None or gr.task != task:
            gr.task, gr.grad_shards = task, out
        else:
            gr.grad_shards = [b if a is None else a if b is None else a.add_(b) for a, b in zip(gr.grad_shards, out)]

    def watch_inputs(self, name: str, args: tuple) -> tuple | None:
        """For a group with frozen parameters: free it once the gradients of its forward inputs are complete
        (then no backward op of the group can still read its parameters), and its own gradients are
        reduce-scattered if it has any. Returns new args (or None: unchanged): each input that requires grad is
        passed on as an alias whose gradient hook counts it, so the group is freed as soon as its own input
        gradients are done, before the previous group's pre-backward prefetches (FSDP2 puts a Function on the
        module's inputs for the same reason)."""
        gr = self.groups[name]
        if not gr.frozen or not torch.is_grad_enabled():
            return None
        inputs = _grad_inputs(args)
        if not inputs:  # e.g. inputs passed as keyword arguments: keep the group until the end of backward
            gr.unwatched = True
            return None
        gr.uses += 1
        gr.inputs_left += 1
        top = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if len(top) != len(inputs) or any(args[i].layout is not torch.strided or args[i].is_nested for i in top):
            # inside containers (not rebuilt: the module may fill them) or not aliasable (nested, sparse)
            torch.autograd.graph.register_multi_grad_hook(inputs, lambda _g: self._inputs_done(name), mode="all")
            return None
        left = [len(top), len(top)]  # (to go, total): reset by end_of_backward for a retained graph
        gr.counters.append(left)
        ref = weakref.ref(self)

        def done(_grad):
            left[0] -= 1
            if left[0] == 0 and (step := ref()) is not None:
                step._inputs_done(name)

        new = list(args)
        for i in top:
            new[i] = torch.ops.aten.alias(args[i])
            new[i].register_hook(done)
        return tuple(new)

    def _inputs_done(self, name: str) -> None:
        self.groups[name].inputs_left -= 1
        self._release_frozen(name)

    def _grads_done(self, name: str) -> None:
        """The group's post-backward ran: free it, unless frozen parameters may still be read by backward ops
        that do not reach here (then once every use's inputs are done too)."""
        gr = self.groups[name]
        if not gr.frozen:
            self.reshard(name)
            return
        gr.nodes_left -= 1
        self._release_frozen(name)

    def _release_frozen(self, name: str) -> None:
        gr = self.groups[name]
        if gr.inputs_left <= 0 and not gr.unwatched and (gr.nodes_left <= 0 or not gr.trainable):
            self.reshard(name)

    def _backward_ended(self, gr: _GroupRuntime) -> None:
        """Per group, at the end of a backward: no views held, and the frozen-group counters ready for another
        backward through a retained graph."""
        self._loosen(gr)
        gr.inputs_left, gr.nodes_left = gr.uses, gr.nodes
        for c in gr.counters:
            c[0] = c[1]

    def end_of_backward(self) -> None:
        self.finish_reduce_scatter()  # (its shards are dropped: nobody asked for them in this backward)
        for name, gr in self.groups.items():
            self.reshard(name)
            self._backward_ended(gr)
            if gr.views is not None and gr.hooked is not None:
                # The graph holds _StepGather's node, which holds this step: strong references from the step
                # back into the graph (the views) would be a cycle that Python's collector cannot see through
                # (autograd nodes), leaking every step. A later backward through the same graph (vjp_fn called
                # again) finds the views through these weak references, or counts as this backward did.
                gr.hooked = tuple(None if v is None else weakref.ref(v) for v in gr.hooked)
                gr.views = gr.fused = None
        self.backward_started = False
        if not any(gr.reentrant for gr in self.groups.values()):
            _remove(self.hook_handles)  # (a reentrant recomputation runs them again in a later backward)

    # ---- the whole forward -----------------------------------------------------------------------
    def run(self, args: tuple, kwargs: dict) -> Any:
        plan = self.plan
        # The group modules' hooks live until the end of backward (or until the step is garbage collected,
        # e.g. when no backward comes): activation checkpointing recomputes forwards during backward, and a
        # region spanning several groups needs each of them gathered again.
        handles = self.hook_handles
        for g in plan.groups[1:]:
            for path in g.modules:
                mod = plan.module.get_submodule(path)
                handles.append(mod.register_forward_pre_hook(_make_pre_hook(self, g.name), prepend=True))
                handles.append(mod.register_forward_hook(_make_post_hook(self, g.name), always_call=True))
        weakref.finalize(self, _remove, handles)
        steps = plan.__dict__.setdefault("_funcshard_steps", weakref.WeakSet())
        if current_graph_task_id() == -1:  # not a recomputation inside some backward
            for old in list(steps):
                if old.backward_started:  # its backward raised half-way: finish it (free, unhook) now
                    old.end_of_backward()
                    for gr in old.groups.values():  # and what its relays did not hand on
                        gr.grad_shards = None
        steps.add(self)
        no_backward = not torch.is_grad_enabled()  # then the hooks go when the forward ends
        root = self.groups[ROOT]
        placeholders = _derived(plan)[2]
        try:
            for g in plan.groups[1:]:
                self._rest(g.name, placeholders[g.name])
            # functional_call semantics, with the aliases of tied parameters resolved once by the plan
            # (torch.func.functional_call scans the whole module for ties on every call).
            self.fused = _single_grad_level() and any(t.requires_grad for t in self.state.values())
            self.relaying = (not self.fused and torch.is_grad_enabled()
                             and not get_interpreter_stack())
            if self.fused:
                outs = _StepGather.apply(self, *self.fused_inputs())
                k = 0
                for gr in self.groups.values():
                    gr.fused, k = outs[k : k + len(gr.shards)], k + len(gr.shards)
            self.gather_for_forward(ROOT)
            self.swap_in(ROOT)
            self.in_forward = True
            out = plan.module(*args, **kwargs)
        except BaseException:
            _remove(handles)
            raise
        finally:
            self.in_forward = False
            self.relays.clear()  # the graph holds them (and this step): the step must not hold the graph
            self.relaying = False
            if no_backward:
                _remove(handles)
            for name, gr in self.groups.items():
                self.swap_out(name)
                self._rest(name, None)
                self._loosen(gr)
        if root.group.reshard_after_forward:
            self.reshard(ROOT)
        self.free_unused_prefetches()
        if plan.order_differs(self.order):
            _warn_order(plan, self.order)
        return self.wrap_for_backward(ROOT, out)


_WARNED_FIRST_ORDER = [False]


def _warn_first_order() -> None:
    """Once per process: the gather's backward (a reduce-scatter) is not itself differentiable."""
    if _WARNED_FIRST_ORDER[0]:
        return
    _WARNED_FIRST_ORDER[0] = True
    warnings.warn(
        "funcshard.apply: a backward with create_graph=True reached the sharded gather; the shard gradients it "
        "returns carry no graph, so differentiating them again (second-order terms through the parameters, e.g. "
        "MAML, Hessian-vector products) misses what flows through the gather. First-order uses of the result are "
        "right; for second order, gather the parameters (funcshard.gather) and differentiate the unsharded model",
        stacklevel=2,
    )


def _warn_order(plan: Plan, order: list[str]) -> None:
    """Once per plan: its groups ran out of the plan's order, so the default prefetch gathers the wrong ones."""
    if plan.__dict__.get("_funcshard_order_warned"):
        return
    plan.__dict__["_funcshard_order_warned"] = True
    warnings.warn(
        f"funcshard.apply: the groups' forwards ran in the order {tuple(order)}, not in the plan's order "
        f"{tuple(g.name for g in plan.groups[1:])}; prefetching follows the plan, so it gathers groups early that "
        f"are not next (more memory, less overlap). Use plan = plan.with_order({tuple(order)!r})",
        stacklevel=3,
    )


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _preserve_versions(tensors):
    """Hide in-place refills from autograd's version check (inference tensors have no versions)."""
    if any(t.is_inference() for t in tensors):
        return contextlib.nullcontext()
    return unsafe_preserve_version_counter(tuple(tensors))


def _grad_inputs(args: Any) -> list[torch.Tensor]:
    """The tensors in ``args`` (any pytree) that require grad."""
    return [a for a in module_io_leaves(args) if isinstance(a, torch.Tensor) and a.requires_grad]


def _pre_backward_hook(step: Step, name: str, once: bool = False, strong: bool = False):
    # Weakly held: the step keeps its hooks, and a strong reference back would make every step a reference
    # cycle that outlives its process group until the garbage collector runs (gloo aborts on exit then).
    # The autograd graph keeps the step alive through its _GroupGather nodes while a backward can come;
    # ``strong``: a hook the step does not keep holds it (for a group without such a node).
    ref = (lambda: step) if strong else weakref.ref(step)
    fired = [None]  # the backward (graph task) in which a once-per-call hook last fired

    def hook(grad):
        step = ref()
        if step is None:
            return None
        task = current_graph_task_id()
        if not once or fired[0] != task:
            fired[0] = task
            step.pre_backward(name)
        if _single_grad_level():
            # torch.func.grad differentiates with create_graph=True (so transforms can nest); with a single
            # grad level nothing differentiates the gradients again, and the graph that made them would keep
            # every finished group's saved activations and full gradients alive until backward ends.
            return grad.detach()
        return None  # the gradient passes unchanged

    return hook


def _take_grads_hook(step: Step, name: str):
    ref = weakref.ref(step)  # the graph keeps the step alive through the node's context

    def hook(grads):
        step = ref()
        return None if step is None else step.take_grads(name, grads)

    return hook


def _single_grad_level() -> bool:
    stack = get_interpreter_stack()
    return stack is not None and len(stack) == 1 and stack[0].key() == TransformType.Grad


def _make_pre_hook(step: Step, name: str):
    ref = weakref.ref(step)  # the hooks outlive run(); the module must not keep the step alive

    def pre_hook(module, args):
        step = ref()
        if step is None:
            return
        gr = step.groups[name]
        if step.in_forward:
            if (gr.fwd_started == 0 or gr.status is not _Status.GATHERED  # first use, or again after a reshard
                    or (torch.is_grad_enabled() and not gr.views_grad)):  # or first used under no_grad
                step.gather_for_forward(name)
            gr.fwd_started += 1
            step.swap_in(name)
            return step.watch_inputs(name, args)
        elif step.recomputing():  # activation-checkpoint recomputation during this step's backward
            step.recompute(name, args)
        elif step.backward_started and current_graph_task_id() != -1:
            raise NotImplementedError(
                f"group {name!r} is recomputed inside a nested backward (an activation checkpoint inside a "
                f"reentrant one: torch.utils.checkpoint(..., use_reentrant=True) runs a backward of its own); "
                f"funcshard.apply supports reentrant checkpointing around or over whole groups, not nested in "
                f"another checkpointed region: use use_reentrant=False for the outer one")

    return pre_hook


def _make_post_hook(step: Step, name: str):
    ref = weakref.ref(step)

    def post_hook(module, args, output):
        step = ref()
        if step is None:
            return None
        gr = step.groups[name]
        if step.in_forward:
            gr.fwd_done += 1
            if gr.fwd_done >= len(gr.group.modules):
                return step.post_forward(name, output)
            return step.wrap_for_backward(name, output)
        if step.recomputing():  # recomputation: the group stays gathered until its post-backward
            step.swap_out(name)
        return None

    return post_hook


def _derived(plan: Plan) -> tuple[dict[str, Buckets], dict[str, list]]:
    """Per-plan facts the runtime needs every step (bucket layouts, parameter slots), computed once and kept
    on the plan object itself (a Plan is immutable; an edited copy gets its own)."""
    hit = plan.__dict__.get("_funcshard_derived")
    if hit is None:
        slots = {g.name: _slots(plan, g) for g in plan.groups}
        hit = ({g.name: Buckets([plan.specs[p] for p in g.params]) for g in plan.groups},
               slots,
               {g.name: [_NotGathered(plan.specs[g.params[i]], g.name) for _, _, i in slots[g.name]]
                for g in plan.groups})
        plan.__dict__["_funcshard_derived"] = hit
    return hit


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__repr__,
             torch.Tensor.is_floating_point, torch.Tensor.element_size}  # and every attribute read (__get__)


class _NotGathered(torch.Tensor):
    """Stands in for a group's parameter while ``apply`` runs and the group is not gathered: reading it
    (from code outside the group's modules, or a checkpoint region spanning several groups) raises."""

    @staticmethod
    def __new__(cls, spec, group: str):
        t = make_subclass(cls, torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
        t._funcshard_where = (spec.fqn, group)
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        fqn, group = next(a._funcshard_where for a in module_io_leaves((args, kwargs)) if isinstance(a, cls))
        raise ShardingError(
            f"parameter {fqn!r} (group {group!r}) was read by {getattr(func, '__name__', func)} outside its "
            f"group's forward, where it is not gathered. funcshard.apply gathers a group only around the forward "
            f"of the group's modules: move the code that uses it into one of those modules, tie it properly "
            f"(the same nn.Parameter registered in both places, so the plan puts it in a common group), or put "
            f"both users in one group (funcshard.plan(..., groups=[(module_a, module_b), ...]))"
        )


def _layouts(plan: Plan) -> dict[str, Buckets]:
    return _derived(plan)[0]


_UNSET = object()


def _param_grad_hook(ref, name: str, i: int):
    def hook(grad):
        step = ref()
        return None if step is None else step.param_grad(name, i, grad)

    return hook


class _StepGather(torch.autograd.Function):
    """All sharded parameters of a step -> its unsharded parameters (storage filled while a group is
    gathered). Used under a torch.func grad transform only: there it replaces one ``_GroupGather`` per group."""

    @staticmethod
    def forward(step: Step, *shards: torch.Tensor):
        return tuple(step.fused_outputs())

    @staticmethod
    def setup_context(ctx, inputs, output):
        step = ctx.step = inputs[0]
        ctx.set_materialize_grads(False)
        # parameters that take no gradient get none computed (inputs here are unwrapped: ask the step's state)
        frozen = [o for o, t in zip(output, step.fused_inputs()) if not t.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.step.fused_shard_grads())


class _Relay(torch.autograd.Function):
    """Plain autograd: a group's trainable shards -> a scalar token, an input of the group's ``_GroupGather``.
    The gather's backward returns no shard gradients (only a zero for the token); the relay's backward
    returns them, once the reduce-scatter finished. Made during the previous group's forward, the relay runs
    after that group's backward (autograd runs ready nodes newest first), so the reduce-scatter overlaps it,
    and no shard gradient is read (summed, accumulated into ``.grad``, captured) before it is final."""

    @staticmethod
    def forward(ctx, step: Step, name: str, index: tuple[int, ...], *shards: torch.Tensor):
        ctx.step, ctx.name, ctx.index = step, name, index
        ctx.set_materialize_grads(False)
        return torch.zeros((), device=shards[0].device)

    @staticmethod
    def backward(ctx, _token_grad):
        return (None, None, None, *ctx.step.relay_grads(ctx.name, ctx.index))


class _GroupGather(torch.autograd.Function):
    """Sharded parameters of one group -> its unsharded parameters (views of the step's raw buffers).
    ``token``: the group's ``_Relay`` output (plain autograd in ``apply``), or None: the shard gradients are
    returned here, after the reduce-scatter."""

    @staticmethod
    def forward(step: Step, name: str, token: torch.Tensor | None, *shards: torch.Tensor):
        gr = step.groups[name]
        step.wait(name)
        return gr.layout.views(gr.bases)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.step, ctx.name, ctx.token = inputs[0], inputs[1], inputs[2] is not None
        ctx.set_materialize_grads(False)  # None: the parameter got no gradient (reduce-scattered as zeros)

    @staticmethod
    def backward(ctx, *grads):
        step = ctx.step
        grads = step.given_grads(ctx.name, grads)
        check_batched_grads("funcshard.apply", grads)
        if torch.is_grad_enabled():  # a backward with create_graph=True
            _warn_first_order()
        if ctx.token:
            step.post_backward_deferred(ctx.name, grads, extra=current_graph_task_id())
            return (None, None, step.token_zero, *[None] * len(grads))
        return (None, None, None, *step.post_backward(ctx.name, grads))

    @staticmethod
    def jvp(ctx, _step, _name, _token, *tangents):
        # The tangent of a gather is the gather of the tangents (forward mode keeps nothing for later).
        return jvp_of_gather(ctx.step.groups[ctx.name].layout, tangents, ctx.step.pg, ctx.step.rank)


def _old_style(fn: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """The same Function with ``forward(ctx, ...)``: under plain autograd it skips the per-call
    ``inspect.signature`` that new-style Functions (needed by torch.func) pay."""

    def forward(ctx, *inputs):
        out = fn.forward(*inputs)
        fn.setup_context(ctx, inputs, out)
        ctx.save_for_backward(*out)  # not for backward: Step._saved_views gets the views back from here
        # outputs of shards that take no gradient get none computed (FSDP2 skips frozen gradients too)
        frozen = [o for o, i in zip(out, inputs[3:]) if isinstance(i, torch.Tensor) and not i.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return out

    return type(f"{fn.__name__}Eager", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(fn.backward)})


_GroupGatherEager = _old_style(_GroupGather)


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` outside torch.func transforms, for Functions without ``setup_context``: what
    ``Function.apply`` does there (the C++ apply; tensors left by an exited transform unwrapped by the caller:
    ``unwrap_if_dead``), without its per-call Python (~5 us)."""
    if function_base_apply is None:  # (a torch without it: the Python path)
        return fn.apply(*args)
    return function_base_apply.__get__(None, fn)(*args)


def _pack_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # an alias without autograd history: the saved views hold no reference to their node


def _unpack_view(t: torch.Tensor) -> torch.Tensor:
    return t  # autograd puts the node back as the tensor's history (it was saved as the node's output)


def _no_saved_hooks() -> bool:
    """No saved-tensor hooks are in effect: then a Function's outputs are saved as they are, without a reference
    to their node, and no _saving_views is needed. (False when that cannot be told.)"""
    if top_saved_tensors_default_hooks is None:
        return False
    try:
        return top_saved_tensors_default_hooks(False) is None
    except (RuntimeError, TypeError):
        return False


@contextlib.contextmanager
def _saving_views():
    """Save _GroupGather's outputs with our own hooks, not with saved-tensor hooks of the caller's (activation
    checkpointing around a group would recompute its region to unpack them; save_on_cpu would copy them)."""
    try:
        cm = torch.autograd.graph.saved_tensors_hooks(_pack_view, _unpack_view)
        cm.__enter__()
    except RuntimeError:  # saved-tensor hooks disabled here: the views are saved as plain outputs
        yield
        return
    try:
        yield
    finally:
        cm.__exit__(None, None, None)
