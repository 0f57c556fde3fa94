"""The cost model's measurements of one process: a training step of the unsharded module on fake tensors.

:func:`profile_step` runs the plan's module forward, the loss and backward once on fake tensors (torch's
``FakeTensorMode``: shapes, dtypes and devices, no data, no ranks), on the device the mesh trains on, so that the
kernels chosen are the real ones (on CPU, e.g. the flash-attention kernel, which saves far less than the math one
the meta device picks). A dispatch mode counts every storage the step allocates and frees (what torch's
``MemTracker`` does) and, per op, its FLOPs (``torch.utils.flop_counter``'s formulas) and bytes read and written.

The parameters are leaves made in their compute dtype (``param_dtype`` under mixed precision), so the step is the
one the runtime runs on the unsharded views; their gradients are kept until the last of their group arrives, then
dropped together: what the runtime's gather node does (it takes a group's gradients when all of them are
complete). Marks record where each group's forward and backward start and end, as the runtime's hooks see them,
with the live bytes of activations (everything the step allocates but the parameters' gradients) and of
gradients there, and each stretch between two marks keeps its peak and its ops' (FLOPs, bytes).

:func:`profile_update` runs an optimizer's ``init`` and ``update`` (and ``apply_updates``) on fake shards: the
optimizer state's bytes and the update's transient peak.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from funcshard._compat import FakeTensorMode, TorchDispatchMode, torch_tree_leaves
from funcshard._plan import ROOT, Plan
from funcshard._policy import cast_floating, compute_dtype

FWD_START, FWD_END, BWD_START, BWD_END = "forward start", "forward end", "backward start", "backward end"


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
    """

    marks: tuple[Mark, ...]
    stretches: tuple[Stretch, ...]
    input_bytes: int
    device: str


@dataclasses.dataclass(frozen=True)
class UpdateProfile:
    """An optimizer's state and update on one rank's shards, traced on fake tensors.

    Attributes:
        state_bytes: bytes of the optimizer state (``init``'s tensors).
        peak_extra: the update's (and ``apply_updates``') highest live bytes beyond shards, gradients and state.
        cost: the update's ops (FLOPs, bytes) as one stretch.
    """

    state_bytes: int
    peak_extra: int
    cost: Stretch


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

    def cut(self) -> Stretch:
        """The stretch since the last cut; the next one starts at the current live bytes."""
        out = Stretch(self.peak, tuple(self.flops), tuple(self.nbytes))
        self.peak, self.flops, self.nbytes = self.live(), [], []
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in torch_tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in torch_tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_storages = {id(t.untyped_storage()) for t in ins}
        fresh = [t for t in outs if id(t.untyped_storage()) not in in_storages]
        formula = flop_registry.get(func.overloadpacket)
        self.flops.append(int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0)
        mutating = func._schema.is_mutable
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


def profile_step(plan: Plan, args: tuple, kwargs: dict, loss: Callable[[Any], torch.Tensor],
                 device: torch.device) -> StepProfile:
    """Trace one forward + loss + backward of ``plan.module`` on fake tensors (see the module docstring)."""
    module = plan.module
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # (the loss may read real targets: made fake on use)
    group_of = {p: g for g in plan.groups for p in g.params}
    leaves: dict[str, torch.Tensor] = {}
    for fqn, spec in plan.specs.items():
        g = group_of[fqn]
        t = _fake_like(mode, torch.empty(spec.shape, device="meta"), device, compute_dtype(spec.dtype, g.param_dtype))
        if spec.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex):
            t.requires_grad_(True)
        leaves[fqn] = t
    buffers = {n: _fake_like(mode, b, device) for n, b in module.named_buffers()}
    fargs, fkwargs = _fake_inputs(mode, (tuple(args), dict(kwargs or {})), device)
    input_bytes = sum(t.numel() * t.element_size() for t in torch_tree_leaves((fargs, fkwargs))
                      if isinstance(t, torch.Tensor))

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

    # forward: a group starts at the first of its modules' pre-hooks, ends at the last post-hook (per pass)
    handles = []
    started: set[str] = set()
    backward_started: set[str] = set()
    for g in plan.groups[1:]:
        for path in g.modules:
            mod = module.get_submodule(path)

            def pre(_m, a, kw, g=g):
                if g.name not in started:
                    started.add(g.name)
                    mark(FWD_START, g.name)
                if g.param_dtype is not None and g.cast_forward_inputs:
                    return cast_floating(g.param_dtype, (a, kw))
                return None

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

    # backward: a group's gradients are dropped together once the last one is complete (the gather node's backward)
    pending = {g.name: {p for p in g.params if leaves[p].requires_grad} for g in plan.groups}
    kept: dict[str, list[torch.Tensor]] = {g.name: [] for g in plan.groups}
    ended: set[str] = set()

    def accumulated(t: torch.Tensor, fqn: str) -> None:
        g = group_of[fqn].name
        live.see(t.grad, "grad")
        kept[g].append(t)
        pending[g].discard(fqn)
        if not pending[g]:
            ended.add(g)
            mark(BWD_END, g)
            for leaf in kept[g]:
                leaf.grad = None
            kept[g].clear()

    for fqn, t in leaves.items():
        if t.requires_grad:
            handles.append(t.register_post_accumulate_grad_hook(lambda t, fqn=fqn: accumulated(t, fqn)))
    root = plan.groups[0]
    try:
        with mode, live:
            mark(FWD_START, ROOT)
            if root.param_dtype is not None and root.cast_forward_inputs:
                fargs, fkwargs = cast_floating(root.param_dtype, (fargs, fkwargs))
            out = torch.func.functional_call(module, {**leaves, **buffers}, fargs, fkwargs)
            if root.output_dtype is not None:
                out = cast_floating(root.output_dtype, out)
            mark(FWD_END, ROOT)
            value = loss(out)
            del out
            mark(BWD_START, ROOT)
            if value.requires_grad:
                value.backward()
            del value
            for g in plan.groups:  # groups without (trainable) parameters with gradients end with the backward
                if g.name not in ended and g.name in backward_started | {ROOT}:
                    mark(BWD_END, g.name)
            stretches.append(live.cut())
    finally:
        for h in handles:
            h.remove()
    return StepProfile(tuple(marks), tuple(stretches), input_bytes, device.type)


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
        state_bytes = live.live()
        live.cut()
        kw = {"donate": True} if donate else {}
        updates, state = optimizer.update(grads, state, params, **kw)
        del grads
        params = optim.apply_updates(params, updates, **kw)
        del updates
        cost = live.cut()
    return UpdateProfile(state_bytes, max(0, cost.peak - state_bytes), cost)
