"""The cost model's measurements of one process: a training step of the unsharded module on fake tensors.

:func:`profile_step` runs the plan's module forward, the loss and backward once on fake tensors (torch's
``FakeTensorMode``: shapes, dtypes and devices, no data, no ranks), on the device the mesh trains on, so that the
kernels chosen are the real ones (on CPU, e.g. the flash-attention kernel, which saves far less than the math one
the meta device picks). A dispatch mode counts every storage the step allocates and frees (what torch's
``MemTracker`` does) and, per op, its FLOPs (``torch.utils.flop_counter``'s formulas) and bytes read and written.

The parameters are leaves made in their compute dtype (``param_dtype`` under mixed precision), so the step is the
one the runtime runs on the unsharded views. As in the runtime, each group's parameters reach the module through one
autograd node made when the group's forward starts, the runtime's own gather node (``_TraceStep``): its backward (the
group's post-backward) runs where the runtime's runs, with the group's gradients, which are dropped there (the
reduce-scatter consumes them). Groups with frozen parameters also mark when the gradients of their forward's inputs
are complete (the runtime's ``FrozenRelease`` frees them only then). Marks record where each group's forward and
backward start and end, as the runtime's hooks see them, with the live bytes of activations (everything the step
allocates but the parameters' gradients) and of gradients there, and each stretch between two marks keeps its peak
and its ops' (FLOPs, bytes).

:func:`profile_update` runs an optimizer's ``init`` and ``update`` (and ``apply_updates``) on fake shards: the
optimizer state's bytes and the update's transient peak.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from funcshard._compat import FakeTensorMode, TorchDispatchMode, op_is_mutable, param_slots, torch_tree_leaves
from funcshard._plan import ROOT, Plan
from funcshard._policy import cast_floating, compute_dtype
from funcshard._spec import ShardingError, takes_grad

FWD_START, FWD_END, BWD_START, BWD_END = "forward start", "forward end", "backward start", "backward end"
INPUTS_DONE = "inputs' gradients done"  # a group with frozen parameters: the gradients of its forward's inputs


@dataclasses.dataclass(frozen=True)
class Mark:
    """A point of the traced step: group ``group``'s forward or backward starts or ends (``kind``).

    Attributes:
        kind: ``"forward start"``, ``"forward end"``, ``"backward start"`` or ``"backward end"``.
        group: the group's name (``""``: the root group).
        activations: live bytes of everything the step allocated but the parameters' gradients.
        grads: live bytes of unsharded parameter gradients (a group's, from the first to the last one).
    """

    kind: str
    group: str
    activations: int
    grads: int


@dataclasses.dataclass(frozen=True)
class Stretch:
    """What runs between two marks: its peak of live bytes (activations + gradients) and its ops' cost.

    Attributes:
        peak: the highest activations + gradients bytes while it runs.
        flops: per op, floating point operations (0 for ops without a formula: elementwise, copies).
        nbytes: per op, bytes read and written (0 for views).
    """

    peak: int
    flops: tuple[int, ...]
    nbytes: tuple[int, ...]

    def seconds(self, flops_per_s: float, bytes_per_s: float) -> float:
        """The roofline time: each op as slow as its compute or its memory traffic makes it."""
        return sum(max(f / flops_per_s, b / bytes_per_s) for f, b in zip(self.flops, self.nbytes))


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """One step of the unsharded module, traced on fake tensors: ``marks[i]`` is followed by ``stretches[i]``.

    Attributes:
        marks: the groups' forward/backward starts and ends, in the order they happened.
        stretches: what ran after each mark (the last one: after the last mark, to the end of backward).
        input_bytes: bytes of the step's tensor inputs (they live through the step).
        device: the device type traced on.
        frozen: groups with a parameter that takes no gradient (freed in backward once their inputs' gradients are
            done too: ``INPUTS_DONE`` marks).
        trainable: groups with a parameter that takes a gradient (they have a post-backward).
        unwatched: frozen groups whose forward inputs take no gradient: kept until the end of backward.
        watched: frozen groups whose forward inputs' gradients are waited for (an ``INPUTS_DONE`` mark each).
        post_backward: groups whose gather node ran its backward (the runtime's post-backward: the reduce-scatter).
    """

    marks: tuple[Mark, ...]
    stretches: tuple[Stretch, ...]
    input_bytes: int
    device: str
    frozen: frozenset[str] = frozenset()
    trainable: frozenset[str] = frozenset()
    unwatched: frozenset[str] = frozenset()
    watched: frozenset[str] = frozenset()
    post_backward: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class UpdateProfile:
    """An optimizer's state and update on one rank's shards, traced on fake tensors.

    Attributes:
        state_bytes: bytes of the optimizer state (``init``'s tensors).
        peak_extra: the update's (and ``apply_updates``') highest live bytes beyond shards, gradients and state.
        cost: the update's ops (FLOPs, bytes) as one stretch.
        offloaded: ``(group, bytes)`` of the state ``optim.offload`` keeps on the host, each group's copied to the
            device and back by every update.
    """

    state_bytes: int
    peak_extra: int
    cost: Stretch
    offloaded: tuple[tuple[str, int], ...] = ()


def _offloaded(state: Any) -> tuple[tuple[str, int], ...]:
    """``(group, bytes)`` of every ``optim.offload`` state inside an optimizer state (chains are tuples)."""
    from funcshard import optim

    if isinstance(state, optim.OffloadState):
        return tuple(state.group_nbytes().items())
    if isinstance(state, tuple):
        return tuple(x for s in state for x in _offloaded(s))
    return ()


class _Live(TorchDispatchMode):
    """Live storage bytes by category (``"act"`` or ``"grad"``), their peak, and each op's (FLOPs, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[int, list] = {}  # id(storage) -> [weakref, bytes, category]
        self.totals = {"act": 0, "grad": 0}
        self.ignore: set[int] = set()  # storages not the step's (parameters)
        self.peak = 0
        self.flops: list[int] = []
        self.nbytes: list[int] = []

    def live(self) -> int:
        return self.totals["act"] + self.totals["grad"]

    def see(self, t: torch.Tensor, category: str = "act") -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.ignore:
            return
        ent = self.entries.get(key)
        n = st.nbytes()
        if ent is None:
            totals, entries = self.totals, self.entries

            def freed(_ref, key=key):
                e = entries.pop(key, None)
                if e is not None:
                    totals[e[2]] -= e[1]

            self.entries[key] = [weakref.ref(st, freed), n, category]
            self.totals[category] += n
        else:
            if ent[2] != category:  # (a gradient found to be a parameter's: moved to its category)
                self.totals[ent[2]] -= ent[1]
                self.totals[category] += ent[1]
                ent[2] = category
            self.totals[category] += n - ent[1]
            ent[1] = n
        self.peak = max(self.peak, self.live())

    def forget(self, tensors) -> None:
        """Stop counting these tensors' storages now (consumed, though a caller still holds them a moment)."""
        for t in tensors:
            e = self.entries.pop(id(t.untyped_storage()), None)
            if e is not None:
                self.totals[e[2]] -= e[1]

    def cut(self) -> Stretch:
        """The stretch since the last cut; the next one starts at the current live bytes."""
        out = Stretch(self.peak, tuple(self.flops), tuple(self.nbytes))
        self.peak, self.flops, self.nbytes = self.live(), [], []
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from funcshard._compat import flop_registry  # (torch's flop counter imports triton: not at import)

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in torch_tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in torch_tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_storages = {id(t.untyped_storage()) for t in ins}
        fresh = [t for t in outs if id(t.untyped_storage()) not in in_storages]
        formula = flop_registry.get(func.overloadpacket)
        self.flops.append(int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0)
        mutating = op_is_mutable(func)
        moved = (sum(t.numel() * t.element_size() for t in ins) + sum(t.numel() * t.element_size() for t in fresh)
                 if fresh or mutating else 0)  # (a view moves nothing)
        self.nbytes.append(moved)
        for t in outs:
            self.see(t)
        if mutating:  # resize_ and friends change their inputs' storages
            for t in ins:
                if id(t.untyped_storage()) in self.entries:
                    self.see(t, self.entries[id(t.untyped_storage())][2])
        return out


def _fake_like(mode, t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    with mode:
        return torch.empty(t.shape, dtype=dtype or t.dtype, device=device)


def _fake_inputs(mode, tree: Any, device: torch.device) -> Any:
    """Real or meta tensors in ``tree`` as fake tensors on ``device`` (integer inputs keep their dtype)."""
    from funcshard._compat import torch_tree_map_only

    return torch_tree_map_only(torch.Tensor, lambda t: _fake_like(mode, t, device), tree)


class _TraceStep:
    """The step the runtime's gather node reads (``_runtime.strategies.gather_node``), for the traced step: the node
    is the runtime's own, made when the group's forward starts, so that autograd runs its backward where it runs the
    runtime's (once every gradient of the group's parameters is complete, in the engine's order by creation: the
    root group's, made first, runs last); its outputs are aliases of the group's parameter leaves, those of frozen
    ones non-differentiable, as the runtime's are. Per group a ``_TracedGroup`` is its run and its buffers;
    ``nodes`` is the runtime's ``Nodes`` (the trace registers no pre-hook: the gradients come as autograd gives
    them)."""

    def __init__(self) -> None:
        from funcshard._runtime.strategies import Nodes

        self.runs: dict[str, _TracedGroup] = {}
        self.groups = self.runs
        self.nodes = Nodes(self)

    def gather(self, name: str, leaves: list[torch.Tensor], done: Callable[[list], None]) -> tuple:
        """The group's parameters as the outputs of its gather node; ``done(grads)``: its post-backward."""
        from funcshard._runtime.strategies import gather_node

        self.runs[name] = _TracedGroup(leaves, done)
        return gather_node(self, name, None, *leaves)


class _TracedGroup:
    """A group of the traced step, as its gather node reads its run and buffers: ``wait`` (the leaves are unsharded
    already), ``views`` (aliases of them), ``post_backward`` (its gradients, Nones dropped, to ``done``: the
    runtime's reduce-scatter consumes them; the node returns no shard gradients), ``node`` (for ``Nodes``)."""

    __slots__ = ("leaves", "done", "node")

    def __init__(self, leaves: list[torch.Tensor], done: Callable[[list], None]):
        from funcshard._runtime.strategies import NodeState

        self.leaves, self.done, self.node = leaves, done, NodeState(None)

    def wait(self) -> None:
        pass

    def views(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in self.leaves)

    def post_backward(self, grads: list) -> list:
        self.done([g for g in grads if g is not None])
        return [None] * len(grads)


def _check_loss(value: Any, trainable: bool) -> None:
    """The loss must be a scalar tensor that depends on the parameters (user errors, said as such)."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"funcshard.cost.estimate: loss(out) must return a scalar tensor, got {shape}; reduce it "
                         f"(e.g. loss=lambda out: out.float().square().mean())")
    if trainable and not value.requires_grad:
        raise ValueError("funcshard.cost.estimate: loss(out) does not depend on the parameters (it requires no "
                         "gradient: detached, computed under no_grad, or from inputs alone), so no backward would "
                         "run; compute it from the module's output without .detach()")


def profile_step(plan: Plan, args: tuple, kwargs: dict, loss: Callable[[Any], torch.Tensor],
                 device: torch.device) -> StepProfile:
    """Trace one forward + loss + backward of ``plan.module`` on fake tensors (see the module docstring)."""
    from funcshard._runtime.backward import grad_inputs
    from funcshard._runtime.binding import slots

    module = plan.module
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # (the loss may read real targets: made fake on use)
    leaves: dict[str, torch.Tensor] = {}
    for g in plan.groups:
        for fqn in g.params:
            spec = plan.specs[fqn]
            t = _fake_like(mode, torch.empty(spec.shape, device="meta"), device,
                           compute_dtype(spec.dtype, g.param_dtype))
            if takes_grad(spec.requires_grad, t.dtype):
                t.requires_grad_(True)
            leaves[fqn] = t
    buffers = {n: _fake_like(mode, b, device) for n, b in module.named_buffers()}
    fargs, fkwargs = _fake_inputs(mode, (tuple(args), dict(kwargs or {})), device)
    input_bytes = sum(t.numel() * t.element_size() for t in torch_tree_leaves((fargs, fkwargs))
                      if isinstance(t, torch.Tensor))
    # the runtime's FrozenRelease: a group with a parameter that takes no gradient is freed in backward only once
    # the gradients of its forward's inputs are complete too (never, before the end, when none requires grad)
    trainable = {g.name for g in plan.groups if any(leaves[p].requires_grad for p in g.params)}
    frozen = {g.name for g in plan.groups if not all(leaves[p].requires_grad for p in g.params)}

    live = _Live()
    live.ignore = {id(t.untyped_storage()) for t in (*leaves.values(), *buffers.values())}
    marks: list[Mark] = []
    stretches: list[Stretch] = []

    def mark(kind: str, group: str) -> None:
        if marks:
            stretches.append(live.cut())
        else:
            live.cut()
        marks.append(Mark(kind, group, live.totals["act"], live.totals["grad"]))

    ended: set[str] = set()

    def post_backward(grads: list[torch.Tensor], name: str) -> None:
        for t in grads:
            live.see(t, "grad")
        ended.add(name)
        mark(BWD_END, name)
        live.forget(grads)  # (the runtime's reduce-scatter consumes them: copied into its input, then dropped)

    originals: dict[tuple[int, str], tuple[torch.nn.Module, Any]] = {}
    nodes = _TraceStep()

    def gather(g) -> None:
        """The group's node, its parameters put on the module (every alias of a tied one)."""
        if not g.params:
            return
        done = lambda grads, name=g.name: post_backward(grads, name)  # noqa: E731
        outs = nodes.gather(g.name, [leaves[p] for p in g.params], done)
        for mod, attr, i in slots(plan, g):
            slot = param_slots(mod)
            originals.setdefault((id(mod), attr), (mod, slot[attr]))
            slot[attr] = outs[i]

    # forward: a group starts at the first of its modules' pre-hooks, ends at the last post-hook (per pass)
    handles = []
    started: set[str] = set()
    backward_started: set[str] = set()
    uses: dict[str, int] = {}
    unwatched: set[str] = set()
    without_grad: set[str] = set()  # groups whose forward ran without grad (reentrant checkpointing's first run)
    called: set[str] = set()  # the group modules whose forward ran in the step's forward
    in_backward = [False]

    def inputs_done(name: str) -> None:
        uses[name] -= 1
        if uses[name] == 0:
            mark(INPUTS_DONE, name)

    for g in plan.groups[1:]:
        for path in g.modules:
            mod = module.get_submodule(path)

            def pre(_m, a, kw, g=g, path=path):
                if not in_backward[0] and path in called:
                    raise ShardingError(
                        f"funcshard.cost.estimate: the forward of group {g.name!r} ran twice in one step (its module "
                        f"{path!r} is called again): the runtime gathers the group again and runs its backward "
                        f"otherwise than the plan's schedule (plan.collective_order()) lists, which the cost model "
                        f"does not replay; call the module once per step, or plan without {path!r} as a group "
                        f"(funcshard.plan(groups=...): its parameters then go to the group enclosing it), to "
                        f"estimate")
                if not in_backward[0]:
                    called.add(path)
                if not in_backward[0] and not torch.is_grad_enabled():
                    without_grad.add(g.name)
                elif in_backward[0] and torch.is_grad_enabled() and g.name in without_grad:
                    raise ShardingError(
                        f"funcshard.cost.estimate: group {g.name!r} runs under reentrant activation checkpointing "
                        f"(torch.utils.checkpoint(..., use_reentrant=True): its forward ran without grad and runs "
                        f"again with grad inside backward, where the runtime gathers it through a new autograd node), "
                        f"which the cost model does not replay; checkpoint with use_reentrant=False (the cost model "
                        f"replays its recomputation) to estimate")
                if g.name not in started:
                    started.add(g.name)
                    mark(FWD_START, g.name)
                    gather(g)
                cast = g.param_dtype is not None and g.cast_forward_inputs
                if cast:
                    a, kw = cast_floating(g.param_dtype, (a, kw))
                if g.name in frozen and torch.is_grad_enabled():  # (FrozenRelease.watch_inputs, the same way)
                    inputs = grad_inputs(a)
                    if not inputs:
                        unwatched.add(g.name)
                        return (a, kw) if cast else None
                    uses[g.name] = uses.get(g.name, 0) + 1
                    top = [i for i, t in enumerate(a) if isinstance(t, torch.Tensor) and t.requires_grad]
                    if len(top) != len(inputs) or any(a[i].layout is not torch.strided or a[i].is_nested for i in top):
                        torch.autograd.graph.register_multi_grad_hook(
                            inputs, lambda _g, name=g.name: inputs_done(name), mode="all")
                        return (a, kw) if cast else None
                    left = [len(top)]

                    def done(_grad, name=g.name, left=left):
                        left[0] -= 1
                        if left[0] == 0:
                            inputs_done(name)

                    a = list(a)
                    for i in top:  # (an alias: its hook runs before the producer's output hooks, as the runtime's)
                        a[i] = torch.ops.aten.alias(a[i])
                        a[i].register_hook(done)
                    return tuple(a), kw
                return (a, kw) if cast else None

            def post(_m, _a, out, g=g):
                mark(FWD_END, g.name)

                def hook(_grad, g=g):  # the runtime's pre-backward: the first gradient of the group's outputs
                    if g.name not in backward_started:
                        backward_started.add(g.name)
                        mark(BWD_START, g.name)

                if torch.is_grad_enabled():
                    for t in torch_tree_leaves(out):
                        if isinstance(t, torch.Tensor) and t.requires_grad:
                            t.register_hook(hook)
                return out if g.output_dtype is None else cast_floating(g.output_dtype, out)

            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post))

    root = plan.groups[0]
    try:
        with mode, live:
            mark(FWD_START, ROOT)
            gather(root)
            if root.param_dtype is not None and root.cast_forward_inputs:
                fargs, fkwargs = cast_floating(root.param_dtype, (fargs, fkwargs))
            out = torch.func.functional_call(module, buffers, fargs, fkwargs)
            if root.output_dtype is not None:
                out = cast_floating(root.output_dtype, out)
            mark(FWD_END, ROOT)
            value = loss(out)
            del out
            _check_loss(value, bool(trainable))
            mark(BWD_START, ROOT)
            if value.requires_grad:
                in_backward[0] = True
                value.backward()
            del value
            post_backward = frozenset(ended)  # (the groups whose node ran: the runtime's post-backwards)
            for g in plan.groups:  # groups without (trainable) parameters with gradients end with the backward
                if g.name not in ended and g.name in backward_started | {ROOT}:
                    mark(BWD_END, g.name)
            stretches.append(live.cut())
    finally:
        for h in handles:
            h.remove()
        for (_, attr), (mod, t) in originals.items():
            param_slots(mod)[attr] = t
    return StepProfile(tuple(marks), tuple(stretches), input_bytes, device.type, frozenset(frozen),
                       frozenset(trainable), frozenset(unwatched), frozenset(uses), post_backward)


def profile_update(optimizer: Any, shards: dict[str, tuple[tuple[int, ...], torch.dtype]],
                   device: torch.device, donate: bool) -> UpdateProfile:
    """Trace ``optimizer.init`` and one ``update`` + ``apply_updates`` on fake shards of the given shapes."""
    from funcshard import optim

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        params = {k: torch.empty(s, dtype=dt, device=device) for k, (s, dt) in shards.items()}
        grads = {k: torch.empty(s, dtype=dt, device=device) for k, (s, dt) in shards.items()}
    live = _Live()
    live.ignore = {id(t.untyped_storage()) for t in (*params.values(), *grads.values())}
    with mode, live:
        state = optimizer.init(params)
        offloaded = _offloaded(state)
        state_bytes = live.live()
        live.cut()
        kw = {"donate": True} if donate else {}
        updates, state = optimizer.update(grads, state, params, **kw)
        del grads
        params = optim.apply_updates(params, updates, **kw)
        del updates
        cost = live.cut()
    return UpdateProfile(state_bytes, max(0, cost.peak - state_bytes), cost, offloaded)
