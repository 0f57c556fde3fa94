"""Units (one per ``fully_shard`` call) and contexts (one per root): FSDP2's settings as edits of a Plan.

A unit holds its modules, its managed parameters (``_Param``) and its settings. At the first forward (or
``unshard()``) the outermost unit's context builds one Plan over the root module with one group per nested unit;
each setting becomes a field of that unit's Group (reshard after forward / backward, unshard in backward, divide
factor, prefetch lists), and the runtime executes it. Gradients reach the DTensor parameters through the context's
``GradSink``. No gather, free or reduce logic lives here.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from funcshard._comm import storage_ptr
from funcshard._compat import is_symm_mem_reduce_scatter, param_slots
from funcshard._offload import to_host
from funcshard._plan import ROOT, UNIT, Group, Plan
from funcshard._plan import plan as make_plan
from funcshard._policy import MixedPrecisionPolicy, reshard_after_forward_default
from funcshard._runtime import Step
from funcshard.fsdp._sink import GradSink, _Param

_OWNER = "_funcshard_owner"  # parameter attribute: the unit managing it (on the original and the DTensor)
FSDP_CLASSES: dict[type, type] = {}  # a module class -> its FSDP<Cls> subclass


# unit settings read where they are used (``GradSink``), none of them in the plan (``_Context.plan``): setting them
# derives no plan again (``set_requires_gradient_sync`` runs twice a step under gradient accumulation)
READ_AT_USE = frozenset({"sync", "reduce_unused", "all_reduce", "all_reduce_hook"})


class _Unit:
    """The modules of one ``fully_shard`` call, their parameters, and the unit's settings."""

    def __init__(self, modules: tuple[nn.Module, ...], mesh: DeviceMesh, params: list[_Param], rsf: bool | None):
        self.modules, self.mesh, self.params = modules, mesh, params
        self.reshard_after_forward = rsf  # None: True, except for the root
        self.parent: _Unit | None = None  # the unit of the next fully_shard call on an ancestor
        self.ctx: _Context | None = None
        self.group: str | None = None  # this unit's group in the root's plan (None: no parameters)
        self.sync = self.reshard_after_backward = self.unshard_in_backward = True
        self.reduce_unused = False
        self.mp_policy = MixedPrecisionPolicy()
        self.divide_factor: float | None = None
        self.forward_prefetch: list[_Unit] | None = None
        self.backward_prefetch: list[_Unit] | None = None
        self.acc: dict[str, torch.Tensor] = {}  # unsharded gradients accumulated without sync, by path
        self.all_reduce = True  # HSDP: all-reduce after the reduce-scatter (False: keep the sums in `partial`)
        self.partial: dict = {}  # HSDP sums reduce-scattered without all-reduce, by dtype, until the next all-reduce
        self.all_reduce_hook = None  # FSDP2's set_all_reduce_hook: run on the reduced output before the cast back
        self.timeout, self.check = None, False  # set_timeout / set_check_mode: the plan's (the shortest, any check)
        self.offload_to_cpu = self.pin_memory = False  # CPUOffloadPolicy: the Group's fields (_offload)
        self.comm = None  # set_custom_all_gather / _reduce_scatter: the Group's ``comm`` (funcshard._comm)
        self.reduce_scatter_buffers = 1  # set_reduce_scatter_max_input_buffers: the plan's is the most of any unit's
        self.tied: list[tuple[_Param, _Unit]] = []  # parameters another call shards too: refused at lazy init

    def name(self) -> str:
        names = [cls_name(m) for m in self.modules]
        return f"[{', '.join(names)}]" if len(names) > 1 else names[0]


def cls_name(module: nn.Module) -> str:
    """The class name the user wrote (not the FSDP<Cls> subclass)."""
    cls = type(module)
    return cls.__mro__[2].__name__ if cls in _GENERATED else cls.__name__


_GENERATED: set[type] = set()


def fsdp_class(cls: type, base: type, namespace: dict) -> type:
    """``FSDP<Cls>(base, Cls)``, made once per class."""
    if cls not in FSDP_CLASSES:
        FSDP_CLASSES[cls] = new = type(f"FSDP{cls.__name__}", (base, cls), namespace)
        _GENERATED.add(new)
    return FSDP_CLASSES[cls]


def unit_of(module: nn.Module) -> _Unit:
    return module.__dict__[UNIT]


def ctx_of(unit: _Unit) -> _Context:
    if unit.ctx is not None and not unit.ctx.stale:
        return unit.ctx
    top = unit
    while top.parent is not None:
        top = top.parent
    for m in top.modules[0].modules():  # parameters replaced since fully_shard (FSDP2 resets them at lazy init)
        if (u := m.__dict__.get(UNIT)) is not None:
            _resync(u)
    return _Context(top)


class _Context:
    """Per root: the base Plan (built once), the Plan with the units' settings, the current Step."""

    def __init__(self, top: _Unit):
        if len(top.modules) != 1:
            raise RuntimeError(f"FSDP requires a single root module but got the modules {top.name()} from the "
                               f"outermost fully_shard call; call fully_shard on their common parent last")
        self.top, self.stale, self.fwd_root, self.step, self._plan = top, False, None, None, None
        self.fwd_module: nn.Module | None = None  # the module whose call began the forward under way
        self.fresh: Step | None = None  # a step unshard() made before its forward
        # steps whose graphs may still run a backward (a forward's graph outlives the next forward: a chunked loss
        # runs a standalone module's forward and backward before the root output's backward)
        self.live: weakref.WeakSet = weakref.WeakSet()
        self.materialized = False  # no managed parameter is on the meta device (checked by the first begin())
        self.order: tuple[str, ...] = ()  # the groups' forward order last seen, when it differs from the modules'
        self._ordered: dict[tuple[str, ...], Plan] = {}
        self.last_order: tuple[str, ...] = ()
        root = top.modules[0]
        paths = {id(m): n for n, m in root.named_modules()}
        self.units: list[_Unit] = []
        for m in root.modules():
            if (u := m.__dict__.get(UNIT)) is not None and u not in self.units:
                self.units.append(u)
        _check_tied(self.units, paths)
        _check_offloaded(self.units, paths)
        recs = {id(r.param): r for u in self.units for r in u.params}
        nested = [u for u in self.units if u is not top]
        base = make_plan(root, top.mesh, groups=[tuple(paths[id(m)] for m in u.modules) for u in nested],
                         _spec_of=lambda fqn, q: recs[id(q)].spec if id(q) in recs else None,
                         layout="per_param")  # DTensor Shard(dim) locals: one padded shard per parameter
        self.recs = {f: recs[i] for f in base.specs if (i := id(root.get_parameter(f))) in recs}
        groups = []  # ignored parameters stay plain module parameters, out of the plan
        for g in base.groups:
            g = dataclasses.replace(g, params=tuple(p for p in g.params if p in self.recs))
            if g.params or g.is_root:
                groups.append(g)
        self.base = base.replace(specs={f: base.specs[f] for f in self.recs}, groups=tuple(groups))
        self.by_group: dict[str, _Unit] = {}
        for u in self.units:
            u.ctx, name = self, ROOT if u is top else paths[id(u.modules[0])]
            g = next((g for g in groups if g.name == name), None)
            held = {id(self.recs[p].param) for p in g.params} if g else set()
            if held != {id(r.param) for r in u.params}:
                raise RuntimeError(f"fully_shard: the plan's group {name!r} does not hold exactly the parameters "
                                   f"of the fully_shard call on {u.name()}; modules shared between units are not "
                                   f"supported")
            u.group = name if held else None
            if held:
                self.by_group[name] = u
        self.sink = GradSink(self)

    def plan(self) -> Plan:
        """The base plan edited by the units' settings (derived again after a setting changed)."""
        if self._plan is None:
            groups = tuple(self._edited(g) for g in self.base.groups)
            given = [u.timeout for u in self.units if u.timeout is not None]
            # (the reduce-scatter queue spans the model: the most any unit asked for, as FSDP2 resolves it)
            self._plan = self.base.replace(groups=groups, forward_prefetch_lists=self._lists("forward"),
                                           backward_prefetch_lists=self._lists("backward"),
                                           timeout=min(given, default=None), check=any(u.check for u in self.units),
                                           reduce_scatter_buffers=max(u.reduce_scatter_buffers for u in self.units))
            self._ordered = {}
        if not self.order:
            return self._plan
        hit = self._ordered.get(self.order)  # a model alternating between two orders reuses both plans
        if hit is None:
            hit = self._ordered[self.order] = self._plan.with_order([n for n in self.order if n in self.by_group])
        return hit

    def settings_changed(self) -> None:
        """A unit setting changed: the plan is derived again, and a step already under way takes it at once (FSDP2
        reads a setting when it uses it)."""
        self._plan = None
        if self.step is not None and not self.stale:
            self.step.retarget(self.plan())

    def _edited(self, g: Group) -> Group:
        """The plan's group with its unit's settings (a group without a unit keeps the defaults)."""
        u = self.by_group.get(g.name)
        rsf = reshard_after_forward_default(None if u is None else u.reshard_after_forward, is_root=g.is_root)
        if u is None:
            return dataclasses.replace(g, reshard_after_forward=rsf)
        mp = u.mp_policy
        return dataclasses.replace(g, reshard_after_forward=rsf, reshard_after_backward=u.reshard_after_backward,
                                   unshard_in_backward=u.unshard_in_backward, grad_divide_factor=u.divide_factor,
                                   param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                   output_dtype=mp.output_dtype, cast_forward_inputs=mp.cast_forward_inputs,
                                   comm=u.comm,
                                   offload_to_cpu=u.offload_to_cpu, pin_memory=u.pin_memory)

    def _lists(self, kind: str) -> dict[str, tuple[str, ...]]:
        out = {}
        for u in self.units:
            if u.group is None or (targets := getattr(u, f"{kind}_prefetch")) is None:
                continue
            if any(t.ctx is not self for t in targets):
                raise ValueError(f"set_modules_to_{kind}_prefetch on {u.name()} names a module that is not under "
                                 f"the same root FSDP module; prefetch only modules of one model")
            out[u.group] = tuple(t.group for t in targets if t.group is not None)
        return out

    def begin(self, fresh: bool = False) -> Step:
        """The Step for the next forward (``fresh``: made by ``unshard()`` before it). Groups the last Step left
        gathered carry over to the new one (``Step.carry_over``)."""
        if not self.materialized:  # (FSDP2's check when training starts; a state dict of a meta model is fine)
            _check_materialized(self.units, self.top.modules[0])
            self.materialized = True
        _check_reduce_scatter_buffers(self)
        old = self.step
        if old is not None and old is self.fresh:
            self.fresh = old if fresh else None
            return old
        new = Step(self.plan(), {f: r.leaf() for f, r in self.recs.items()}, sink=self.sink, recompute_nested=True)
        self.fresh = new if fresh else None
        if old is not None:
            new.carry_over(old)
        self.step = new
        self.live.add(new)
        return new

    def backward_step(self) -> Step | None:
        """The step an activation-checkpoint recomputation inside backward belongs to: of the steps whose backward
        runs in this autograd task, the one whose pre-backward ran last (its hook on the checkpointed region's output
        fires just before the recomputation; the same on every rank); else the newest step. The newest step is not
        always it: a chunked loss runs standalone forwards and backwards of a module before the root output's
        backward, and two forwards before one backward (DPO) run the older step's recomputations after the newer's."""
        running = [s for s in self.live if s.recomputing()]
        return max(running, key=lambda s: s.last_pre_backward) if running else self.step

    def end_forward(self) -> None:
        step = self.step
        step.end_forward()
        self.fwd_root = self.fwd_module = None
        # Prefetch follows the order the units' forwards ran in (FSDP2 records it each iteration): this step's
        # backward at once (the runtime's Prefetcher); later forwards once the same order was seen twice in a row (a
        # model alternating between orders keeps the module order for its forward prefetch).
        seen = tuple(step.prefetcher.order)
        if self.plan().order_differs(seen) and seen == self.last_order:
            self.order = seen
        self.last_order = seen


def _check_tied(units: list[_Unit], paths: dict[int, str]) -> None:
    """FSDP2's check at lazy initialization (not at ``fully_shard``): no parameter is sharded by two calls under one
    root (a tied parameter whose modules were sharded apart: each call made a shard of its own)."""
    for u in units:
        for r, owner in u.tied:
            if owner in units:
                m, a = r.slots[0]
                fqn = f"{paths[id(m)] + '.' if paths[id(m)] else ''}{a}"
                raise ValueError(f"fully_shard({u.name()}): parameter {fqn!r} is shared with (tied to) a parameter "
                                 f"already managed by another fully_shard call, on {owner.name()}; a parameter "
                                 f"belongs to one unit: shard the modules sharing it together, fully_shard([a, b]), "
                                 f"or leave it to a common ancestor")


def _check_materialized(units: list[_Unit], root: nn.Module) -> None:
    """FSDP2's check when training starts: no managed parameter is left on the meta device (named as FSDP2 names
    them: the first unit, in root-then-module order, with any)."""
    for u in units:
        on_meta = [r for r in u.params if r.padded.is_meta]
        if on_meta:
            paths = {id(m): n for n, m in root.named_modules()}
            names = [f"{paths[id(m)] + '.' if paths[id(m)] else ''}{a}" for r in on_meta for m, a in r.slots[:1]]
            raise RuntimeError(f"FSDP parameters should be materialized from meta device before training, but the "
                               f"following were still on meta device: {names}\nFor example, call "
                               f"module.to_empty(device) to materialize to device and call module.reset_parameters() "
                               f"on each module to initialize values.")


def _check_reduce_scatter_buffers(ctx: _Context) -> None:
    """FSDP2's check at lazy initialization: a unit keeping more than one reduce-scatter input buffer does not
    reduce-scatter through FSDP2's symmetric-memory comm (its pool reuses one buffer)."""
    for u in ctx.units:
        rs = None if u.comm is None else u.comm.reduce_scatter
        if u.reduce_scatter_buffers > 1 and is_symm_mem_reduce_scatter(rs):
            raise ValueError(f"set_reduce_scatter_max_input_buffers(>1) is not supported with the symmetric-memory "
                             f"reduce-scatter comm, but got {u.reduce_scatter_buffers} for module "
                             f"'{_module_path(ctx, u)}' using {type(rs).__name__}. Keep max_input_buffers=1 with "
                             f"symmetric memory, or use the default reduce-scatter comm.")


def _check_offloaded(units: list[_Unit], paths: dict[int, str]) -> None:
    """FSDP2's check at lazy initialization: an offloading unit's sharded parameters are on the host (not left on the
    meta device, nor moved to an accelerator by ``to_empty`` / ``to``)."""
    bad = [(f"{paths[id(m)] + '.' if paths[id(m)] else ''}{a}", r.padded.device) for u in units if u.offload_to_cpu
           for r in u.params if r.padded.device.type != "cpu" for m, a in r.slots[:1]]
    if bad:
        raise RuntimeError("FSDP parameters should be materialized on CPU when enabling CPU offloading. For example, "
                           "load a CPU state dict or call module.to_empty(device=\"cpu\"). Found following parameters "
                           f"on non-CPU device: {bad}")


class _FSDPParamView:
    """A managed parameter as FSDP2's state shows it: its path from the root module (``_param_fqn``)."""

    def __init__(self, fqn: str):
        self._param_fqn = fqn

    def __repr__(self) -> str:
        return f"FSDPParam({self._param_fqn!r})"


class _FSDPParamGroupView:
    """A unit's group as FSDP2's state shows it: the module path (``_module_fqn``), the parameters, the unit's own
    ``reduce_scatter_max_input_buffers``."""

    def __init__(self, module_fqn: str, params: tuple[str, ...], reduce_scatter_max_input_buffers: int = 1):
        self._module_fqn = module_fqn
        self.fsdp_params = [_FSDPParamView(p) for p in params]
        self.reduce_scatter_max_input_buffers = reduce_scatter_max_input_buffers


class _CommContextView:
    """FSDP2's shared comm context as its users read it: the model's reduce-scatter queue depth (the plan's)."""

    def __init__(self, reduce_scatter_max_input_buffers: int):
        self.reduce_scatter_max_input_buffers = reduce_scatter_max_input_buffers


class _StateContext:
    def __init__(self, all_states: list):
        self.all_states = all_states


class FSDPState:
    """What ``fully_shard.state(module)`` returns: one per ``fully_shard`` call (shared by the modules of a grouped
    call), with the facts FSDP2's state exposes to its users and tests: ``_is_root`` (None before the lazy
    initialization, which the root's first forward or ``_lazy_init()`` runs), ``_state_ctx.all_states`` (root first,
    then the nested units in module order), ``_fsdp_param_group`` (None for a unit without parameters: its module path
    ``_module_fqn``, parameters ``fsdp_params[i]._param_fqn``, paths from the root module, and
    ``reduce_scatter_max_input_buffers``), ``_comm_ctx.reduce_scatter_max_input_buffers`` (the model's). A read-only view of the
    unit: the runtime keeps its own data."""

    def __init__(self, unit: _Unit):
        self._unit = unit
        self._lazy_root = False  # _lazy_init() was called on this unit while it was not the outermost one

    @property
    def _is_root(self) -> bool | None:
        unit = self._unit
        if self._lazy_root:
            return True
        if unit.ctx is None or unit.ctx.stale:
            return None if not any(s._lazy_root for s in _ancestor_states(unit)) else False
        return unit is unit.ctx.top

    def _lazy_init(self) -> None:
        """FSDP2's lazy initialization, run now: on the outermost unit it builds the root's context (the Plan); on a
        nested unit it marks that unit a root of its own subtree, after which the outer root's lazy initialization
        refuses, as FSDP2's does (FSDP2 needs forward to run through the root first)."""
        unit = self._unit
        if unit.parent is None:
            ctx = ctx_of(unit)  # (raises for a grouped outermost call: FSDP requires a single root module)
            for u in ctx.units:
                if u is not unit and u.__dict__.get("state") is not None and u.state._lazy_root:
                    raise RuntimeError(f"FSDP state has already been lazily initialized for {_module_path(ctx, u)}\n"
                                       f"FSDP requires running forward through the root module first")
            return
        self._lazy_root = True

    @property
    def _state_ctx(self) -> _StateContext:
        ctx = ctx_of(self._unit)
        return _StateContext([state_of(u) for u in ctx.units])

    @property
    def _fsdp_param_group(self) -> _FSDPParamGroupView | None:
        unit = self._unit
        ctx = ctx_of(unit)
        if unit.group is None:
            return None
        return _FSDPParamGroupView(unit.group, ctx.base.group(unit.group).params, unit.reduce_scatter_buffers)

    @property
    def _comm_ctx(self) -> _CommContextView:
        return _CommContextView(ctx_of(self._unit).plan().reduce_scatter_buffers)

    @property
    def _fsdp_param_groups(self) -> list[_FSDPParamGroupView]:
        group = self._fsdp_param_group
        return [] if group is None else [group]


def state_of(unit: _Unit) -> FSDPState:
    state = unit.__dict__.get("state")
    if state is None:
        state = unit.state = FSDPState(unit)
    return state


def _ancestor_states(unit: _Unit) -> list[FSDPState]:
    out, u = [], unit.parent
    while u is not None:
        if u.__dict__.get("state") is not None:
            out.append(u.state)
        u = u.parent
    return out


def _module_path(ctx: _Context, unit: _Unit) -> str:
    paths = {id(m): n for n, m in ctx.top.modules[0].named_modules()}
    return ", ".join(paths[id(m)] for m in unit.modules)


def _resync(unit: _Unit) -> None:
    """After ``_apply`` (``to``, ``to_empty``) or ``load_state_dict(assign=True)`` replaced parameter data:
    pad the new local tensors again; they become the state the runtime reads."""
    changed = False
    for r in unit.params:
        mod, attr = r.slots[0]
        cur = param_slots(mod)[attr]
        if not isinstance(cur, DTensor):
            raise TypeError(f"fully_shard: {unit.name()}.{attr} was replaced by a {type(cur).__name__}; "
                            f"managed parameters must stay DTensors (load a sharded state dict instead)")
        setattr(cur, _OWNER, unit)  # swap_tensors (in nn.Module._apply) moves __dict__ to the other tensor
        with torch.no_grad():
            local = cur.to_local()
        if cur is r.param and local.dtype == r.padded.dtype and local.device == r.padded.device and (
                r.padded.is_meta or storage_ptr(local) == storage_ptr(r.padded)):
            continue
        r.spec = dataclasses.replace(r.spec, dtype=local.dtype)
        r.padded = local.new_zeros(r.spec.local_shape)
        with torch.no_grad():
            r.local(r.padded).copy_(local)
        if unit.pin_memory and not r.padded.is_meta:  # FSDP2: a pinning unit's new local tensor goes to pinned memory
            r.padded = to_host(r.padded, True)
        new = nn.Parameter(r.dtensor(r.local(r.padded), unit.mesh), requires_grad=cur.requires_grad)
        try:  # keep the parameter object (optimizers may hold it), as nn.Module._apply does
            torch.utils.swap_tensors(cur, new)
            new = cur
        except RuntimeError:
            pass
        for m, a in r.slots:
            param_slots(m)[a] = new
        setattr(new, _OWNER, unit)
        r.param, changed = new, True
    if changed and unit.ctx is not None:
        unit.ctx.stale = True  # rebuild the plan (dtypes may have changed) at the next forward
