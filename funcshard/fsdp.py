"""fully_shard: FSDP2's module API (``torch.distributed.fsdp``) as a drop-in, built on funcshard's core.

    from funcshard import fully_shard           # was: from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())  # DTensor parameters, Shard(dim) over the mesh

How it maps onto the core. Each ``fully_shard`` call makes a *unit*. It shards the unit's parameters at
once (:meth:`ShardSpec.local_shard`: one padded shard per parameter, owned by the adapter) and registers each
as a DTensor ``nn.Parameter`` whose local tensor is the unpadded view of that padded shard, so optimizers,
``clip_grad_norm_``, ``state_dict`` and DCP read and update the shards in place. At the first forward (or
``unshard()``) the outermost unit, the root, builds one :class:`~funcshard.Plan` over its module with one
group per nested unit; unit settings (reshard after forward, prefetch lists) are edits of that Plan. Each
iteration runs one runtime ``Step`` (the runtime ``funcshard.apply`` uses) driven by the units' forward
hooks; at each group's post-backward the core's reduce-scatter output becomes the parameters' DTensor
``.grad``. No collective logic lives here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from funcshard._collectives import no_grad, raw_grads
from funcshard._compat import (
    buffer_slots,
    current_graph_task_id,
    dtensor_local,
    dtensor_spec,
    new_dtensor,
    param_slots,
    post_accumulate_grad_hooks,
)
from funcshard._plan import ROOT, Plan, check_mesh
from funcshard._plan import plan as make_plan
from funcshard._runtime import Step, _Status
from funcshard._spec import ShardSpec
from funcshard._tree import module_io_map_only

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]

_UNIT = "_funcshard_unit"  # module attribute: the unit the module belongs to
_OWNER = "_funcshard_owner"  # parameter attribute: the unit managing it (on the original and the DTensor)


# ---- policies: torch's fields and defaults; what is not built raises -------------------------------


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch's fields and defaults. Only the default (no casts) is built; other values raise."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass
class OffloadPolicy:
    """No offloading (the default)."""


@dataclasses.dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Offload parameters, gradients and optimizer state to CPU. Not built yet: ``fully_shard`` raises."""

    pin_memory: bool = True


def _not_built(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not built yet in funcshard's fully_shard; {instead}")


def _check_unbuilt(mesh, reshard_after_forward, mp_policy, offload_policy, dp_mesh_dims) -> None:
    if dp_mesh_dims is not None:
        raise _not_built("dp_mesh_dims (DTensor parameters on a full SPMD mesh)", "pass a 1-D data-parallel mesh")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        if isinstance(reshard_after_forward, int):
            raise _not_built("reshard_after_forward as an int (reshard to a smaller group after forward, "
                             "ZeRO++ hpZ)", "pass True, False or None")
        raise ValueError(f"reshard_after_forward should be a bool or None, not {reshard_after_forward!r}")
    casts = [f"{f}={getattr(mp_policy, f)}" for f in ("param_dtype", "reduce_dtype", "output_dtype")
             if getattr(mp_policy, f, None) is not None]
    if casts:  # ours or torch's policy: the fields are the same
        raise _not_built(f"mixed precision ({', '.join(casts)})", "use the default MixedPrecisionPolicy() "
                         "(or cast the model, e.g. model.to(torch.bfloat16), before fully_shard)")
    if hasattr(offload_policy, "pin_memory"):  # CPUOffloadPolicy, ours or torch's
        raise _not_built("CPU offload (CPUOffloadPolicy)", "use OffloadPolicy() (no offloading)")
    if mesh.ndim == 2:
        raise _not_built("HSDP (a 2-D (replicate, shard) mesh)", "pass a 1-D mesh, e.g. mesh['shard']")
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard expects a 1-D DeviceMesh but got {mesh}")


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        dist.init_process_group()
    acc = torch.accelerator.current_accelerator()
    return init_device_mesh(acc.type if acc is not None else "cpu", (dist.get_world_size(),))


def _device_of(mesh: DeviceMesh) -> torch.device:
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, kind, None)
    if handle is None or not getattr(handle, "is_available", lambda: False)():
        raise ValueError(f"fully_shard got a mesh of device type {kind!r}, and this process has no {kind} "
                         f"device; build the mesh for the device the model trains on, e.g. "
                         f"init_device_mesh('cpu', (world_size,)) with gloo")
    return torch.device(kind, handle.current_device())


# ---- units (one per fully_shard call) and contexts (one per root) ----------------------------------


class _Param:
    """One managed parameter: the registered DTensor parameter and the padded shard behind it."""

    __slots__ = ("padded", "param", "slots", "spec", "valid", "_leaf")

    def __init__(self, padded: torch.Tensor, spec: ShardSpec, valid: int, mesh: DeviceMesh, requires_grad: bool):
        self.padded, self.spec, self.valid = padded, spec, valid
        self.param = nn.Parameter(self.dtensor(self.local(padded), mesh), requires_grad=requires_grad)
        self.slots: list[tuple[nn.Module, str]] = []  # every (module, attribute) holding it
        self._leaf: tuple | None = None

    def local(self, padded: torch.Tensor) -> torch.Tensor:
        """The unpadded part of a padded local shard: what DTensor's ``Shard(dim)`` holds on this rank."""
        if self.valid == padded.shape[self.spec.dim]:
            return padded
        return padded.narrow(self.spec.dim, 0, self.valid)

    def leaf(self) -> torch.Tensor:
        """The padded shard as the runtime's state (an autograd leaf that never gets a ``.grad``: the gradients
        go to the DTensor parameter), made again only when the shard or its requires_grad changed."""
        rg, hit = self.param.requires_grad, self._leaf
        if hit is None or hit[0] is not self.padded or hit[1] != rg:
            hit = self._leaf = (self.padded, rg, self.padded.detach().requires_grad_(rg))
        return hit[2]

    def dtensor(self, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        shape = torch.Size(self.spec.shape)
        stride = tuple(shape[i + 1:].numel() for i in range(len(shape)))
        with torch.no_grad():
            return DTensor.from_local(local, mesh, (Shard(self.spec.dim),), run_check=False, shape=shape,
                                      stride=stride)

    def grad_dtensor(self, local: torch.Tensor) -> DTensor:
        """A gradient with the parameter's DTensor spec, built directly (``from_local`` runs an autograd
        Function and rebuilds the spec: ~70 us per parameter per step)."""
        return new_dtensor(DTensor, local, dtensor_spec(self.param), requires_grad=False)



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
        self.divide_factor: float | None = None
        self.forward_prefetch: list[_Unit] | None = None
        self.backward_prefetch: list[_Unit] | None = None
        self.acc: dict[str, torch.Tensor] = {}  # unsharded gradients accumulated without sync, by path

    def name(self) -> str:
        names = [_cls_name(m) for m in self.modules]
        return f"[{', '.join(names)}]" if len(names) > 1 else names[0]


def _cls_name(module: nn.Module) -> str:
    """The class name the user wrote (not the FSDP<Cls> subclass)."""
    return type(module).__mro__[2].__name__ if isinstance(module, FSDPModule) else type(module).__name__


def _unit_of(module: nn.Module) -> _Unit:
    return module.__dict__[_UNIT]


def _ctx(unit: _Unit) -> _Context:
    if unit.ctx is not None and not unit.ctx.stale:
        return unit.ctx
    top = unit
    while top.parent is not None:
        top = top.parent
    return _Context(top)


class _Context:
    """Per root: the base Plan (built once), the Plan with the units' settings, the current Step."""

    def __init__(self, top: _Unit):
        if len(top.modules) != 1:
            raise RuntimeError(f"fully_shard needs a single root module, but the outermost call got the modules "
                               f"{top.name()}; call fully_shard on their common parent last")
        self.top, self.stale, self.fwd_root, self.step, self._plan = top, False, None, None, None
        self.order: tuple[str, ...] = ()  # the groups' forward order last seen, when it differs from the modules'
        self._ordered: dict[tuple[str, ...], Plan] = {}
        self.last_order: tuple[str, ...] = ()
        root = top.modules[0]
        paths = {id(m): n for n, m in root.named_modules()}
        self.units: list[_Unit] = []
        for m in root.modules():
            if (u := m.__dict__.get(_UNIT)) is not None and u not in self.units:
                self.units.append(u)
        recs = {id(r.param): r for u in self.units for r in u.params}
        nested = [u for u in self.units if u is not top]
        base = make_plan(root, top.mesh, groups=[tuple(paths[id(m)] for m in u.modules) for u in nested],
                         shard_placement_fn=lambda fqn, q: recs[id(q)].spec.dim if id(q) in recs else None,
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

    def plan(self):
        """The base plan edited by the units' settings (derived again after a setting changed)."""
        if self._plan is None:
            rsf = {n: u.reshard_after_forward for n, u in self.by_group.items()}
            groups = tuple(dataclasses.replace(g, reshard_after_forward=(not g.is_root) if rsf.get(g.name) is None
                                               else rsf[g.name]) for g in self.base.groups)
            self._plan = self.base.replace(groups=groups, forward_prefetch_lists=self._lists("forward"),
                                           backward_prefetch_lists=self._lists("backward"))
            self._ordered = {}
        if not self.order:
            return self._plan
        hit = self._ordered.get(self.order)  # a model alternating between two orders reuses both plans
        if hit is None:
            hit = self._ordered[self.order] = self._plan.with_order([n for n in self.order if n in self.by_group])
        return hit

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

    def begin(self, fresh: bool = False) -> _Step:
        """The Step for the next forward. Groups the last Step left gathered (the root after forward,
        reshard_after_backward=False, unshard()) carry over once that Step's graph is done with them."""
        old = self.step
        if old is not None and old.fresh:
            old.fresh = fresh
            return old
        new = _Step(self)
        new.fresh = fresh
        if old is not None:
            old.drop_reduce_scatter()  # a backward that raised half-way: its gradients are not put on .grad
            reuse = old.done or not old.graph
            for name, gr in old.groups.items():
                if reuse and gr.status is not _Status.SHARDED and name in new.groups:
                    _adopt(new, old, name)
                else:
                    old.release(name)
        self.step = new
        return new

    def end_forward(self) -> None:
        step = self.step
        for name, pending in step.pending.items():
            if pending:  # a unit of several modules, not all of which ran
                pending.clear()
                step.swap_out(name)
                if step.groups[name].group.reshard_after_forward:
                    step.reshard(name)
        step.graph = step.graph or torch.is_grad_enabled()
        self.fwd_root = None
        step.free_unused_prefetches()
        # Prefetch follows the order the units' forwards ran in (FSDP2 records it each iteration): this step's
        # backward at once (Step.prefetch); later forwards once the same order was seen twice in a row (a model
        # alternating between orders keeps the module order for its forward prefetch).
        seen = tuple(step.order)
        if self.plan().order_differs(seen) and seen == self.last_order:
            self.order = seen
        self.last_order = seen


def _adopt(new: Step, old: Step, name: str) -> None:
    """Move a gathered group's buffers from ``old`` to ``new``: no second all-gather."""
    o, n = old.groups[name], new.groups[name]
    old.wait(name)
    swapped = o.swapped
    old.swap_out(name)
    n.bases, n.copy_to, n.status = o.bases, o.copy_to, _Status.GATHERED
    o.bases, o.copy_to, o.status, o.views = None, None, _Status.SHARDED, None
    if swapped:
        _register_unsharded(new, name)


def _register_unsharded(step: Step, name: str) -> None:
    """Put the gathered (unpadded) parameters on the modules, outside autograd, as ``unshard()`` does."""
    gr = step.groups[name]
    with torch.no_grad():
        gr.views, gr.node = gr.layout.views(gr.bases), None
    step.swap_in(name)


class _Step(Step):
    """The runtime Step, plus what FSDP2's module API asks of backward: DTensor ``.grad``s, accumulation
    without sync, per-unit divide factors, reshard_after_backward, unshard_in_backward."""

    def __init__(self, ctx: _Context):
        state = {f: r.leaf() for f, r in ctx.recs.items()}
        super().__init__(ctx.plan(), state)
        self.ctx, self.pending, self.fresh, self.graph, self.done = ctx, {}, False, False, False

    def release(self, name: str) -> None:
        """Free the group and put the sharded parameters back on the modules (outside forward/backward)."""
        self.reshard(name)
        self.swap_out(name)
        self._loosen(self.groups[name])

    def unshard(self, name: str) -> None:
        if self.backward_started and not self.ctx.by_group[name].unshard_in_backward:
            return  # set_unshard_in_backward(False): the user promised its backward reads no parameters
        super().unshard(name)

    def pre_backward(self, name: str) -> None:
        super().pre_backward(name)
        if self.groups[name].status is _Status.SHARDED:  # not gathered (unshard_in_backward=False): no views
            self.swap_out(name)

    def post_backward(self, name: str, grads) -> list[None]:
        unit, gr = self.ctx.by_group[name], self.groups[name]
        paths = gr.group.params
        raw_grads(grads)  # in place: the reduce-scatter consumes the list (frees the gradients)
        if not unit.sync:  # accumulate unsharded; the next synced backward reduce-scatters the sum
            with torch.no_grad():
                for p, g in zip(paths, grads):
                    if g is not None:
                        unit.acc[p] = unit.acc[p].add_(g) if p in unit.acc else g.clone()
            self._grads_done(name)
            return [None] * len(grads)
        for i, p in enumerate(paths):
            if p in unit.acc:
                grads[i] = unit.acc.pop(p) if grads[i] is None else unit.acc.pop(p).add_(grads[i])
        factor = unit.divide_factor if unit.divide_factor is not None else self.plan.divide_factor
        had = [g is not None for g in grads]
        # the unsharded parameters are freed first (FSDP2's order); the reduce-scatter's shards are put on the
        # .grads (_reduced) in the next group's post-backward or at the end of backward
        self.post_backward_deferred(name, grads, extra=had, factor=factor)
        return [None] * len(grads)  # the gradients live on the DTensor parameters, not on the state

    def _reduced(self, name: str, out: list, had: list[bool]) -> None:
        """Accumulate a group's reduce-scattered shards into its parameters' DTensor ``.grad``."""
        reduce_unused, recs = self.ctx.by_group[name].reduce_unused, self.ctx.recs
        with no_grad():
            for p, g, o in zip(self.groups[name].group.params, had, out):
                r = recs[p]
                param = r.param
                if o is None or not param.requires_grad or (not g and not reduce_unused):
                    continue  # like FSDP2: a parameter without a gradient on this rank gets none
                o = r.local(o)
                grad = param.grad
                if grad is None:
                    param.grad = r.grad_dtensor(o)
                else:  # (its local tensor: DTensor.to_local runs an autograd Function)
                    dtensor_local(grad).add_(o)
                if hooks := post_accumulate_grad_hooks(param):
                    for hook in hooks.values():
                        hook(param)

    def _release_frozen(self, name: str) -> None:
        if self.ctx.by_group[name].reshard_after_backward:
            super()._release_frozen(name)

    def _recomputed(self, name: str) -> None:
        if self.ctx.by_group[name].reshard_after_backward:
            super()._recomputed(name)

    def _grads_done(self, name: str) -> None:
        if self.ctx.by_group[name].reshard_after_backward or self.groups[name].frozen:
            super()._grads_done(name)  # (frozen: counted; freed only with reshard_after_backward)

    def end_of_backward(self) -> None:
        self.finish_reduce_scatter()
        for name in self.groups:
            if (u := self.ctx.by_group.get(name)) is None or u.reshard_after_backward:
                self.reshard(name)
            self.swap_out(name)
            self._backward_ended(self.groups[name])
        self.backward_started, self.done = False, True


# ---- module hooks -------------------------------------------------------------------------------------


def _no_inference_tensors(fn):
    """Run ``fn`` outside ``inference_mode`` (grad stays off): the runtime's buffers outlive an
    inference-mode forward, and inference tensors cannot be refilled later."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def _in_backward() -> bool:
    return current_graph_task_id() != -1


@_no_inference_tensors
def _pre_forward(unit: _Unit, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    ctx = _ctx(unit)
    name = unit.group
    if _in_backward():  # activation-checkpoint recomputation
        if name is not None and (step := ctx.step) is not None:
            step.recompute(name, args)
        return None
    moved = None
    if ctx.fwd_root is None:  # the first unit to run forward runs this iteration's root logic
        ctx.fwd_root = unit
        ctx.begin()
        if unit.mesh.device_type != "cpu":  # like FSDP2's root: inputs to the mesh's device
            moved = module_io_map_only(torch.Tensor, lambda t: t.to(_device_of(unit.mesh)), (args, kwargs))
    step = ctx.step
    if name is not None:
        if not step.pending.get(name):
            step.pending[name] = {id(m) for m in unit.modules}
            step.swap_out(name)  # parameters registered by unshard() make way for autograd-visible ones
            step.gather_for_forward(name)
        step.swap_in(name)
        # a group with frozen parameters is freed once its inputs' gradients are done
        watched = step.watch_inputs(name, moved[0] if moved is not None else args)
        if watched is not None:
            moved = (watched, moved[1] if moved is not None else kwargs)
    return moved


@_no_inference_tensors
def _post_forward(unit: _Unit, module: nn.Module, args: Any, output: Any) -> Any:
    ctx = unit.ctx
    if _in_backward() or ctx is None or ctx.step is None:
        return output
    step, name = ctx.step, unit.group
    if name is not None:
        if pending := step.pending.get(name):
            pending.discard(id(module))
        output = step.wrap_for_backward(name, output) if pending else step.post_forward(name, output)
    if ctx.fwd_root is unit and not (name is not None and step.pending.get(name)):
        ctx.end_forward()
    return output


def _reshard_hook(module: nn.Module, *args: Any) -> None:  # state_dict / load_state_dict: sharded params
    unit = module.__dict__.get(_UNIT)
    if unit is not None and unit.ctx is not None and unit.ctx.fwd_root is None:
        FSDPModule.reshard(module)


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
                r.padded.is_meta or local.untyped_storage().data_ptr() == r.padded.untyped_storage().data_ptr()):
            continue
        r.spec = dataclasses.replace(r.spec, dtype=local.dtype)
        r.padded = local.new_zeros(r.spec.local_shape)
        with torch.no_grad():
            r.local(r.padded).copy_(local)
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


# ---- the public API ---------------------------------------------------------------------------------


class UnshardHandle:
    """A handle to wait on a :meth:`FSDPModule.unshard` op."""

    def wait(self) -> None:
        """Wait for the all-gather; the unsharded parameters are then registered on the module."""


class _UnshardHandleImpl(UnshardHandle):
    def __init__(self, step: Step, name: str | None):
        self._step, self._name = step, name

    @_no_inference_tensors
    def wait(self) -> None:
        step, name, self._step = self._step, self._name, None
        if step is None or name is None:
            return
        step.wait(name)
        if step.groups[name].status is _Status.GATHERED and not step.groups[name].swapped:
            _register_unsharded(step, name)


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to: ``FSDP<Cls>(FSDPModule, Cls)``."""

    def __new__(cls, *args, **kwargs):  # e.g. slicing an FSDPSequential constructs the original class
        orig = cls.__mro__[2]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _set(self, recurse: bool, **settings: Any) -> None:
        units = {id(u): u for m in (self.modules() if recurse else [self]) if (u := m.__dict__.get(_UNIT))}
        for u in units.values():
            for k, v in settings.items():
                setattr(u, k, v)
            if u.ctx is not None:
                u.ctx._plan = None  # derive the plan again at the next step

    @_no_inference_tensors
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters and register them unsharded (not recursive). With
        ``async_op=True``, return a handle to wait on; the module's next forward waits for it anyway."""
        unit = _unit_of(self)
        ctx = _ctx(unit)
        busy = ctx.fwd_root is not None or (ctx.step is not None and ctx.step.backward_started)
        step = ctx.step if busy else ctx.begin(fresh=True)
        if unit.group is not None:
            step.unshard(unit.group)
        handle = _UnshardHandleImpl(step, unit.group)
        if async_op:
            return handle
        handle.wait()
        return None

    @_no_inference_tensors
    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        unit = _unit_of(self)
        if unit.ctx is not None and not unit.ctx.stale and unit.ctx.step is not None and unit.group is not None:
            unit.ctx.step.release(unit.group)

    @_no_inference_tensors
    def reset_iter_state(self) -> None:
        """After forward or backward raised: free every group and forget the iteration (on the root)."""
        unit = _unit_of(self)
        if (ctx := unit.ctx) is None or ctx.stale:
            return
        if ctx.top is not unit:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        if ctx.step is not None:
            ctx.step.drop_reduce_scatter()
            for name in ctx.step.groups:
                ctx.step.release(name)
        ctx.step, ctx.fwd_root = None, None
        for u in ctx.units:
            u.acc.clear()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients without reduce-scatter (FSDP1's ``no_sync``);
        the next backward with True reduce-scatters the sum."""
        self._set(recurse, sync=bool(requires_gradient_sync))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """The plan's ``Group.reshard_after_forward``, from the next iteration on."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        self._set(recurse, reshard_after_forward=reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep the parameters gathered after backward; the next forward uses them without an
        all-gather (gradient accumulation)."""
        self._set(recurse, reshard_after_backward=bool(reshard_after_backward))

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: parameters without a gradient on this rank still get the reduced gradient."""
        self._set(recurse, reduce_unused=bool(reduce_scatter_unused_params))

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: no all-gather for this module's backward (it must read no parameters, e.g. an embedding)."""
        self._set(False, unshard_in_backward=bool(unshard_in_backward))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduce-scattered (summed) gradients by ``factor`` instead of the mesh size."""
        if not factor > 0:
            raise ValueError(f"the gradient divide factor must be > 0, got {factor}")
        self._set(False, divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:  # deprecated in FSDP2
        self.set_gradient_divide_factor(factor)

    def _set_prefetch(self, kind: str, modules: list) -> None:
        for m in modules:
            if not isinstance(m, FSDPModule):
                raise ValueError(f"Expects FSDPModule but got {type(m)}: {m}")
        self._set(False, **{f"{kind}_prefetch": [_unit_of(m) for m in modules]})

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters when this module's forward starts (the plan's
        ``forward_prefetch_lists``; replaces the depth-1 default for this module)."""
        self._set_prefetch("forward", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters when this module's backward starts."""
        self._set_prefetch("backward", modules)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted: funcshard finishes every reduce-scatter inside backward; nothing waits for a last one."""

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted: all-gathers are issued from the current stream, which already follows the optimizer."""

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: funcshard always reduce-scatters with SUM, then divides once."""

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """True is the only behaviour of a 1-D mesh; False (skip HSDP's all-reduce) is not built."""
        if not requires_all_reduce:
            raise _not_built("set_requires_all_reduce(False) (HSDP gradient all-reduce)",
                             "a 1-D mesh has no all-reduce to skip")

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        self.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        _resync(_unit_of(self))
        return out


def _unbuilt_method(self, *args: Any, _name: str, **kwargs: Any) -> None:
    raise _not_built(_name, "funcshard runs one all-gather and one reduce-scatter (SUM, then one divide) per group "
                     "and dtype, on the mesh's process group, with buffers from the caching allocator")


for _name in ("set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook",
              "set_reduce_scatter_max_input_buffers", "set_separate_reduce_scatter_group",
              "set_allocate_memory_from_process_group_for_comm", "set_symm_mem_for_comm"):
    setattr(FSDPModule, _name, functools.partialmethod(_unbuilt_method, _name=_name))

_FSDP_CLASSES: dict[type, type] = {}


def _no_deepcopy(*args: Any, **kwargs: Any):
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn=None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
):
    """Shard ``module``'s parameters over ``mesh`` like ``torch.distributed.fsdp.fully_shard`` (same
    signature and semantics; apply bottom-up: blocks, then the root). A list of modules forms one unit.

    Parameters become DTensor ``nn.Parameter``s (``Shard(dim)``; ``shard_placement_fn(param) -> Shard | None``
    picks the dim; uneven sizes are padded, on any dim). ``reshard_after_forward``: True frees the unsharded
    parameters after forward, False keeps them for backward, None means True except for the root. Not built
    (NotImplementedError): mixed precision, CPU offload, HSDP / 2-D meshes, int ``reshard_after_forward``,
    ``dp_mesh_dims``. Returns ``module``, its class now ``FSDP<Cls>`` (a subclass of :class:`FSDPModule`).
    """
    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(f"fully_shard does not support containers that do not implement forward: {m}")
        if m.__dict__.get(_UNIT) is not None:
            raise ValueError(f"fully_shard was already applied to this {_cls_name(m)}; apply it once per "
                             f"module, bottom-up (submodules first, then their ancestors)")
    mesh = mesh if mesh is not None else _default_mesh()
    _check_unbuilt(mesh, reshard_after_forward, mp_policy, offload_policy, dp_mesh_dims)
    device = _device_of(mesh)
    check_mesh(mesh)
    managed, nested, params = _collect(modules, set(ignored_params or ()))
    world, rank = mesh.size(), mesh.get_local_rank()
    records = []
    for path, p in params:
        placement = shard_placement_fn(p) if shard_placement_fn is not None else None
        if placement is not None and not isinstance(placement, Shard):
            raise _not_built("shard_placement_fn returning a per-parameter mesh (ShardPlacementResult)",
                             "return Shard(dim) or None")
        dim = 0 if placement is None else placement.dim
        if not -p.dim() <= dim < p.dim():
            raise ValueError(f"shard_placement_fn returned Shard({dim}) for {path!r} of shape {tuple(p.shape)}; "
                             f"pick a dim in [{-p.dim()}, {p.dim() - 1}]")
        spec = ShardSpec(fqn=path, shape=tuple(p.shape), dtype=p.dtype, dim=dim % p.dim(), axis=0, world=world,
                         requires_grad=p.requires_grad)
        full = p.detach() if p.is_meta else p.detach().to(device)
        records.append(_Param(spec.local_shard(full, rank), spec, spec.local_valid(rank), mesh, p.requires_grad))
    # nothing above changed the modules; from here on, register
    unit = _Unit(modules, mesh, records, reshard_after_forward)
    for (_, p), r in zip(params, records):
        setattr(p, _OWNER, unit)
        setattr(r.param, _OWNER, unit)
        for m in managed:
            held = param_slots(m)
            for attr, q in held.items():
                if q is p:
                    held[attr] = r.param
                    r.slots.append((m, attr))
    for m in managed:
        buffers = buffer_slots(m)
        for k, b in buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                buffers[k] = b.to(device)
    for u in nested:
        u.parent = unit
        if u.ctx is not None:
            u.ctx.stale = True
    for m in modules:
        m.__dict__[_UNIT] = unit
        m.register_forward_pre_hook(functools.partial(_pre_forward, unit), prepend=True, with_kwargs=True)
        m.register_forward_hook(functools.partial(_post_forward, unit))
        m.register_state_dict_pre_hook(_reshard_hook)
        m.register_load_state_dict_pre_hook(_reshard_hook)
        m.register_load_state_dict_post_hook(lambda mod, keys: _resync(_unit_of(mod)))
        cls = type(m)
        if cls not in _FSDP_CLASSES:
            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})
        m.__class__ = _FSDP_CLASSES[cls]
    return module


def _collect(modules: tuple[nn.Module, ...], ignored: set) -> tuple[list, list, list]:
    """The modules one call manages (not those under an earlier, nested call), the nested units, and the
    parameters to shard as (path, parameter); raises on parameters another call manages."""
    managed: list[nn.Module] = []
    nested: list[_Unit] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        seen.add(id(m))
        for c in m.children():
            if (u := c.__dict__.get(_UNIT)) is not None and c not in modules:
                nested.extend([u] if u not in nested else [])
            elif id(c) not in seen:
                visit(c)
        managed.append(m)

    for m in modules:
        visit(m)
    prefix = {id(x): f"{n}." if n else "" for m in reversed(modules) for n, x in m.named_modules()}
    call = "fully_shard(" + ", ".join(_cls_name(m) for m in modules) + ")"
    params, seen = [], set()
    for m in managed:
        for attr, p in param_slots(m).items():
            if p is None or p in ignored or id(p) in seen:
                continue
            path = prefix[id(m)] + attr
            if (owner := getattr(p, _OWNER, None)) is not None:
                if any(x is m for o in owner.modules for x in o.modules()):
                    raise ValueError(f"{call}: its parameter {path!r} is already managed by the fully_shard call "
                                     f"on {owner.name()}, an ancestor; apply fully_shard bottom-up: submodules "
                                     f"first, then their ancestors")
                raise ValueError(f"{call}: parameter {path!r} is shared with (tied to) a parameter the "
                                 f"fully_shard call on {owner.name()} already manages; a parameter belongs to one "
                                 f"unit: shard the modules sharing it together, fully_shard([a, b]), or leave it "
                                 f"to a common ancestor")
            if isinstance(p, DTensor):
                raise _not_built("fully_shard on DTensor parameters (FSDP + tensor parallel)",
                                 "pass plain parameters")
            if p.dim() == 0:
                raise ValueError(f"fully_shard doesn't support scalar parameters. Change {path} to a 1D tensor "
                                 f"with numel equal to 1.")
            seen.add(id(p))
            params.append((path, p))
    return managed, nested, params


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run like ``forward``: gather before, reshard after. A no-op on a module
    ``fully_shard`` was not applied to."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig, unit = getattr(module, method_name), _unit_of(module)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        moved = _pre_forward(unit, self, args, kwargs)
        args, kwargs = moved if moved is not None else (args, kwargs)
        return _post_forward(unit, self, args, orig(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))
