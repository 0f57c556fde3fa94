"""A group's bucketed collectives: one flat bucket per dtype (``Buckets``), the one all-gather pipeline (copy-in and
issue: ``issue_all_gather``; wait and copy-out: ``PendingGather``), fed a group's shards (``start_gather``), its
post-forward shards over a block of ``k`` ranks (``start_regather``) or the extension's inputs, and the
gradient reduce-scatter (``start_reduce_scatter`` / ``PendingReduce``: copy-in, issue, the HSDP all-reduce, the one
divide, the cast back). Every wait is ``_collectives.wait_work``; a communication buffer is freed only after its work
is waited.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from funcshard import _comm
from funcshard._collectives import (
    Where,
    all_gather_into,
    free_buffers,
    no_functorch,
    no_grad,
    raw,
    reduce_scatter_into,
    wait_work,
)
from funcshard._comm import CommHook
from funcshard._compat import chunk_cat, foreach_copy_, unflatten_dense_tensors
from funcshard._policy import compute_dtype, divide_factors, reduce_dtype_of
from funcshard._schedule import bucket_sizes
from funcshard._spec import ShardSpec, differentiable


class Buckets:
    """The layout of one group's shards: one flat bucket per dtype, parameters at fixed offsets.

    Per-parameter layout: a bucket is the concatenation of the parameters' (equal-size) local shards; its
    all-gather output ``(world, n)`` is copied out into each parameter's padded tensor ("targets").
    Flat layout: a bucket is the group's flat buffer; the all-gather output is the parameters themselves.
    """

    def __init__(self, specs: Sequence[ShardSpec], only: Sequence[int] | None = None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None):
        self.specs = tuple(specs)
        self.world = specs[0].world if specs else 1
        self.flat = bool(specs) and specs[0].flat is not None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self._subsets: dict[tuple[int, ...], Buckets] = {}
        keep = None if only is None else set(only)
        # each parameter's compute dtype: what it is all-gathered and used in (its own, or param_dtype)
        self.compute = tuple(compute_dtype(s.dtype, param_dtype) for s in self.specs)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in range(len(self.specs)):
            if keep is None or i in keep:
                by_dtype.setdefault(self.compute[i], []).append(i)
        self.buckets = tuple((dt, tuple(ix)) for dt, ix in by_dtype.items())  # keyed by compute dtype
        self.numels = {dt: [self.specs[i].local_numel for i in ix] for dt, ix in self.buckets}
        self.dim0 = {dt: not self.flat and all(self.specs[i].dim == 0 for i in ix) for dt, ix in self.buckets}
        # per bucket, as PendingGather takes them: whether the copy-out is by rows, each input's elements per rank
        self.gather_rows = [self.dim0[dt] for dt, _ in self.buckets]
        self.gather_sizes = [self.numels[dt] for dt, _ in self.buckets]
        # elements per rank of each bucket's collective, and whether padding is among them (the schedule's sizes)
        sizes = bucket_sizes([self.specs[i] for _, ix in self.buckets for i in ix], param_dtype)
        self.chunk = {dt: n for dt, (n, _) in sizes.items()}
        self.has_padding = {dt: pad for dt, (_, pad) in sizes.items()}
        # the gradient's reduce-scatter dtype, and the shards' dtype it is cast back to (None: they differ within
        # the bucket, e.g. fp32 and bf16 parameters both computing in bf16: cast piece by piece)
        self.reduce = {dt: reduce_dtype_of(dt, reduce_dtype) for dt, _ in self.buckets}
        origs = {dt: {self.specs[i].dtype for i in ix} for dt, ix in self.buckets}
        self.shard_dtype = {dt: next(iter(o)) if len(o) == 1 else None for dt, o in origs.items()}
        # this rank's gradient shards, consecutive in the reduce-scatter output (flat layout: the parameters'
        # pieces of this rank's slice), as meta tensors for one-call views of it (torch's unflatten_dense_tensors;
        # a Python loop of views costs ~3 us a parameter)
        meta = torch.device("meta")
        self.shard_templates = {dt: [torch.empty(self.specs[i].local_shape, dtype=self.shard_dtype[dt] or
                                                 self.reduce[dt], device=meta) for i in ix]
                                for dt, ix in self.buckets}
        # a 0-dim parameter's gradient is viewed as (1,) for torch._chunk_cat
        self.scalar = {dt: any(not self.specs[i].shape for i in ix) for dt, ix in self.buckets}

    def only(self, index: tuple[int, ...]) -> Buckets:
        """The layout of the parameters at ``index`` alone (the rest are left out of its buckets; results are
        still indexed by position in ``specs``): a group's reduce-scatter covers only the parameters that take
        a gradient, as FSDP2's does, so a frozen parameter costs no traffic and no buffer. The flat layout keeps
        every parameter at its fixed offset: itself."""
        if self.flat or len(index) == len(self.specs):
            return self
        hit = self._subsets.get(index)
        if hit is None:
            hit = self._subsets[index] = Buckets(self.specs, only=index, param_dtype=self.param_dtype,
                                                 reduce_dtype=self.reduce_dtype)
        return hit

    def new_buffers(self, device) -> list[torch.Tensor]:
        """The raw unsharded storage: per-parameter padded tensors, or one flat buffer per dtype.

        Per-parameter layout: one storage per parameter, not one per group, so that an in-place edit of one
        unsharded parameter (e.g. a frozen one under no_grad in forward) leaves the version counters, and so
        the autograd views, of the group's other parameters alone."""
        if self.flat:
            return [torch.empty(self.world * self.chunk[dt], dtype=dt, device=device) for dt, _ in self.buckets]
        return [torch.empty(s.padded_shape, dtype=dt, device=device) for s, dt in zip(self.specs, self.compute)]

    def flat_shards(self, shards: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per bucket, the local shards as 1-D views: the copy-in's inputs (a caller gathering the same shards
        twice makes them once). Plain tensors (``unwrapped``), under no_grad: the views have no history."""
        return [[shards[i].reshape(-1) for i in ix] for _, ix in self.buckets]

    def copy_targets(self, padded: Sequence[torch.Tensor]) -> list[list[torch.Tensor] | None]:
        """Per bucket, where the copy-out writes: each padded parameter as ``(world, local numel)`` (every shard
        on dim 0) or ``(world, *local_shape)`` (``ShardSpec.split_view``); None in the flat layout (no
        copy-out). Made once per set of buffers: views stay valid when the storage is freed and refilled."""
        if self.flat:
            return [None] * len(self.buckets)
        return [[padded[i].view(self.world, -1) for i in ix] if self.dim0[dt]
                else [self.specs[i].split_view(padded[i]) for i in ix] for dt, ix in self.buckets]

    def views(self, buffers: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The unsharded parameters as views of the raw buffers."""
        if not self.flat:
            return tuple(s.unpad(t) for s, t in zip(self.specs, buffers))
        out: list[torch.Tensor | None] = [None] * len(self.specs)
        for (dt, ix), buf in zip(self.buckets, buffers):
            for i in ix:
                s = self.specs[i]
                out[i] = buf[s.flat.offset : s.flat.offset + s.numel].view(s.shape)
        return tuple(out)  # type: ignore[arg-type]


class PendingGather:
    """All-gathers in flight, one per bucket, from any of the pipeline's inputs (``issue_all_gather``): each output is
    ``ranks`` rank-major slices, each slice the bucket's inputs one after the other. ``finish(targets)`` waits and
    copies out: input ``i`` of a bucket, its ``(ranks, n_i)`` columns of the output, into ``targets[bucket][i]``,
    a ``(ranks, ...)`` view of where it goes (``Buckets.copy_targets``, ``regather_targets``; allocated by the caller
    only then, so a prefetched group holds just its all-gather buffer). ``in_place``: the outputs are the unsharded
    buffers (the flat layout's: nothing to copy, nothing freed). ``chunks`` hands a bucket's columns over instead (the
    extension's copy-out is its ``fsdp_post_all_gather``), ``release`` then frees."""

    def __init__(self, outs: list, works: list, rows: Sequence[bool], sizes: Sequence[Sequence[int] | None],
                 where: Where | None = None, comm_owned: bool = False, in_place: bool = False):
        self.outs, self.works, self.where = outs, works, where
        self.rows = rows  # per bucket: its targets are (ranks, n_i) rows (one torch.split_with_sizes_copy)
        self.sizes = sizes  # per bucket: each input's elements per rank (None: the targets' rows say)
        self.comm_owned = comm_owned  # the outputs are an FSDP2 comm's (its ``allocate``): dropped, never resized
        self.in_place = in_place  # the outputs are the unsharded buffers themselves (the flat layout's)

    def chunks(self, k: int, ranks: int, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Wait for bucket ``k``'s all-gather over ``ranks`` ranks; its output as each input's ``(ranks, size)``
        columns."""
        wait_work(self.works[k], self.where)
        return self.outs[k].view(ranks, -1).split(sizes, dim=1)

    def finish(self, targets: Sequence[Sequence[torch.Tensor] | None] | None) -> None:
        if self.in_place:
            for work in self.works:
                wait_work(work, self.where)
            self.outs = self.works = None
            return
        dsts, srcs = [], []
        with no_grad():
            for out, work, dst, rows, sizes in zip(self.outs, self.works, targets, self.rows, self.sizes):
                wait_work(work, self.where)
                view = out.view(dst[0].shape[0], -1)  # (ranks, their slice)
                if rows:  # every input's target is (ranks, n_i): one op
                    torch.split_with_sizes_copy(view, sizes or [d.shape[1] for d in dst], dim=1, out=dst)
                    continue
                for c, d in zip(view.split(sizes, dim=1), dst):
                    dsts.append(d)
                    srcs.append(c.view(d.shape))
            if dsts:
                foreach_copy_(dsts, srcs)
        self.release()

    def release(self) -> None:
        """Free the all-gather outputs (now, not when the process group's work objects let go of them)."""
        if not self.comm_owned and not self.in_place:
            free_buffers(self.outs)
        self.outs = self.works = None


def start_gather(
    layout: Buckets, flat_shards: Sequence[Sequence[torch.Tensor]], group, rank: int,
    outs: Sequence[torch.Tensor] | None = None, where: Where | None = None, comm: CommHook | None = None,
) -> PendingGather:
    """The pipeline fed a group's local shards (``Buckets.flat_shards``): one flat buffer per dtype (one copy each),
    the all-gathers issued (async). ``outs``: the flat layout's unsharded buffers to gather into (in place). ``where``:
    what ``finish`` names and bounds its waits by (``wait_work``). ``comm``: the group's hook (``_comm``; its FSDP2
    comm allocates the output)."""
    works, bufs, owned = [], [], False
    name = where and where.group
    with no_grad():
        for k, (dt, ix) in enumerate(layout.buckets):
            out, work, owned = issue_all_gather(flat_shards[k], layout.chunk[dt], dt, layout.world, rank, group,
                                                comm, name, out=None if outs is None else outs[k],
                                                valid=sum(layout.numels[dt]))
            bufs.append(out)
            works.append(work)
    return PendingGather(bufs, works, layout.gather_rows, layout.gather_sizes, where, owned, outs is not None)


def issue_all_gather(pieces: Sequence[torch.Tensor], n: int, dtype: torch.dtype, world: int, rank: int, group,
                     comm: CommHook | None, name: str | None, out: torch.Tensor | None = None,
                     valid: int | None = None) -> tuple[torch.Tensor, Any, bool]:
    """The one all-gather pipeline's copy-in and issue (plain shards, a group's post-forward shards over its block of
    ``k`` ranks, the extension's ``fsdp_pre_all_gather`` outputs: they differ only in the ``pieces`` they feed it).

    ``pieces`` (1-D, this rank's inputs in order, ``valid`` elements in all) are copied into this rank's slice of
    ``out`` (``n`` elements; the rest of the slice zeroed: padding), which is allocated here unless given (the group's
    FSDP2 comm's ``allocate`` when its hook runs); then the all-gather is issued (async): the group's hook where it
    runs one (``_comm.hooked``), else ``torch.distributed``'s, none over a single rank. ``name``: the group, for a
    hook's errors. Returns ``(out, work, comm_owned)``: the output (a functional hook's result, copied into a given
    ``out``), the work to wait (``wait_work``; None: complete) and whether ``out`` is the comm's (dropped, never
    freed: it may reuse it)."""
    hook = _comm.hooked(comm, _comm.ALL_GATHER, world)
    given = out is not None
    if not given:
        out = _comm.allocate(comm if hook else None, _comm.ALL_GATHER, world * n, dtype, pieces[0].device)
    inp = out.narrow(0, rank * n, n)
    if valid is None:
        valid = sum(p.numel() for p in pieces)
    torch.cat(pieces, out=inp.narrow(0, 0, valid) if valid < n else inp)
    if valid < n:
        inp.narrow(0, valid, n - valid).zero_()
    if hook:
        work, got = _comm.run(comm, _comm.ALL_GATHER, out, inp, group, name)
        if got is not out:  # a functional hook's result (a given buffer, the flat layout's: copied in)
            out = out.copy_(got) if given else got
    else:
        work = all_gather_into(out, inp, group) if world > 1 else None  # (1 rank: no collective)
    return out, work, hook and not given and _comm.allocates(comm, _comm.ALL_GATHER)


def bucket_buffers(layout: Buckets, bases: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per bucket, the unsharded buffers it fills: its parameters' padded tensors, or the flat layout's buffer."""
    if layout.flat:
        return [[b] for b in bases]
    return [[bases[i] for i in ix] for _, ix in layout.buckets]


def post_forward_shards(layout: Buckets, bases: Sequence[torch.Tensor], rank: int, k: int) -> list[torch.Tensor]:
    """Per bucket, what a rank keeps after forward when its group is resharded to ``k`` ranks (int
    ``reshard_after_forward``): the ``rank``-th of ``k`` equal slices of each of its unsharded buffers (padding
    included: ``k`` divides the shard count), concatenated, a copy (FSDP2's post-forward shard)."""
    with no_grad():
        return [torch.cat([t.view(k, -1)[rank] for t in ts]) for ts in bucket_buffers(layout, bases)]


def regather_targets(layout: Buckets, bases: Sequence[torch.Tensor], k: int) -> list[list[torch.Tensor]]:
    """Per bucket, where a gather from the post-forward shards copies out: each unsharded buffer as the ``k`` slices
    ``post_forward_shards`` cut, rank-major ``(k, n)``."""
    return [[t.view(k, -1) for t in ts] for ts in bucket_buffers(layout, bases)]


def start_regather(layout: Buckets, post: Sequence[torch.Tensor], group, rank: int, k: int,
                   where: Where | None = None, comm: CommHook | None = None) -> PendingGather:
    """The pipeline fed a group's post-forward shards, over its block of ``k`` ranks (with the group's all-gather
    hook, as FSDP2 runs its custom all-gather over the post-forward group too); ``finish(regather_targets(...))``."""
    outs, works, owned = [], [], False
    with no_grad():
        for p in post:
            out, work, owned = issue_all_gather([p], p.numel(), p.dtype, k, rank, group, comm, where and where.group)
            outs.append(out)
            works.append(work)
    return PendingGather(outs, works, [True] * len(outs), [None] * len(outs), where, owned)


def gather_tangents(layout: Buckets, tangents: Sequence[torch.Tensor | None], group, rank: int,
                    where: Where | None = None):
    """All-gather a group's shard tangents (or shards) into new full tensors: the forward-mode rule. ``where``: what
    the wait names and is bounded by (``wait_work``; checkpoint.export_full's)."""
    with no_functorch(), no_grad():
        device = next(t.device for t in tangents if t is not None)
        shards = [torch.zeros(s.local_shape, dtype=s.dtype, device=device) if t is None else raw(t)
                  for s, t in zip(layout.specs, tangents)]
        bases = layout.new_buffers(device)
        start_gather(layout, layout.flat_shards(shards), group, rank,
                     outs=bases if layout.flat else None, where=where).finish(layout.copy_targets(bases))
    return layout.views(bases)


def jvp_of_gather(layout: Buckets, tangents: Sequence[torch.Tensor | None], group, rank: int):
    """The forward-mode rule of a gather: the gather of the tangents, None for an integer parameter (its output
    is not differentiable)."""
    out = gather_tangents(layout, tangents, group, rank)
    return tuple(o if differentiable(s.dtype) else None for o, s in zip(out, layout.specs))


def _per_param_grad_copies(spec: ShardSpec, dst: torch.Tensor, g: torch.Tensor, dsts: list, srcs: list) -> None:
    """Copies that lay a full gradient out as ``dst`` ``(world, *local_shape)``; padding stays zero."""
    g = g.reshape(spec.sharded_shape)
    full_rows = spec.size // spec.chunk if spec.chunk else 0
    d = spec.dim
    if full_rows:  # ranks whose shard is all real data
        shp = list(spec.sharded_shape)
        shp[d : d + 1] = [full_rows, spec.chunk]
        dsts.append(dst.narrow(0, 0, full_rows))
        srcs.append(g.narrow(d, 0, full_rows * spec.chunk).reshape(shp).movedim(d, 0))
    rem = spec.size - full_rows * spec.chunk
    if rem:  # the one rank whose shard is partly padding
        dsts.append(dst.select(0, full_rows).narrow(d, 0, rem))
        srcs.append(g.narrow(d, full_rows * spec.chunk, rem))


def reduce_scatter_grads(
    layout: Buckets, grads: list[torch.Tensor | None], group, divide: float, device: torch.device
) -> list[torch.Tensor]:
    """Reduce-scatter (sum) a group's full gradients, one collective per dtype, divide once by ``divide``,
    and return each parameter's local gradient shard (views into one flat buffer per dtype).

    Consumes ``grads``: its entries are dropped once copied into the reduce-scatter input, before the output
    is allocated (as FSDP2 does), so that a caller holding no other reference frees the full gradients first."""
    return start_reduce_scatter(layout, grads, group, device, divide).finish()


class PendingReduce:
    """A group's reduce-scatters in flight; ``finish()`` waits, frees the inputs, all-reduces over the replicate
    group (HSDP), applies the rest of the divide factor ``start_reduce_scatter`` was given (the one divide, split as
    ``_policy.divide_factors`` says) and returns the local gradient shards."""

    comm_owned = False  # the inputs are an FSDP2 comm's: dropped, never resized

    def __init__(self, layout: Buckets, pending: list, replicate=None, where: Where | None = None):
        self.layout, self.pending, self.replicate, self.where = layout, pending, replicate, where

    def finish(self, *, all_reduce: bool = True, partial: dict | None = None,
               hook=None) -> list[torch.Tensor] | None:
        """HSDP (a replicate group): each output is all-reduced (sum) over it before the divide. ``partial``: sums a
        finish without all-reduce left (by dtype; taken and added first). ``all_reduce=False``: keep the sums in
        ``partial`` instead (no all-reduce, divide or shards: FSDP2's ``set_requires_all_reduce(False)``); returns
        None. ``hook(output)``: FSDP2's all-reduce hook, on each output in the reduce dtype after the all-reduce, when
        it holds what FSDP2's holds there (after the divide for fp32 and bf16, which FSDP2 divides inside the
        collectives; before the rest of it for fp16)."""
        layout = self.layout
        result: list[torch.Tensor | None] = [None] * len(layout.specs)
        pending, self.pending = self.pending, []
        reduced = []
        with no_grad():
            for dt, ix, inp, out, work, (before, after) in pending:
                if work is not None:
                    wait_work(work, self.where)  # (raises: nothing freed, the backend may still read the input)
                if inp is not out and not self.comm_owned:
                    free_buffers([inp])
                if partial is not None and (acc := partial.pop(dt, None)) is not None:
                    out.add_(acc)
                if self.replicate is not None and not all_reduce:
                    partial[dt] = out
                    continue
                ar = None
                if self.replicate is not None:
                    ar = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.replicate, async_op=True)
                reduced.append((dt, ix, out, ar, before, after))
            if self.replicate is not None and not all_reduce:
                return None
            for dt, ix, out, ar, before, after in reduced:
                if ar is not None:
                    wait_work(ar, self.where and self.where._replace(kind="all-reduce (HSDP)", pg=self.replicate))
                if hook is not None and before != 1.0:
                    hook(out)
                if after != 1.0:
                    out.div_(after)  # in the reduce dtype, before the cast back (FSDP2's order)
                if hook is not None and before == 1.0:
                    hook(out)
                shard_dtype = layout.shard_dtype[dt]
                if shard_dtype is not None and out.dtype != shard_dtype:
                    out = out.to(shard_dtype)
                # the shards are consecutive in the output (flat layout: the pieces of this rank's slice)
                pieces = unflatten_dense_tensors(out, layout.shard_templates[dt])
                if shard_dtype is None:  # shards of several dtypes in one bucket: each cast on its own
                    pieces = [p.to(layout.specs[i].dtype) for i, p in zip(ix, pieces)]
                for i, piece in zip(ix, pieces):
                    result[i] = piece
        return result  # type: ignore[return-value]


def start_reduce_scatter(
    layout: Buckets, grads: list[torch.Tensor | None], group, device: torch.device, divide: float = 1.0,
    replicate=None, where: Where | None = None, comm: CommHook | None = None,
) -> PendingReduce:
    """Copy a group's full gradients into one reduce-scatter input per dtype (cast to the reduce dtype by the copy)
    and issue the reduce-scatters (async; none over a single rank); consumes ``grads`` (see
    ``reduce_scatter_grads``). ``divide``: the factor ``finish`` will divide by; for a reduce dtype that risks
    overflow part of it is applied here, before the sum (``_policy.divide_factors``). ``replicate``: the process group
    ``finish`` all-reduces the outputs over (HSDP). ``comm``: the group's hook (``_comm``; its FSDP2 comm allocates the
    input and the output, and is called with ``op=SUM``)."""
    pending = []
    world = layout.world
    hooked = _comm.hooked(comm, _comm.REDUCE_SCATTER, world)
    with no_grad():
        for dt, ix in layout.buckets:
            if not differentiable(dt):
                continue  # integer parameters have no gradient (flat layout: their bucket; see _spec.reduced)
            n = layout.chunk[dt]
            missing = False
            for i in ix:
                if grads[i] is None:
                    missing = True
                elif grads[i].layout is not torch.strided:
                    grads[i] = grads[i].to_dense()  # e.g. nn.Embedding(sparse=True): shards are dense slices
            # dim-0 shards: torch._chunk_cat writes the padded rank-major layout (padding included) in one op
            one_op = layout.dim0[dt] and not missing and all(grads[i].is_contiguous() and grads[i].numel()
                                                             for i in ix)
            alloc = torch.zeros if (layout.has_padding[dt] or missing) and not one_op else torch.empty
            rdt = layout.reduce[dt]
            inp = _comm.allocate(comm if hooked else None, _comm.REDUCE_SCATTER, world * n, rdt, device,
                                 zero=alloc is torch.zeros)
            dsts, srcs = [], []
            if one_op and len({grads[i].dtype for i in ix}) > 1:  # e.g. accumulated fp32 beside fresh bf16
                for i in ix:  # (torch._chunk_cat takes one dtype; the cast is exact or the copy's own)
                    grads[i] = grads[i].to(rdt)
            if one_op:
                gs = [grads[i] for i in ix]
                if layout.scalar[dt]:
                    gs = [g.view(layout.specs[i].sharded_shape) for i, g in zip(ix, gs)]
                chunk_cat(gs, dim=0, num_chunks=world, out=inp.view(world, n))
                gs = None
            elif layout.flat:
                for i in ix:
                    spec, g = layout.specs[i], grads[i]
                    if g is not None:
                        dsts.append(inp[spec.flat.offset : spec.flat.offset + spec.numel].view(spec.shape))
                        srcs.append(g)
            else:
                for i, c in zip(ix, inp.view(world, n).split(layout.numels[dt], dim=1)):
                    if grads[i] is not None:
                        spec = layout.specs[i]
                        _per_param_grad_copies(spec, c.view(world, *spec.local_shape), grads[i], dsts, srcs)
            if dsts:
                foreach_copy_(dsts, srcs)
            dsts = srcs = g = None  # (g: the flat branch's loop variable holds the last gradient)
            for i in ix:
                grads[i] = None
            split = before, _ = divide_factors(divide, rdt)  # (the one split: finish applies the rest)
            if before != 1.0:
                inp.div_(before)
            if world == 1:  # the input is the output (FSDP2 issues no collective either)
                pending.append((dt, ix, inp, inp, None, split))
                continue
            if hooked:
                out = _comm.allocate(comm, _comm.REDUCE_SCATTER, n, rdt, device)
                work, out = _comm.run(comm, _comm.REDUCE_SCATTER, out, inp, group, where and where.group)
                pending.append((dt, ix, inp, out, work, split))
                continue
            out = torch.empty(n, dtype=rdt, device=device)
            pending.append((dt, ix, inp, out, reduce_scatter_into(out, inp, group), split))
    result = PendingReduce(layout, pending, replicate, where)
    result.comm_owned = hooked and _comm.allocates(comm, _comm.REDUCE_SCATTER)
    return result
