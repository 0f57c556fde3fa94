"""Divergence checks: the ranks agree on what a step does, checked before a mismatched collective runs.

Always on (when the shard axis has 2 or more ranks): **which parameters take gradients, and which groups the
forward ran**. A group's reduce-scatter covers the parameters that require grad (``GroupBuffers.reduce_layout``),
decided by each rank's own state; ranks that froze different parameters would pair different layouts: silently
wrong gradients (equal sizes) or a crash (gloo's "Connection reset by peer"). A forward that ran other groups on some
rank (a data-dependent branch, LayerDrop) makes the backward's all-gathers and reduce-scatters pair wrongly. Design: a
rank cannot know that another rank's set changed without communicating, and a check only the rank whose set changed
takes part in would hang; so every rank takes part in every step. At the end of each forward a rank posts its
requires-grad mask (the plan's parameters as 62-bit words, and a hash) and the groups its forward ran to the process
group's store; at the start of the step's backward (its first backward hook, before any backward collective) it
reads every rank's. The exchange is out of band, through the c10d store rather than a collective of the process
group: it never pairs with a data collective (a rank that diverged cannot make it hang or corrupt it), the plan's
printed collective order stays the whole truth (``_schedule``, checked at c10d dispatch by the tests), and on CUDA it
needs no device-to-host copy. Cost: three store round trips per step (a post, one read, by which time the other
ranks have posted, and a count of the readers: the last deletes the exchange's keys, so the store does not grow). Every rank reads every rank's post, so every rank raises the same ``DivergenceError``, naming
the first differing parameter or group and the ranks on each side, before any mismatched reduce-scatter runs. HSDP:
the same exchange over the replicate group. The fake process group (no peers) is not checked.

Check mode (``plan(..., check=True)``, ``fully_shard``'s ``set_check_mode(True)``; off by default): **the sequence of
collectives**. Before each all-gather and reduce-scatter the step issues, and at the end of each forward and backward,
the ranks exchange what they are about to do (kind, group, phase) through the same store: a forward that skipped a
group on one rank is found at the first differing collective, on every rank, each rank's collective named. It costs
a blocking store exchange per collective (three round trips): a debugging mode, like torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL``.

Both exchanges are bounded by the plan's timeout; a rank that never posts (dead, stalled, diverged) ends the others'
wait with a ``CollectiveTimeout`` naming it. The exchanges count steps and collectives per process group: every rank
must make the same steps on it (they must anyway: their collectives pair up).
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from funcshard._collectives import CollectiveTimeout, DivergenceError, mark_broken, pg_desc
from funcshard._compat import process_group_store
from funcshard._runtime.part import Part

if TYPE_CHECKING:
    from funcshard._runtime.step import Step

_BITS = 62  # bits per packed word
_SEQ: dict[tuple[str, int], tuple] = {}  # (exchange, id(group)) -> (group, exchanges so far: the same on every rank)
_PEERS: dict[int, tuple] = {}  # id(process group) -> (group, its store, world, rank, global ranks); None: fake group
_DAY = 86400.0


def packed_mask(masks: tuple[tuple[bool, ...], ...]) -> str:
    """The requires-grad flags of every group's parameters (plan order): a hash and the flags as 62-bit words."""
    bits = [b for m in masks for b in m]
    words = [sum(1 << j for j, b in enumerate(bits[i : i + _BITS]) if b) for i in range(0, len(bits), _BITS)]
    digest = hashlib.blake2b(repr(masks).encode(), digest_size=8).hexdigest()
    return " ".join([digest, *map(str, words)])


def _unpack(value: str, n: int) -> list[bool]:
    words = [int(w) for w in value.split()[1:]]
    return [bool(words[i // _BITS] >> (i % _BITS) & 1) for i in range(n)]


def _peers(pg):
    """(group, store, world, rank, global ranks) of a process group with peers to check against, else None."""
    key = id(pg)
    hit = _PEERS.get(key)
    if hit is None or hit[0] is not pg:
        world = dist.get_world_size(pg)
        fake = str(dist.get_backend(pg)) == "fake"
        hit = (pg, None if world == 1 or fake else process_group_store(pg), world, dist.get_rank(pg),
               dist.get_process_group_ranks(pg))
        _PEERS[key] = hit
    return hit if hit[1] is not None else None


def _post(kind: str, peers, value: str) -> int:
    """Post this rank's ``value`` for the next exchange of ``kind`` on the group; returns its number."""
    pg, store, world, rank, _ = peers
    k, hit = (kind, id(pg)), _SEQ.get((kind, id(pg)))  # (per group object: ranks run as threads have one each)
    seq = (hit[1] if hit is not None and hit[0] is pg else 0) + 1
    _SEQ[k] = (pg, seq)
    store.set(f"funcshard/{kind}/{seq}/{rank}", f"{seq} {value}")
    return seq


def _read(kind: str, peers, seq: int, seconds: float | None, doing: str) -> list[str]:
    """Every rank's value of exchange ``seq`` (bounded by ``seconds``; a rank that does not post in time: a
    CollectiveTimeout naming it, and the group is marked broken). Each exchange has its own keys (several forwards
    may post before the first of their backwards reads: gradient accumulation, a grouped unit's member run per
    chunk); the last rank to read an exchange deletes its keys, so the store holds only exchanges some rank has yet
    to read."""
    pg, store, world, _, ranks = peers
    keys = [f"funcshard/{kind}/{seq}/{r}" for r in range(world)]
    deadline = time.monotonic() + (seconds if seconds is not None else _DAY)
    delay = 1e-3  # (a late rank: polled with backoff, up to 10 reads a second, so waiting ranks spare the store)
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(min(left, 1.0), 0.001)))
            got = [v.decode().split(" ", 1) for v in store.multi_get(keys)]
        except (RuntimeError, dist.DistError):
            got = None
        if got is not None:
            if store.add(f"funcshard/{kind}/{seq}/read", 1) == world:  # the last reader clears the exchange
                for k in (*keys, f"funcshard/{kind}/{seq}/read"):
                    store.delete_key(k)
            return [v for _, v in got]
        late = [ranks[r] for r, k in enumerate(keys) if not store.check([k])]
        if time.monotonic() >= deadline:
            mark_broken(pg, f"ranks {late} did not reach {doing}")
            raise CollectiveTimeout(
                f"funcshard: ranks {late} did not reach {doing} (exchange #{seq} on {pg_desc(pg)}) within "
                f"{seconds:g} s; this rank (rank {dist.get_rank()}) waited for them there. They died, stalled, or run "
                f"something else (a forward that ran fewer groups, another number of microbatches or forwards, a rank "
                f"that raised). Fix: make every rank run the same steps; the process group can no longer be trusted: "
                f"restart the job (or make a new process group, mesh, plan and state). Raise the bound with "
                f"plan(..., timeout=s), model.set_timeout(s) (fully_shard) or FUNCSHARD_TIMEOUT=s if a rank is "
                f"legitimately that slow")
        time.sleep(delay)
        delay = min(2 * delay, 0.1)


class Checks(Part):
    """The step's divergence checks: the end-of-forward exchange (``posted`` / ``agree``) and check mode's sequence
    exchange (``collective``)."""

    def __init__(self, step: Step):
        super().__init__(step)
        self.pending: list | None = None  # [(peers, exchange number, posted value)] of the end-of-forward exchange
        self.sequence = bool(step.plan.check)

    def post(self) -> None:
        """End of forward: post this rank's requires-grad mask and the groups its forward ran, on the shard group and
        the replicate group (HSDP)."""
        step = self.step
        groups = [peers for pg in (step.pg, step.replicate_pg) if pg is not None and (peers := _peers(pg)) is not None]
        if not groups:
            return
        masks = tuple(gb.grad_mask for gb in step.groups.values())
        cache = step.facts.masks
        value = cache.get(masks)
        if value is None:
            value = cache[masks] = packed_mask(masks)
        value = f"{value} |{','.join(step.prefetcher.order)}"
        self.pending = [(peers, _post("step", peers, value), value) for peers in groups]

    def agree(self) -> None:
        """Start of backward (before any backward collective; the first reduce-scatter or the end of backward if no
        hook ran first): the ranks agree on which parameters take gradients and which groups the forward ran, or
        every rank raises a DivergenceError naming the first that differs."""
        pending, self.pending = self.pending, None
        if not pending:
            return
        for peers, seq, mine in pending:
            got = _read("step", peers, seq, self.step.bound.seconds, "the start of the step's backward")
            if any(v != mine for v in got):
                raise self._error(got, peers)

    def _error(self, got: list[str], peers) -> DivergenceError:
        pg, ranks = peers[0], peers[4]
        fix = ("Every rank raises this error, before any mismatched collective; funcshard no longer uses this process "
               "group: restart the job, or make a new process group, mesh, plan and state")
        orders = [v.split("|", 1)[1] for v in got]
        if len(set(orders)) > 1:
            runs = [o.split(",") if o else [] for o in orders]
            i = next(i for i in range(max(map(len, runs)) + 1) if len({tuple(r[i : i + 1]) for r in runs}) > 1)
            by: dict[str, list[int]] = {}
            for r, run in enumerate(runs):
                by.setdefault(repr(run[i]) if i < len(run) else "nothing (its forward ended)", []).append(ranks[r])
            told = "; ".join(f"ranks {rs}: {v}" for v, rs in by.items())
            mark_broken(pg, "the ranks' forwards ran different groups")
            return DivergenceError(
                f"funcshard: the ranks' forwards ran different groups on {pg_desc(pg)}: the group run after "
                f"{runs[0][:i] if i else 'none'} is {told}. Their backward collectives would pair different groups "
                f"(wrong gradients, a crash or a hang). Fix: run every group on every rank (a data-dependent branch, "
                f"an expert without tokens, LayerDrop: run the group with a zero contribution, or decide the branch "
                f"with the same random numbers on every rank). " + fix)
        names = [(g.name, p) for g in self.step.plan.groups for p in g.params]
        masks = [_unpack(v.split("|", 1)[0], len(names)) for v in got]
        on = off = []
        group = param = "?"
        differ = sum(1 for j in range(len(names)) if len({m[j] for m in masks}) > 1)
        for i, (group, param) in enumerate(names):
            on = [ranks[r] for r, m in enumerate(masks) if m[i]]
            off = [ranks[r] for r, m in enumerate(masks) if not m[i]]
            if on and off:
                break
        mark_broken(pg, "the ranks disagree on which parameters take gradients")
        return DivergenceError(
            f"funcshard: the ranks disagree on which parameters take gradients (requires_grad) on {pg_desc(pg)}: "
            f"parameter {param!r} of group {group!r} takes a gradient on ranks {on} and not on ranks {off} "
            f"({differ} parameter(s) differ). Their reduce-scatters would pair different layouts: wrong gradients, or "
            f"a crash. Fix: freeze the same parameters on every rank (requires_grad_(False) on all ranks, or the same "
            f"state leaves with requires_grad); a rank-dependent freeze is not data parallelism. " + fix)

    # ---- check mode: the sequence of collectives -----------------------------------------------------------------
    def collective(self, what: str) -> None:
        """Check mode: every rank of the shard group is about to do ``what`` (e.g. ``all-gather of group 'b.0'
        (forward)``), or all raise: a DivergenceError naming each rank's, or a CollectiveTimeout naming the ranks that
        did not arrive."""
        if not self.sequence:
            return
        step = self.step
        peers = _peers(step.pg)
        if peers is None:
            return
        seq = _post("sequence", peers, what)
        got = _read("sequence", peers, seq, step.bound.seconds, f"collective #{seq} (this rank: {what})")
        if len(set(got)) > 1:
            pg, ranks = peers[0], peers[4]
            by: dict[str, list[int]] = {}
            for r, v in enumerate(got):
                by.setdefault(v, []).append(ranks[r])
            told = "; ".join(f"ranks {rs}: {v}" for v, rs in by.items())
            mark_broken(pg, f"check mode: the ranks diverged at collective #{seq}")
            raise DivergenceError(
                f"funcshard check mode: the ranks diverged at collective #{seq} of {pg_desc(pg)}: {told}. Every rank "
                f"must run the same groups in the same order (no data-dependent skipping of a group: run it with a "
                f"zero contribution instead; the same number of microbatches and forwards on every rank). Every rank "
                f"raises this error before the collective; funcshard no longer uses this process group: restart the "
                f"job, or make a new process group, mesh, plan and state")
