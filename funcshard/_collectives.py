"""Differentiable collectives, and the bucketed per-group all-gather / reduce-scatter the runtime uses.

all_gather and reduce_scatter are each other's transpose: the backward of all_gather is a reduce-scatter
with a *sum* (the mathematical transpose), and vice versa; all_reduce (sum) is its own transpose. None of
them averages: data-parallel averaging is one explicit divide, applied by the runtime after the gradient
reduce-scatter (``Plan.divide_factor``), never inside these functions.

Asynchrony: every collective is issued with ``async_op=True`` and its work handle is waited before the
result is read. On CUDA with NCCL the collective runs on the process group's own communication stream and
``Work.wait()`` makes the consuming stream wait on it (an event fence, the CPU does not block); on CPU with
gloo, the collective runs on gloo's threads while Python continues, and ``wait()`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor

from funcshard._spec import ShardSpec

__all__ = ["all_gather", "reduce_scatter", "all_reduce"]

# torch 2.13 renamed the tensor collectives; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    return _all_gather_single(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    return _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any functorch wrappers, detached (shares storage)."""
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t.detach()


def no_functorch():
    """In-place and communication work inside a backward under a functorch transform runs with functorch off."""
    return torch._C._DisableFuncTorch()


def _group_of(where) -> dist.ProcessGroup:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(where, DeviceMesh):
        return where.get_group(where.ndim - 1)
    return where if where is not None else dist.group.WORLD


# ---- differentiable collectives (dim 0; under autograd and torch.func) --------------------------


def _ag(x: torch.Tensor, group) -> torch.Tensor:
    w = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((w * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x, group).wait()
    return out


def _rs(x: torch.Tensor, group) -> torch.Tensor:
    w = dist.get_world_size(group)
    if x.shape[0] % w:
        raise ValueError(
            f"reduce_scatter needs dim 0 divisible by the group size {w}, got shape {tuple(x.shape)}; pad it"
        )
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // w, *x.shape[1:]))
    reduce_scatter_into(out, x, group).wait()
    return out


def _ar(x: torch.Tensor, group) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=True).wait()
    return out


def _batched(fn, x, bdim, group):
    """vmap rule: move the batch dim to 1 so dim 0 stays the collective's dim."""
    if bdim is None:
        return fn(x, group), None
    x = x.movedim(bdim, 1) if x.dim() > 1 else x.movedim(bdim, 0).unsqueeze(0)
    return fn(x, group), 1


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        with no_functorch():
            return _ag(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        with no_functorch():
            return _rs(g, ctx.group), None

    @staticmethod
    def jvp(ctx, t, _):
        return _AllGather.apply(t, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _batched(_AllGather.apply, x, in_dims[0], group)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        with no_functorch():
            return _rs(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        with no_functorch():
            return _ag(g, ctx.group), None

    @staticmethod
    def jvp(ctx, t, _):
        return _ReduceScatter.apply(t, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _batched(_ReduceScatter.apply, x, in_dims[0], group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        with no_functorch():
            return _ar(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        with no_functorch():
            return _ar(g, ctx.group), None

    @staticmethod
    def jvp(ctx, t, _):
        return _AllReduce.apply(t, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _AllReduce.apply(x, group), in_dims[0]


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0. Backward: reduce-scatter (sum). ``group``: a
    ProcessGroup, a DeviceMesh (its last axis) or None (the default group)."""
    return _AllGather.apply(x, _group_of(group))


def reduce_scatter(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks and give each rank its dim-0 slice. Backward: all-gather."""
    return _ReduceScatter.apply(x, _group_of(group))


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks. Backward: all-reduce (sum) of the cotangent."""
    return _AllReduce.apply(x, _group_of(group))


# ---- bucketed per-group collectives (one collective per group and dtype) ------------------------


def _free(buffers) -> None:
    """Release communication buffers whose collective has completed."""
    for b in buffers:
        b.untyped_storage().resize_(0)


class Buckets:
    """The layout of one group's shards: one flat bucket per dtype, parameters at fixed offsets."""

    def __init__(self, specs: Sequence[ShardSpec]):
        self.specs = tuple(specs)
        self.world = specs[0].world if specs else 1
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, s in enumerate(self.specs):
            by_dtype.setdefault(s.dtype, []).append(i)
        self.buckets = tuple((dt, tuple(ix)) for dt, ix in by_dtype.items())
        self.numels = {dt: [self.specs[i].local_numel for i in ix] for dt, ix in self.buckets}
        self.has_padding = {dt: any(self.specs[i].padding for i in ix) for dt, ix in self.buckets}


class PendingGather:
    """All-gathers in flight for one group; ``finish(targets)`` waits and copies out into the padded tensors
    (allocated by the caller only then, so a prefetched group holds just its all-gather buffer)."""

    def __init__(self, layout: Buckets, outs, works):
        self.layout, self.outs, self.works = layout, outs, works

    def finish(self, targets: Sequence[torch.Tensor]) -> None:
        lay = self.layout
        dsts, srcs = [], []
        for (dt, ix), out, work in zip(lay.buckets, self.outs, self.works):
            work.wait()
            chunks = out.view(lay.world, -1).split(lay.numels[dt], dim=1)
            for i, c in zip(ix, chunks):
                spec = lay.specs[i]
                dsts.append(spec.split_view(targets[i]))
                srcs.append(c.view(lay.world, *spec.local_shape))
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
        _free(self.outs)  # now, not when the process group's work objects let go of them
        self.outs = self.works = None


def start_gather(layout: Buckets, shards: Sequence[torch.Tensor], group, rank: int) -> PendingGather:
    """Copy the group's local shards into one flat buffer per dtype (one copy each) and issue the
    all-gathers (async)."""
    outs, works = [], []
    with torch.no_grad():
        for dt, ix in layout.buckets:
            n = sum(layout.numels[dt])
            out = torch.empty(layout.world * n, dtype=dt, device=shards[ix[0]].device)
            inp = out.narrow(0, rank * n, n)
            torch.cat([shards[i].reshape(-1) for i in ix], out=inp)
            outs.append(out)
            works.append(all_gather_into(out, inp, group))
    return PendingGather(layout, outs, works)


def gather_tangents(layout: Buckets, tangents: Sequence[torch.Tensor | None], group, rank: int):
    """All-gather a group's shard tangents (or shards) into new full tensors: the forward-mode rule."""
    with no_functorch(), torch.no_grad():
        device = next(t.device for t in tangents if t is not None)
        shards = [torch.zeros(s.local_shape, dtype=s.dtype, device=device) if t is None else raw(t)
                  for s, t in zip(layout.specs, tangents)]
        targets = [torch.empty(s.padded_shape, dtype=s.dtype, device=x.device) for s, x in zip(layout.specs, shards)]
        start_gather(layout, shards, group, rank).finish(targets)
    return tuple(s.unpad(t) for s, t in zip(layout.specs, targets))


def reduce_scatter_grads(
    layout: Buckets, grads: Sequence[torch.Tensor | None], group, divide: float, device: torch.device
) -> list[torch.Tensor]:
    """Reduce-scatter (sum) a group's full gradients, one collective per dtype, divide once by ``divide``,
    and return each parameter's local gradient shard (views into one flat buffer per dtype)."""
    result: list[torch.Tensor | None] = [None] * len(layout.specs)
    pending = []
    with torch.no_grad():
        for dt, ix in layout.buckets:
            if not (dt.is_floating_point or dt.is_complex):
                continue  # integer parameters have no gradient
            n = sum(layout.numels[dt])
            alloc = torch.zeros if layout.has_padding[dt] else torch.empty
            inp = alloc((layout.world, n), dtype=dt, device=device)
            chunks = inp.split(layout.numels[dt], dim=1)
            dsts, srcs = [], []
            for i, c in zip(ix, chunks):
                spec, g = layout.specs[i], grads[i]
                dst = c.view(layout.world, *spec.local_shape)
                if g is None:
                    if alloc is torch.empty:
                        dst.zero_()
                    continue
                g = g.reshape(spec.sharded_shape)
                full_rows = spec.size // spec.chunk if spec.chunk else 0
                if full_rows:  # ranks whose shard is all real data
                    d = spec.dim
                    shp = list(spec.sharded_shape)
                    shp[d : d + 1] = [full_rows, spec.chunk]
                    dsts.append(dst.narrow(0, 0, full_rows))
                    srcs.append(g.narrow(d, 0, full_rows * spec.chunk).reshape(shp).movedim(d, 0))
                rem = spec.size - full_rows * spec.chunk
                if rem:  # the one rank whose shard is partly padding
                    dsts.append(dst.select(0, full_rows).narrow(spec.dim, 0, rem))
                    srcs.append(g.narrow(spec.dim, full_rows * spec.chunk, rem))
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            out = torch.empty(n, dtype=dt, device=device)
            pending.append((dt, ix, inp, out, reduce_scatter_into(out, inp.view(-1), group)))
        for dt, ix, inp, out, work in pending:
            work.wait()
            _free([inp])
            if divide != 1.0:
                out.div_(divide)
            for i, piece in zip(ix, out.split(layout.numels[dt])):
                result[i] = piece.view(layout.specs[i].local_shape)
    return result  # type: ignore[return-value]
