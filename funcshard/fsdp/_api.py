"""FSDP2's module API: ``fully_shard``, ``FSDPModule`` and its ``set_*`` methods, the module hooks.

``fully_shard`` shards a unit's parameters at once (``make_spec``, ``ShardSpec.local_shard``) and registers each
as a DTensor ``nn.Parameter`` whose local tensor is the unpadded view of its padded shard. The module hooks hand
each forward to the root's runtime Step (``Step.module_pre_forward`` / ``module_post_forward``); the ``set_*``
methods change unit settings, which become Plan edits at the next iteration (``_units``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from funcshard._collectives import check_timeout
from funcshard._compat import (
    buffer_slots,
    group_allocator,
    composable_apis,
    current_graph_task_id,
    dtensor_local,
    mark_composable,
    param_slots,
)
from funcshard._comm import GroupAllocated, custom_comm, group_allocated
from funcshard._compile import runtime_boundary
from funcshard._mesh import (
    check_mesh,
    default_fsdp_mesh,
    device_of,
    dp_axes,
    mesh_str,
    model_sharding,
    spmd_dp_mesh,
)
from funcshard._offload import offload_fields, to_host
from funcshard._plan import ROOT
from funcshard._policy import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    cast_floating,
    check_mp_policy,
    resolve_reshard_after_forward,
)
from funcshard._runtime import Step
from funcshard._spec import dim_range, make_spec
from funcshard._tree import module_io_map_only
from funcshard.fsdp._sink import _Param
from funcshard.fsdp._units import (
    _OWNER,
    READ_AT_USE,
    UNIT,
    FSDPState,
    _resync,
    _Unit,
    cls_name,
    ctx_of,
    fsdp_class,
    state_of,
    unit_of,
)



def _not_built(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not built yet in funcshard's fully_shard; {instead}")


def _check_unbuilt(mesh, reshard_after_forward, dp_mesh_dims) -> None:
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(f"reshard_after_forward should be a bool, an int or None, not {reshard_after_forward!r}")
    if dp_mesh_dims is None and mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: a 1-D mesh (FSDP) or a 2-D "
                         f"(replicate, shard) mesh (HSDP); pass the data-parallel sub-mesh, e.g. "
                         f"mesh[('replicate', 'shard')]")
    if dp_mesh_dims is None and mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise FullyShardError(f"Please init the 2D mesh for HSDP with mesh_dim_names specified: fully_shard got "
                              f"{mesh_str(mesh)}, a 2-D mesh without axis names; build it with "
                              f"init_device_mesh(device_type, (replicate, shard), mesh_dim_names=('replicate', "
                              f"'shard')) (FSDP2 asks the same)")


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


@runtime_boundary  # (FSDP2's hooks break the graph too: torch._dynamo.config.skip_fsdp_hooks)
@_no_inference_tensors
def _pre_forward(unit: _Unit, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    ctx = ctx_of(unit)
    name = unit.group
    if _in_backward():  # activation-checkpoint recomputation
        if name is not None and (step := ctx.backward_step()) is not None:
            return step.module_pre_forward(name, module, args, kwargs)
        return _cast_inputs(unit, args, kwargs)
    moved = None
    if ctx.fwd_root is not None and ctx.step is not None and ctx.step.failed is not None:
        ctx.fwd_root = ctx.fwd_module = None  # the forward that began the failed step raised: this one begins anew
    if ctx.fwd_root is None:  # the first unit to run forward runs this iteration's root logic
        step = ctx.begin()  # (raises before the forward counts as begun: a retry starts afresh)
        ctx.fwd_root, ctx.fwd_module = unit, module
        step.begin_forward()
        if unit.mesh.device_type != "cpu":  # like FSDP2's root: inputs to the mesh's device
            device = device_of(unit.mesh, "fully_shard")
            moved = module_io_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))
    if name is not None:
        new = ctx.step.module_pre_forward(name, module, *(moved if moved is not None else (args, kwargs)))
    else:  # a unit without parameters of its own: no group, but its policy's casts apply (as in FSDP2)
        new = _cast_inputs(unit, *(moved if moved is not None else (args, kwargs)))
    return new if new is not None else moved


def _cast_inputs(unit: _Unit, args: tuple, kwargs: dict) -> tuple | None:
    mp = unit.mp_policy
    if mp.param_dtype is None or not mp.cast_forward_inputs:
        return None
    return cast_floating(mp.param_dtype, (args, kwargs))


@runtime_boundary
@_no_inference_tensors
def _post_forward(unit: _Unit, module: nn.Module, args: Any, output: Any) -> Any:
    ctx = unit.ctx
    if _in_backward() or ctx is None or ctx.step is None:
        return output
    step, name = ctx.step, unit.group
    if name is not None:
        in_forward = step.in_forward
        output = step.module_post_forward(name, module, output)
        if in_forward and not step.tracker.is_open(name):
            # a group left gathered after its forward (reshard_after_forward=False; the root by default) shows its
            # unsharded parameters on the module until it is resharded, as FSDP2 registers them
            step.runs[name].register_unsharded()
    elif unit.mp_policy.output_dtype is not None:  # (a unit without parameters: its policy's cast, as in FSDP2)
        output = cast_floating(unit.mp_policy.output_dtype, output)
    if ctx.fwd_root is unit and ctx.fwd_module is module:  # the call that began this forward returns
        ctx.end_forward()  # (a grouped unit's members not run in it are finished: ``Step.end_forward``)
        if name is None:  # a parameterless root (no unit group): its outputs get the root group's pre-backward hook,
            # as apply's do, so this step's backward is marked where it starts (Step.last_pre_backward), before any
            # recomputation in the root's region
            output = step.runs[ROOT].wrap_for_backward(output)
        for g in step.groups:  # (those finished there and left gathered: registered as above)
            step.runs[g].register_unsharded()
    return output


def _on_stream(hook: Any, stream: Any, device_type: str) -> Any:
    """``hook`` run on ``stream``: the stream waits for the current one (the reduced output), the current one waits for
    the stream after the hook (the output is read next)."""
    device = torch.get_device_module(device_type)

    def run(output: torch.Tensor) -> None:
        current = device.current_stream()
        stream.wait_stream(current)
        with device.stream(stream):
            hook(output)
        current.wait_stream(stream)

    return run


def _reshard_hook(module: nn.Module, *args: Any) -> None:  # state_dict / load_state_dict: sharded params
    unit = module.__dict__.get(UNIT)
    if unit is not None and unit.ctx is not None and unit.ctx.fwd_root is None:
        FSDPModule.reshard(module)


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
        step.runs[name].wait()
        step.runs[name].register_unsharded()


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to: ``FSDP<Cls>(FSDPModule, Cls)``."""

    def __new__(cls, *args, **kwargs):  # e.g. slicing an FSDPSequential constructs the original class
        orig = cls.__mro__[2]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _set(self, recurse: bool, **settings: Any) -> None:
        units = {id(u): u for m in (self.modules() if recurse else [self]) if (u := m.__dict__.get(UNIT))}
        for u in units.values():
            for k, v in settings.items():
                setattr(u, k, v)
            if u.ctx is not None and not READ_AT_USE.issuperset(settings):
                u.ctx.settings_changed()

    @_no_inference_tensors
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters and register them unsharded (not recursive). With
        ``async_op=True``, return a handle to wait on; the module's next forward waits for it anyway.

        Args:
            async_op: return a handle instead of waiting.
        """
        unit = unit_of(self)
        ctx = ctx_of(unit)
        busy = ctx.fwd_root is not None or (ctx.step is not None and ctx.step.backward_started)
        step = ctx.step if busy else ctx.begin(fresh=True)
        if unit.group is not None:
            step.runs[unit.group].unshard()
        handle = _UnshardHandleImpl(step, unit.group)
        if async_op:
            return handle
        handle.wait()
        return None

    @_no_inference_tensors
    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        unit = unit_of(self)
        if unit.ctx is not None and not unit.ctx.stale and unit.ctx.step is not None and unit.group is not None:
            unit.ctx.step.runs[unit.group].release()

    @_no_inference_tensors
    def reset_iter_state(self) -> None:
        """After forward or backward raised: free every group and forget the iteration (on the root)."""
        unit = unit_of(self)
        if (ctx := unit.ctx) is None or ctx.stale:
            return
        if ctx.top is not unit:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        if ctx.step is not None:
            ctx.step.abandon()
        ctx.step, ctx.fwd_root, ctx.fresh = None, None, None
        for u in ctx.units:
            u.acc.clear()
            u.partial.clear()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients without reduce-scatter (FSDP1's ``no_sync``);
        the next backward with True reduce-scatters the sum.

        Args:
            requires_gradient_sync: reduce-scatter the gradients in backward.
            recurse: apply it to every FSDP module inside this one too (else to this module's unit only).
        """
        self._set(recurse, sync=bool(requires_gradient_sync))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """The plan's ``Group.reshard_after_forward``, from the next iteration on.

        Args:
            reshard_after_forward: free the unsharded parameters after forward.
            recurse: apply it to every FSDP module inside this one too (else to this module's unit only).
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        self._set(recurse, reshard_after_forward=reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep the parameters gathered after backward; the next forward uses them without an
        all-gather (gradient accumulation).

        Args:
            reshard_after_backward: free the unsharded parameters after backward.
            recurse: apply it to every FSDP module inside this one too (else to this module's unit only).
        """
        self._set(recurse, reshard_after_backward=bool(reshard_after_backward))

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: parameters without a gradient on this rank still get the reduced gradient.

        Args:
            reduce_scatter_unused_params: reduce-scatter parameters this rank computed no gradient for (as zeros).
            recurse: apply it to every FSDP module inside this one too (else to this module's unit only).
        """
        self._set(recurse, reduce_unused=bool(reduce_scatter_unused_params))

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: no all-gather for this module's backward (it must read no parameters, e.g. an embedding).

        Args:
            unshard_in_backward: all-gather the parameters for this module's backward.
        """
        self._set(False, unshard_in_backward=bool(unshard_in_backward))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduce-scattered (summed) gradients by ``factor`` instead of the mesh size.

        Args:
            factor: the divisor (> 0) of the summed gradients.
        """
        if not factor > 0:
            raise ValueError(f"the gradient divide factor must be > 0, got {factor}")
        self._set(False, divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:  # deprecated in FSDP2
        """FSDP2's deprecated name of :meth:`set_gradient_divide_factor`.

        Args:
            factor: the divisor (> 0) of the summed gradients.
        """
        self.set_gradient_divide_factor(factor)

    def _set_prefetch(self, kind: str, modules: list) -> None:
        for m in modules:
            if not isinstance(m, FSDPModule):
                raise ValueError(f"Expects FSDPModule but got {type(m)}: {m}")
        self._set(False, **{f"{kind}_prefetch": [unit_of(m) for m in modules]})

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters when this module's forward starts (the plan's
        ``forward_prefetch_lists``; replaces the depth-1 default for this module).

        Args:
            modules: ``FSDPModule``s whose parameters to all-gather.
        """
        self._set_prefetch("forward", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters when this module's backward starts.

        Args:
            modules: ``FSDPModule``s whose parameters to all-gather.
        """
        self._set_prefetch("backward", modules)

    def set_timeout(self, timeout: float | None, *, recurse: bool = True) -> None:
        """funcshard's (not FSDP2's): seconds a collective of a step may take before every waiting rank raises
        ``CollectiveTimeout`` (``funcshard.plan(timeout=)``; None: ``FUNCSHARD_TIMEOUT``, else 300). The model's
        steps use the shortest timeout set on any of its modules.

        Args:
            timeout: seconds (None: ``FUNCSHARD_TIMEOUT``, else 300; 0: no bound of funcshard's own).
            recurse: apply it to every FSDP module inside this one too (else to this module's unit only).
        """
        check_timeout(timeout, "set_timeout")
        self._set(recurse, timeout=timeout)

    def set_check_mode(self, check: bool, *, recurse: bool = True) -> None:
        """funcshard's (not FSDP2's): check mode (``funcshard.plan(check=)``): the ranks check that they run the same
        collectives in the same order; on for the model if set on any of its modules.

        Args:
            check: check mode on or off.
            recurse: apply it to every FSDP module inside this one too (else to this module's unit only).
        """
        self._set(recurse, check=bool(check))

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted: funcshard finishes every reduce-scatter inside backward; nothing waits for a last one.

        Args:
            is_last_backward: accepted and ignored.
        """

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted: all-gathers are issued from the current stream, which already follows the optimizer.

        Args:
            event: accepted and ignored.
        """

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: funcshard always reduce-scatters with SUM, then divides once.

        Args:
            enable: accepted and ignored.
        """

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters gradients but keeps the sums (no all-reduce over the replicate axis, nothing
        in ``.grad``); the next backward with True adds them before its all-reduce (gradient accumulation with only
        reduce-scatter). A 1-D mesh has no all-reduce: no effect there (as in FSDP2).

        Args:
            requires_all_reduce: all-reduce the gradients over the replicate axis in backward.
            recurse: apply it to every FSDP module inside this one too (else to this module's unit only).
        """
        self._set(recurse, all_reduce=bool(requires_all_reduce))

    def set_all_reduce_hook(self, hook: Any, *, stream: Any = None) -> None:
        """``hook(output)`` runs on each reduced gradient buffer of this module's group, in the reduce dtype, after
        the HSDP all-reduce (1-D: after the reduce-scatter), with what FSDP2's hook sees there (averaged for fp32 and
        bf16), before the cast back to the parameters' dtype. ``stream``: the hook runs on it (it first waits for the
        current stream's work; the current stream waits for the hook's before the output is read), as in FSDP2;
        refused with HSDP, as in FSDP2.

        Args:
            hook: ``hook(output) -> None``, called on each reduced gradient buffer, as described above.
            stream: the stream to run the hook on (None: the current one).
        """
        unit = unit_of(self)
        if stream is not None:
            if unit.mesh.ndim == 2:
                raise ValueError("stream cannot be set when using native HSDP")
            if not hasattr(stream, "wait_stream"):
                kind = unit.mesh.device_type
                raise TypeError(f"{unit.name()}: set_all_reduce_hook(stream={type(stream).__name__}): expects a stream "
                                f"of the mesh's device ({kind}), e.g. torch.get_device_module({kind!r}).Stream()")
            hook = _on_stream(hook, stream, unit.mesh.device_type)
        self._set(False, all_reduce_hook=hook)

    def set_custom_all_gather(self, comm: Any) -> None:
        """FSDP2's ``AllGather`` protocol (``allocate`` + in-place ``__call__``) runs this module's group's all-gathers
        (not recursive), with FSDP2's buffers and ``async_op=True``; see ``funcshard._comm``.

        Args:
            comm: an object with FSDP2's ``AllGather`` protocol (``allocate(size, dtype=, device=)`` and
                ``__call__(output_tensor=, input_tensor=, group=, async_op=)``).
        """
        unit = unit_of(self)
        self._set(False, comm=custom_comm(unit.comm, unit.name(), all_gather=comm))

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """FSDP2's ``ReduceScatter`` protocol runs this module's group's reduce-scatters (``op=SUM``; funcshard divides
        once after).

        Args:
            comm: an object with FSDP2's ``ReduceScatter`` protocol (``allocate`` and ``__call__(output_tensor=,
                input_tensor=, group=, op=, async_op=)``).
        """
        unit = unit_of(self)
        self._set(False, comm=custom_comm(unit.comm, unit.name(), reduce_scatter=comm))

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reduce-scatters backward keeps in flight at once, each holding its input buffer (FSDP2
        2.13's, the plan's ``reduce_scatter_buffers``): a module's post-backward waits for the oldest only when this
        many are in flight. 1 (default): the next group's post-backward waits for the one in flight; more: an exposed
        reduce-scatter no longer stalls the next group's backward, at the memory of the buffers kept. The queue spans
        the model: it keeps the most any of its modules asked for (as FSDP2 resolves it). The same gradients whatever
        the value. Takes effect at the next post-backward (FSDP2 reads it once, at its lazy initialization). With HSDP
        each reduce-scatter is still taken before the next collective, so that its all-reduce follows it: one in
        flight.

        Args:
            max_input_buffers: an int >= 1.
            recurse: apply it to every FSDP module inside this one too (else to this module's unit only).
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):  # (FSDP2's checks)
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        self._set(recurse, reduce_scatter_buffers=max_input_buffers)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's all-gather and reduce-scatter buffers with the process group's own allocator, where
        it has one (NCCL's, e.g. for zero-copy transfers over SHARP), as FSDP2 does (not recursive). Where the process
        group has none (gloo, the CPU) this is a no-op: the buffers come from torch's allocator either way. Refused
        (``AssertionError``, as in FSDP2) once ``set_custom_all_gather`` or ``set_custom_reduce_scatter`` set a comm
        for this module; either set after it replaces it for its collective.

        Args:
            enable: allocate from the process group (False: from torch's allocator again).
        """
        unit = unit_of(self)
        current = unit.comm
        for kind, field in (("all gather", "all_gather"), ("reduce scatter", "reduce_scatter")):
            f = None if current is None else getattr(current, field)
            if f is not None and not isinstance(f, GroupAllocated):
                raise AssertionError(f"cannot call set_allocate_memory_from_process_group() when {kind} comm is "
                                     f"custom: {f.__class__.__name__}")  # (FSDP2's words; a mock's spec class)
        axes = dp_axes(unit.mesh)
        device = device_of(unit.mesh, "set_allocate_memory_from_process_group_for_comm")
        backend = group_allocator(unit.mesh.get_group(axes.shard), device) if enable else None
        self._set(False, comm=None if backend is None else group_allocated(backend))

    def _get_fsdp_state(self) -> FSDPState:
        """``fully_shard.state(self)`` (FSDP2's method of the same name)."""
        return state_of(unit_of(self))

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        self.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        _resync(unit_of(self))
        return out


def _unbuilt_method(self, *args: Any, _name: str, **kwargs: Any) -> None:
    raise _not_built(_name, "funcshard runs one all-gather and one reduce-scatter (SUM, then one divide) per group "
                     "and dtype, on the mesh's process group, with buffers from the caching allocator")


for _name in ("set_separate_reduce_scatter_group", "set_symm_mem_for_comm"):
    setattr(FSDPModule, _name, functools.partialmethod(_unbuilt_method, _name=_name))

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
    signature and semantics; apply bottom-up: blocks, then the root). Parameters become DTensor ``nn.Parameter``s
    (``Shard(dim)``; HSDP ``(Replicate(), Shard(dim))``); uneven sizes are padded, on any dim. funcshard's own
    ``set_timeout`` / ``set_check_mode`` (not FSDP2's) are on the returned module.

    Args:
        module: the module, or a list of modules forming one unit (gathered together).
        mesh: 1-D, or 2-D ``(replicate, shard)`` with axis names (HSDP: sharded over axis 1, gradients
            reduce-scattered over it and all-reduced over axis 0). None: a 1-D mesh over the default process group.
        reshard_after_forward: True frees the unsharded parameters after forward, False keeps them for backward, None
            means True except for the root, an int ``k`` (dividing the shard axis size) keeps them sharded over blocks
            of ``k`` ranks until backward (also with tensor parallel, where FSDP2 refuses it).
        shard_placement_fn: ``param -> Shard(dim) | None``: the dim to shard each parameter on (None: dim 0).
        mp_policy: a ``MixedPrecisionPolicy`` (funcshard's or torch's) for this unit.
        offload_policy: ``CPUOffloadPolicy(pin_memory=...)``: sharded parameters and gradients on the host (pinned if
            asked), copied to the device before the all-gather and back after the reduce-scatter; the optimizer steps
            on the host (FSDP2's semantics, ``funcshard/_offload.py``). ``OffloadPolicy()``: none.
        ignored_params: parameters this unit leaves alone (not sharded, not managed).
        dp_mesh_dims: FSDP over tensor parallel on a full SPMD ``mesh``: ``DataParallelMeshDims(shard='dp',
            replicate=...)`` names its data-parallel axes; every parameter must be a DTensor on ``mesh`` with
            ``Replicate()`` there. (The other form: DTensor parameters on ``mesh['tp']`` of the mesh ``mesh`` was
            sliced from, ``parallelize_module`` first, then ``fully_shard(block, mesh=mesh['dp'])``.) Each local tensor
            is sharded over the data-parallel axes; the parameter is a DTensor over both (``_StridedShard`` where
            FSDP2 uses it), the module sees its DTensor gathered.

    Returns:
        ``module``, its class now ``FSDP<Cls>`` (a subclass of :class:`FSDPModule`).
    """
    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(f"fully_shard does not support containers that do not implement forward: {m}")
        if m.__dict__.get(UNIT) is not None:
            raise FullyShardError(f"fully_shard was already applied to this {cls_name(m)}; apply it once per "
                                  f"module, bottom-up (submodules first, then their ancestors). (FSDP2: Each "
                                  f"distinct composable distributed API can only be applied to a module once.)")
    mesh = mesh if mesh is not None else default_fsdp_mesh()
    _check_unbuilt(mesh, reshard_after_forward, dp_mesh_dims)
    check_mp_policy(mp_policy, "fully_shard(" + ", ".join(cls_name(m) for m in modules) + ")")
    offload = offload_fields(offload_policy, "fully_shard(" + ", ".join(cls_name(m) for m in modules) + ")")
    spmd = None  # dp_mesh_dims: the indices of the data-parallel axes in the full SPMD mesh; FSDP runs on those
    if dp_mesh_dims is not None:
        if mesh.mesh_dim_names is None:
            raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
        mesh, spmd = spmd_dp_mesh(mesh, dp_mesh_dims)
    device = device_of(mesh, "fully_shard")
    check_mesh(mesh)
    axes = dp_axes(mesh)  # (1-D: shard over it; 2-D: (replicate, shard), HSDP)
    world, rank = mesh.size(axes.shard), mesh.get_local_rank(axes.shard)
    if reshard_after_forward is not None:
        reshard_after_forward = resolve_reshard_after_forward(
            reshard_after_forward, world, "fully_shard(" + ", ".join(cls_name(m) for m in modules) + ")")
    managed, nested, params, tied = _collect(modules, set(ignored_params or ()))
    records = []
    for path, p in params:
        placement = shard_placement_fn(p) if shard_placement_fn is not None else None
        if placement is not None and not isinstance(placement, Shard):
            raise _not_built("shard_placement_fn returning a per-parameter mesh (ShardPlacementResult)",
                             "return Shard(dim) or None")
        dim = 0 if placement is None else placement.dim
        local = dtensor_local(p) if isinstance(p, DTensor) else p  # (tensor parallel: its local tensor is sharded)
        lo, hi = dim_range(tuple(local.shape))
        if not lo <= dim <= hi:
            raise FullyShardError(f"shard_placement_fn returned Shard({dim}) for {path!r} of shape "
                                  f"{tuple(local.shape)}; pick a dim in [{lo}, {hi}] (FSDP2: Shard dim {dim} is "
                                  f"invalid for {local.dim()}D tensor)")
        if spmd is not None and local is p:
            raise ValueError(f"When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh "
                             f"(e.g. via distribute_module). Got plain tensor for parameter {path!r}.")
        model = None if local is p else model_sharding(path, p, mesh, dim % (hi + 1), spmd)
        spec = make_spec(path, local, dim, axis=axes.shard, world=world, model=model, requires_grad=p.requires_grad)
        # (CPU offload: sharded where the parameter is, then kept on the host, pinned if asked: FSDP2's placement)
        full = local.detach() if local.is_meta or offload["offload_to_cpu"] else local.detach().to(device)
        padded = spec.local_shard(full, rank)
        if offload["offload_to_cpu"] and not padded.is_meta:
            padded = to_host(padded, offload["pin_memory"])
        records.append(_Param(padded, spec, spec.local_valid(rank), mesh, p.requires_grad))
    # nothing above changed the modules; from here on, register
    unit = _Unit(modules, mesh, records, reshard_after_forward)
    unit.tied = [(records[i], owner) for i, owner in tied]
    unit.mp_policy = mp_policy
    unit.offload_to_cpu, unit.pin_memory = offload["offload_to_cpu"], offload["pin_memory"]
    for (_, p), r in zip(params, records):
        setattr(p, _OWNER, unit)
        setattr(r.param, _OWNER, unit)
        for m in managed:
            for attr, q in param_slots(m).items():
                if q is p:
                    param_slots(m)[attr] = r.param
                    r.slots.append((m, attr))
    for m in managed:
        for k, b in buffer_slots(m).items():
            if b is not None and b.device != device and not b.is_meta:
                buffer_slots(m)[k] = b.to(device)
    for u in nested:
        u.parent = unit
        if u.ctx is not None:
            u.ctx.stale = True
    for m in modules:
        m.__dict__[UNIT] = unit
        m.register_forward_pre_hook(functools.partial(_pre_forward, unit), prepend=True, with_kwargs=True)
        m.register_forward_hook(functools.partial(_post_forward, unit))
        m.register_state_dict_pre_hook(_reshard_hook)
        m.register_load_state_dict_pre_hook(_reshard_hook)
        m.register_load_state_dict_post_hook(lambda mod, keys: _resync(unit_of(mod)))
        m.__class__ = fsdp_class(type(m), FSDPModule, {"__deepcopy__": _no_deepcopy})
        mark_composable(m, "fully_shard")  # (torch's replicate refuses the module and leaves its parameters to us)
    return module


class FullyShardError(ValueError, AssertionError):
    """Bad input to ``fully_shard`` where FSDP2 raises an AssertionError (a second call on one module, a shard dim
    the parameter lacks, a 2-D mesh without axis names): a ValueError, and the AssertionError code written for FSDP2
    catches."""


def _state(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``: the state of the ``fully_shard`` call that manages ``module`` (None if none)."""
    unit = module.__dict__.get(UNIT)
    return None if unit is None else state_of(unit)


fully_shard.state = _state  # as FSDP2's fully_shard (a torch ``contract``) has it


def _collect(modules: tuple[nn.Module, ...], ignored: set) -> tuple[list, list, list, list]:
    """The modules one call manages (not those under an earlier, nested call, nor those torch's ``replicate`` manages,
    as in FSDP2), the nested units, the parameters to shard as (path, parameter), and those of them another,
    unrelated call manages too (tied parameters) as (index, that call's unit); raises on parameters an ancestor's call
    manages, on a module ``replicate`` manages, and on parameters FSDP2 cannot shard (scalar, non-contiguous)."""
    managed: list[nn.Module] = []
    nested: list[_Unit] = []
    seen: set[int] = set()
    call = "fully_shard(" + ", ".join(cls_name(m) for m in modules) + ")"
    for m in modules:
        if "replicate" in composable_apis(m):
            raise RuntimeError(f"Cannot apply `fully_shard()` on a Module already managed by `replicate`: {call}; "
                               f"replicate already synchronizes its parameters. Apply fully_shard to its parent "
                               f"instead (its parameters stay replicate's) or to a module replicate was not applied to")

    def visit(m: nn.Module) -> None:
        seen.add(id(m))
        for c in m.children():
            if (u := c.__dict__.get(UNIT)) is not None and c not in modules:
                nested.extend([u] if u not in nested else [])
            elif id(c) not in seen and "replicate" not in composable_apis(c):  # (replicate's modules stay its own)
                visit(c)
        managed.append(m)

    for m in modules:
        visit(m)
    prefix = {id(x): f"{n}." if n else "" for m in reversed(modules) for n, x in m.named_modules()}
    params, seen, tied = [], set(), []
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
                tied.append((len(params), owner))  # (refused at lazy initialization, as FSDP2 does: _check_tied)
            if p.dim() == 0:
                raise ValueError(f"fully_shard doesn't support scalar parameters. Change {path} to a 1D tensor "
                                 f"with numel equal to 1.")
            if not p.is_contiguous():  # (FSDP2's rule: the DTensor parameter could not keep the strides of p)
                raise NotImplementedError(
                    f"FSDP does not support non-contiguous parameters yet: {call}: {path!r} has shape "
                    f"{tuple(p.shape)} and stride {p.stride()}; make it contiguous before fully_shard, e.g. "
                    f"module.to(memory_format=torch.contiguous_format) for a channels_last weight")
            seen.add(id(p))
            params.append((path, p))
    return managed, nested, params, tied


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run like ``forward``: gather before, reshard after. A no-op on a module
    ``fully_shard`` was not applied to.

    Args:
        module: a module ``fully_shard`` was applied to (any other: nothing happens).
        method_name: the name of the method to wrap (e.g. ``"generate"``).
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig, unit = getattr(module, method_name), unit_of(module)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        moved = _pre_forward(unit, self, args, kwargs)
        args, kwargs = moved if moved is not None else (args, kwargs)
        return _post_forward(unit, self, args, orig(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """FSDP2's ``share_comm_ctx``: several FSDP roots (pipeline stages, each its own root) share their communication
    streams, so their collectives' buffers do not fragment memory across streams. funcshard's collectives run on the
    process group's own streams (NCCL's, one set per communicator; gloo has none) and its host copies on one stream
    per device, not on streams of each root, so roots over one mesh share them already; this checks ``modules`` as
    FSDP2 does.

    Args:
        modules: the FSDP root modules (a list of ``FSDPModule``).
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
