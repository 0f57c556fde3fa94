"""Divergence checks: the ranks agree on what a step does, checked before a mismatched collective runs.

Always on (when the shard axis has 2 or more ranks): **which parameters take gradients, and which groups the
forward ran**. A group's reduce-scatter covers the parameters that require grad (``GroupBuffers.reduce_layout``),
decided by each rank's own state; ranks that froze different parameters would pair different layouts: silently
wrong gradients (equal sizes) or a crash (gloo's "Connection reset by peer"). A forward that ran other groups on some
rank (a data-dependent branch, LayerDrop) makes the backward's all-gathers and reduce-scatters pair wrongly. A rank
cannot know that another rank's set changed without communicating, and a check only the rank whose set changed takes
part in would hang (and the forward's group order, checked by the same exchange, can change at any step); so every
rank takes part in every step that can have a backward: at the end of each forward that recorded autograd history
(``torch.is_grad_enabled()``; a forward under ``no_grad`` / ``inference_mode`` has no backward to protect and is not
checked), before the forward returns, hence before any backward collective. Whole at the end of the forward (not
posted there and read at the start of backward, as the first version did): nothing is left pending by a forward whose
backward never runs, or raises.

The exchange (``_agree``) is out of band, through the process group's c10d store, not a collective of the process
group: it never pairs with a data collective (a rank that diverged cannot make it hang or corrupt it), the plan's
printed collective order stays the whole truth (``_schedule``, checked at c10d dispatch by the tests), and on CUDA it
needs no device sync. Its cost is O(1) store operations per rank and O(W) per step in all, whatever the world size W:
each rank's value is a 128-bit digest of its requires-grad mask and forward order; the first rank to arrive puts its
digest in the exchange's key (``compare_set``, which returns the first digest to everyone after it), so each rank
learns whether it agrees with the first, exactly (no sum of hashes, no overflow); an atomic ``add`` counts the ranks
that arrived and those that differ; the last to arrive adds the verdict to a third key, which every other rank waits
for and reads with one more ``add`` (the count of readers: the last reader deletes it; the last arrival deleted the
other two). Four store round trips per rank and step (the last to arrive: three, plus two deletes), one store server
for all: W = 1024 ranks make about 4096 small requests a step, each moving a 32-byte digest or a number, where the
first version (every rank posted its mask and forward order, every rank waited for and read all W posts) moved W^2 =
a million values a step through the store server. Only when the verdict says the ranks differ does every rank post its whole
value (the mask as 62-bit words, the forward's groups) and read all W of them (W^2 on the error path only), so that
every rank raises the same ``DivergenceError``, naming the first differing parameter or group and the ranks on each
side. HSDP: the same exchange over the replicate group; a rank whose shard group diverged takes part in it with a value
no agreeing rank has (``_DIVERGED``), so that the ranks of the shard groups that agreed raise too, naming what it found
(every replicate group holds a rank of each shard group). The fake process group (no peers) is not checked.

Measured (``benchmarks/divergence_check.py``, table in ``benchmarks/divergence_check.md``; 8 one-block groups, CPU,
a 2-core machine shared with other jobs, load average 12-16): on the fake process group the check only finds that
there are no peers (9 us a step): the fake-PG per-group CPU figure is unchanged within noise. On gloo, the time inside
the check per step (the slowest rank's median, including the wait for the last rank to arrive) was 2.9 ms at W = 2
and 7.4 ms at W = 4; the exchange alone with the ranks lined up, 3.4 ms (W = 2) on that loaded machine, i.e. four
localhost round trips under heavy scheduling contention; the on/off step-time medians could not resolve it (their
paired differences' IQR: tens of ms).

Check mode (``plan(..., check=True)``, ``fully_shard``'s ``set_check_mode(True)``; off by default): **the sequence of
collectives**. Before each all-gather and reduce-scatter the step issues, and at the end of each forward and backward,
the ranks agree on what they are about to do (kind, group, phase) with the same exchange: a forward that skipped a
group on one rank is found at the first differing collective, on every rank, each rank's collective named. It costs a
blocking exchange per collective: a debugging mode, like torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.

Every wait of an exchange is bounded by the plan's timeout (none: unbounded); a rank that never arrives (dead,
stalled, diverged) ends the others' wait with a ``CollectiveTimeout`` naming it: a rank that waited longer than a
second marks itself as present, and the one rank elected to give up (``_give_up``) waits up to ``_GRACE`` for the ranks
that had arrived to do so, so that only the late ones are named. Giving up is ordered against the last arrival through
the arrival count (``_GAVE_UP``): either the exchange completed first and every rank goes on, or it never completes,
the waiting ranks are woken (``_ABANDONED``) and raise the same error, and a rank arriving later raises at once instead
of going on alone into the step's collectives. The exchanges count steps and collectives per process group: every rank
must make the same steps on it (they must anyway: their collectives pair up). Nothing is left in the store after an
exchange that every rank finished, whatever happens next (a forward without backward, a backward that raises); an
exchange that timed out leaves its keys (the process group is broken then, and refused; a rank arriving late reads
them to raise at once).

A group made again under a name used before has the same store prefix (the default group initialised again on the
same store; ``new_group(..., use_local_synchronization=True)`` over the same ranks names a group by a hash of its ranks
and of how many groups the process holds): it must not read the keys a failed exchange of the old group left. The
namespace must be one every rank agrees on whatever its process did before (ranks as threads of one process, ranks
whose processes made other groups, a respawned rank): a count kept per process hung such ranks. So it is kept in the
store itself, as the group's **epoch** (``_EPOCH``, under the group's prefix): an exchange that fails on a rank (a
timeout, a dead peer, an interrupt: ``_failed``) records what it left and moves the epoch on, once per epoch
(``compare_set``); a group object reads the epoch at its first step (``_peers``) and uses the keys of that epoch only.
Every rank reads the same epoch: a group is made again only after every rank has left the old one (gloo connects all
its ranks when a group is made), hence after the failed rank moved the epoch on (NCCL makes its communicators at the
first collective: there a rank that makes the group again within the second a waiting peer takes to see the failure
can read the old epoch, and its first exchange ends at the bound). The first rank of the group then
deletes what the failed exchanges of older epochs left (``_clean``). One limit: a rank whose *first* step on a group
comes after another rank's exchange on it failed reads the new epoch, so it does not see that failure; it waits alone
and raises a CollectiveTimeout at the bound (instead of at once).

A dead peer is seen at once, not at the bound: each rank posts its process (host, pid, start time) in the group's store
at its first step (one key per rank and group, kept), and a rank waiting in an exchange looks at the processes of its
peers on the same host after every second of waiting (``_check_alive``): a peer whose process is gone raises a
CollectiveError naming it (peers on other hosts: at the bound). The step's collectives see a dead peer through gloo's
closed connection.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from funcshard._collectives import CollectiveError, CollectiveTimeout, DivergenceError, mark_broken, pg_desc
from funcshard._compat import process_group_store
from funcshard._runtime.part import Part

if TYPE_CHECKING:
    from funcshard._runtime.step import Step

_BITS = 62  # bits per packed word
_LOW = (1 << 32) - 1  # an add's low 32 bits count ranks, the high bits what they told (differing ranks; the verdict)
_DIFFERS = (1 << 24) - 1  # the arrival count's bits 32-55: the ranks that differ from the first
_GAVE_UP = 1 << 56  # added to the arrival count once, by the rank elected to give up on the exchange (_give_up)
_ABANDONED = 1 << 40  # added to the verdict key by that rank: the exchange never completes; its readers raise
_DIVERGED = "!"  # the replicate exchange's value of a rank whose shard group diverged (a digest is hex)
_GRACE = 2.0  # s the rank giving up waits for the arrived ranks to mark themselves present (they do within a second)
_SEQ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> {exchange: exchanges so far (the
# same on every rank)}; per group object, not name: ranks run as threads (torch's threaded group) have one each
_PEERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> (its store or None: no peers to
# check against, world, rank, global ranks); weakly: a destroyed group's gloo threads go with its last reference
_EPOCH = "funcshard/epoch"  # the group's epoch (in its own store, unprefixed): moved on by an exchange that failed
_EPOCHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> (its own store, the epoch its
# exchanges use); see _peers
ENABLED = True  # the default check (benchmarks/divergence_check.py turns it off to measure it); not check mode's


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
    """(group, store, world, rank, global ranks) of a process group with peers to check against, else None; the
    store: the group's keys of its epoch (see the module docstring). The first time: the epoch read (the first rank
    deletes what older epochs' failed exchanges left: ``_clean``) and this rank's process posted in the store
    (``_process``), so that a waiting peer on the same host can tell that it died (``_check_alive``)."""
    hit = _PEERS.get(pg)
    if hit is None:
        world = dist.get_world_size(pg)
        fake = str(dist.get_backend(pg)) == "fake"
        store = None if world == 1 or fake else process_group_store(pg)
        rank = dist.get_rank(pg)
        if store is not None:
            epoch = store.add(_EPOCH, 0)
            _EPOCHS[pg] = (store, epoch)
            if epoch and rank == 0:
                _clean(store, epoch, world)
            store = _in_epoch(store, epoch)
        hit = _PEERS[pg] = (store, world, rank, dist.get_process_group_ranks(pg))
        if hit[0] is not None:
            hit[0].set(f"funcshard/process/{hit[2]}", _process())
    return (pg, *hit) if hit[0] is not None else None


def _in_epoch(store, epoch: int):
    """The group's store for the keys of ``epoch`` (epoch 0: the group's own keys, as they always were)."""
    return store if epoch == 0 else dist.PrefixStore(f"funcshard.{epoch}/", store)


def _failed(peers, kind: str, seq: int) -> None:
    """An exchange failed on this rank (timed out, a peer died, interrupted): its keys may stay in the store (a late
    rank reads them to raise at once). Record which they are, for ``_clean``, and move the group's epoch on (once per
    epoch, whichever rank fails first), so that a group made again under this name uses keys of its own."""
    pg, store, _, rank = peers[:4]
    own, epoch = _EPOCHS[pg]
    try:
        store.set(f"funcshard/left/{rank}", f"funcshard/{kind}/{seq}")
        own.compare_set(_EPOCH, str(epoch), str(epoch + 1))
    except (RuntimeError, dist.DistError):  # (the store itself is gone: no group can be made on it again)
        pass


def _clean(store, epoch: int, world: int) -> None:
    """Delete what the failed exchanges of the epochs before ``epoch`` left in the group's store, and their ranks'
    processes (``_peers``, on the group's first rank: every rank of the old groups has left them). Once per epoch
    (``funcshard/cleaned``: the epochs before it are clean)."""
    clean = store.add("funcshard/cleaned", 0)
    if clean >= epoch or store.compare_set("funcshard/cleaned", str(clean), str(epoch)) != str(epoch).encode():
        return  # (cleaned already)
    for old in map(lambda e: _in_epoch(store, e), range(clean, epoch)):
        left = [f"funcshard/left/{r}" for r in range(world)]
        bases = {old.get(key).decode() for key in left if old.check([key])}
        keys = [*left, *(f"funcshard/process/{r}" for r in range(world))]
        for base in bases:
            keys += [f"{base}/{k}" for k in ("first", "arrived", "done", "gaveup", "late", "all/read")]
            keys += [f"{base}/{k}/{r}" for k in ("here", "all") for r in range(world)]
        for key in keys:
            old.delete_key(key)


# ---- a dead peer seen while waiting: its process is gone (peers on this host) ---------------------------------
_SLICE = 1.0  # s: a wait's slice, after which the peers' processes are looked at
_HOSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> {rank: (pid, start)} of its
# peers on this host (read once, when a wait first outlasts a slice)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process on this host, from /proc; None if it is gone (or no /proc)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # (after the command name, which may hold spaces and parentheses)
    return fields[0], fields[19]


_ME: dict[int, str] = {}  # pid -> _process() (a forked child is another process)


def _process() -> str:
    """This process as a peer on the same host can look at it: the host (its boot id and pid namespace: a pid means
    the same process only within both), the pid and the start time (a pid used again is another process)."""
    pid = os.getpid()
    if pid in _ME:
        return _ME[pid]
    stat, boot = _stat(pid), _read("/proc/sys/kernel/random/boot_id")
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = None
    me = _ME[pid] = ("-" if stat is None or boot is None or ns is None  # (no /proc: cannot be looked at)
                     else json.dumps([f"{socket.gethostname()} {boot} {ns}", pid, stat[1]]))
    return me


def _check_alive(peers, doing: str, seq: int) -> None:
    """Raise a CollectiveError if a peer on this host has died (its process gone, a zombie, or its pid another
    process's): seen within a slice of a wait, not at the bound. Peers on other hosts are not looked at (their waits
    end at the bound)."""
    pg, store, world, rank, ranks = peers
    known = _HOSTS.get(pg)
    if known is None:  # {rank: (pid, start) on this host, or None: elsewhere}; ranks not posted yet are read later
        known = _HOSTS[pg] = {rank: None} if _process() != "-" else dict.fromkeys(range(world))
    if len(known) < world:
        host = json.loads(_process())[0]
        for r in range(world):
            key = f"funcshard/process/{r}"
            if r not in known and store.check([key]):
                v = store.get(key).decode()
                known[r] = (p[1], p[2]) if v != "-" and (p := json.loads(v))[0] == host else None
    for r, (pid, start) in [(r, v) for r, v in known.items() if v is not None]:
        stat = _stat(pid)
        if stat is None or stat[0] in "ZXx" or stat[1] != start:
            mark_broken(pg, f"rank {ranks[r]} died")
            raise CollectiveError(
                f"funcshard: rank {ranks[r]} died (its process, pid {pid} on this host, is gone) while this rank "
                f"(rank {dist.get_rank()}) waited for the ranks at {doing} (exchange #{seq} on {pg_desc(pg)}). The "
                f"process group can no longer be trusted: restart the job (or make a new process group, mesh, plan "
                f"and state); see that rank's log for why it died")


def _agree(kind: str, peers, value: str, seconds: float | None, doing: str) -> tuple[bool, int]:
    """Exchange #n of ``kind`` on the group: (whether every rank's ``value`` is this rank's, n). O(1) store operations
    per rank (see the module docstring), every wait bounded by ``seconds`` (None: unbounded); ``doing`` names what the
    ranks reach (its ``#?``: the exchange's number)."""
    pg, store, world, rank, ranks = peers
    counts = _SEQ.setdefault(pg, {})
    seq = counts[kind] = counts.get(kind, 0) + 1
    base = f"funcshard/{kind}/{seq}"
    doing = doing.replace("#?", f"#{seq}")
    try:
        mine = ("=" + value).encode()  # (never empty: compare_set's "" means "absent")
        differs = store.compare_set(f"{base}/first", "", mine) != mine
        arrived = store.add(f"{base}/arrived", 1 + (int(differs) << 32))
        if arrived & _LOW == world:  # the last to arrive: every rank has compared; the verdict is known
            store.delete_key(f"{base}/first")
            store.delete_key(f"{base}/arrived")
            if arrived & _GAVE_UP:  # (a rank stopped waiting before this one arrived: it raised; so does this one)
                _given_up(peers, base, seq, seconds, doing)
            read = store.add(f"{base}/done", ((2 if arrived >> 32 & _DIFFERS else 1) << 32) + 1)
        else:
            if arrived & _GAVE_UP:
                _given_up(peers, base, seq, seconds, doing)
            _wait(store, base, f"{base}/done", peers, seq, seconds, doing)
            read = store.add(f"{base}/done", 1)
            if read & _ABANDONED:  # (woken by the rank that gave up: the ranks it names never came)
                late = [int(r) for r in store.get(f"{base}/late").decode().split(",") if r]
                _timeout(pg, late, doing, seq, seconds)
        if read & _LOW == world:  # the last reader
            store.delete_key(f"{base}/done")
    except BaseException:
        _failed(peers, kind, seq)
        raise
    return read >> 32 & 3 == 1, seq


def _wait(store, base: str, key: str, peers, seq: int, seconds: float | None, doing: str) -> None:
    """Wait for ``key`` (the last rank's verdict) at most ``seconds`` (None: unbounded); else give up on the exchange
    (``_give_up``). A rank that waits longer than a second marks itself present, so that the late ones can be named."""
    deadline = time.monotonic() + (seconds if seconds is not None else math.inf)
    here = None
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait([key], timedelta(seconds=max(min(left, _SLICE), 0.001)))
            if here is not None:
                store.delete_key(here)
            return
        except (RuntimeError, dist.DistError):
            pass
        _check_alive(peers, doing, seq)
        if here is None:
            here = f"{base}/here/{peers[3]}"
            store.set(here, "1")
        if time.monotonic() >= deadline:
            _give_up(store, base, key, peers, seq, seconds, doing)  # (returns: the verdict came after all)
            store.delete_key(here)
            return


def _give_up(store, base: str, key: str, peers, seq: int, seconds: float, doing: str) -> None:
    """This rank's bound passed while it waited for the verdict. One waiting rank is elected to end the exchange: it
    adds ``_GAVE_UP`` to the arrival count, which orders it against the last arrival's own add (the exchange either
    completed first, and every rank goes on, or never completes: every rank arriving later raises at once instead of
    going on alone into the step's collectives). Once the ranks that had arrived have marked themselves present, it
    writes the ranks that had not, and wakes the waiting ranks with ``_ABANDONED``; they raise the same
    CollectiveTimeout. Returns if the verdict came after all (the caller reads it)."""
    pg, _, world, rank, ranks = peers
    if store.compare_set(f"{base}/gaveup", "", str(rank)) == str(rank).encode():  # this rank is elected
        arrived = store.add(f"{base}/arrived", _GAVE_UP) & _LOW
        if arrived in (0, world):  # the last rank arrived first: the exchange completed (0: its key deleted already)
            if arrived == 0:
                store.delete_key(f"{base}/arrived")  # (made again by this add)
            store.delete_key(f"{base}/gaveup")
        else:
            grace = time.monotonic() + _GRACE  # (a rank that arrived marks itself present within a second)
            while True:
                late = [r for r in range(world) if r != rank and not store.check([f"{base}/here/{r}"])]
                if world - len(late) >= arrived or time.monotonic() >= grace:
                    break
                time.sleep(0.1)
            store.set(f"{base}/late", ",".join(str(ranks[r]) for r in late))
            store.add(key, _ABANDONED)
            _timeout(pg, [ranks[r] for r in late], doing, seq, seconds)
    # the verdict, or the elected rank's _ABANDONED, comes next: each within its own bound
    deadline = time.monotonic() + _GRACE + (seconds or 0.0)
    while time.monotonic() < deadline:
        try:
            store.wait([key], timedelta(seconds=_SLICE))
            return
        except (RuntimeError, dist.DistError):
            pass
        _check_alive(peers, doing, seq)
    late = [ranks[r] for r in range(world) if r != rank and not store.check([f"{base}/here/{r}"])]
    _timeout(pg, late, doing, seq, seconds)


def _given_up(peers, base: str, seq: int, seconds: float | None, doing: str):
    """This rank arrived at an exchange that a waiting rank had given up on: raise at once (not into the step's
    collectives, which no rank pairs any more)."""
    pg, store, world, rank, ranks = peers
    who = ranks[int(store.get(f"{base}/gaveup").decode())]
    mark_broken(pg, f"rank {who} gave up waiting for rank {ranks[rank]} at {doing}")
    raise CollectiveTimeout(
        f"funcshard: this rank (rank {dist.get_rank()}) reached {doing} (exchange #{seq} on {pg_desc(pg)}) after "
        f"rank {who} had stopped waiting there for the ranks that had not arrived ({_bound(seconds)}): that rank "
        f"raised a CollectiveTimeout, so this one raises too, instead of issuing the step's collectives alone. Fix: "
        f"find why this rank was late in its own log (a stall, another number of microbatches or forwards); the "
        f"process group can no longer be trusted: restart the job (or make a new process group, mesh, plan and "
        f"state). " + _RAISE)


def _bound(seconds: float | None) -> str:
    return "unbounded" if seconds is None else f"within {seconds:g} s"


_RAISE = ("Raise the bound with plan(..., timeout=s), model.set_timeout(s) (fully_shard) or FUNCSHARD_TIMEOUT=s if a "
          "rank is legitimately that slow")


def _timeout(pg, late: list[int], doing: str, seq: int, seconds: float | None):
    mark_broken(pg, f"ranks {late} did not reach {doing}")
    raise CollectiveTimeout(
        f"funcshard: ranks {late} did not reach {doing} (exchange #{seq} on {pg_desc(pg)}) {_bound(seconds)}; "
        f"this rank (rank {dist.get_rank()}) waited for them there. They died, stalled, or run something else (a "
        f"forward that ran fewer groups, another number of microbatches or forwards, a rank that raised). Fix: make "
        f"every rank run the same steps; the process group can no longer be trusted: restart the job (or make a new "
        f"process group, mesh, plan and state). " + _RAISE)


def _everyones(kind: str, peers, seq: int, value: str, seconds: float | None, doing: str) -> list[str]:
    """The error path: every rank's whole ``value`` for exchange ``seq`` (each rank posts its own and reads all W:
    W^2 in all, only once the ranks are known to differ); the last reader deletes the keys."""
    pg, store, world, rank, ranks = peers
    base = f"funcshard/{kind}/{seq}/all"
    try:
        store.set(f"{base}/{rank}", value)
        keys = [f"{base}/{r}" for r in range(world)]
        deadline = time.monotonic() + (seconds if seconds is not None else math.inf)
        while True:
            try:
                store.wait(keys, timedelta(seconds=max(min(deadline - time.monotonic(), _SLICE), 0.001)))
                break
            except (RuntimeError, dist.DistError):
                _check_alive(peers, doing, seq)
                if time.monotonic() >= deadline:
                    late = [ranks[r] for r, key in enumerate(keys) if not store.check([key])]
                    _timeout(pg, late, doing, seq, seconds)
    except BaseException:
        _failed(peers, kind, seq)
        raise
    got = [v.decode() for v in store.multi_get(keys)]
    if store.add(f"{base}/read", 1) == world:
        for key in (*keys, f"{base}/read"):
            store.delete_key(key)
    return got


class Checks(Part):
    """The step's divergence checks: the end-of-forward exchange (``post``) and check mode's sequence exchange
    (``collective``)."""

    def __init__(self, step: Step):
        super().__init__(step)
        self.sequence = bool(step.plan.check)
        for pg in (step.pg, step.replicate_pg):  # (posts this rank's process at the first step: _check_alive)
            if pg is not None:
                _peers(pg)

    def post(self) -> None:
        """End of a forward that can have a backward (before any of its collectives): the ranks agree on which
        parameters take gradients and which groups the forward ran, on the shard group and the replicate group
        (HSDP), or every rank raises a DivergenceError naming the first that differs."""
        if not ENABLED or not torch.is_grad_enabled():
            return
        step = self.step
        groups = [peers for pg in (step.pg, step.replicate_pg) if pg is not None and (peers := _peers(pg)) is not None]
        if not groups:
            return
        masks = tuple(gb.grad_mask for gb in step.groups.values())
        key = (masks, tuple(step.prefetcher.order))
        cache = step.facts.masks
        hit = cache.get(key)
        if hit is None:
            if len(cache) > 64:  # (forward orders that vary from step to step: bounded)
                cache.clear()
            whole = f"{packed_mask(masks)} |{json.dumps(key[1])}"  # (not joined with ",": a module's name may hold
            # one, and two orders of the same length joined alike gave the same digest: ["a,b", "c"], ["a", "b,c"])
            hit = cache[key] = (hashlib.blake2b(whole.encode(), digest_size=16).hexdigest(), whole)
        digest, whole = hit
        doing = "the end of the step's forward"
        found = None  # the error found on the shard group: the replicate group is still told (HSDP, below)
        for peers in groups:
            # A rank whose shard group diverged takes part in the replicate group's exchange with a value no agreeing
            # rank has: its replicate peers (in shard groups that agree) raise too, instead of going on into a
            # backward whose collectives the diverged ranks never issue (they waited out the bound, then named the
            # ranks that raised as ranks that never arrived). Every replicate group holds a rank of each shard group.
            same, seq = _agree("step", peers, digest if found is None else _DIVERGED, step.bound.seconds, doing)
            if not same:
                told = whole if found is None else _DIVERGED + str(found)
                error = self._error(_everyones("step", peers, seq, told, step.bound.seconds, doing), peers)
                found = found or error
        if found is not None:
            raise found

    def _error(self, got: list[str], peers) -> DivergenceError:
        pg, ranks = peers[0], peers[4]
        fix = ("Every rank raises this error, before any mismatched collective; funcshard no longer uses this process "
               "group: restart the job, or make a new process group, mesh, plan and state")
        told = [(ranks[r], v[len(_DIVERGED):]) for r, v in enumerate(got) if v.startswith(_DIVERGED)]
        if told:  # (HSDP: a rank's shard group diverged; this rank's shard group agreed)
            mark_broken(pg, f"the ranks of rank {told[0][0]}'s shard group diverged")
            return DivergenceError(
                f"funcshard: the ranks diverged on another process group of the mesh: rank {told[0][0]} of "
                f"{pg_desc(pg)} (this rank's replicate group) found: {told[0][1]} (This rank's own shard group "
                f"agreed; it raises too, before its backward, whose collectives those ranks no longer issue.)")
        orders = [v.split("|", 1)[1] for v in got]
        if len(set(orders)) > 1:
            runs = [json.loads(o) for o in orders]
            i = next(i for i in range(max(map(len, runs)) + 1) if len({tuple(r[i : i + 1]) for r in runs}) > 1)
            by: dict[str, list[int]] = {}
            for r, run in enumerate(runs):
                by.setdefault(repr(run[i]) if i < len(run) else "nothing (its forward ended)", []).append(ranks[r])
            told = "; ".join(f"ranks {rs}: {v}" for v, rs in by.items())
            mark_broken(pg, "the ranks' forwards ran different groups")
            return DivergenceError(
                f"funcshard: the ranks' forwards ran different groups on {pg_desc(pg)}: the "
                f"{f'group run after {runs[0][:i]}' if i else 'first group run'} is {told}. Their backward collectives would pair different groups "
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
        doing = f"collective #? (this rank: {what})"
        same, seq = _agree("sequence", peers, what, step.bound.seconds, doing)
        if not same:
            got = _everyones("sequence", peers, seq, what, step.bound.seconds, doing.replace("#?", f"#{seq}"))
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
