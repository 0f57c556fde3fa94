"""The Plan: specs, groups and schedule as frozen, printable data.

A Plan says, for one module on one mesh, how every parameter is sharded (:class:`ShardSpec`), which
parameters are all-gathered together (:class:`Group`) and in which order, and the schedule: reshard after
forward, prefetch depth, explicit prefetch lists, gradient divide factor. The runtime only executes it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from funcshard._collectives import check_timeout
from funcshard._comm import CommHook, check_comm, check_extension, wire_nbytes
from funcshard._compat import dtensor_local
from funcshard._schedule import backward_reaches, label, passes, reduce_scatter_depth, schedule
from funcshard._mesh import (
    axis_name,
    dp_axes,
    mesh_str,
    model_sharding,
    post_forward_group,
    resolve_full_mesh,
    resolve_mesh,
    spmd_dp_mesh,
)
from funcshard._offload import offload_fields
from funcshard._owner import OwnerStep, owner_steps
from funcshard._policy import (
    MixedPrecisionPolicy,
    check_mp_policy,
    compute_dtype,
    reshard_after_forward_default,
    resolve_reshard_after_forward,
)
from funcshard._spec import FlatSlot, ShardingError, ShardSpec, dim_range, make_spec, placement_dim

__all__ = ["Group", "Plan", "plan"]

ROOT = ""  # the root group's name: the parameters no policy picked
UNIT = "_funcshard_unit"  # module attribute: the fully_shard unit the module belongs to (funcshard.fsdp's)


@dataclasses.dataclass(frozen=True)
class Group:
    """Parameters all-gathered together: one collective per dtype.

    Attributes:
        name: the group's name: its first module's path, ``""`` for the root group.
        modules: paths of the modules whose forward uses the group (gathered before the first of them runs,
            freed after the last of them has run). The root group's module is the whole model, ``("",)``.
        params: canonical paths of the group's parameters, in module order.
        reshard_after_forward: free the unsharded parameters after forward (gather again for backward). An int
            ``k`` (1 < k < shard axis size, dividing it): keep them sharded over ``k`` ranks after forward (FSDP2's
            post-forward mesh, ZeRO++ hpZ), so the backward all-gather runs within a block of ``k`` ranks; the plan
            turns 1 into False and the shard axis size into True.
        reshard_after_backward: free them after backward (False: the next forward uses them without an
            all-gather, e.g. during gradient accumulation).
        unshard_in_backward: gather the group again for its backward (False: its backward reads no parameters,
            e.g. an embedding's).
        grad_divide_factor: divide this group's summed gradients by this instead of ``Plan.divide_factor``.
        comm: the group's collectives replaced (``funcshard.CommHook``: functional hooks, e.g. a quantized
            all-gather, or FSDP2 ``AllGather`` / ``ReduceScatter`` objects, what ``fully_shard``'s
            ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` set); None: ``torch.distributed``'s.
        param_dtype: mixed precision (``MixedPrecisionPolicy``'s fields, FSDP2's semantics): floating parameters are
            all-gathered and used in ``param_dtype`` (None: their own dtype).
        reduce_dtype: the dtype gradients are reduce-scattered in (default ``param_dtype``); they are handed back in
            the shards' dtype.
        output_dtype: the dtype floating outputs of the group's modules are cast to (None: no cast).
        cast_forward_inputs: cast floating inputs of the group's modules to ``param_dtype``.
        offload_to_cpu: CPU offload (``CPUOffloadPolicy``'s, FSDP2's semantics, ``_offload.py``): the group's shards
            and gradients live on the host, copied to the device before the all-gather and back after the
            reduce-scatter.
        pin_memory: the offloaded shards and gradients are in pinned host memory.
    """

    name: str
    modules: tuple[str, ...]
    params: tuple[str, ...]
    reshard_after_forward: bool | int
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    grad_divide_factor: float | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    comm: CommHook | None = None
    offload_to_cpu: bool = False
    pin_memory: bool = False

    @property
    def is_root(self) -> bool:
        """Whether this is the root group (the parameters no group policy picked; name ``""``)."""
        return self.name == ROOT


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity: usable as a dict key
class Plan:
    """How one module is sharded over one mesh and scheduled. Make one with :func:`funcshard.plan`.

    Attributes:
        module: the planned module (its structure, not its parameter values, is what the plan is about).
        mesh: the DeviceMesh; parameters are sharded over ``shard_axis``.
        shard_axis: the mesh axis parameters are sharded over (``_mesh.dp_axes``: the only axis of a 1-D mesh, axis
            1 of a 2-D ``(replicate, shard)`` mesh for HSDP).
        replicate_axis: the mesh axis parameters are replicated over (HSDP: axis 0 of a 2-D mesh; None: none);
            gradients are all-reduced over it after the reduce-scatter.
        specs: one :class:`ShardSpec` per parameter, keyed by canonical path.
        groups: the gather groups in forward execution order; the root group comes first.
        forward_prefetch: how many groups ahead the forward all-gathers run (0: gather on use).
        backward_prefetch: how many groups ahead (in reverse order) the backward all-gathers run.
        forward_prefetch_lists: explicit per-group forward prefetch lists (group name -> names of groups to gather
            when its forward starts); they replace the depth-based default for that group.
        backward_prefetch_lists: the same for backward.
        grad_divide_factor: gradients are reduce-scattered with a sum (and all-reduced over the replicate axis), then
            divided by this factor, once. Default: the data-parallel size (the mesh size: replicate * shard), so
            gradients are those of the global mean loss.
        layout: ``"per_param"`` (each parameter sharded on its own dim) or ``"flat"`` (each group's parameters of one
            dtype in one flat buffer split evenly over the ranks); see :func:`funcshard.plan`.
        timeout: seconds any one wait of a step may take before it raises ``CollectiveTimeout`` (None: the
            ``FUNCSHARD_TIMEOUT`` environment variable, else 300; 0 or inf: no bound of funcshard's own).
        check: check mode: the ranks check, out of band, that they issue the same collectives in the same order
            (``_runtime/check.py``); off by default (a store round trip per collective).
        owner_steps: the optimizer step's owner exchanges, ``_owner.OwnerStep`` each (:meth:`with_optimizer`).
        reduce_scatter_buffers: how many reduce-scatters backward keeps in flight at once (:func:`funcshard.plan`).
    """

    module: nn.Module = dataclasses.field(repr=False, compare=False)
    mesh: DeviceMesh
    shard_axis: int
    specs: Mapping[str, ShardSpec]
    groups: tuple[Group, ...]
    forward_prefetch: int = 1
    backward_prefetch: int = 1
    forward_prefetch_lists: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    backward_prefetch_lists: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    grad_divide_factor: float | None = None
    layout: str = "per_param"
    replicate_axis: int | None = None
    timeout: float | None = None
    check: bool = False
    owner_steps: tuple[OwnerStep, ...] = dataclasses.field(default=(), repr=False)
    reduce_scatter_buffers: int = 1
    # what other modules derive from the plan (layouts, schedule, runtime facts): computed once per Plan object,
    # kept with it (a new, edited plan starts empty), so nothing outside holds a plan or its module alive
    _derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):  # int reshard_after_forward: 1 is False, the shard axis size True (FSDP2's rule)
        if any(not isinstance(g.reshard_after_forward, bool) for g in self.groups):
            object.__setattr__(self, "groups", tuple(
                dataclasses.replace(g, reshard_after_forward=_post_forward_size(g, self._shard_world()))
                for g in self.groups))

    def _shard_world(self) -> int:
        if self.mesh is not None:
            return self.mesh.size(self.shard_axis)
        return next(iter(self.specs.values())).world if self.specs else 1

    # ---- derived facts -------------------------------------------------------------------------
    def derived(self, key: str, make: Callable[[Plan], Any]) -> Any:
        """``make(self)``, computed once per plan object under ``key`` (the one per-plan cache).

        Args:
            key: the cache key (one per kind of derived fact).
            make: computes the value from the plan, once.
        """
        hit = self._derived.get(key)
        if hit is None:
            hit = self._derived[key] = make(self)
        return hit

    @property
    def world(self) -> int:
        """Ranks on the shard axis (the shards of every parameter)."""
        return self.mesh.size(self.shard_axis)

    @property
    def replicas(self) -> int:
        """Ranks on the replicate axis (1: none)."""
        return 1 if self.replicate_axis is None else self.mesh.size(self.replicate_axis)

    def post_forward_world(self, group: Group) -> int | None:
        """``k`` when the group is kept sharded over ``k`` ranks after forward (int ``reshard_after_forward``), else
        None.

        Args:
            group: one of this plan's groups.
        """
        rsf = group.reshard_after_forward
        return None if isinstance(rsf, bool) else rsf

    def shard_group(self):
        """The process group of the shard axis, and this rank's index on it."""
        return self.mesh.get_group(self.shard_axis), self.mesh.get_local_rank(self.shard_axis)

    def replicate_group(self):
        """The process group gradients are all-reduced over (HSDP), None without a replicate axis of 2 or more."""
        return None if self.replicas == 1 else self.mesh.get_group(self.replicate_axis)

    def post_forward_group(self, k: int):
        """``(process group, rank in it)`` of this rank's block of ``k`` ranks of the shard axis (``_mesh``).

        Args:
            k: the block size (an int ``reshard_after_forward``).
        """
        return post_forward_group(self.mesh, self.shard_axis, k)

    def axes_str(self) -> str:
        """The mesh axes as printed: which one shards, which one replicates."""
        def one(kind: str, axis: int) -> str:
            return f"{kind} axis {axis_name(self.mesh, axis)} ({self.mesh.size(axis)} ranks)"

        rep = "" if self.replicate_axis is None else ", " + one("replicate", self.replicate_axis)
        return one("shard", self.shard_axis) + rep

    @property
    def divide_factor(self) -> float:
        """The factor gradients are divided by after the reduce-scatter (applied exactly once)."""
        if self.grad_divide_factor is not None:
            return float(self.grad_divide_factor)
        return float(self.mesh.size())

    def divide_factor_of(self, group: Group) -> float:
        """The factor the group's summed gradients are divided by: its own, or the plan's.

        Args:
            group: one of this plan's groups.
        """
        return self.divide_factor if group.grad_divide_factor is None else float(group.grad_divide_factor)

    def group(self, name: str) -> Group:
        """The group named ``name`` (``""``: the root); a KeyError listing the plan's groups if none is.

        Args:
            name: the group's name (its first module's path).
        """
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"plan has no group {name!r}; its groups are {[g.name for g in self.groups]}")

    def prefetch_after(self, name: str, *, backward: bool = False, ran: tuple[str, ...] | None = None
                       ) -> tuple[str, ...]:
        """Names of the groups whose all-gather is issued when group ``name`` starts (forward or backward): its
        explicit list if it has one, else the next ``depth`` groups in the plan's order (backward: reversed).
        ``ran``: the order the groups' forwards actually ran in (backward: the order they finished in; backward
        prefetch follows its reverse, as FSDP2 records it), when it is known. The one rule the runtime and the
        schedule both use.

        Args:
            name: the group that starts.
            backward: the backward's prefetch (else the forward's).
            ran: the order the groups' forwards ran in (backward: the order they finished in), when known; None: the
                plan's order.
        """
        cache = self.derived("prefetch_after", lambda _: {})
        key = (name, backward, ran)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = self._prefetch_after(name, backward, ran)
        return hit

    def _prefetch_after(self, name: str, backward: bool, ran: tuple[str, ...] | None) -> tuple[str, ...]:
        lists = self.backward_prefetch_lists if backward else self.forward_prefetch_lists
        if name in lists:
            return tuple(lists[name])
        if ran:
            order = list(ran)
        else:  # (backward: the order the passes close in, a parent after its children: _schedule.passes)
            order = list(passes(self).closed) if backward else [g.name for g in self.groups if not g.is_root]
        if backward:
            order = order[::-1]
        depth = self.backward_prefetch if backward else self.forward_prefetch
        if name == ROOT or name not in order:  # the root starts first in forward and in backward
            return tuple(order[:depth])
        i = order.index(name)
        return tuple(order[i + 1 : i + 1 + depth])

    # ---- editing (returns new plans) ---------------------------------------------------------
    def replace(self, **changes: Any) -> Plan:
        """A copy with some fields changed (``dataclasses.replace``), validated again.

        Args:
            **changes: fields of :class:`Plan` and their new values.
        """
        new = dataclasses.replace(self, **changes)
        _check_schedule(new)
        return new

    def with_order(self, names: Sequence[str]) -> Plan:
        """A copy whose non-root groups run in this order (the root stays first): the default prefetch, forward
        and backward, follows the plan's group order. Groups not named keep their order, after the named ones.

        Args:
            names: non-root group names in the order their forwards run.
        """
        for n in names:
            self.group(n)
        rest = [g for g in self.groups[1:] if g.name not in set(names)]
        return self.replace(groups=(self.groups[0], *(self.group(n) for n in names), *rest))

    def order_differs(self, names: Sequence[str]) -> bool:
        """Whether groups that ran in the order ``names`` ran out of the plan's order.

        Args:
            names: the groups in the order their forwards ran.
        """
        seen = set(names)
        return [g.name for g in self.groups if g.name in seen] != list(names)

    def with_group(self, name: str, **changes: Any) -> Plan:
        """A copy where group ``name`` has some fields changed, e.g. ``reshard_after_forward=False``, or
        ``mp_policy=MixedPrecisionPolicy(...)`` for its four precision fields, ``offload_policy=CPUOffloadPolicy(...)``
        for its offload fields.

        Args:
            name: the group's name.
            **changes: fields of :class:`Group` (``reshard_after_forward``, ``comm``, ...), or ``mp_policy=`` /
                ``offload_policy=`` for its precision or offload fields.
        """
        self.group(name)
        if "mp_policy" in changes:  # (None: no mixed precision, as in plan())
            policy = changes.pop("mp_policy")
            changes.update(_mp_fields(MixedPrecisionPolicy() if policy is None else policy, f"group {name!r}"))
        if "offload_policy" in changes:  # (None: no offload)
            changes.update(offload_fields(changes.pop("offload_policy"), f"group {name!r}"))
        groups = tuple(dataclasses.replace(g, **changes) if g.name == name else g for g in self.groups)
        return self.replace(groups=groups)

    def with_optimizer(self, optimizer: Any, params: Iterable[str] | None = None) -> Plan:
        """A copy that prints (and lists in :meth:`collective_order`) the optimizer's owner exchanges: ``owner_steps``.

        Args:
            optimizer: ``optim.muon``, ``optim.owner_compute``, an ``optim.multi_transform`` or a ``chain`` holding
                one, built with ``plan=`` a plan of these shards; one without owners (``optim.adamw``) adds nothing.
            params: the paths the optimizer is given (a dict or its keys); default: the trained floating-point ones.

        Returns:
            The new plan (this one is not changed).
        """
        return self.replace(owner_steps=owner_steps(self, optimizer, params, where="Plan.with_optimizer"))

    # ---- printing ----------------------------------------------------------------------------
    def collective_order(self) -> list[str]:
        """The collectives of one training step, in issue order (one all-gather / reduce-scatter per group and dtype;
        then the optimizer's all-to-alls: :meth:`with_optimizer`), as the runtime issues them in plan order. Backward
        lists the groups a gradient reaches (``_schedule.backward_reaches``: from the first parameter that takes a
        gradient on, taking the step's inputs to take none, as under ``torch.func`` transforms; a root parameter used
        where its module is registered); an input that requires grad under plain autograd reaches more (and frees a
        frozen group once its inputs' gradients are done, not at the end of backward), which
        ``funcshard.cost.estimate`` refuses to cost."""
        return schedule(self).lines() + [c.line() for s in self.owner_steps for c in s.collectives]

    def __str__(self) -> str:
        return _printout(self)


def _printout(plan: Plan) -> str:
    """``str(plan)``: its header, the groups and their parameters, the step's collectives in order, the per-step
    totals."""
    lines = [_header(plan)]
    step = schedule(plan)
    for g in plan.groups:
        nbytes = step.unsharded_nbytes(g.name)
        dtypes = sorted({str(plan.specs[p].dtype).removeprefix("torch.") for p in g.params})
        lines.append(
            f"  group {label(g.name)}: {len(g.params)} params, {nbytes / 2**20:.2f} MiB unsharded, "
            f"dtypes {dtypes}, reshard_after_forward={g.reshard_after_forward}" + "".join(
                f", {k}={v}" for k, v in (("reshard_after_backward", g.reshard_after_backward),
                                          ("unshard_in_backward", g.unshard_in_backward),
                                          ("grad_divide_factor", g.grad_divide_factor),
                                          ("param_dtype", g.param_dtype), ("reduce_dtype", g.reduce_dtype),
                                          ("output_dtype", g.output_dtype),
                                          ("cast_forward_inputs", g.cast_forward_inputs), ("comm", g.comm),
                                          ("offload", ("cpu, pinned" if g.pin_memory else "cpu")
                                           if g.offload_to_cpu else None))
                if v is not None and v is not True)
        )
        lines.extend(f"    {_described(plan, p)}" for p in g.params)
    lines.append("  one step:")
    lines.extend(f"    {i:>3}. {line}{step.ops[i - 1].where(plan.mesh)}" for i, line in enumerate(step.lines(), 1))
    lines += _owner_lines(plan, len(step.ops))
    unreached = [label(g.name) for g in plan.groups[1:] if g.name not in backward_reaches(plan)]
    if unreached:
        lines.append(f"  no gradient reaches {', '.join(unreached)}: no parameter that takes one is used before their "
                     f"forwards end (the step's inputs are taken to take none; _schedule.backward_reaches), so they "
                     f"are not gathered for a backward of their own nor reduce-scattered")
    totals = step.totals()
    lines.append(f"  per step: all-gather {totals['all-gather'] / 2**20:.2f} MiB, reduce-scatter "
                 f"{totals['reduce-scatter'] / 2**20:.2f} MiB (unsharded buffers, padding included)" +
                 (f", all-reduce {totals['all-reduce'] / 2**20:.2f} MiB" if "all-reduce" in totals else ""))
    if any(g.comm is not None for g in plan.groups):
        wire: dict[str, int] = {}
        for c in step.collectives():
            wire[c.kind] = wire.get(c.kind, 0) + wire_nbytes(plan, c)
        if wire:  # (none at world size 1: no collective runs)
            lines.append("  moved by the groups' comm hooks: " + ", ".join(
                f"{k} {v / 2**20:.2f} MiB" for k, v in wire.items()))
    copied = step.copy_totals()  # (CPU offload)
    if copied:
        lines.append("  copied between host and device (CPU offload), per step: " + ", ".join(
            f"{k} {v / 2**20:.2f} MiB" for k, v in copied.items()))
    kept = step.kept_after_forward()
    lines.append(f"  held between forward and backward, per rank: {kept / 2**20:.2f} MiB of unsharded parameters "
                 f"(groups not resharded, or resharded to fewer ranks)")
    lines += [f"  {line}" for s in plan.owner_steps for line in s.lines()]  # (with_optimizer)
    return "\n".join(lines)


def _described(plan: Plan, path: str) -> str:
    """A parameter's line of the printout: its spec, and its owner rank when an owner exchange (``with_optimizer``)
    owns it."""
    marks = plan.derived("owner_marks", lambda p: {
        e.path: f"  [owner: rank {e.owner}{f', {s.label!r}' if s.label else ''}]" for s in p.owner_steps
        for e in s.owners.entries})
    return plan.specs[path].describe() + marks.get(path, "")


def _owner_lines(plan: Plan, n: int) -> list[str]:
    """The optimizer step's all-to-alls (``Plan.with_optimizer``) as the printout numbers them, after ``n`` ops."""
    where = f"  [all-to-all on axis {axis_name(plan.mesh, plan.shard_axis)} ({plan.world} ranks)]"
    collectives = [c for s in plan.owner_steps for c in s.collectives]
    return [f"    {n + i:>3}. {c.line()}{where}" for i, c in enumerate(collectives, 1)]


def _header(p: Plan) -> str:
    """The first line of ``str(plan)``: the mesh, the sizes, the schedule's settings."""
    depth = reduce_scatter_depth(p)
    return (f"Plan over {mesh_str(p.mesh)} ({p.axes_str()}), {len(p.specs)} parameters in {len(p.groups)} groups; "
            f"prefetch forward {p.forward_prefetch} backward {p.backward_prefetch}; "
            f"gradients divided by {p.divide_factor:g} after reduce-scatter"
            f"{'' if p.replicate_axis is None else ' and all-reduce'}; layout {p.layout}"
            + (f"; timeout {p.timeout:g} s" if p.timeout is not None else "")
            + ("; check mode" if p.check else "")
            + (f"; reduce-scatters in flight up to {depth}" + (
                f" (reduce_scatter_buffers={p.reduce_scatter_buffers}; HSDP: each all-reduce follows its "
                f"reduce-scatter)" if depth != p.reduce_scatter_buffers else "")
               if p.reduce_scatter_buffers != 1 else ""))


# ---- building a plan ---------------------------------------------------------------------------

GroupPolicy = (
    None
    | type
    | tuple[type, ...]
    | Callable[[str, nn.Module], bool]
    | Sequence[str | Sequence[str]]
)


def plan(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    groups: GroupPolicy = None,
    shard_placement_fn: Callable[[str, nn.Parameter], int | None] | None = None,
    reshard_after_forward: bool | int | None = None,
    prefetch: int = 1,
    backward_prefetch: int | None = None,
    forward_prefetch_lists: Mapping[str, Iterable[str]] | None = None,
    backward_prefetch_lists: Mapping[str, Iterable[str]] | None = None,
    grad_divide_factor: float | None = None,
    layout: str = "per_param",
    mp_policy: Any = None,
    offload_policy: Any = None,
    timeout: float | None = None,
    check: bool = False,
    dp_mesh_dims: Any = None,
    comm: CommHook | None = None,
    reduce_scatter_buffers: int = 1,
    _spec_of: Callable[[str, nn.Parameter], ShardSpec] | None = None,
) -> Plan:
    """Plan how ``module``'s parameters are sharded over ``mesh`` and scheduled.

    Args:
        module: the model. Its parameters may live on the meta device (only shapes and dtypes are read).
        mesh: a 1-D DeviceMesh (parameters are sharded over its only axis), or a 2-D ``(replicate, shard)`` one
            (HSDP: sharded over axis 1, replicated over axis 0; gradients reduce-scattered over axis 1, then
            all-reduced over axis 0). ``None``: a 1-D mesh over the default process group.
        groups: which modules form gather groups; the remaining parameters form the root group. One of:
            a module class or tuple of classes (every instance is a group, e.g. the transformer blocks);
            a callable ``(fqn, module) -> bool``; a sequence of module paths, each a string (one module) or
            a sequence of strings (several modules forming one group). Nested picks nest like FSDP2: an
            inner group takes its own parameters, the outer one the rest. ``None``: one root group.
        shard_placement_fn: ``(fqn, param) -> dim | None``: the tensor dim to shard each parameter on
            (``None``: dim 0). Negative dims count from the end. Uneven sizes are padded, on any dim.
        reshard_after_forward: free each group's unsharded parameters after its forward. ``None``: True for
            every group but the root (which is used again at once by backward), as FSDP2 does. An int ``k``
            dividing the shard axis size: keep them sharded over ``k`` ranks after forward (``Group``).
        prefetch: forward prefetch depth: while group k computes, the all-gathers of groups k+1..k+prefetch
            are in flight. 0 gathers each group when it is used.
        backward_prefetch: backward prefetch depth (default: ``prefetch``).
        forward_prefetch_lists: explicit forward prefetch lists, group name -> the names of the groups whose
            all-gathers are issued when that group's forward starts (replaces the depth for that group).
        backward_prefetch_lists: the same for backward: group name -> the groups gathered when its backward
            starts.
        grad_divide_factor: divide the summed gradients by this (default: the mesh size, i.e. average).
        layout: ``"per_param"`` (default): every parameter is sharded on its own dim, each rank's shard a
            regular tensor (DTensor ``Shard(dim)``-compatible, what ``fully_shard`` and DCP checkpoints
            use); all-gathered group buffers are copied out into the parameters. ``"flat"``: each group's
            parameters of one dtype form one flat buffer split evenly over the ranks, so the all-gathered
            buffer *is* the parameters (no copy-out, no transient second copy of the group); local shards
            are 1-D pieces whose sizes differ between ranks (no DTensor placement describes them).
        mp_policy: a ``MixedPrecisionPolicy`` for every group (``plan.with_group(name, mp_policy=...)`` for one):
            see :class:`Group`. Shards, gradients and optimizer state stay in the parameters' dtype.
        offload_policy: a ``CPUOffloadPolicy`` for every group (``plan.with_group(name, offload_policy=...)`` for
            one): the groups' shards (``shard``) and gradients on the host, see :class:`Group`.
        timeout: seconds a step's collective may take before every waiting rank raises ``CollectiveTimeout``
            naming it (a dead or diverged rank); None: ``FUNCSHARD_TIMEOUT``, else 300. See :class:`Plan`.
        check: check mode (off by default): the ranks check that they run the same collectives in the same order
            and raise ``DivergenceError`` naming the first that differs. Which parameters take gradients is always
            checked.
        dp_mesh_dims: ``DataParallelMeshDims(shard=..., replicate=...)`` naming the data-parallel axes of ``mesh``,
            a full SPMD mesh whose other axes are the model's (torch 2.12+'s ``fully_shard`` argument): every
            parameter must then be a DTensor on ``mesh`` with ``Replicate()`` on those axes.
        comm: a ``funcshard.CommHook`` for every group (``plan.with_group(name, comm=...)`` for one): its functions
            run the groups' all-gathers and/or reduce-scatters (e.g. ``funcshard.int8_all_gather()``, a quantized
            all-gather); ``str(plan)`` and ``funcshard.cost`` count the bytes the hook says it moves.
        reduce_scatter_buffers: how many groups' gradient reduce-scatters backward keeps in flight at once (an int
            >= 1), each holding its buffers (FSDP2's ``set_reduce_scatter_max_input_buffers``): a group's
            post-backward waits for the oldest one only when this many are in flight. 1 (default): one at a time,
            each waited in the next group's post-backward. More: an exposed (slow) reduce-scatter no longer stalls the
            next group's backward, at the memory of the buffers kept (``funcshard.cost`` counts them). The same
            results whatever the value. With a replicate axis (HSDP) each reduce-scatter is taken before the next
            collective, so that its all-reduce follows it (the schedule's order): one in flight, whatever the value.

    Parameters that are DTensors (tensor parallel: ``parallelize_module(module, mesh['tp'], ...)`` with ``mesh``
    ``mesh['dp']`` of the same root mesh; or on the full mesh with ``dp_mesh_dims``) are sharded as their local
    tensors: a spec's ``shape`` is the local shape and its ``model`` (``ModelSharding``) the model's own sharding;
    the module sees each gathered local tensor as its DTensor again, and gradients are redistributed to the
    parameter's placements on the model's axes before the reduce-scatter (``_mesh.model_sharding``).
    """
    spmd = None
    if dp_mesh_dims is not None:
        mesh, spmd = spmd_dp_mesh(resolve_full_mesh(mesh), dp_mesh_dims)
    mesh = resolve_mesh(mesh)
    axes = dp_axes(mesh)
    shard_axis = axes.shard
    world = mesh.size(shard_axis)
    named = _canonical_params(module)
    aliases = named["paths"]

    specs: dict[str, ShardSpec] = {}
    problems: list[str] = []
    for fqn, p in named["params"].items():
        if _spec_of is not None:  # (fully_shard: the specs its units made; None for a parameter it leaves alone)
            given = _spec_of(fqn, p) or make_spec(fqn, p, 0, axis=shard_axis, world=world)
            specs[fqn] = dataclasses.replace(given, fqn=fqn, aliases=tuple(aliases[fqn]), requires_grad=p.requires_grad)
            continue
        try:
            dim = 0 if shard_placement_fn is None else placement_dim(fqn, shard_placement_fn(fqn, p))
            local, model = p, None
            if isinstance(p, DTensor) or spmd is not None:
                local, model = _model_spec(fqn, p, mesh, dim, spmd)
        except ShardingError as e:
            problems.append(f"  {e}")
            continue
        lo, hi = dim_range(tuple(local.shape))
        if not lo <= dim <= hi:
            problems.append(
                f"  {fqn}: shape {tuple(local.shape)} has no dim {dim}; shard_placement_fn must return a dim in "
                f"[{lo}, {hi}] (or None for dim 0)"
            )
            continue
        specs[fqn] = make_spec(fqn, local, dim, axis=shard_axis, world=world, aliases=tuple(aliases[fqn]),
                               model=model, requires_grad=p.requires_grad)
    if problems:
        raise ShardingError(
            f"cannot shard over mesh {mesh_str(mesh)}:\n" + "\n".join(problems)
        )

    root_rsf = reshard_after_forward_default(reshard_after_forward, is_root=True)
    other_rsf = reshard_after_forward_default(reshard_after_forward, is_root=False)
    group_list = _make_groups(module, groups, named, root_rsf, other_rsf)
    if mp_policy is not None:
        precision = _mp_fields(mp_policy, "plan")
        group_list = tuple(dataclasses.replace(g, **precision) for g in group_list)
    if comm is not None:
        group_list = tuple(dataclasses.replace(g, comm=check_comm(comm, "plan")) for g in group_list)
    for g in group_list:  # tensor subclasses: with both all-gather extension methods, or none and not a wrapper
        for q in g.params:
            t = named["params"][q]
            check_extension(dtensor_local(t) if isinstance(t, DTensor) else t, g.name, q)
    if offload_policy is not None:
        offload = offload_fields(offload_policy, "plan")
        group_list = tuple(dataclasses.replace(g, **offload) for g in group_list)
    if layout == "flat":
        if shard_placement_fn is not None:
            raise ShardingError(
                'layout="flat" shards each group as one flat buffer, so shard_placement_fn has no dims to '
                'pick; drop it, or use layout="per_param"'
            )
        specs = _flat_specs(specs, group_list, mesh.get_local_rank(shard_axis))
    elif layout != "per_param":
        raise ShardingError(f'layout must be "per_param" or "flat", got {layout!r}')
    result = Plan(
        module=module,
        mesh=mesh,
        shard_axis=shard_axis,
        specs=specs,
        groups=group_list,
        forward_prefetch=int(prefetch),
        backward_prefetch=int(prefetch if backward_prefetch is None else backward_prefetch),
        forward_prefetch_lists={k: tuple(v) for k, v in (forward_prefetch_lists or {}).items()},
        backward_prefetch_lists={k: tuple(v) for k, v in (backward_prefetch_lists or {}).items()},
        grad_divide_factor=grad_divide_factor,
        layout=layout,
        replicate_axis=axes.replicate,
        timeout=timeout,
        check=bool(check),
        reduce_scatter_buffers=reduce_scatter_buffers,
    )
    _check_schedule(result)
    return result


def _model_spec(fqn: str, p: torch.Tensor, mesh: DeviceMesh, dim: int, spmd) -> tuple[torch.Tensor, Any]:
    """A DTensor parameter's local tensor (what is sharded) and its ``ModelSharding``; a plain one with
    ``dp_mesh_dims`` raises (every parameter must then live on the SPMD mesh, as in FSDP2)."""
    if not isinstance(p, DTensor):
        raise ShardingError(
            f"{fqn}: a plain tensor; with dp_mesh_dims every parameter must be a DTensor on the full SPMD mesh "
            f"(distribute it there with Replicate() on the data-parallel axes), as FSDP2 requires")
    local = dtensor_local(p)
    lo, hi = dim_range(tuple(local.shape))
    return local, model_sharding(fqn, p, mesh, dim % (hi + 1) if lo <= dim <= hi else dim, spmd)


def _post_forward_size(g: Group, world: int) -> bool | int:
    """A group's int ``reshard_after_forward`` checked against the shard axis size and normalized (FSDP2's rule)."""
    try:
        return resolve_reshard_after_forward(g.reshard_after_forward, world, f"group {label(g.name)!r}")
    except ValueError as e:
        raise ShardingError(str(e)) from None


def _flat_specs(specs: dict[str, ShardSpec], groups: Sequence[Group], rank: int) -> dict[str, ShardSpec]:
    """Give every parameter its slot in its group's flat buffer (one buffer per group and dtype)."""
    out = dict(specs)
    for g in groups:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for p in g.params:
            by_dtype.setdefault(specs[p].dtype, []).append(p)
        for names in by_dtype.values():
            total = sum(specs[p].numel for p in names)
            offset = 0
            for p in names:
                out[p] = dataclasses.replace(specs[p], dim=0, flat=FlatSlot(offset, total, rank))
                offset += specs[p].numel
    return out


def _canonical_params(module: nn.Module) -> dict[str, dict]:
    """Every parameter once (first path wins), and canonical path -> all its paths (tied parameters)."""
    params: dict[str, nn.Parameter] = {}
    by_id: dict[int, str] = {}
    paths: dict[str, list[str]] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        canon = by_id.setdefault(id(p), fqn)
        paths.setdefault(canon, []).append(fqn)
        if canon == fqn:
            params[fqn] = p
    return {"params": params, "paths": paths}


def _owner(fqn: str, roots: Sequence[str]) -> str | None:
    """The deepest module path in ``roots`` that contains the path ``fqn``."""
    best = None
    for r in roots:
        if r == "" or fqn == r or fqn.startswith(r + "."):
            if best is None or len(r) > len(best):
                best = r
    return best


def _make_groups(
    module: nn.Module, policy: GroupPolicy, named: dict, root_rsf: bool, other_rsf: bool
) -> tuple[Group, ...]:
    mods = dict(module.named_modules())
    order = {name: i for i, name in enumerate(mods)}
    # 1. which module paths form which group
    units: list[tuple[str, ...]] = []
    matching = False  # a class or callable policy (it must pick something: _check_matched)
    if isinstance(policy, str):  # one module path
        policy = [policy]
    elif isinstance(policy, (list, tuple, set, frozenset)) and policy and all(isinstance(c, type) for c in policy):
        policy = tuple(policy)  # module classes, given in any container
    if policy is None:
        pass
    elif isinstance(policy, type) or (isinstance(policy, tuple) and policy and all(isinstance(c, type) for c in policy)):
        units = [(n,) for n, m in mods.items() if n and isinstance(m, policy)]
        matching = True
    elif callable(policy):
        units = [(n,) for n, m in mods.items() if n and policy(n, m)]
        matching = True
    else:
        for item in policy:
            unit = (item,) if isinstance(item, str) else tuple(item)
            for n in unit:
                if n not in mods:
                    raise ShardingError(
                        f"groups names module {n!r}, which {type(module).__name__} does not have; "
                        f"pick from its named_modules(), e.g. {list(mods)[1:6]}"
                    )
                if n == "":
                    raise ShardingError(
                        "groups names the root module ''; the root group is implicit (every parameter no "
                        "group takes), so leave it out"
                    )
            units.append(unit)
    seen: dict[str, tuple[str, ...]] = {}
    for unit in units:
        for n in unit:
            if n in seen:
                raise ShardingError(f"module {n!r} is in two groups: {seen[n]} and {unit}; list it once")
            seen[n] = unit
    # 2. each parameter goes to the deepest picked module that contains all of its paths
    mod_roots = list(seen)
    by_unit: dict[tuple[str, ...], list[str]] = {u: [] for u in units}
    root_params: list[str] = []
    for canon, paths in named["paths"].items():
        owners = {_owner(p, mod_roots) for p in paths}
        units_of = {seen[o] if o is not None else None for o in owners}
        if len(units_of) == 1 and None not in units_of:
            by_unit[units_of.pop()].append(canon)
        else:  # not under a picked module, or tied across groups: the root gathers it for everyone
            root_params.append(canon)
    groups = [Group(ROOT, ("",), tuple(root_params), root_rsf)]
    for unit in sorted(units, key=lambda u: order[u[0]]):
        if by_unit[unit]:
            groups.append(Group(unit[0], unit, tuple(by_unit[unit]), other_rsf))
    if matching and len(groups) == 1:
        _unmatched(module, policy, [u[0] for u in units])
    return tuple(groups)


def _unmatched(module: nn.Module, policy: Any, picked: list[str]) -> None:
    """A class or callable group policy that gives no group: every parameter would be in the root group, gathered
    for the whole step (no memory saved): almost surely the wrong class or a callable that never says yes."""
    if isinstance(policy, type):
        shown = policy.__name__
    elif isinstance(policy, tuple):
        shown = "(" + ", ".join(c.__name__ for c in policy) + ",)"
    else:
        shown = getattr(policy, "__qualname__", None) or repr(policy)
    classes = list(dict.fromkeys(type(m).__name__ for n, m in module.named_modules() if n))
    found = (f"matches no submodule of {type(module).__name__} (its submodule classes: {classes[:8]}"
             f"{' ...' if len(classes) > 8 else ''})" if not picked else
             f"matches {len(picked)} submodules ({picked[:3]}{' ...' if len(picked) > 3 else ''}) of "
             f"{type(module).__name__}, none of which holds a parameter of its own")
    raise ShardingError(
        f"groups={shown} {found}, so every parameter would be in the root group, all gathered for the whole step; "
        f"pass the class of the repeated blocks (e.g. groups=(TransformerBlock,)), a callable (fqn, module) -> bool "
        f"that picks them, module paths, or groups=None for one root group on purpose")


def _mp_fields(policy: Any, where: str) -> dict[str, Any]:
    check_mp_policy(policy, where)
    return {f: getattr(policy, f) for f in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")}


def _check_groups(p: Plan) -> None:
    """The groups name the plan's parameters and the module's modules, each group once, the root group first: an
    edit (``Plan.replace``) that does not would fail later, inside a step, with a KeyError or AttributeError."""
    if not p.groups or not p.groups[0].is_root:
        raise ShardingError(f"the plan's first group must be the root group (name {ROOT!r}, modules ('',)); got "
                            f"{[g.name for g in p.groups[:1]]}. Keep plan.groups[0] when editing the groups")
    names = [g.name for g in p.groups]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ShardingError(f"groups {twice} appear more than once in the plan; each group name once (merge them, or "
                            f"edit the existing group with plan.with_group)")
    modules = None if p.module is None else {n for n, _ in p.module.named_modules()}
    for g in p.groups:
        unknown = [q for q in g.params if q not in p.specs]
        if unknown:
            raise ShardingError(
                f"group {label(g.name)!r} names parameters {unknown} that the plan does not shard (not parameters "
                f"of {type(p.module).__name__}, or not canonical paths; known: {_some(p.specs)}); name parameters by "
                f"their path from the planned module, e.g. plan.specs' keys")
        if modules is not None and (gone := [m for m in g.modules if m not in modules]):
            raise ShardingError(
                f"group {label(g.name)!r} names modules {gone} that {type(p.module).__name__} does not have "
                f"(known: {_some(modules)}); name modules by their path from the planned module "
                f"(module.named_modules())")


def _some(names) -> str:
    names = sorted(names)
    return f"{names[:6]}{f' and {len(names) - 6} more' if len(names) > 6 else ''}"


def _check_schedule(p: Plan) -> None:
    _check_groups(p)
    names = {g.name for g in p.groups}
    for g in p.groups:
        check_comm(g.comm, f"group {label(g.name)!r}")
        for f in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = getattr(g, f)
            if dt is not None and (not isinstance(dt, torch.dtype) or not dt.is_floating_point):
                raise ShardingError(f"group {label(g.name)!r}: {f}={dt} is not a floating point dtype; mixed "
                                    f"precision uses torch.bfloat16, torch.float16 or torch.float32 (None: no cast)")
        if p.layout == "flat" and g.param_dtype is not None:
            _check_flat_precision(p, g)
    if p.layout not in ("per_param", "flat"):
        raise ShardingError(f"layout={p.layout!r}: use 'per_param' or 'flat' (chosen when the specs are made: "
                            f"funcshard.plan(..., layout=...))")
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in (p.forward_prefetch, p.backward_prefetch)):
        raise ShardingError(
            f"prefetch depths must be ints >= 0 (groups ahead), got forward {p.forward_prefetch!r}, backward "
            f"{p.backward_prefetch!r}"
        )
    for kind, lists in (("forward", p.forward_prefetch_lists), ("backward", p.backward_prefetch_lists)):
        for k, v in lists.items():
            for n in (k, *v):
                if n not in names:
                    raise ShardingError(
                        f"{kind}_prefetch_lists names group {n!r}, which the plan does not have; "
                        f"its groups are {sorted(names)}"
                    )
    seen: dict[str, str] = {}
    for g in p.groups:
        for q in g.params:
            if q in seen:
                raise ShardingError(f"parameter {q!r} is in groups {seen[q]!r} and {g.name!r}; a parameter "
                                    f"belongs to exactly one group")
            seen[q] = g.name
    flat = {s.flat is not None for s in p.specs.values()}
    if flat and flat != {p.layout == "flat"}:
        raise ShardingError(
            f"layout={p.layout!r} does not match the plan's specs; the layout is chosen when the specs are made: "
            f"call funcshard.plan(..., layout={p.layout!r}) instead of replacing the field"
        )
    missing = set(p.specs) - set(seen)
    if missing:
        raise ShardingError(f"parameters {sorted(missing)} are in no group; every parameter needs one")
    check_timeout(p.timeout, "plan")
    k = p.reduce_scatter_buffers
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ShardingError(f"reduce_scatter_buffers must be an int >= 1 (how many reduce-scatters backward keeps in "
                            f"flight; 1: one at a time), got {k!r}")
    f = p.grad_divide_factor
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < math.inf):
        raise ShardingError(f"grad_divide_factor must be a finite number > 0 (None: the data-parallel size), got "
                            f"{f!r}")


def _check_flat_precision(p: Plan, g: Group) -> None:
    """In the flat layout a group's parameters of one dtype share one flat buffer (their slots are fixed when the
    specs are made, whatever the precision), and the all-gather of a compute dtype is one such buffer: parameters of
    two dtypes that ``param_dtype`` casts to one compute dtype would be two buffers in one collective."""
    by_compute: dict[torch.dtype, dict[torch.dtype, list[str]]] = {}
    for q in g.params:
        s = p.specs[q]
        by_compute.setdefault(compute_dtype(s.dtype, g.param_dtype), {}).setdefault(s.dtype, []).append(q)
    for dt, origs in by_compute.items():
        if len(origs) > 1:
            found = "; ".join(f"{str(o).removeprefix('torch.')}: {names[:3]}{' ...' if len(names) > 3 else ''}"
                              for o, names in origs.items())
            raise ShardingError(
                f"group {label(g.name)!r}: param_dtype={g.param_dtype} casts parameters of "
                f"{len(origs)} dtypes to {dt} ({found}); with layout='flat' each dtype is its own flat buffer, so "
                f"they cannot share one all-gather. Use layout='per_param', give them one dtype, or put the "
                f"parameters of each dtype in a group of their own")


def module_params(plan: Plan) -> dict[str, torch.Tensor]:
    """The planned module's current parameters, by canonical path."""
    return _canonical_params(plan.module)["params"]
