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

from funcshard._spec import ShardingError

__all__ = ["CommHook", "check_comm", "hook_nbytes", "custom_comm"]

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
        return self.all_gather if kind == ALL_GATHER else self.reduce_scatter


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


def hook_nbytes(comm: CommHook | None, kind: str, numel: int, dtype: torch.dtype, world: int) -> int:
    """Bytes of a collective's unsharded buffer as the group's hook moves it (``numel`` elements per rank)."""
    plain = numel * world * dtype.itemsize
    if comm is None or comm.nbytes is None or comm.fn(kind) is None:
        return plain
    return int(comm.nbytes(kind, numel, dtype, world))


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
            f"the {kind} hook {_fn_name(f)} of group {_label(name)} returned {shown}; it must return shape "
            f"{tuple(out.shape)}, dtype {out.dtype} (" + (
                "every rank's bucket concatenated, this rank's at rank * n" if kind == ALL_GATHER else
                "this rank's slice of the sum over ranks") + "): fix the hook, or leave "
            f"CommHook.{'all_gather' if kind == ALL_GATHER else 'reduce_scatter'}=None for torch.distributed's")
    if got.device != out.device:
        got = got.to(out.device)
    return None, got


def _label(name: str | None) -> str:
    return "'' (the root group)" if name == "" else repr(name) if name is not None else "(unnamed)"
