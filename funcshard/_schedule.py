"""One training step's collectives as data: their order, and the elements and bytes each one moves.

The only place that computes them. ``Plan.collective_order()`` prints :meth:`Schedule.lines`, ``Plan.__str__``
takes its group sizes from here, and the runtime's bucket layouts (``_pipeline.Buckets``) size their
all-gathers and reduce-scatters with :func:`bucket_sizes`, the function the schedule sizes them with.

The order is the one the runtime issues when the groups' modules run in plan order, each called inside its parent
module's forward (:func:`passes`): forward, each group gathered when its pass opens (or earlier, by a prefetch), freed
when it closes if it reshards; a group whose module contains another group's module (a parent) stays gathered while
the nested group runs, as in FSDP2, so it is unsharded beside it. Backward runs the passes in reverse of the order they
closed in (FSDP2's reverse post-forward order): a group is gathered before its backward (the gradient reaches a
parent's outputs before its children's), the groups it encloses run their backward inside its own, and it is
reduce-scattered and freed after them (its parameters' gradients complete after its children's: the usual case, a
parent that uses its parameters before it calls its children). Backward runs only the groups a gradient reaches
(:func:`backward_reaches`: those whose forward ends after the first parameter that takes a gradient is used); the
others are gathered in backward only when a reached group prefetches them, never reduce-scattered, and freed at the
end of backward. A group's all-reduce over the replicate axis (HSDP)
follows its reduce-scatter before any later all-gather. The root group is gathered first and reduce-scattered last.
Up to :func:`reduce_scatter_depth` reduce-scatters are in flight at once (``Plan.reduce_scatter_buffers``): each is
waited in the post-backward that would put one more in flight, or at the end of backward; the order they are issued in
is the same whatever the depth.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from funcshard._policy import compute_dtype, reduce_dtype_of
from funcshard._spec import ShardSpec, reduced, takes_grad

if TYPE_CHECKING:
    from funcshard._plan import Group, Plan

__all__ = ["Collective", "HostCopy", "Op", "Passes", "Schedule", "backward_reaches", "bucket_sizes", "frees_listed",
           "frozen_held", "gradient_from", "gradient_source", "passes", "reduce_scatter_at", "reduce_scatter_depth",
           "schedule"]

ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
ALL_REDUCE = "all-reduce"
FREE = "free"
BACKWARD = "-- backward --"  # the marker between forward and backward
HOST_TO_DEVICE, DEVICE_TO_HOST = "host-to-device", "device-to-host"  # CPU offload's copies (HostCopy)


def label(name: str) -> str:
    """A group's printed name: ``<root>`` for the root group (named ``""``)."""
    return "<root>" if name == "" else name


POST_BACKWARD, END_OF_BACKWARD = "post-backward", "end of backward"  # where a reduce-scatter runs (reduce_scatter_at)


def frees_listed(group: Group) -> bool:
    """Whether the step lists the group's free after forward as an op (``free``): a group with parameters, and the
    root; a group without parameters holds nothing, so its free is no line (the runtime frees it all the same). Its
    free after backward is its reduce-scatter's line. The rule ``_build`` and the cost model's replay both read."""
    return group.is_root or bool(group.params)


def reduce_scatter_at(plan: Plan, group: Group) -> str | None:
    """Where backward issues the group's reduce-scatter: ``POST_BACKWARD``, once its gradients are complete (a group
    with parameters that a gradient reaches: :func:`backward_reaches`); ``END_OF_BACKWARD``, after every other group's
    (the root with parameters: its gather node is made first in forward, so autograd runs it last); None for a group
    without parameters or one no gradient reaches (none is issued). The rule ``_build`` and the cost model's replay
    both read."""
    if not group.params:
        return None
    if group.is_root:
        return END_OF_BACKWARD
    return POST_BACKWARD if group.name in backward_reaches(plan) else None


def backward_reaches(plan: Plan) -> frozenset[str]:
    """The non-root groups whose backward runs: a gradient reaches their outputs, so the runtime's pre-backward
    gathers them and (with a trainable parameter) their post-backward reduce-scatters them. The one rule the schedule,
    the printout and the cost model read (``cost.estimate`` holds it to the traced step and refuses where they differ).

    A gradient flows from the first parameter that takes one (``_spec.takes_grad``) in the forward; a group's outputs
    carry one iff its forward pass (:func:`passes`) closes after that point: a group with a trainable parameter, every
    group after it, a group enclosing one. Where in its group's pass a trainable parameter is used the plan takes from
    the module tree: the root's, or a parent group's, parameter of a module registered before a group's first module
    that opens inside that pass (or of a module enclosing it, e.g. the model's own) is used before that group, one
    registered after them (a head, a parent's last layer) after them, one of a module inside a group's modules (a
    weight tied across groups, the root's: its first path) while that group's pass is open; without a module tree in
    the plan's order (``Plan.with_order``) first in its group's pass. What the plan cannot know, it assumes: the
    step's inputs take no gradient (``torch.func`` transforms, ``funcshard.value_and_grad``: only the state is
    differentiated; under plain autograd an input that requires grad makes the gradient reach every group after it),
    each group's outputs feed the next group's forward, a parameter is used where its module is registered, a group's
    forward runs once per step and uses its trainable parameters. Made once per plan."""
    return plan.derived("backward_reaches", _reaches)


def _reaches(plan: Plan) -> frozenset[str]:
    source = gradient_from(plan)
    return frozenset(n for i, (e, n) in enumerate(passes(plan).forward) if e == "close" and i > source)


def frozen_held(plan: Plan) -> frozenset[str]:
    """The non-root groups with a parameter that takes no gradient whose inputs no gradient reaches (their pass opens
    before :func:`gradient_from`; the step's inputs taken to take none): the runtime's ``FrozenRelease`` has no input
    gradient to wait for, so it frees them at the end of backward, not after their reduce-scatter."""
    source = gradient_from(plan)
    return frozenset(n for i, (e, n) in enumerate(passes(plan).forward) if e == "open" and i < source
                     and not all(plan.specs[p].requires_grad for p in plan.group(n).params))


def gradient_from(plan: Plan) -> float:
    """Where in the forward (an index into ``passes(plan).forward``) the gradient starts (:func:`backward_reaches`):
    just before the event ``i`` at which the first trainable parameter is used (``i - 0.5``); ``len(forward)`` when
    none is. A group's inputs carry a gradient iff its pass opens after it, its outputs iff its pass closes after it."""
    return gradient_source(plan)[0]


def gradient_source(plan: Plan) -> tuple[float, str | None, str | None]:
    """``(gradient_from(plan), the parameter used there, the module path it is taken to be used at)``; the parameter
    and path are None when no parameter takes a gradient, the path None without a module tree in the plan's order
    (the parameter then taken to be used first in its group's pass). Made once per plan."""
    return plan.derived("gradient_source", _gradient_source)


def _gradient_source(plan: Plan) -> tuple[float, str | None, str | None]:
    events = passes(plan).forward
    where = {(e, n): i for i, (e, n) in enumerate(events)}
    tree = _module_tree(plan)
    best: tuple[float, str | None, str | None] = (float(len(events)), None, None)
    for g in plan.groups:
        o, c = (-1, len(events)) if g.is_root else (where[("open", g.name)], where[("close", g.name)])
        for p in g.params:
            if not takes_grad(plan.specs[p].requires_grad, plan.specs[p].dtype):
                continue
            # (a tied parameter's name is its first registered path: with the modules in tree order, its first use)
            owner = p.rpartition(".")[0]
            at = o + 0.5 if tree is None else _used_at(plan, tree, events, o, c, owner) - 0.5
            if at < best[0]:
                best = (at, p, None if tree is None else owner)
    return best


def _used_at(plan: Plan, tree: tuple[dict[str, int], dict[str, int]], events: Sequence[tuple[str, str]], o: int,
             c: int, owner: str) -> int:
    """The first event of the pass ``(o, c)`` that follows the use of a parameter of module ``owner``: the opening of
    a group whose first module is registered after it, or the closing of a group whose modules enclose it (a module
    inside a group's subtree is used while that group's pass is open); ``c`` when none is; ``o + 1`` for a module
    the plan's module does not have."""
    index, first = tree
    m = index.get(owner)
    if m is None:  # (a module the plan's module does not have: first in the pass)
        return o + 1

    def encloses(name: str) -> bool:
        return any(owner == path or owner.startswith(path + ".") for path in plan.group(name).modules)

    return next((i for i in range(o + 1, c) if (events[i][0] == "open" and first[events[i][1]] > m)
                 or (events[i][0] == "close" and encloses(events[i][1]))), c)


def _module_tree(plan: Plan) -> tuple[dict[str, int], dict[str, int]] | None:
    """``(module path -> index in the module tree, group -> its first module's index)`` when the groups' modules run
    in the module tree's order (:func:`_calls`); else None."""
    index = {n: i for i, (n, _) in enumerate(plan.module.named_modules())} if isinstance(plan.module, nn.Module) else {}
    calls = _calls(plan, [g for g in plan.groups if not g.is_root])
    at = [index.get(m) for m, _ in calls]
    if None in at or at != sorted(at):
        return None
    first: dict[str, int] = {}
    for (_, n), i in zip(calls, at):
        first.setdefault(n, i)
    return index, first


def bucket_sizes(specs: Sequence[ShardSpec], param_dtype: torch.dtype | None = None
                 ) -> dict[torch.dtype, tuple[int, bool]]:
    """Per compute dtype (``compute_dtype``: the parameter's, or ``param_dtype`` for a floating one under mixed
    precision; in order of first appearance), the size of the group's collective for the parameters ``specs``:
    ``(elements per rank, whether padding is among them)``. The all-gather's input and the reduce-scatter's output
    have that many elements, their unsharded buffer ``world`` times as many.

    Per-parameter layout: the concatenation of the parameters' local shards (each padded on its dim). Flat
    layout: the group's flat buffer of that dtype split evenly, ``ceil(total / world)``, padded at its end."""
    by_dtype: dict[torch.dtype, list[ShardSpec]] = {}
    for s in specs:
        by_dtype.setdefault(compute_dtype(s.dtype, param_dtype), []).append(s)
    out: dict[torch.dtype, tuple[int, bool]] = {}
    for dt, ss in by_dtype.items():
        first = ss[0]
        if first.flat is not None:  # every rank's slice of the flat buffer has the same length
            chunk = math.ceil(first.flat.total / first.world)
            out[dt] = (chunk, chunk * first.world != first.flat.total)
        else:
            out[dt] = (sum(s.local_numel for s in ss), any(s.padding for s in ss))
    return out


def _unsharded_nbytes(specs: Sequence[ShardSpec], param_dtype: torch.dtype | None = None) -> int:
    """Bytes of the parameters unsharded (in their compute dtype): padded per parameter (per-parameter layout),
    unpadded (flat layout)."""
    return sum((s.numel if s.flat else math.prod(s.padded_shape)) * compute_dtype(s.dtype, param_dtype).itemsize
               for s in specs)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective as the process group sees it: one group's all-gather, reduce-scatter or all-reduce of one dtype.

    Attributes:
        kind: ``"all-gather"``, ``"reduce-scatter"`` or ``"all-reduce"`` (HSDP, over the replicate axis).
        group: the group's name (``""``: the root group).
        dtype: the buffer's dtype.
        numel: elements per rank: the all-gather's input, the reduce-scatter's output, the all-reduce's buffer.
        world: ranks in the process group it runs on: the mesh axis' size, or ``k`` for the backward all-gather of a
            group resharded to ``k`` ranks after forward (a block of the shard axis).
        axis: the mesh axis it runs along (the plan's shard axis; its replicate axis for an all-reduce).
    """

    kind: str
    group: str
    dtype: torch.dtype
    numel: int
    world: int
    axis: int

    @property
    def full_numel(self) -> int:
        """Elements of the unsharded buffer: the all-gather's output, the reduce-scatter's input (an all-reduce's
        buffer is as large on every rank)."""
        return self.numel if self.kind == ALL_REDUCE else self.numel * self.world

    @property
    def nbytes(self) -> int:
        """Bytes of the unsharded buffer (the all-gather's output, the reduce-scatter's input, the all-reduce's
        buffer)."""
        return self.full_numel * self.dtype.itemsize

    def where(self, mesh) -> str:
        """The process group it runs on, as printed: the mesh axis, and the block size when it is a part of it."""
        from funcshard._mesh import axis_name

        if mesh is None:
            return f"axis {self.axis} ({self.world} ranks)"
        size = mesh.size(self.axis)
        part = f"blocks of {self.world} of its {size} ranks" if self.world != size else f"{size} ranks"
        return f"axis {axis_name(mesh, self.axis)} ({part})"


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """One copy between the host and the device in a step (CPU offload, ``_offload``): an offloaded group's shards
    copied to the device before each all-gather of them (``GroupBuffers.issue``; a re-gather from the shards kept on
    ``k`` ranks after forward copies nothing), its gradient shards copied back after its reduce-scatter
    (``HostReduce``); ``funcshard.cost`` adds ``optim.offload``'s state of each group, in and out. On a CPU mesh the
    host is the device and nothing is copied: these are the bytes the same plan copies on an accelerator.

    Attributes:
        kind: ``"host-to-device"`` or ``"device-to-host"``.
        group: the group's name (``""``: the root group).
        what: ``"parameters"``, ``"gradients"`` or ``"optimizer state"``.
        nbytes: the bytes copied (the local shards, padding included, in their own dtype).
    """

    kind: str
    group: str
    what: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Op:
    """One line of a step: a group's all-gather, free or reduce-scatter, or the start of backward.

    Attributes:
        kind: ``"all-gather"``, ``"reduce-scatter"``, ``"free"`` or ``"-- backward --"`` (group ``None``).
        group: the group's name (``""``: the root group).
        why: why it runs then, e.g. ``"prefetch, while blocks.0 computes"`` (``""``: on use).
        collectives: what the process group runs for it, one per dtype (none for a free, nor for the
            reduce-scatter of a group without a parameter that takes a gradient).
    """

    kind: str
    group: str | None = None
    why: str = ""
    collectives: tuple[Collective, ...] = ()

    def line(self) -> str:
        if self.kind == BACKWARD:
            return BACKWARD
        name = label(self.group or "")
        if self.kind == REDUCE_SCATTER:
            return f"{REDUCE_SCATTER} {name}, " + (self.why or "free it")
        return f"{self.kind} {name}" + (f" ({self.why})" if self.why else "")

    def where(self, mesh) -> str:
        """Which process group each of its collectives runs on (``Plan.__str__``), e.g. ``"  [reduce-scatter on axis
        'shard' (2 ranks), all-reduce on axis 'replicate' (2 ranks)]"``; empty without collectives."""
        seen = dict.fromkeys(f"{c.kind} on {c.where(mesh)}" for c in self.collectives)
        return f"  [{', '.join(seen)}]" if seen else ""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One training step of a plan: its ops in issue order, and each group's unsharded size.

    Attributes:
        ops: the step's ops in issue order (``Op``).
        group_nbytes: ``(group name, bytes unsharded)`` per group, in plan order.
        reduce_scatter_depth: how many reduce-scatters are in flight at once at most (:func:`reduce_scatter_depth`):
            each is waited when one more would exceed it, or at the end of backward.
    """

    ops: tuple[Op, ...]
    group_nbytes: tuple[tuple[str, int], ...]
    kept_fraction: tuple[int, ...] = ()  # per group: 0 freed after forward, 1 kept, k a k-th kept
    copies: tuple[HostCopy, ...] = ()  # CPU offload: the step's host <-> device copies, in issue order
    reduce_scatter_depth: int = 1  # reduce-scatters in flight at once at most (reduce_scatter_depth)

    def lines(self) -> list[str]:
        """The step as printed by ``Plan.collective_order()``, one string per op."""
        return [op.line() for op in self.ops]

    def collectives(self) -> tuple[Collective, ...]:
        """The communication alone: every collective the process group runs, in issue order."""
        return tuple(c for op in self.ops for c in op.collectives)

    def totals(self) -> dict[str, int]:
        """Bytes of the unsharded buffers per kind of collective (``"all-gather"``, ``"reduce-scatter"``; and
        ``"all-reduce"`` when the step has one: HSDP)."""
        out = {ALL_GATHER: 0, REDUCE_SCATTER: 0}
        for c in self.collectives():
            out[c.kind] = out.get(c.kind, 0) + c.nbytes
        return out

    def copy_totals(self) -> dict[str, int]:
        """Bytes copied per step between host and device by kind (CPU offload; empty without an offloaded group)."""
        out: dict[str, int] = {}
        for c in self.copies:
            out[c.kind] = out.get(c.kind, 0) + c.nbytes
        return out

    def unsharded_nbytes(self, group: str) -> int:
        return dict(self.group_nbytes)[group]

    def most_unsharded(self) -> int:
        """The most non-root groups unsharded at once along the step: a group counts from its all-gather's issue
        (its buffers are allocated then) to its free or its reduce-scatter (which frees it unless it stays
        gathered). ``prefetch + 1`` for groups that do not nest, more with nested ones (a parent stays gathered
        while the groups inside it run)."""
        root = self.group_nbytes[0][0] if self.group_nbytes else ""
        held: set[str] = set()
        most = 0
        for op in self.ops:
            if op.group is None or op.group == root:
                continue
            if op.kind == ALL_GATHER:
                held.add(op.group)
                most = max(most, len(held))
            elif op.kind == FREE or (op.kind == REDUCE_SCATTER and not op.why):
                held.discard(op.group)
        return most

    def kept_after_forward(self) -> int:
        """Bytes of unsharded parameters a rank holds between forward and backward, beyond its shards: the groups
        not resharded after forward in full, those resharded to ``k`` ranks a ``k``-th (what the memory between the
        True and False cases is)."""
        return sum(n // k for n, k in zip(dict(self.group_nbytes).values(), self.kept_fraction) if k)


def reduce_scatter_depth(plan: Plan) -> int:
    """How many reduce-scatters backward keeps in flight at once (the runtime's ``ReduceQueue``, the cost model's
    replay): ``Plan.reduce_scatter_buffers``, but one with a replicate axis (HSDP), where each reduce-scatter is taken
    before the next collective so that its all-reduce follows it (the order above)."""
    return 1 if plan.replicas > 1 else plan.reduce_scatter_buffers


def schedule(plan: Plan) -> Schedule:
    """The plan's step (made once per plan object: a Plan is immutable, an edited copy gets its own)."""
    return plan.derived("schedule", _build)


def _collectives(kind: str, g, specs: Sequence[ShardSpec], plan: Plan, k: int | None = None
                 ) -> tuple[Collective, ...]:
    """A group's collectives of one kind, one per compute dtype: all-gathers in the compute dtype (``k``: the backward
    all-gather of a group resharded to ``k`` ranks, whose input is a ``k``-th of the unsharded buffer); reduce-scatters
    in the reduce dtype (``reduce_dtype_of``), each followed (HSDP) by an all-reduce of its output over the replicate
    axis. None over a single rank."""
    if not specs:
        return ()
    world, axis = specs[0].world, specs[0].axis  # (a plan shards every parameter over one axis)
    sizes = bucket_sizes(specs, g.param_dtype).items()
    if kind == ALL_GATHER:
        if k is not None:
            return tuple(Collective(kind, g.name, dt, n * world // k, k, axis) for dt, (n, _) in sizes)
        return tuple(Collective(kind, g.name, dt, n, world, axis) for dt, (n, _) in sizes) if world > 1 else ()
    reduce = [(reduce_dtype_of(dt, g.reduce_dtype), n) for dt, (n, _) in sizes]
    rs = tuple(Collective(kind, g.name, dt, n, world, axis) for dt, n in reduce) if world > 1 else ()
    replicas = plan.replicas
    return rs + (tuple(Collective(ALL_REDUCE, g.name, dt, n, replicas, plan.replicate_axis) for dt, n in reduce)
                 if replicas > 1 else ())


def _reduced(specs: Sequence[ShardSpec]) -> list[ShardSpec]:
    """The parameters a group's reduce-scatter covers (``_spec.reduced``, the runtime's rule), by the plan's
    ``requires_grad`` (the module's): the runtime asks the shards it is given, the same unless a caller
    differentiates with respect to shards of frozen parameters too."""
    flat = bool(specs) and specs[0].flat is not None
    return [specs[i] for i in reduced(flat, [s.requires_grad for s in specs], [s.dtype for s in specs])]


@dataclasses.dataclass(frozen=True)
class Passes:
    """The non-root groups' forward passes as the runtime's ``ForwardTracker`` sees them when the modules run in
    plan order, each inside its parent module's forward: a group's pass opens when its first module starts and
    closes when all of its modules have finished.

    Attributes:
        forward: ``("open" | "close", group)`` in the order they happen.
        closed: the groups in the order their passes close (post-forward); backward runs them in reverse
            (``Plan.prefetch_after``'s default backward order, FSDP2's reverse post-forward order).
        enclosing: per group, the groups whose pass was open when its own opened, outermost first (its parents:
            gathered while it runs, in forward and in backward).
    """

    forward: tuple[tuple[str, str], ...]
    closed: tuple[str, ...]
    enclosing: dict[str, tuple[str, ...]]


def passes(plan: Plan) -> Passes:
    """The plan's forward passes (made once per plan)."""
    return plan.derived("passes", _passes)


def _calls(plan: Plan, groups: Sequence) -> list[tuple[str, str]]:
    """``(module path, group)`` in the order the group modules' forwards start: the module tree's order (a parent's
    before its children's) when it opens the groups in the plan's order; else (``Plan.with_order``, or modules the
    plan's module does not have) the plan's order, each group's modules in turn."""
    paths = [(m, g.name) for g in groups for m in g.modules]
    index = {n: i for i, (n, _) in enumerate(plan.module.named_modules())} if isinstance(plan.module, nn.Module) else {}
    if all(m in index for m, _ in paths):
        calls = sorted(paths, key=lambda c: index[c[0]])
        if list(dict.fromkeys(n for _, n in calls)) == [g.name for g in groups]:
            return calls
    return paths


def _passes(plan: Plan) -> Passes:
    groups = [g for g in plan.groups if not g.is_root]
    modules = {g.name: set(g.modules) for g in groups}
    forward: list[tuple[str, str]] = []
    closed: list[str] = []
    enclosing: dict[str, tuple[str, ...]] = {}
    running: dict[str, set[str]] = {}  # group -> its modules still to finish in its open pass
    stack: list[tuple[str, str]] = []  # the module forwards under way, innermost last

    def finish() -> None:
        path, name = stack.pop()
        left = running[name]
        left.discard(path)
        if not left:
            forward.append(("close", name))
            closed.append(name)

    for path, name in _calls(plan, groups):
        while stack and not path.startswith(stack[-1][0] + "."):  # (not called inside that module)
            finish()
        if not running.get(name):
            enclosing[name] = tuple(n for e, n in forward if e == "open" and running.get(n))
            forward.append(("open", name))
            running[name] = set(modules[name])
        stack.append((path, name))
    while stack:
        finish()
    return Passes(tuple(forward), tuple(closed), enclosing)


def _build(plan: Plan) -> Schedule:
    specs = {g.name: [plan.specs[p] for p in g.params] for g in plan.groups}
    gathers = {g.name: _collectives(ALL_GATHER, g, specs[g.name], plan) for g in plan.groups}
    post = {g.name: (k, _collectives(ALL_GATHER, g, specs[g.name], plan, k)) for g in plan.groups
            if (k := plan.post_forward_world(g)) is not None}
    reduces = {g.name: _collectives(REDUCE_SCATTER, g, _reduced(specs[g.name]), plan) for g in plan.groups}
    ops: list[Op] = []
    copies: list[HostCopy] = []
    host = {g.name: sum(s.local_numel * s.dtype.itemsize for s in specs[g.name]) for g in plan.groups
            if g.offload_to_cpu}  # (an offloaded group's shards: copied in before each all-gather of them)
    grads_back = {g.name: sum(s.local_numel * s.dtype.itemsize for s in specs[g.name]
                              if takes_grad(s.requires_grad, s.dtype))
                  for g in plan.groups if g.offload_to_cpu}  # (its gradient shards, back after the reduce-scatter)
    gathered: set[str] = set()
    resharded: set[str] = set()  # groups kept sharded over k ranks after forward: their next gather runs on k
    empty = {g.name for g in plan.groups if not g.params}
    fwd = passes(plan)

    def ag(name: str, why: str) -> None:
        if name not in gathered and name not in empty:
            gathered.add(name)
            if name in resharded:
                resharded.discard(name)
                k, colls = post[name]
                ops.append(Op(ALL_GATHER, name, f"{why}; from {k} ranks" if why else f"from {k} ranks", colls))
            else:
                ops.append(Op(ALL_GATHER, name, why, gathers[name]))
                if name in host:
                    copies.append(HostCopy(HOST_TO_DEVICE, name, "parameters", host[name]))

    def free_after_forward(g) -> None:
        gathered.discard(g.name)
        if g.name in post:
            resharded.add(g.name)
            ops.append(Op(FREE, g.name, f"keep a {post[g.name][0]}-rank shard"))
        else:
            ops.append(Op(FREE, g.name))

    root = plan.groups[0]
    ag(root.name, "")
    for p in plan.prefetch_after(root.name):
        ag(p, f"prefetch, while {label(root.name)} computes")
    for event, name in fwd.forward:
        g = plan.group(name)
        if event == "open":
            ag(name, "")
            for p in plan.prefetch_after(name):
                ag(p, f"prefetch, while {label(name)} computes")
        elif g.reshard_after_forward and frees_listed(g):
            free_after_forward(g)
    if root.reshard_after_forward and frees_listed(root):
        free_after_forward(root)
    ops.append(Op(BACKWARD))

    held = frozen_held(plan)

    def kept(g) -> str:  # the reduce-scatter's line: the group is freed after it, unless the plan keeps it
        if not g.reshard_after_backward:
            return "keep it gathered (reshard_after_backward=False)"
        if g.name in held:
            return ("free it at the end of backward (a frozen parameter, and no gradient reaches its inputs: the "
                    "step's inputs taken to take none)")
        return ""

    def reduce_scatter(g) -> None:
        if reduce_scatter_at(plan, g) is not None:
            ops.append(Op(REDUCE_SCATTER, g.name, kept(g), reduces[g.name]))
            if grads_back.get(g.name):
                copies.append(HostCopy(DEVICE_TO_HOST, g.name, "gradients", grads_back[g.name]))
            if g.reshard_after_backward:
                gathered.discard(g.name)

    reached = backward_reaches(plan)
    inside: list[str] = []  # the groups whose backward is under way, innermost last
    for g in (root, *(plan.group(n) for n in reversed(fwd.closed) if n in reached)):
        while inside and inside[-1] not in fwd.enclosing.get(g.name, ()):  # its backward is done
            reduce_scatter(plan.group(inside.pop()))
        if g.unshard_in_backward:  # (False: its backward reads no parameters, nothing is gathered for it)
            ag(g.name, "" if g.is_root else "before its backward")
        for p in plan.prefetch_after(g.name, backward=True):
            if plan.group(p).unshard_in_backward:  # (one no gradient reaches: gathered all the same, never used)
                ag(p, f"prefetch, while {label(g.name)} computes" + (
                    "" if p in reached else "; no gradient reaches it: unused, freed at the end of backward"))
        if not g.is_root:
            inside.append(g.name)
    while inside:
        reduce_scatter(plan.group(inside.pop()))
    for g in plan.groups:  # (the root's)
        if reduce_scatter_at(plan, g) == END_OF_BACKWARD:
            reduce_scatter(g)
    kept = tuple(0 if g.name in empty or g.reshard_after_forward is True else post[g.name][0] if g.name in post else 1
                 for g in plan.groups)
    return Schedule(tuple(ops), tuple((g.name, _unsharded_nbytes(specs[g.name], g.param_dtype)) for g in plan.groups),
                    kept, tuple(copies), reduce_scatter_depth(plan))
