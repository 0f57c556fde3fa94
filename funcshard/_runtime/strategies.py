"""How a group's gather enters autograd: three strategies, each owning its own per-group fields.

- ``Nodes`` (plain autograd, and ``torch.func.jvp``): one ``_GroupGather`` node per group and forward, shards ->
  unsharded parameters. Its backward is the group's post-backward (free, reduce-scatter, divide once). It saves its
  outputs, so a later use (activation checkpointing recomputing in a backward, possibly a second one through a
  retained graph) gets the views back (``saved_views``) without the step holding the graph.
- ``Relay`` (plain autograd in ``apply``): the group's trainable shards -> a scalar token, an input of the group's
  ``_GroupGather``. The gather's backward returns no shard gradients; the relay's does, once the reduce-scatter
  finished. Made during the previous group's forward, autograd runs the relay after that group's backward, so the
  reduce-scatter overlaps it.
- ``Fused`` (under a ``torch.func`` grad transform): one ``_StepGather`` for the whole step (each
  ``autograd.Function`` call costs ~1 ms there). Each parameter is used through a view whose gradient hook collects
  its gradient and hands autograd back zeros without storage; the group's last hook runs the post-backward;
  ``_StepGather``'s backward, at the end of backward, returns the reduce-scattered shards. After the forward the
  hooked views are held by a *keeper* that only the pre-backward hooks on the groups' outputs hold (the upper part
  of the graph), so they live exactly as long as a backward can reach them, and the Step holds them weakly.

The graph keeps its Step alive (each node's context holds it); the Step never keeps the graph alive past the
forward or backward that uses it: a reference cycle through autograd nodes, which Python's collector cannot break
(a ``torch.func.vjp`` whose ``vjp_fn`` is never called would keep the Step and its gathered groups forever).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.forward_ad import unpack_dual

from funcshard._collectives import no_functorch, unwrapped
from funcshard._pipeline import jvp_of_gather
from funcshard._primitives import (buckets, check_backward_transforms, check_batched_grads, divides,
                                   given_scatter_mean, refuse_again, rows, scatter_mean)
from funcshard._compile import runtime_boundary
from funcshard._compat import (
    GradInterpreter,
    TransformType,
    current_graph_task_id,
    get_interpreter_stack,
    function_base_apply,
    top_saved_tensors_default_hooks,
    torch_tree_leaves,
    unwrap_if_dead,
    will_engine_execute_node,
)
from funcshard._runtime.part import Part
from funcshard._schedule import label, reduce_scatter_depth

if TYPE_CHECKING:
    from funcshard._runtime.step import Step

_UNSET = object()


# ---- per-group _GroupGather nodes ---------------------------------------------------------------------------


class NodeState:
    """A group's ``_GroupGather`` state in a step (``GroupRun.node``)."""

    __slots__ = ("node", "views_grad", "kept", "grads_hook")

    def __init__(self, grads_hook):
        # The _GroupGather node that made the views (weakly), when they carry autograd history: the step holds such
        # views only while it uses them (see Nodes.loosen); the node saved them, so they come back.
        self.node: weakref.ref | None = None
        self.views_grad = False  # whether the views were made with grad enabled (carry autograd history)
        self.kept: list | None = None  # the full gradients the node's pre-hook took over
        self.grads_hook = grads_hook  # the node's pre-hook (take_grads_hook)


class Nodes(Part):
    """A group's gather as a ``_GroupGather`` node (its state: ``GroupRun.node``, a ``NodeState``): the node of the
    current views, and the gradients it hands the post-backward."""

    def gather(self, name: str, token: torch.Tensor | None, count: bool = True) -> None:
        """The group's unsharded parameters as outputs of a new _GroupGather node (its backward runs the group's
        post-backward), from the gathered buffers. ``count``: a new post-backward to wait for (not when the node
        replaces one that died unused)."""
        step = self.step
        shards = map(_unwrap_if_dead, [step.state[p] for p in step.groups[name].group.params])
        views = gather_node(step, name, token, *shards)
        run = step.runs[name]
        run.slots.views = views
        node = next((v.grad_fn for v in views if v.grad_fn is not None), None)
        if node is not None:
            run.node.node = weakref.ref(node)
            node.register_prehook(run.node.grads_hook)
            if count:
                step.frozen.node_made(name)

    def gather_jvp(self, name: str) -> None:
        step = self.step
        step.runs[name].slots.views = _GroupGather.apply(
            step, name, None, *[step.state[p] for p in step.groups[name].group.params])

    def saved_views(self, name: str) -> tuple[torch.Tensor, ...] | None:
        """The group's autograd-visible views again, from the node that made them (None: its graph is gone or was
        freed by a backward, so no forward or backward can use them any more)."""
        run = self.step.runs[name]
        ns, b = run.node, run.slots
        node = ns.node() if ns.node is not None else None
        if node is None:
            return None
        try:
            b.views = node.saved_tensors
        except RuntimeError:  # freed by a backward without retain_graph
            ns.node = None
        return b.views

    def loosen(self, name: str) -> None:
        """Let go of views that carry autograd history once the forward (or backward) is done with them: they
        would keep the graph, and through it the step, alive."""
        run = self.step.runs[name]
        b = run.slots
        if run.node.node is not None and not b.swapped:
            b.views = None

    def take_grads(self, name: str, grads: tuple) -> tuple:
        """The node's pre-hook: keep the group's full gradients and hand autograd undefined ones, so that the
        reduce-scatter in the node's backward holds the only reference and frees each gradient once it is copied
        into the reduce-scatter input, before the output is allocated (FSDP2's order)."""
        self.step.runs[name].node.kept = list(grads)
        return (None,) * len(grads)

    def given_grads(self, name: str, grads: tuple) -> list:
        """The gradients for the group's post-backward: those the pre-hook kept, or (no pre-hook) these."""
        ns = self.step.runs[name].node
        kept, ns.kept = ns.kept, None
        return kept if kept is not None else list(grads)


def take_grads_hook(step: Step, name: str):
    # weak: the graph keeps the step alive through the node's context. (A partial of one marked function: marking a
    # closure per group and step cost ~35 us each.)
    return functools.partial(_take_grads, weakref.ref(step), name)


@runtime_boundary
def _take_grads(ref, name: str, grads):
    step = ref()
    return None if step is None else step.nodes.take_grads(name, grads)


class _GroupGather(torch.autograd.Function):
    """Sharded parameters of one group -> its unsharded parameters (views of the step's raw buffers).
    ``token``: the group's ``_Relay`` output (plain autograd in ``apply``), or None: the shard gradients are
    returned here, after the reduce-scatter.

    The one per-group gather Function: the runtime's forward (wait, the views), context and backward (the group's
    post-backward) are written here once. ``_GroupGatherEager`` (made by ``_old_style``) is this class for plain
    autograd, the same three bodies called from an old-style ``forward(ctx, ...)``; this new-style class is what
    ``torch.func.jvp`` needs (``setup_context``, the ``jvp`` rule). The cost model's trace makes the same node
    (``gather_node`` over its stand-in step, ``_cost_trace``), so its backward runs where the runtime's runs."""

    @staticmethod
    def forward(step: Step, name: str, token: torch.Tensor | None, *shards: torch.Tensor):
        step.runs[name].wait()
        return step.groups[name].views()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.step, ctx.name, ctx.token = inputs[0], inputs[1], inputs[2] is not None
        ctx.set_materialize_grads(False)  # None: the parameter got no gradient (reduce-scattered as zeros)

    @staticmethod
    @runtime_boundary  # (autograd calls it, under torch.compile too: see funcshard._compile)
    def backward(ctx, *grads):
        step = ctx.step
        grads = step.nodes.given_grads(ctx.name, grads)
        check_batched_grads("funcshard.apply", grads)
        if second_order(step, ctx.name):  # (apply, create_graph=True: differentiable gradients, any order)
            token = step.relay.token_zero if ctx.token else None
            return (None, None, token, *second_order_grads(step, ctx.name, grads))
        dep = _second_order_dep(grads)
        if ctx.token:
            if dep is not None:
                step.relay.dep = dep  # (the shards' relay returns their gradients: refused if differentiated again)
            step.runs[ctx.name].reduce_later(grads, step.relay)
            return (None, None, step.relay.token_zero, *[None] * len(grads))
        return (None, None, None, *first_order(dep, step.runs[ctx.name].post_backward(grads), step, ctx.name))

    @staticmethod
    def jvp(ctx, _step, _name, _token, *tangents):
        # The tangent of a gather is the gather of the tangents (forward mode keeps nothing for later).
        step = ctx.step
        return jvp_of_gather(step.groups[ctx.name].layout, tangents, step.pg, step.rank)


def _old_style(fn: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """The same Function with ``forward(ctx, ...)``: under plain autograd it skips the per-call
    ``inspect.signature`` that new-style Functions (needed by torch.func) pay. What only plain autograd needs is
    added here: the outputs saved (``Nodes.saved_views``), those of shards that take no gradient marked
    non-differentiable (under ``torch.func.jvp`` every output keeps its tangent)."""

    def forward(ctx, *inputs):
        out = fn.forward(*inputs)
        fn.setup_context(ctx, inputs, out)
        ctx.save_for_backward(*out)  # not for backward: Nodes.saved_views gets the views back from here
        # outputs of shards that take no gradient get none computed (FSDP2 skips frozen gradients too)
        frozen = [o for o, i in zip(out, inputs[3:]) if isinstance(i, torch.Tensor) and not i.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return out

    return type(f"{fn.__name__}Eager", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(fn.backward)})


_GroupGatherEager = _old_style(_GroupGather)


def _dividing_groups(plan) -> frozenset:
    """The groups of ``plan`` whose gather divides its gradient or sums it over HSDP's replicas (made once per plan)."""
    return plan.derived("dividing_groups", lambda p: frozenset(b.group for b in buckets(p) if divides(b)))


def _divides(ctx) -> bool:
    """Whether an apply or fully_shard step's gather node divides its gradient or sums it over HSDP's replicas (read by
    ``_primitives.refuse_series`` from a later gather's walk; not stored per forward: a class property)."""
    plan = getattr(ctx.step, "plan", None)  # (apply's and fully_shard's steps alike: both gathers divide)
    return plan is not None and ctx.name in _dividing_groups(plan)


def _plan_divides(plan) -> bool:
    """Whether some group of ``plan`` divides its gradient or sums it over replicas (a whole-step gather's node)."""
    return bool(_dividing_groups(plan))


def _mark_gathers() -> None:
    """The runtime's per-group gather nodes' kind for ``_primitives``' walks (a gather: where they stop) and whether
    they divide (``refuse_series``): class properties, read only by a walk, nothing stored per forward. (Under a
    torch.func transform a Function's node is of a class functorch generates: ``_StepGather`` sets its own.)"""
    for fn in (_GroupGather, _GroupGatherEager):
        fn._backward_cls._funcshard_node = "gather"
        fn._backward_cls._funcshard_divides = property(_divides)


def gather_node(step: Any, name: str, token: torch.Tensor | None, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Group ``name``'s unsharded parameters as the outputs of a new plain-autograd gather node
    (``_GroupGatherEager``), its backward the group's post-backward. ``step``: the runtime's ``Step``, or the cost
    model's stand-in for one (``_cost_trace``: what the node reads of it is ``runs[name].wait()``,
    ``runs[name].post_backward(grads)``, ``groups[name].views()`` and ``nodes.given_grads(name, grads)``). Under
    saved-tensor hooks (e.g. non-reentrant activation checkpointing around the group) the node saves its views as
    ``_saving_views`` says, so that a recomputed region saves what its forward saved."""
    if _no_saved_hooks():  # autograd saves the outputs plainly
        return _apply(_GroupGatherEager, step, name, token, *shards)
    with _saving_views():
        return _apply(_GroupGatherEager, step, name, token, *shards)


# ---- relays (apply under plain autograd) --------------------------------------------------------------------


class _Relay(torch.autograd.Function):
    """A group's trainable shards -> a scalar token, an input of the group's ``_GroupGather``.

    Not a gather (its output is a token, not parameters), so not merged into ``_GroupGather``: it is the shards'
    gradient path under plain autograd. Made during the previous group's forward, autograd runs its backward after
    that group's backward, so the group's reduce-scatter, issued by ``_GroupGather``'s backward, overlaps it; its
    backward returns the reduce-scattered shards (``Relay.grads``)."""

    @staticmethod
    def forward(ctx, step: Step, name: str, index: tuple[int, ...], *shards: torch.Tensor):
        ctx.step, ctx.name, ctx.index = step, name, index
        ctx.set_materialize_grads(False)
        return torch.zeros((), device=shards[0].device)

    @staticmethod
    @runtime_boundary
    def backward(ctx, _token_grad):
        relay = ctx.step.relay
        return (None, None, None, *first_order(relay.dep if torch.is_grad_enabled() else None,
                                               relay.grads(ctx.name, ctx.index), ctx.step, ctx.name))


class Relay(Part):
    """``apply``'s gradient path under plain autograd; also the sink its deferred reduce-scatters deliver to."""

    def __init__(self, step: Step):
        super().__init__(step)
        self.on = False  # this forward makes relays
        self.tokens: dict[str, torch.Tensor] = {}  # group -> its relay's token, held only while forward runs
        self.token_zero: torch.Tensor | None = None  # each group's gradient for its token
        self.shards: dict[str, tuple[int, list]] = {}  # group -> (graph task, reduce-scattered shards)
        self.dep: torch.Tensor | None = None  # a create_graph=True backward's cotangent (``first_order``)
        self._names = tuple(step.groups)  # the plan's order
        self._position = {n: i for i, n in enumerate(self._names)}

    def tokens_for(self, name: str) -> torch.Tensor | None:
        """The group's token, and the relays of the next trainable groups made now, as many as reduce-scatters may
        be in flight (``_schedule.reduce_scatter_depth``; one by default): autograd runs each after this group's
        backward, so that a group's shards are asked for (``ReduceQueue.finish_if``) no earlier than the queue takes
        its reduce-scatter anyway."""
        token = self._token(name)
        for ahead in self._next_trainable(name, reduce_scatter_depth(self.step.plan)):
            self._token(ahead)
        return token

    def _token(self, name: str | None) -> torch.Tensor | None:
        if name is None:
            return None
        token = self.tokens.get(name)
        if token is None:
            step = self.step
            params = step.groups[name].group.params
            index = tuple(i for i, p in enumerate(params) if step.state[p].requires_grad)  # (fixed now)
            token = self.tokens[name] = _apply(_Relay, step, name, index,
                                               *map(_unwrap_if_dead, [step.state[params[i]] for i in index]))
            if self.token_zero is None:
                self.token_zero = torch.zeros((), device=token.device)
        return token

    def _next_trainable(self, name: str, depth: int) -> list[str]:
        """The next ``depth`` trainable groups after ``name`` in the plan's order (the forward runs in the plan's
        order unless warned; if not, a relay is just made later, and waits a little longer)."""
        names, groups = self._names, self.step.groups
        out: list[str] = []
        for k in range(self._position[name] + 1, len(names)):
            if len(out) == depth:
                break
            if groups[names[k]].trainable:
                out.append(names[k])
        return out

    def end_forward(self) -> None:
        self.tokens.clear()  # the graph holds them (and the step): the step must not hold the graph
        self.on = False

    # the sink of the deferred reduce-scatters
    def collect(self, name: str, grads: list) -> tuple[list, Any]:
        return grads, _graph_task_id()

    def deliver(self, name: str, shards: list, task: Any) -> None:
        """Keep the group's gradient shards for its relay's backward (summed over the group's uses)."""
        held = self.shards.get(name)
        if held is None or held[0] != task:
            self.shards[name] = (task, shards)
        else:
            self.shards[name] = (task, [b if a is None else a if b is None else a.add_(b)
                                        for a, b in zip(held[1], shards)])

    def grads(self, name: str, index: tuple[int, ...]) -> list[torch.Tensor | None]:
        """The relay's backward: the reduce-scattered gradients of its inputs, the group's parameters at ``index``
        (None: none came)."""
        task = _graph_task_id()
        self.step.reduce_queue.finish_if(name, task)  # (the relay ran before the next group's post-backward)
        held = self.shards.pop(name, None)  # autograd owns them now (no second reference)
        got = held[1] if held is not None and held[0] == task else None
        return [None if got is None else got[i] for i in index]

    def drop(self) -> None:
        self.shards.clear()


# ---- the whole-step gather (under a torch.func grad transform) ----------------------------------------------


class FusedState:
    """A group's part of the whole-step gather (``GroupRun.fused``)."""

    __slots__ = ("outs", "hooked", "task", "expect", "grads", "got", "grad_shards", "ran")

    def __init__(self):
        self.outs: tuple[torch.Tensor, ...] | None = None  # this group's outputs of _StepGather
        self.hooked: tuple | None = None  # the hooked views (weak references once a backward has ended)
        self.task = -1  # the backward (graph task) that expect/grads/got/grad_shards belong to
        self.expect: int | None = None
        self.grads: list | None = None
        self.got = 0
        self.grad_shards: list | None = None
        self.ran: list[bool] | None = None  # which hooked views received a gradient in the last backward


class Fused(Part):
    def __init__(self, step: Step):
        super().__init__(step)
        self._zeros: dict = {}
        self.keeper: list | None = None  # during forward: where the hooked views go when it ends (end_forward)

    def begin(self) -> None:
        """_StepGather over every group's shards; each group's slice of its outputs."""
        step = self.step
        self.keeper = []
        outs = _StepGather.apply(step, *self.inputs())
        k = 0
        for name, gb in step.groups.items():
            n = len(gb.shards)
            self.step.runs[name].fused.outs, k = outs[k : k + n], k + n

    def views(self, name: str) -> tuple[torch.Tensor, ...]:
        """The group's views for a forward use: plain outputs under no_grad; else the hooked views (made once per
        step: a group used again later reuses them, and its gradients add up)."""
        fs = self.step.runs[name].fused
        if not torch.is_grad_enabled():  # e.g. a no-grad recycling pass: no history, no hooks
            return fs.outs
        if fs.hooked is None:
            fs.hooked = self._hooked_views(name)
            self.step.frozen.node_made(name)  # one post-backward per backward for the whole step
        return tuple(o if v is None else v for o, v in zip(fs.outs, fs.hooked))

    def _hooked_views(self, name: str) -> tuple[torch.Tensor, ...]:
        """The group's parameters as views of its _StepGather outputs, each with the gradient hook that collects
        it. The hook fires when the parameter's gradient is complete (before the view's backward node runs),
        unlike a hook on the Function's outputs, which would wait for the end of backward."""
        ref = weakref.ref(self.step)
        views = []
        for i, out in enumerate(self.step.runs[name].fused.outs):
            if out.requires_grad:
                out = torch.ops.aten.alias(out)  # AliasBackward passes any gradient on (sparse too)
                out.register_hook(_param_grad_hook(ref, name, i))
                views.append(out)
            else:
                views.append(None)
        return tuple(views)

    def end_forward(self) -> list | None:
        """The forward is done: the step lets go of the graph. The hooked views go to the keeper (returned; None when
        this forward was not fused), which the pre-backward hooks on the groups' outputs hold (``wrap_for_backward``);
        the step keeps weak references, which ``_expected`` reads in backward."""
        keeper, self.keeper = self.keeper, None
        if keeper is None:
            return None
        for run in self.step.runs.values():
            fs = run.fused
            if fs.hooked is not None and not any(isinstance(v, weakref.ref) for v in fs.hooked):
                keeper.extend(v for v in fs.hooked if v is not None)
                fs.hooked = tuple(None if v is None else weakref.ref(v) for v in fs.hooked)
            fs.outs = None
            run.slots.views = None
        return keeper

    def param_grad(self, name: str, i: int, grad: torch.Tensor) -> torch.Tensor:
        """One parameter's complete gradient. The group's last one runs its post-backward; the gradient goes on to
        _StepGather's backward as zeros without storage, so the full gradients are freed as soon as the
        reduce-scatter has read them."""
        fs = self.step.runs[name].fused
        task = _graph_task_id()
        if fs.task != task:  # the group's first gradient in this backward (what an aborted one left is dropped)
            check_backward_transforms("funcshard.apply")
            fs.task, fs.grad_shards, fs.got = task, None, 0
            fs.expect = self._expected(fs)
            fs.grads = [_UNSET] * len(fs.hooked)
        fs.grads[i] = grad
        fs.got += 1
        if fs.got == fs.expect:
            self._complete(name, fs)
        return None if grad is None else self._zeros_like(grad)

    def _complete(self, name: str, fs: FusedState) -> None:
        """The group's gradients of this backward are all in: its post-backward."""
        fs.ran = [g is not _UNSET for g in fs.grads]
        grads, fs.grads = [None if g is _UNSET else g for g in fs.grads], None
        step = self.step
        exact = step.below and differentiated_below(step)
        if exact:  # (the gradients as plain autograd records them below the transform)
            grads_below = [None if g is None else unwrapped(g) for g in grads]
        fs.grad_shards = step.runs[name].post_backward(grads)  # None: undefined (e.g. a custom Function's)
        if exact and fs.grad_shards is not None:
            with no_functorch(), torch.enable_grad():
                fs.grad_shards = second_order_grads(step, name, grads_below, fs.grad_shards,
                                                    functools.partial(_regather_all, step))

    def _zeros_like(self, grad: torch.Tensor) -> torch.Tensor:
        """Zeros without storage, one per shape and dtype: handed to autograd in place of a full gradient that
        funcshard took over (a tensor hook cannot return None for that)."""
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

    @staticmethod
    def _expected(fs: FusedState) -> int:
        """How many of the group's hooked views get a gradient in the running backward."""
        n = 0
        for k, ref in enumerate(fs.hooked):
            if ref is None:  # no hook (the parameter takes no gradient)
                continue
            v = ref() if isinstance(ref, weakref.ref) else ref
            if v is not None:
                n += will_engine_execute_node(v.grad_fn)
            else:  # a later backward through the same graph, and the view object is gone: as in the last one
                n += fs.ran is None or fs.ran[k]
        return n

    def outputs(self) -> list[torch.Tensor]:
        """_StepGather's forward: every group's unsharded parameters as views of padded buffers that have no
        storage until the group is gathered."""
        outs = []
        for gb in self.step.groups.values():
            if gb.shards:
                outs.extend(gb.storageless_views())
        return outs

    def inputs(self) -> list[torch.Tensor]:
        """_StepGather's inputs (and outputs) in order: every group's shards, group by group."""
        step = self.step
        return [step.state[p] for g in step.plan.groups for p in g.params]

    def shard_grads(self) -> list[torch.Tensor | None]:
        out = []
        task = _graph_task_id()
        for name, gb in self.step.groups.items():
            if gb.shards:
                fs = self.step.runs[name].fused
                if fs.task == task and fs.grads is not None:  # fewer gradients came than _expected counted
                    self._complete(name, fs)
                done = fs.grad_shards is not None and fs.task == task
                out.extend(fs.grad_shards if done else [None] * len(gb.shards))
                fs.grad_shards = None
        return out

    def end_backward(self, name: str) -> None:
        """The graph holds _StepGather's node, which holds the step: strong references from the step back into the
        graph (the views) would be a cycle Python's collector cannot see through. A later backward through the same
        graph (vjp_fn called again) finds the views through weak references, or counts as this backward did."""
        run = self.step.runs[name]
        fs, b = run.fused, run.slots
        if b.views is not None and fs.hooked is not None:
            fs.hooked = tuple(None if v is None else weakref.ref(v) for v in fs.hooked)
            b.views = fs.outs = None


def _param_grad_hook(ref, name: str, i: int):
    return functools.partial(_param_grad, ref, name, i)  # (one marked function: see take_grads_hook)


@runtime_boundary
def _param_grad(ref, name: str, i: int, grad):
    step = ref()
    return None if step is None else step.fused.param_grad(name, i, grad)


class _StepGather(torch.autograd.Function):
    """All sharded parameters of a step -> its unsharded parameters (storage filled while a group is gathered).

    Not merged into ``_GroupGather``: under a torch.func grad transform each Function call costs ~1 ms
    (functorch's ``custom_function_call``), so the step pays one for all its groups; its backward runs at the end of
    backward, so the groups' post-backwards run from hooks on their views (``Fused.param_grad``), not from it."""

    @staticmethod
    def forward(step: Step, *shards: torch.Tensor):
        return tuple(step.fused.outputs())

    @staticmethod
    def setup_context(ctx, inputs, output):
        step = ctx.step = inputs[0]
        ctx.set_materialize_grads(False)
        ctx._funcshard_node, ctx._funcshard_divides = "gather", _plan_divides(step.plan)  # (refuse_series' walk)
        # parameters that take no gradient get none computed (inputs here are unwrapped: ask the step's state)
        frozen = [o for o, t in zip(output, step.fused.inputs()) if not t.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)

    @staticmethod
    @runtime_boundary
    def backward(ctx, *grads):
        step = ctx.step
        # (plain autograd below the level, after the level's own backward ran inside it (torch.func.grad,
        # grad_and_value): differentiated_below. Not the level's own backward run outside it, as torch.func.vjp's
        # vjp_fn runs it, once or again: no stack there either; its gradients came by the views' hooks, grads holds
        # none of them: the first-order path below)
        stack = get_interpreter_stack()
        if not stack and step.below and step.backward_in_level and differentiated_below(step):
            return (None, *_outer_shard_grads(step, grads))
        if stack:
            step.backward_in_level = True
        out = first_order(_second_order_dep(grads), step.fused.shard_grads())
        if torch.is_grad_enabled() and stack:  # (torch.func.grad: see _tracked_below)
            out = _tracked_below(step, out)
        elif torch.is_grad_enabled() and step.below:  # (torch.func.vjp's vjp_fn with create_graph: _VJP_BELOW)
            out = refuse_again(_VJP_BELOW, step.below, out)
        return (None, *out)


_mark_gathers()


# ---- helpers ------------------------------------------------------------------------------------------------

_graph_task_id = current_graph_task_id
_unwrap_if_dead = unwrap_if_dead
_FUNCTION_APPLY = function_base_apply


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` outside torch.func transforms, for Functions without ``setup_context``: what
    ``Function.apply`` does there (the C++ apply; tensors left by an exited transform unwrapped by the caller:
    ``_unwrap_if_dead``), without its per-call Python (~5 us)."""
    if _FUNCTION_APPLY is None:  # (a torch without it: the Python path)
        return fn.apply(*args)
    return _FUNCTION_APPLY.__get__(None, fn)(*args)


def _pack_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # an alias without autograd history: the saved views hold no reference to their node


def _unpack_view(t: torch.Tensor) -> torch.Tensor:
    return t  # autograd puts the node back as the tensor's history (it was saved as the node's output)


_top_saved_hooks = top_saved_tensors_default_hooks


def _no_saved_hooks() -> bool:
    """No saved-tensor hooks are in effect: then a Function's outputs are saved as they are, without a reference
    to their node, and no _saving_views is needed. (False when that cannot be told.)"""
    if _top_saved_hooks is None:
        return False
    try:
        return _top_saved_hooks(False) is None
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


_SECOND_ORDER = (
    "funcshard.apply: a gradient taken by torch.func.grad (or vjp, grad_and_value) through apply's runtime was "
    "differentiated again by plain autograd below the transform (MAML's meta-gradient by loss.backward() over an inner "
    "torch.func.grad): the runtime's whole-step gather under torch.func reduce-scatters outside autograd, so the terms "
    "through the parameters' gather would be missing (a wrong second derivative). The first-order values are right "
    "and were returned. Take the inner gradient with torch.autograd.grad(..., create_graph=True) (apply's runtime "
    "differentiates it again), nest torch.func transforms (torch.func.grad(grad(...)): apply runs the traced path), or "
    "use funcshard.traced_apply or funcshard.gather + torch.func.functional_call")

_BELOW = (
    "funcshard.apply: a gradient taken by torch.func.grad (or vjp, grad_and_value) through apply's runtime was "
    "differentiated again by plain autograd below the transform (MAML's meta-gradient by loss.backward() over an inner "
    "torch.func.grad; the state or an input requires grad there), through group {group!r}, whose reduce-scatter "
    "apply's runtime cannot transpose: {why}. The first-order values are right and were returned. Use a plan without "
    "it, nest torch.func transforms (torch.func.grad(grad(...))), or funcshard.gather + torch.func.functional_call")

_VJP_BELOW = (
    "funcshard.apply: the gradients of a torch.func.vjp's vjp_fn (the level's backward, run outside the transform) "
    "through apply's runtime were differentiated again by plain autograd (the state or an input requires grad: MAML's "
    "inner step by torch.func.vjp); apply's runtime does not make that exact. The first-order values are right and "
    "were returned. Take the inner gradient with torch.func.grad (exact: its gradients are differentiable below the "
    "transform), or use funcshard.traced_apply or funcshard.gather + torch.func.functional_call")

_NOT_DIFFERENTIABLE = (
    "funcshard.apply: a gradient taken with create_graph=True was differentiated again through group {group!r}, whose "
    "reduce-scatter apply's runtime cannot make differentiable: {why}. The first-order values are right and were "
    "returned. For second order use a plan without it, or funcshard.traced_apply or funcshard.gather + "
    "torch.func.functional_call (their collectives are differentiable at any order)")


def create_graph_backward() -> bool:
    """A plain-autograd backward with ``create_graph=True`` runs (its grad mode; not torch.func's levels, which
    differentiate with create_graph=True too: a nested transform runs the traced path, not this runtime)."""
    return torch.is_grad_enabled() and not get_interpreter_stack()


def _second_order_dep(cotangents) -> torch.Tensor | None:
    """In a plain-autograd backward with create_graph=True, an incoming cotangent that carries a graph (else None).
    (torch.func.grad's gradients differentiated again below the transform are ``_tracked_below``'s.)"""
    if not create_graph_backward():
        return None
    return next((g for g in cotangents if g is not None and g.requires_grad), None)


def not_differentiable(step, name: str) -> str | None:
    """Why apply's runtime cannot reduce-scatter group ``name``'s gradients with the differentiable collectives in a
    ``create_graph=True`` backward (None: it can; ``second_order_grads``)."""
    plan, gb = step.plan, step.groups[name]
    g = gb.group
    if plan.layout != "per_param":
        return f"layout={plan.layout!r} (its shards are pieces of one buffer, not a parameter's rows)"
    if g.comm is not None:
        return "it has a comm hook (Group.comm), which the differentiable reduce-scatter would bypass"
    if g.offload_to_cpu:
        return "it offloads to the host (CPUOffloadPolicy)"
    if gb.ext is not None:
        return "its parameters define FSDP2's all-gather extension (fsdp_pre_all_gather / fsdp_post_all_gather)"
    if model := [p for p in g.params if plan.specs[p].model is not None]:
        return f"model-sharded (tensor-parallel DTensor) parameters {model}"
    return None


def _refusal(step, name: str) -> str:
    """What differentiating the runtime's first-order gradients of group ``name`` again raises."""
    why = not_differentiable(step, name) if getattr(step, "api", None) == "funcshard.apply" else None
    return _SECOND_ORDER if why is None else _NOT_DIFFERENTIABLE.format(group=label(name), why=why)


def graph_backward(step) -> bool:
    """Whether the running backward is a ``create_graph=True`` one of apply's runtime (not fully_shard's, nor the cost
    model's stand-in step's); then the graph it makes reads the unsharded parameters again when it is
    differentiated, and the step keeps its groups gathered from then on (``Step.second_order``: set here only;
    read by ``GroupRun.free_after_backward``). Called by each group's pre-backward and gather node."""
    if getattr(step, "api", None) != "funcshard.apply" or not create_graph_backward():
        return False
    step.second_order = True
    return True


def second_order(step, name: str) -> bool:
    """Whether group ``name``'s gather node runs in a ``create_graph=True`` backward of apply's runtime that can make
    its gradients differentiable (``second_order_grads``; ``graph_backward``).
    Decided by the backward's grad mode, not by the cotangents, so that every rank takes the same collectives."""
    return graph_backward(step) and not_differentiable(step, name) is None


def second_order_grads(step, name: str, grads: list, given: list | None = None, ready=None) -> list:
    """Group ``name``'s shard gradients in a ``create_graph=True`` backward: its full gradients ``grads`` (consumed)
    reduce-scattered and divided as its runtime would (the plan's buckets, divide factors and reduce dtype;
    ``_primitives.buckets``), by the differentiable collectives (``_primitives.rows``, ``scatter_mean``: the traced path's
    create_graph backward), so that differentiating them again gets every term through the gather, with the divide
    taken once per reverse level (``_primitives._Mean``). One reduce-scatter per bucket, synchronous (not the
    runtime's bucketed, overlapped one). The terms of the double backward read the group's unsharded parameters: the
    step keeps them gathered (``GroupRun.free_after_backward``).

    ``given``: the shard gradients the runtime's first-order reduce-scatter made of ``grads`` already (under one
    ``torch.func.grad`` level whose gradients plain autograd records below it: ``below``): returned as they are, as
    functions of ``grads`` (``_primitives.given_scatter_mean``: no collective now; the transposes, after ``ready()``,
    when differentiated)."""
    gb = step.groups[name]
    at = {p: i for i, p in enumerate(gb.group.params)}
    out: list = [None] * len(at) if given is None else list(given)
    if given is None:
        step.checks.collective(f"reduce-scatter of group {name!r} (create_graph backward)")
    for b in buckets(step.plan):
        taken = [(p, at[p.path]) for p in b.params if b.group == name and gb.grad_mask[at[p.path]]]
        if not taken:
            continue
        if given is not None:  # (no op now: the full gradients' transposes are taken when differentiated; the
            # same parameters on every rank, as the runtime's reduce-scatter: a missing one as zeros)
            values = [torch.zeros(p.local_shape, dtype=p.dtype, device=gb.device) if given[i] is None else given[i]
                      for p, i in taken]
            for (_, i), g in zip(taken, given_scatter_mean(b, [p for p, _ in taken], values,
                                                           [grads[i] for _, i in taken], step.pg,
                                                           step.replicate_pg, ready)):
                out[i] = g
            continue
        cols = []
        for p, i in taken:
            g, grads[i] = grads[i], None
            if g is None:  # (no gradient on this rank: zeros, as the runtime sends)
                g = torch.zeros(p.shape, dtype=b.compute, device=gb.device)
            cols.append(rows(b, p, g.to_dense() if g.layout is not torch.strided else g))
        flat = scatter_mean(b, torch.cat(cols, dim=1).to(b.reduce), step.pg, step.replicate_pg)
        for (p, i), piece in zip(taken, flat.split([p.numel for p, _ in taken])):
            out[i] = piece.to(p.dtype).view(p.local_shape)
    return out


def differentiated_below(step) -> bool:
    """Whether apply's ``step`` under one ``torch.func.grad`` level, whose gradients plain autograd records below the
    transform (``step.below``), makes them exact there (MAML's meta-gradient by ``loss.backward()`` over an inner
    ``torch.func.grad``): every group's reduce-scatter can be transposed (``not_differentiable``). Then the runtime
    runs as at first order (schedule, collectives, frees), and its shard gradients are, below the transform, functions
    of the full gradients autograd recorded there (``second_order_grads`` with ``given``: no collective then); a
    backward through them gathers the step's groups again (``_regather_all``) and transposes the reduce-scatter, and
    reaching the whole-step gather's node below the transform reduce-scatters its cotangents
    (``_outer_shard_grads``): the traced path's terms. Else they refuse (``_tracked_below``)."""
    return _not_transposed(step) is None


def _not_transposed(step) -> tuple[str, str] | None:
    """The first group of ``step`` (with shards) whose reduce-scatter cannot be transposed, and why; None: none."""
    return next(((n, w) for n, gb in step.groups.items()
                 if gb.shards and (w := not_differentiable(step, n)) is not None), None)


def _regather_all(step) -> None:
    """A backward below the transform differentiates the runtime's torch.func.grad gradients: the graph recorded there
    reads the unsharded parameters (views of the step's buffers, freed after its backward): gather every group again
    (``Step.regather``: the group's pre-backward), in the plan's order on every rank. (The gradients' graph holds the
    step, as a gather node's context does; the step holds no graph.)"""
    for name, gb in step.groups.items():
        if gb.shards:
            step.regather(name)


def regather_below(step, name: str, outputs: list) -> None:
    """Group ``name``'s ``outputs`` under the torch.func.grad level (``differentiated_below``): a hook on the tensors
    below the transform gathers the group again when a backward there reaches them (the level's value, e.g.
    ``grad_and_value``'s, differentiated by plain autograd: the group's operations read its unsharded parameters),
    as the runtime's pre-backward hook does at the level."""
    for t in outputs:
        base = unwrapped(t)
        if base is not t and base.requires_grad:
            base.register_hook(functools.partial(_regather_hook, step, name))


@runtime_boundary
def _regather_hook(step, name: str, grad):
    step.regather(name)  # (the graph holds the step, as a gather node's context does)


def _outer_shard_grads(step, grads) -> list:
    """The whole-step gather's node, reached by a backward below the torch.func.grad level (its outputs' cotangents
    ``grads``, group by group): each group's reduce-scatter and divide, by ``second_order_grads`` (differentiable
    where that backward is)."""
    out, k = [], 0
    for name, gb in step.groups.items():
        n = len(gb.shards)
        if n:
            out.extend(second_order_grads(step, name, list(grads[k : k + n])))
            k += n
    return out


def _tracked_below(step, grads):
    """The runtime's gradients under ``torch.func.grad``, where plain autograd records them below the transform (the
    state under its wrappers requires grad, or an input does: ``step.below``, what apply's entry found) and a group's
    reduce-scatter cannot be transposed (``not_differentiable``; else they are exact: ``differentiated_below``): they
    depend on those tensors and raise ``_BELOW`` naming the group when differentiated; before, they were constants
    there and the second-order term was silently missing. A step without ``below`` (fully_shard's) scans its state
    (``_SECOND_ORDER``)."""
    if getattr(step, "below", None) is None:  # (not apply's step)
        deps = tracked(step.state.values())
        return refuse_again(_SECOND_ORDER, deps, grads) if deps else grads
    why = _not_transposed(step) if step.below else None
    if why is None:  # (nothing recorded below, or exact: Fused._complete)
        return grads
    return refuse_again(_BELOW.format(group=label(why[0]), why=why[1]), step.below, grads)


def below(state, inputs) -> list[torch.Tensor]:
    """Under one torch.func grad/vjp level entered with grad mode on, the tensors of the call (``state``'s values (a
    mapping; anything else is left to ``check_state``) and the leaves of ``inputs``) that plain autograd records
    below the transform (``tracked``): the level's gradients depend on them there, and the runtime makes them exact
    there (``differentiated_below``) or refuse being differentiated again (``_tracked_below``). Not a reason to run
    the traced path: whether plain autograd will differentiate the gradients is not known when apply runs, and leaves
    that require grad under ``torch.func.grad`` are an ordinary first-order call (they keep the runtime's schedule).
    Empty otherwise: no transform, another stack (a jvp level: the runtime's gather node is plain autograd's below
    it, ``GroupBuffers.grad_mask``; its tangents: ``tangents_below``), grad mode off where the level was entered
    (nothing below records it)."""
    stack = get_interpreter_stack()
    if not stack or len(stack) != 1 or stack[0].key() != TransformType.Grad:
        return []
    if not GradInterpreter(stack[0]).prevGradMode():  # (the transform turns grad mode on inside it)
        return []
    return tracked([*(state.values() if isinstance(state, Mapping) else ()), *torch_tree_leaves(inputs)])


def tangents_below(state, inputs) -> bool:
    """Under one torch.func.jvp level with grad mode on, whether a tangent of the call's tensors (``state``'s values,
    the leaves of ``inputs``) is recorded by plain autograd below it: a backward through jvp's outputs differentiates
    it, through the gather of the tangents, which apply's runtime makes outside autograd (the traced path's is
    differentiable: ``funcshard.apply`` runs it). Measured before: a torch error (the runtime's).
    Only asked under a single jvp level."""
    if not torch.is_grad_enabled():  # (jvp leaves grad mode as it was)
        return False
    tensors = [t for t in (*state.values(), *torch_tree_leaves(inputs)) if isinstance(t, torch.Tensor)]
    return bool(tracked(unpack_dual(t).tangent for t in tensors))


def tracked(tensors) -> list[torch.Tensor]:
    """Those of ``tensors`` whose base below every torch.func wrapper requires grad (plain autograd records them)."""
    return [t for t in tensors if isinstance(t, torch.Tensor) and unwrapped(t).requires_grad]


def first_order(dep: torch.Tensor | None, grads, step=None, name: str | None = None):
    """The runtime's shard gradients as returned to autograd: as they are, or (``dep``: a create_graph=True backward
    the runtime does not make differentiable) wrapped so that differentiating them again raises instead of missing
    the terms through the gather: ``_refusal``'s text for group ``name`` of apply's ``step``, else ``_SECOND_ORDER``."""
    if dep is None:
        return list(grads)
    return refuse_again(_SECOND_ORDER if step is None else _refusal(step, name), (dep,), grads)
