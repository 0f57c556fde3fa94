"""Whole-matrix updates over sharded parameters: owner ranks, and the all-to-all to them and back.

Muon, Shampoo, SOAP and Dion need each parameter's whole matrix; a rank holds only its shard. Each matrix gets one
*owner* rank of the shard group (``assign_owners``: longest processing time first over each matrix's cost, the same
answer on every rank because it reads only the paths, shapes and costs, in the given order); ``Exchange`` sends every
rank's piece of each matrix to its owner (one ``all_to_all_single`` per dtype, pieces packed per destination), the
owner computes the whole matrix's update, and a second all-to-all sends each rank its piece back. A rank's pieces are
its spec's boxes (``ShardSpec.boxes``: the real elements it holds, padding never travels), so any shard dim, uneven
sizes and the flat layout are one code path, as in checkpoints. Waits are bounded as every funcshard collective's
(``_collectives.wait_work``: ``CollectiveTimeout`` naming the exchange). Under fake tensors (``funcshard.cost``'s
traced update) the buffers are made and no collective runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from funcshard._collectives import public_where, wait_work
from funcshard._compat import FakeTensor
from funcshard._spec import Box, ShardingError, ShardSpec, takes_grad

__all__ = ["Exchange", "OwnerCollective", "OwnerStep", "Owned", "Owners", "assign_owners", "by_dtype", "ns_flops",
           "owner_rounds", "owner_step", "owner_steps"]


def ns_flops(shape: Sequence[int], ns_steps: int = 5) -> int:
    """FLOPs of Muon's Newton-Schulz on a matrix of ``shape`` (torch's ``_zeropower_via_newtonschulz``): per step,
    with ``m = min(shape)``, ``n = max(shape)``: the Gram matrix ``X X^T`` (2 m^2 n), ``b A + c A A`` (2 m^3) and
    ``a X + B X`` (2 m^2 n)."""
    m, n = min(shape[0], shape[1]), max(shape[0], shape[1])
    return ns_steps * (4 * m * m * n + 2 * m**3)


@dataclasses.dataclass(frozen=True)
class Owned:
    """One matrix's owner: an entry of :class:`Owners`.

    Attributes:
        path: the parameter's path.
        shape: its global shape.
        owner: the rank (on the shard axis) that computes its whole-matrix update.
        flops: its cost, the number the assignment balanced (Newton-Schulz FLOPs for Muon).
    """

    path: str
    shape: tuple[int, ...]
    owner: int
    flops: int


@dataclasses.dataclass(frozen=True)
class Owners:
    """Which rank computes each whole matrix. Printable: a table of path, shape, owner, FLOPs, then each rank's
    total and the busiest rank's share over the mean (1.00: perfectly balanced).

    Attributes:
        world: ranks on the shard axis.
        entries: one :class:`Owned` per matrix, in the order given (the parameters' order).
    """

    world: int
    entries: tuple[Owned, ...]

    @functools.cached_property
    def _by_path(self) -> dict[str, Owned]:
        return {e.path: e for e in self.entries}

    def owner(self, path: str) -> int:
        """The rank that owns ``path``.

        Args:
            path: a parameter's path (one of the entries'; another raises ``KeyError``).
        """
        return self._by_path[path].owner

    def owned_by(self, rank: int) -> tuple[str, ...]:
        """The paths ``rank`` owns, in the entries' order.

        Args:
            rank: a rank on the shard axis (``0 <= rank < world``).
        """
        return tuple(e.path for e in self.entries if e.owner == rank)

    def loads(self) -> list[int]:
        """Each rank's total FLOPs."""
        out = [0] * self.world
        for e in self.entries:
            out[e.owner] += e.flops
        return out

    def imbalance(self) -> float:
        """The busiest rank's FLOPs over the mean (1.0: balanced; ``world``: one rank does everything)."""
        loads = self.loads()
        total = sum(loads)
        return max(loads) * self.world / total if total else 1.0

    def __str__(self) -> str:
        w = max([len("parameter"), *(len(e.path) for e in self.entries)])
        lines = [f"Owners of {len(self.entries)} matrices over {self.world} ranks (longest processing time first, "
                 f"by FLOPs):", f"  {'parameter':<{w}}  {'shape':>14}  owner  {'FLOPs':>9}"]
        lines += [f"  {e.path:<{w}}  {str(tuple(e.shape)):>14}  {e.owner:>5}  {e.flops:>9.3g}"
                  for e in self.entries]
        loads = self.loads()
        lines.append("  per rank FLOPs: " + ", ".join(f"{r}: {x:.3g}" for r, x in enumerate(loads)) +
                     f"; busiest / mean {self.imbalance():.2f}")
        return "\n".join(lines)


def assign_owners(items: Sequence[tuple[str, tuple[int, ...], int]], world: int) -> Owners:
    """Owners for ``items`` (``(path, shape, cost)``) over ``world`` ranks: longest processing time first (the
    costliest matrix first, ties in the given order) to the least loaded rank (ties: the lowest rank). Deterministic:
    every rank computes the same table from the same items."""
    load = [0] * world
    owner: dict[int, int] = {}
    for i in sorted(range(len(items)), key=lambda i: (-items[i][2], i)):
        r = min(range(world), key=lambda q: (load[q], q))
        owner[i] = r
        load[r] += items[i][2]
    return Owners(world, tuple(Owned(p, tuple(s), owner[i], int(c)) for i, (p, s, c) in enumerate(items)))


def owner_rounds(owners: Owners, keys: Sequence[str]) -> list[list[str]]:
    """``keys`` in the exchange's rounds: round ``j`` holds each owner's ``j``-th matrix (the same on every rank)."""
    wanted = set(keys)
    per = [[k for k in owners.owned_by(o) if k in wanted] for o in range(owners.world)]
    return [[p[j] for p in per if j < len(p)] for j in range(max(map(len, per), default=0))]


TO_OWNERS, BACK = "to the owners", "back from the owners"  # (the two phases, as errors and printouts name them)


def by_dtype(keys: Sequence[str], dtype_of: Callable[[str], torch.dtype]) -> list[tuple[str, list[str]]]:
    """``keys`` split by dtype (``(str(dtype), keys in the given order)``, sorted by the dtype's name): one exchange
    per dtype, in this order (``Exchange`` runs them so; ``owner_step`` lists them so)."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(str(dtype_of(k)), []).append(k)
    return sorted(groups.items())


def _region(full: torch.Tensor, box: Box) -> torch.Tensor:
    """``box`` as a view of the whole tensor (global coordinates)."""
    for d, (o, n) in enumerate(zip(box.offsets, box.sizes)):
        full = full.narrow(d, o, n)
    return full


class Exchange:
    """The all-to-all of whole matrices to their owners and back, for the parameters ``specs`` (path -> spec,
    every rank the same paths in the same order) over ``group`` (the shard axis's process group; None with one
    rank), ``rank`` this rank's index on it. ``what`` names it in errors; ``timeout``: the plan's.

    :meth:`map` pipelines: the matrices go in rounds, each round at most one matrix per owner (its ``j``-th), and
    round ``j + 1``'s all-to-all to the owners and round ``j``'s back run while the owners compute (gloo runs them on
    its threads; NCCL on its stream), so an owner holds one or two whole matrices at a time, not all of its own.
    :meth:`to_owners` / :meth:`from_owners` are one round of everything."""

    def __init__(self, specs: Mapping[str, ShardSpec], owners: Owners, group, rank: int, *,
                 timeout: float | None = None, what: str = "optim.owner_compute"):
        self.specs, self.owners, self.group, self.rank = dict(specs), owners, group, rank
        self.world, self.timeout, self.what = owners.world, timeout, what
        self.boxes = {k: [s.boxes(r) for r in range(self.world)] for k, s in self.specs.items()}

    def _by_dtype(self, tensors: Mapping[str, torch.Tensor] | Mapping[str, torch.dtype]) -> list[tuple[str, list]]:
        return by_dtype(list(self.specs), lambda k: tensors[k] if isinstance(tensors[k], torch.dtype)
                        else tensors[k].dtype)

    def rounds(self, keys: Sequence[str]) -> list[list[str]]:
        return owner_rounds(self.owners, keys)

    def _start(self, recv: torch.Tensor, send: torch.Tensor, out_splits: list[int], in_splits: list[int],
               phase: str):
        if self.group is None or self.world == 1:
            recv.copy_(send)
            return None
        if isinstance(send, FakeTensor):  # (funcshard.cost's traced update: the buffers, no collective)
            return None
        where = public_where("all-to-all", f"{self.what} ({phase})", self.group, self.timeout)
        return dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group, async_op=True), where

    @staticmethod
    def _wait(pending) -> None:
        if pending is not None:
            wait_work(*pending)

    def _to(self, local: Mapping[str, torch.Tensor], keys: Sequence[str]):
        """Start sending every rank's pieces of ``keys`` (one dtype) to their owners."""
        r, W, owners = self.rank, self.world, self.owners
        mine = [k for k in keys if owners.owner(k) == r]
        parts, in_splits = [], []
        for o in range(W):
            n = 0
            for k in keys:
                if owners.owner(k) == o:
                    for b in self.boxes[k][r]:
                        parts.append(b.view(local[k]).reshape(-1))
                        n += parts[-1].numel()
            in_splits.append(n)
        like = local[keys[0]]
        out_splits = [sum(math.prod(b.sizes) for k in mine for b in self.boxes[k][s]) for s in range(W)]
        send = torch.cat(parts) if parts else like.new_empty((0,))
        recv = like.new_empty((sum(out_splits),))
        return self._start(recv, send, out_splits, in_splits, TO_OWNERS), recv, mine, like

    def _to_finish(self, started) -> dict[str, torch.Tensor]:
        pending, recv, mine, like = started
        self._wait(pending)
        fulls = {k: like.new_empty(self.specs[k].shape) for k in mine}
        off = 0
        for s in range(self.world):
            for k in mine:
                for b in self.boxes[k][s]:
                    n = math.prod(b.sizes)
                    _region(fulls[k], b).copy_(recv[off:off + n].view(b.sizes))
                    off += n
        return fulls

    def _back(self, fulls: Mapping[str, torch.Tensor], keys: Sequence[str], like: Mapping[str, torch.Tensor],
              dtype: torch.dtype):
        """Start sending the owners' results of ``keys`` (``fulls``: this rank's) back as every rank's pieces."""
        r, W, owners = self.rank, self.world, self.owners
        for k, t in fulls.items():
            spec = self.specs[k]
            if tuple(t.shape) != tuple(spec.shape) or t.dtype != dtype:
                raise ShardingError(
                    f"{self.what}: the whole-matrix update of {k!r} is {tuple(t.shape)} {t.dtype}, not the "
                    f"parameter's {tuple(spec.shape)} {dtype}; return an update of the gradient's shape and dtype "
                    f"(the other ranks wait for it and time out)")
        mine = [k for k in keys if owners.owner(k) == r]
        parts, in_splits = [], []
        for s in range(W):
            n = 0
            for k in mine:
                for b in self.boxes[k][s]:
                    parts.append(_region(fulls[k], b).reshape(-1))
                    n += parts[-1].numel()
            in_splits.append(n)
        frm = [k for o in range(W) for k in keys if owners.owner(k) == o]  # (what arrives, in the senders' order)
        out_splits = [sum(math.prod(b.sizes) for k in keys if owners.owner(k) == o for b in self.boxes[k][r])
                      for o in range(W)]
        proto = like[keys[0]]
        send = torch.cat(parts) if parts else proto.new_empty((0,), dtype=dtype)
        recv = proto.new_empty((sum(out_splits),), dtype=dtype)
        return self._start(recv, send, out_splits, in_splits, BACK), recv, frm

    def _back_finish(self, started, out: dict[str, torch.Tensor]) -> None:
        pending, recv, frm = started
        self._wait(pending)
        off = 0
        for k in frm:
            for b in self.boxes[k][self.rank]:
                n = math.prod(b.sizes)
                b.view(out[k]).copy_(recv[off:off + n].view(b.sizes))
                off += n

    def to_owners(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole matrices of the paths this rank owns, from every rank's ``local`` shard (padding ignored)."""
        fulls: dict[str, torch.Tensor] = {}
        for _, keys in self._by_dtype(local):
            fulls.update(self._to_finish(self._to(local, keys)))
        return fulls

    def from_owners(self, fulls: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor],
                    dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """Every rank's shard (shaped as ``like[path]``, padding zero, dtype ``dtypes[path]``) of the whole matrices
        the owners computed (``fulls``: this rank's, each of its spec's shape and ``dtypes[path]``)."""
        out = {k: torch.zeros_like(like[k], dtype=dtypes[k]) for k in self.specs}
        for _, keys in self._by_dtype(dtypes):
            self._back_finish(self._back(fulls, keys, like, dtypes[keys[0]]), out)
        return out

    def map(self, local: Mapping[str, torch.Tensor], fn: Callable[[str, torch.Tensor], torch.Tensor],
            dtypes: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
        """``fn(path, whole matrix)`` run on each matrix's owner, the results back as shards shaped like ``local``
        (``dtypes``: the results' dtypes, default the inputs'), pipelined in rounds (see the class)."""
        dtypes = {k: t.dtype for k, t in local.items()} if dtypes is None else dtypes
        out = {k: torch.zeros_like(local[k], dtype=dtypes[k]) for k in self.specs}
        for _, keys in self._by_dtype(local):
            rounds, dtype = self.rounds(keys), dtypes[keys[0]]
            if any(dtypes[k] != dtype for k in keys):
                raise ShardingError(f"{self.what}: results of one input dtype must share a dtype, got "
                                    f"{sorted({str(dtypes[k]) for k in keys})}")
            to, back = self._to(local, rounds[0]), None
            for j, keys_j in enumerate(rounds):
                fulls = self._to_finish(to)
                if j + 1 < len(rounds):
                    to = self._to(local, rounds[j + 1])  # (in flight while this round computes)
                started = self._back({k: fn(k, v) for k, v in fulls.items()}, keys_j, local, dtype)
                if back is not None:
                    self._back_finish(back, out)
                back = started
            self._back_finish(back, out)
        return {k: out[k] for k in self.specs}


# ---- the exchange as data: what a step's all-to-alls move, in issue order (Plan.with_optimizer, cost.owner_costs) --

def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


@dataclasses.dataclass(frozen=True)
class OwnerCollective:
    """One all-to-all of an owner exchange, as :class:`Exchange` issues it.

    Attributes:
        phase: ``"to the owners"`` (every rank's pieces of the round's matrices to their owners) or ``"back from the
            owners"`` (the owners' results, as every rank's pieces).
        round: the round (0 first; round ``j`` holds each owner's ``j``-th matrix of this dtype).
        rounds: the exchange's rounds of this dtype.
        dtype: what it moves (Muon: bfloat16, torch's Newton-Schulz input; else the parameters').
        paths: the round's matrices.
        owners: their owners (``owners[i]`` owns ``paths[i]``).
        sent: bytes each rank (the index) sends to the other ranks (a rank's piece of its own matrix stays; padding
            never travels).
        received: bytes each rank receives from the other ranks.
    """

    phase: str
    round: int
    rounds: int
    dtype: torch.dtype
    paths: tuple[str, ...]
    owners: tuple[int, ...]
    sent: tuple[int, ...]
    received: tuple[int, ...]

    def line(self) -> str:
        """The collective as ``Plan.__str__`` lists it."""
        arrow = "->" if self.phase == TO_OWNERS else "<-"
        mats = ", ".join(f"{p} {arrow} rank {o}" for p, o in zip(self.paths, self.owners))
        return (f"all-to-all {self.phase}, round {self.round + 1}/{self.rounds} "
                f"({str(self.dtype).removeprefix('torch.')}: {mats}), up to {_size(max(self.sent))} sent per rank")


@dataclasses.dataclass(frozen=True)
class OwnerStep:
    """A whole-matrix transformation's part of one optimizer step (``optim.muon``, ``optim.owner_compute``, each
    labelled one of an ``optim.multi_transform``): who owns what, the all-to-alls in issue order with every rank's
    bytes, every rank's FLOPs on the matrices it owns, and its memory beyond the sharded state. ``Plan.with_optimizer``
    prints it; ``funcshard.cost.owner_costs`` adds the time.

    Attributes:
        label: the transformation's label in a ``multi_transform`` (``""`` alone).
        owners: the owner table (:class:`Owners`).
        collectives: the all-to-alls in the order the exchange issues them (none on one rank).
        extra_bytes: each rank's memory beyond the sharded state while it updates, as the pipelined exchange holds it
            (``Exchange.map``): the result shards (and for Muon the bfloat16 copies of the update shards it sends),
            plus at the worst round its whole matrices in and out, for Newton-Schulz its Gram-matrix pair
            (``2 m^2``), and the packed send and receive buffers of the three all-to-alls in flight then (the next
            round's to the owners, this and the last round's back).
    """

    label: str
    owners: Owners
    collectives: tuple[OwnerCollective, ...]
    extra_bytes: tuple[int, ...]

    def _sum(self, phase: str, field: str) -> tuple[int, ...]:
        out = [0] * self.owners.world
        for c in self.collectives:
            if c.phase == phase:
                out = [a + b for a, b in zip(out, getattr(c, field))]
        return tuple(out)

    @property
    def flops(self) -> tuple[int, ...]:
        """Each rank's FLOPs on the matrices it owns (the cost the owners were balanced by)."""
        return tuple(self.owners.loads())

    @property
    def to_owners_sent(self) -> tuple[int, ...]:
        """Bytes each rank sends in the all-to-alls to the owners."""
        return self._sum(TO_OWNERS, "sent")

    @property
    def to_owners_received(self) -> tuple[int, ...]:
        """Bytes each rank receives in them (the other ranks' pieces of the matrices it owns)."""
        return self._sum(TO_OWNERS, "received")

    @property
    def back_sent(self) -> tuple[int, ...]:
        """Bytes each rank sends in the all-to-alls back (the other ranks' pieces of its results)."""
        return self._sum(BACK, "sent")

    @property
    def back_received(self) -> tuple[int, ...]:
        """Bytes each rank receives in them (its pieces of the results of the matrices others own)."""
        return self._sum(BACK, "received")

    def lines(self) -> list[str]:
        """The owner table and every rank's figures, as ``Plan.__str__`` prints them."""
        o = self.owners
        name = f" ({self.label!r})" if self.label else ""
        out = [f"owners{name}: {len(o.entries)} whole matrices over {o.world} ranks (longest processing time first, "
               f"by FLOPs), {len(self.collectives)} all-to-alls; busiest / mean FLOPs {o.imbalance():.2f}"]
        out += str(o).splitlines()[1:-1]  # (the table's rows: path, shape, owner, FLOPs)
        ts, tr, bs, br = self.to_owners_sent, self.to_owners_received, self.back_sent, self.back_received
        cols = ("to the owners sent / received", "back sent / received")
        out.append(f"  {'rank':>4}  {'FLOPs':>9}  {cols[0]:>30}  {cols[1]:>22}  extra memory")
        out += [f"  {r:>4}  {self.flops[r]:>9.3g}  {_size(ts[r]) + ' / ' + _size(tr[r]):>30}  "
                f"{_size(bs[r]) + ' / ' + _size(br[r]):>22}  {_size(self.extra_bytes[r])}" for r in range(o.world)]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def owner_step(specs: Mapping[str, ShardSpec], owners: Owners, wire_dtype: torch.dtype | None = None,
               label: str = "") -> OwnerStep:
    """The step of an exchange over ``owners`` (``specs``: path -> spec, every owned path's), moving ``wire_dtype``
    (None: each parameter's dtype): the one place the exchange's bytes and memory are counted."""
    w = owners.world
    dtype = {e.path: wire_dtype or specs[e.path].dtype for e in owners.entries}
    size = {k: d.itemsize for k, d in dtype.items()}
    piece = {k: [size[k] * sum(math.prod(b.sizes) for b in specs[k].boxes(r)) for r in range(w)] for k in dtype}
    out: list[OwnerCollective] = []
    peak = [0] * w
    for _, keys in by_dtype(list(dtype), dtype.__getitem__):
        rounds = owner_rounds(owners, keys)
        n = len(rounds)
        # the issue order of ``Exchange.map``: round 0 to the owners, then for each round j the next round's to the
        # owners and round j's back (tests/test_muon.py holds the two to the same calls)
        order = [(TO_OWNERS, 0)] + [x for j in range(n) for x in ([(TO_OWNERS, j + 1)] if j + 1 < n else []) +
                                    [(BACK, j)]]
        for phase, j in order if w > 1 else ():
            sent, received = [0] * w, [0] * w
            for k in rounds[j]:
                o = owners.owner(k)
                for r in range(w):
                    if r != o:
                        src, dst = (r, o) if phase == TO_OWNERS else (o, r)
                        sent[src] += piece[k][r]
                        received[dst] += piece[k][r]
            out.append(OwnerCollective(phase, j, n, dtype[rounds[j][0]], tuple(rounds[j]),
                                       tuple(owners.owner(k) for k in rounds[j]), tuple(sent), tuple(received)))
        for r in range(w):
            def packed(j: int) -> int:  # a round's packed send + receive buffers on rank r (the same both ways)
                if not 0 <= j < n:
                    return 0
                return sum(piece[k][r] for k in rounds[j]) + sum(
                    sum(piece[k]) for k in rounds[j] if owners.owner(k) == r)
            for j, keys_j in enumerate(rounds):
                own = [k for k in keys_j if owners.owner(k) == r]
                held = sum(2 * specs[k].numel * size[k] for k in own)  # the whole matrix in, and its result
                if wire_dtype is not None:  # (Newton-Schulz: X X^T and its update)
                    held += sum(2 * min(specs[k].shape) ** 2 * size[k] for k in own if len(specs[k].shape) == 2)
                peak[r] = max(peak[r], held + packed(j - 1) + packed(j) + packed(j + 1))
    outs = [sum(piece[k][r] for k in piece) for r in range(w)]  # (the result shards, made when the exchange starts)
    copies = outs if wire_dtype is not None else [0] * w  # (Muon: the bf16 copies of the update shards it sends)
    return OwnerStep(label, owners, tuple(out), tuple(outs[r] + copies[r] + peak[r] for r in range(w)))


def owner_steps(plan: Any, optimizer: Any, keys: Sequence[str] | None = None, *,
                where: str = "owner_steps") -> tuple[OwnerStep, ...]:
    """The :class:`OwnerStep` of each whole-matrix transformation in ``optimizer`` (``optim.muon``,
    ``optim.owner_compute``, those of an ``optim.multi_transform``, or of a ``chain`` holding one) given the
    parameters ``keys`` of ``plan`` (default: its trained floating-point ones); ``()`` for an optimizer without
    owners. An optimizer built for a plan of other shards (world size, shapes) raises (``where`` names the caller).
    """
    if getattr(optimizer, "owners", None) is None:
        return ()
    specs = plan.specs
    keys = [k for k, s in specs.items() if takes_grad(s.requires_grad, s.dtype)] if keys is None else list(keys)
    bad = [k for k in keys if k not in specs]
    if bad:
        raise ShardingError(f"{where}: keys {bad[:8]} are not parameters of the plan (its parameters: "
                            f"{list(specs)[:8]}...)")
    # (as init sees them: this rank's shards, here on the meta device; a multi_transform's callable labels read them)
    try:
        tables = optimizer.owners({k: torch.empty(specs[k].local_shape, dtype=specs[k].dtype, device="meta")
                                   for k in keys})
    except ShardingError as e:  # (its plan's shards are not this plan's: another world size, other shapes)
        raise ShardingError(f"{where}: the optimizer does not fit this plan ({plan.world} ranks): {e}. Fix: build "
                            f"the optimizer with plan= this plan (or pass params= the paths it is given)") from None
    inner = getattr(optimizer, "transforms", None)
    if inner is not None:
        todo = [(label, t, getattr(inner[label], "wire_dtype", None)) for label, t in tables.items()]
    else:
        todo = [("", tables, getattr(optimizer, "wire_dtype", None))]
    for label, owners, _ in todo:
        wrong = [e.path for e in owners.entries if tuple(e.shape) != tuple(specs[e.path].shape)]
        if owners.world != plan.world or wrong:
            raise ShardingError(
                f"{where}: the optimizer{f' {label!r}' if label else ''} assigns owners over {owners.world} ranks"
                f"{f' to {wrong[:4]} of other shapes' if wrong else ''}, and this plan shards over {plan.world} "
                f"ranks: it was built for another plan. Fix: build the optimizer with plan= this plan")
    return tuple(owner_step(specs, owners, dtype, label) for label, owners, dtype in todo if owners.entries)
