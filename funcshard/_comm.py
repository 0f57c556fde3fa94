"""A group's collectives, replaced: FSDP2's custom comms and funcshard's functional comm hooks.

Two kinds of callables run a group's all-gather or reduce-scatter in place of ``torch.distributed``'s:

- FSDP2's ``Comm`` protocols (torch 2.9+ ``AllGather`` / ``ReduceScatter``, ``fully_shard``'s
  ``set_custom_all_gather`` / ``set_custom_reduce_scatter``): an object with ``allocate(size, *, dtype, device)``,
  which makes the communication buffers, and an in-place ``__call__(output_tensor, input_tensor, group,
  [op,] async_op)`` returning a ``Work`` (or None when it completed). The buffers are FSDP2's: the all-gather's output
  ``(world * n,)`` (its input the rank's slice of it), the reduce-scatter's input ``(world * n,)`` and output
  ``(n,)``, one of each per group and dtype. funcshard always reduce-scatters with ``op=SUM`` and divides once after.
- funcshard's functional hooks (``CommHook``, ``funcshard.plan(..., comm=...)`` or ``plan.with_group(name,
  comm=...)``): plain functions that return the result, ``all_gather(shard, group) -> full`` (``(n,)`` ->
  ``(world * n,)``, this rank's elements at ``rank * n``) and ``reduce_scatter(full, group) -> shard`` (the sum over
  ranks of ``full``'s ``rank``-th slice), in the buffer's dtype; ``nbytes(kind, n, dtype, world)`` says how many bytes
  of the unsharded buffer the hook moves (a quantized all-gather moves fewer), which the plan prints and the cost
  model counts. A functional hook runs synchronously (its result is the collective's).

A hook whose result has the wrong shape or dtype raises a ``ShardingError`` naming the group and the hook.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from funcshard._collectives import all_gather_into, group_label, reduce_scatter_into
from funcshard._spec import ShardingError

__all__ = ["CommHook", "GroupAllocated", "bf16_reduce_scatter", "group_allocated", "check_comm", "check_extension", "custom_comm", "hook_nbytes", "int8_all_gather",
           "plain", "wire_nbytes"]

ALL_GATHER, REDUCE_SCATTER = "all-gather", "reduce-scatter"


@dataclasses.dataclass(frozen=True)
class CommHook:
    """One group's all-gather and/or reduce-scatter, replaced (None: ``torch.distributed``'s).

    Attributes:
        all_gather: ``fn(shard, group) -> full``: this rank's flat bucket ``(n,)`` -> every rank's, concatenated
            ``(world * n,)``, same dtype; or an FSDP2 ``AllGather`` object (``allocate`` + in-place ``__call__``).
        reduce_scatter: ``fn(full, group) -> shard``: the flat gradient bucket ``(world * n,)`` -> the sum over ranks
            of this rank's slice ``(n,)``, same dtype; or an FSDP2 ``ReduceScatter`` object.
        nbytes: ``nbytes(kind, n, dtype, world) -> int``: the bytes of the unsharded buffer the hook moves for a
            bucket of ``n`` elements per rank (``kind``: ``"all-gather"`` or ``"reduce-scatter"``); None: the
            buffer's own (``world * n * dtype.itemsize``). What ``str(plan)`` and ``funcshard.cost`` count.
        name: how the plan prints it (default: the functions' names).

    A functional hook's result is taken over by funcshard, which frees its storage when the group reshards (the
    all-gather's) or once it is added to the gradient (the reduce-scatter's): return a fresh tensor, not a buffer the
    hook keeps for the next call (a view of the hook's input is copied). At world size 1 no collective runs, so hooks
    are not called (``int8_all_gather`` quantizes nothing there). A state of tensor subclasses (the all-gather
    extension) loads back as those subclasses (``funcshard.checkpoint.load``).
    """

    all_gather: Any = None
    reduce_scatter: Any = None
    nbytes: Callable[[str, int, torch.dtype, int], int] | None = None
    name: str | None = None

    def __str__(self) -> str:
        if self.name:
            return self.name
        parts = [f"{k}={_fn_name(f)}" for k, f in (("all_gather", self.all_gather),
                                                    ("reduce_scatter", self.reduce_scatter)) if f is not None]
        return "CommHook(" + ", ".join(parts) + ")"

    def fn(self, kind: str):
        """The hook for one kind of collective, or None where it runs plain.

        Args:
            kind: ``"all_gather"`` or ``"reduce_scatter"``.
        """
        return self.all_gather if kind == ALL_GATHER else self.reduce_scatter if kind == REDUCE_SCATTER else None


def _fn_name(f: Any) -> str:
    return getattr(f, "__qualname__", None) or type(f).__name__


def _inplace(f: Any) -> bool:
    """An FSDP2 ``Comm`` object (allocates its buffers, writes the output in place), not a functional hook."""
    return callable(getattr(f, "allocate", None))


def check_comm(comm: Any, where: str) -> CommHook | None:
    """A plan's or group's ``comm``: None, or a ``CommHook`` whose fields are callables."""
    if comm is None:
        return None
    if not isinstance(comm, CommHook):
        raise ShardingError(f"{where}: comm={comm!r} is not a funcshard.CommHook; pass e.g. "
                            f"funcshard.CommHook(all_gather=fn) (fn(shard, group) -> full), or None")
    for field in ("all_gather", "reduce_scatter", "nbytes"):
        f = getattr(comm, field)
        if f is not None and not callable(f):
            raise ShardingError(f"{where}: CommHook.{field}={f!r} is not callable")
    return comm


def custom_comm(current: CommHook | None, where: str, **change: Any) -> CommHook:
    """``fully_shard``'s ``set_custom_all_gather`` / ``set_custom_reduce_scatter``: the unit's hook with one of its
    collectives replaced by an FSDP2 ``Comm`` object (checked: ``allocate`` and ``__call__``)."""
    (field, comm), = change.items()
    if not _inplace(comm) or not callable(comm):
        proto = "AllGather" if field == "all_gather" else "ReduceScatter"
        raise TypeError(f"{where}: set_custom_{field}({type(comm).__name__}): expects an object with FSDP2's "
                        f"{proto} protocol (torch.distributed.fsdp._fully_shard._fsdp_api.{proto}): "
                        f"allocate(size, *, dtype, device) -> Tensor and an in-place __call__(output_tensor, "
                        f"input_tensor, group, ...) -> Work | None")
    return dataclasses.replace(current or CommHook(), **change)


class GroupAllocated:
    """FSDP2's ``ProcessGroupAllocAllGather`` / ``ProcessGroupAllocReduceScatter`` (``fully_shard``'s
    ``set_allocate_memory_from_process_group_for_comm``): an FSDP2 comm whose buffers come from the process group's
    backend (``allocate_tensor``: NCCL's allocator, registered with the communicator), running ``torch.distributed``'s
    collective. Made only for a backend that allocates (``_compat.group_allocator``)."""

    def __init__(self, kind: str, backend: Any):
        self.kind, self.backend = kind, backend

    def __repr__(self) -> str:
        return f"process-group-allocated {self.kind}"

    def allocate(self, size, *, dtype: torch.dtype, device) -> torch.Tensor:
        numel = 1
        for s in size:
            numel *= int(s)
        return self.backend.allocate_tensor(numel, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op: Any = None,
                 async_op: bool = True):
        if self.kind == ALL_GATHER:
            return all_gather_into(output_tensor, input_tensor, group, async_op)
        return reduce_scatter_into(output_tensor, input_tensor, group, async_op)  # (SUM: funcshard's only op)


def group_allocated(backend: Any) -> CommHook:
    """The comm hook of a group whose buffers the process group's backend allocates (``GroupAllocated``)."""
    return CommHook(all_gather=GroupAllocated(ALL_GATHER, backend),
                    reduce_scatter=GroupAllocated(REDUCE_SCATTER, backend))


def hooked(comm: CommHook | None, kind: str, world: int | None = None) -> bool:
    """Whether a group's ``kind`` collective runs its hook (``CommHook.all_gather`` / ``reduce_scatter``) rather than
    ``torch.distributed``'s: the group has one for ``kind`` and, ``world`` given, there are peers (over a single rank
    no collective runs, so no hook is called). The one rule: the pipeline, the extension and the byte counts ask it."""
    return comm is not None and comm.fn(kind) is not None and (world is None or world > 1)


def hook_nbytes(comm: CommHook | None, kind: str, numel: int, dtype: torch.dtype, world: int) -> int:
    """Bytes of a collective's unsharded buffer as the group's hook moves it (``numel`` elements per rank)."""
    plain = numel * world * dtype.itemsize
    if not hooked(comm, kind) or comm.nbytes is None:
        return plain
    return int(comm.nbytes(kind, numel, dtype, world))


def wire_nbytes(plan, c) -> int:
    """A schedule's ``Collective`` as its group's hook moves it: the hook's bytes (``CommHook.nbytes``), else the
    unsharded buffer's (``Collective.nbytes``). The one rule ``str(plan)`` and ``funcshard.cost`` count with."""
    comm = plan.group(c.group).comm
    if not hooked(comm, c.kind):
        return c.nbytes
    return hook_nbytes(comm, c.kind, c.numel, c.dtype, c.world)


# ---- the runtime's calls ---------------------------------------------------------------------------------


def allocates(comm: CommHook | None, kind: str) -> bool:
    """Whether the group's ``kind`` collective runs on an FSDP2 comm, whose ``allocate`` makes its buffers."""
    f = None if comm is None else comm.fn(kind)
    return f is not None and _inplace(f)


def allocate(comm: CommHook | None, kind: str, numel: int, dtype: torch.dtype, device, zero: bool = False
             ) -> torch.Tensor:
    """A communication buffer: the FSDP2 comm's ``allocate`` where the group has one for ``kind``, else the
    caching allocator's."""
    if allocates(comm, kind):
        t = comm.fn(kind).allocate((numel,), dtype=dtype, device=device)
        return t.zero_() if zero else t
    return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)


def run(comm: CommHook, kind: str, out: torch.Tensor, inp: torch.Tensor, group, name: str
        ) -> tuple[Any, torch.Tensor]:
    """Issue the group's hooked collective: ``(work or None, the output)``. An FSDP2 comm writes ``out`` in place
    (asynchronously where it returns a Work); a functional hook returns its result, checked against ``out``."""
    f = comm.fn(kind)
    if _inplace(f):
        if kind == ALL_GATHER:
            work = f(output_tensor=out, input_tensor=inp, group=group, async_op=True)
        else:
            work = f(output_tensor=out, input_tensor=inp, group=group, op=dist.ReduceOp.SUM, async_op=True)
        return work, out
    got = f(inp, group)
    if not isinstance(got, torch.Tensor) or got.shape != out.shape or got.dtype != out.dtype:
        shown = (f"shape {tuple(got.shape)}, dtype {got.dtype}" if isinstance(got, torch.Tensor)
                 else f"a {type(got).__name__}")
        raise ShardingError(
            f"the {kind} hook {_fn_name(f)} of group {group_label(name)} returned {shown}; it must return shape "
            f"{tuple(out.shape)}, dtype {out.dtype} (" + (
                "every rank's bucket concatenated, this rank's at rank * n" if kind == ALL_GATHER else
                "this rank's slice of the sum over ranks") + "): fix the hook, or leave "
            f"CommHook.{'all_gather' if kind == ALL_GATHER else 'reduce_scatter'}=None for torch.distributed's")
    if got.device != out.device:
        got = got.to(out.device)
    elif got.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():  # a view of the input (e.g. this
        got = got.clone()  # rank's slice of an all-reduced input): funcshard frees the input after the hook
    return None, got


# ---- two hooks to start from ---------------------------------------------------------------------------------------


def int8_all_gather(block: int = 256) -> CommHook:
    """A quantized all-gather (ZeRO++'s qwZ): each rank's bucket goes over the wire as int8 with one fp32 scale per
    ``block`` elements (absmax / 127), one collective of bytes, and is dequantized on arrival (this rank's own
    elements too, so every rank computes with the same parameters). Lossy: the forward and backward see the
    dequantized parameters; gradients and the optimizer keep full precision. Floating buckets only (others: plain).

    Args:
        block: elements per fp32 scale (an int >= 1; smaller: more precise, more bytes).

    Returns:
        A :class:`CommHook` replacing the all-gather (give it to a group's ``comm``).
    """
    if not isinstance(block, int) or block < 1:
        raise ShardingError(f"int8_all_gather: block={block!r} must be an int >= 1 (elements per fp32 scale)")

    def blocks(n: int) -> int:
        return -(-n // block)

    def all_gather(shard: torch.Tensor, group) -> torch.Tensor:

        n, world = shard.numel(), dist.get_world_size(group)
        if not shard.dtype.is_floating_point:
            out = shard.new_empty(world * n)
            all_gather_into(out, shard, group, async_op=False)
            return out
        nb = blocks(n)
        x = torch.nn.functional.pad(shard.float(), (0, nb * block - n)).view(nb, block)
        scale = x.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
        q = torch.round(x / scale).to(torch.int8)
        packed = torch.cat([q.view(-1).view(torch.uint8), scale.view(-1).view(torch.uint8)])
        out = packed.new_empty(world * packed.numel())
        all_gather_into(out, packed, group, async_op=False)
        out = out.view(world, -1)
        q = out[:, : nb * block].contiguous().view(torch.int8).view(world, nb, block)
        scale = out[:, nb * block :].contiguous().view(torch.float32).view(world, nb, 1)
        return (q.float() * scale).view(world, -1)[:, :n].to(shard.dtype).reshape(-1)

    def nbytes(kind: str, n: int, dtype: torch.dtype, world: int) -> int:
        if not dtype.is_floating_point:
            return world * n * dtype.itemsize
        return world * (blocks(n) * block + 4 * blocks(n))

    return CommHook(all_gather=all_gather, nbytes=nbytes, name=f"int8_all_gather(block={block})")


def bf16_reduce_scatter() -> CommHook:
    """A compressed reduce-scatter: fp32 gradients summed in bfloat16 on the wire (half the bytes), the result cast
    back to fp32 before the divide. Other dtypes: plain."""

    def reduce_scatter(full: torch.Tensor, group) -> torch.Tensor:

        world = dist.get_world_size(group)
        wire = full.to(torch.bfloat16) if full.dtype == torch.float32 else full
        out = wire.new_empty(full.numel() // world)
        reduce_scatter_into(out, wire, group, async_op=False)
        return out.to(full.dtype)

    def nbytes(kind: str, n: int, dtype: torch.dtype, world: int) -> int:
        return world * n * (2 if dtype == torch.float32 else dtype.itemsize)

    return CommHook(reduce_scatter=reduce_scatter, nbytes=nbytes, name="bf16_reduce_scatter()")


# ---- the tensor-subclass all-gather extension (FSDP2's fsdp_pre_all_gather / fsdp_post_all_gather) ---------------


def _wrapper_subclass(t: torch.Tensor) -> bool:
    """A traceable wrapper subclass (``__tensor_flatten__``, e.g. torchao's float8 weights), not a DTensor."""
    cls = type(t)
    return cls not in _PLAIN and hasattr(cls, "__tensor_flatten__") and not isinstance(t, DTensor)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


EXTENSION = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def patched(t: torch.Tensor) -> bool:
    """Whether a plain tensor carries the all-gather extension's methods on the object itself (FSDP2 reads them from
    the instance: monkey-patched). (Attribute lookups: reading ``t.__dict__`` would make one dict per tensor per step.)"""
    return hasattr(t, EXTENSION[0]) or hasattr(t, EXTENSION[1])


def plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor (or parameter), not a tensor subclass."""
    return type(t) in _PLAIN


def storage_ptr(t: torch.Tensor) -> int:
    """The data pointer of a tensor's storage; a wrapper subclass's: its first inner tensor's (it has none)."""
    while _wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t.untyped_storage().data_ptr()


def check_extension(t: torch.Tensor, group: str, param: str) -> bool:
    """Whether the tensor's class has the all-gather extension; raises for a class with one of the two methods, or
    a wrapper subclass with neither (its all-gather would move its plain data and hand the module a plain tensor,
    silently). ``plan`` asks it of every parameter, the runtime of every shard it gathers."""
    if type(t) in _PLAIN and not patched(t):
        return False
    pre, post = (hasattr(t, n) for n in EXTENSION)
    where = f"group {group_label(group)}, parameter {param!r}"
    if pre != post:
        have, lack = ("pre", "post") if pre else ("post", "pre")
        raise ShardingError(f"{where}: its {type(t).__name__} defines fsdp_{have}_all_gather but not "
                            f"fsdp_{lack}_all_gather; the all-gather extension needs both (FSDP2's protocol: "
                            f"fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy) -> (inputs, "
                            f"metadata), fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None))")
    if not pre and _wrapper_subclass(t):
        raise ShardingError(f"{where}: a tensor subclass ({type(t).__name__}) without fsdp_pre_all_gather / "
                            f"fsdp_post_all_gather: funcshard would all-gather its plain data and hand the module "
                            f"a plain tensor. Define both methods on {type(t).__name__} (what torchao's float8 "
                            f"weights do), or shard a plain tensor")
    return pre
