"""The runtime's own lifecycle run over stand-in buffers: what the cost model replays (``cost._Replay``).

A ``ReplayStep`` holds a real ``GroupRun`` per group, the real ``Prefetcher``, ``FrozenRelease`` and ``ReduceQueue``,
and in place of each group's ``GroupBuffers`` a ``StandIn``: the same status (``Status``) and methods, which tell a
ledger (the cost model's memory, time and schedule) what the real ones would allocate, issue, wait for and free. So
when a group is gathered, prefetched and freed (``GroupRun.gather_and_prefetch``, ``GroupRun.reshard_after_forward``,
``GroupRun.free_after_backward``, ``FrozenRelease``) and when the reduce-scatter in flight is taken
(``ReduceQueue.start``, ``ReduceQueue.before_gather``) are decided by the runtime's code, once, in both.

The ledger (``cost._Replay``): ``all_gather(name, post)`` (``post``: the bytes kept after forward it gathers from, or
None), ``copy_out(name)``, ``freed(name)``, ``kept(name, k) -> bytes`` (the ``k``-th of an int
``reshard_after_forward``), ``reduce_scatter(name)`` (its reduce-scatter in flight, with ``replicate`` (not None:
HSDP's all-reduce follows) and ``finish()``, or None: none issued).
"""

from __future__ import annotations

from typing import Any

from funcshard._plan import Group, Plan
from funcshard._runtime.backward import FrozenRelease, ReduceQueue
from funcshard._runtime.buffers import Status
from funcshard._runtime.group import GroupRun
from funcshard._runtime.prefetch import Prefetcher


class StandIn:
    """A group's ``GroupBuffers`` in the replay: its status and post-forward shards, no tensors."""

    __slots__ = ("group", "ledger", "shards", "status", "post", "frozen", "trainable")

    def __init__(self, group: Group, ledger: Any, frozen: bool, trainable: bool):
        self.group, self.ledger = group, ledger
        self.shards = group.params  # (an empty group gathers nothing: GroupRun.issue, GroupBuffers.issue)
        self.status = Status.SHARDED
        self.post: int | None = None  # bytes kept after forward (int reshard_after_forward), until gathered from
        self.frozen, self.trainable = frozen, trainable

    def issue(self, pg, rank: int, where=None) -> None:
        if self.status is not Status.SHARDED:
            return
        if not self.shards:
            self.status = Status.GATHERED
            return
        self.ledger.all_gather(self.group.name, self.post)
        self.status = Status.GATHERING

    def wait(self) -> None:
        if self.status is not Status.GATHERING:
            return
        self.ledger.copy_out(self.group.name)
        self.post = None  # (the k-th kept after forward was the all-gather's input)
        self.status = Status.GATHERED

    def free(self) -> None:
        self.post = None
        if self.status is Status.SHARDED:
            return
        self.wait()
        self.ledger.freed(self.group.name)
        self.status = Status.SHARDED

    def reshard_to(self, plan: Plan, k: int) -> None:
        if self.status is Status.SHARDED:
            return
        self.wait()
        self.free()
        self.post = self.ledger.kept(self.group.name, k)


class _Slots:
    """No module: nothing to swap."""

    swapped = False

    def swap_out(self) -> None:
        pass


class _Checks:
    sequence = False

    def collective(self, what: str) -> None:
        pass


class _Queue(ReduceQueue):
    """The runtime's reduce queue; the reduce-scatter it issues is the ledger's."""

    observed = False  # (its takes are not the runtime's events: funcshard.trace does not record them)

    def __init__(self, step: ReplayStep, ledger: Any):
        super().__init__(step)
        self.ledger = ledger

    def issue(self, name: str, grads: list):
        return self.ledger.reduce_scatter(name)


class ReplayStep:
    """A step of ``plan`` over stand-ins (see the module docstring): ``runs``, ``groups`` (the stand-ins),
    ``prefetcher``, ``frozen``, ``reduce_queue``, as ``Step``'s."""

    def __init__(self, plan: Plan, ledger: Any, frozen: frozenset[str], trainable: frozenset[str]):
        self.plan = plan
        self.pg, self.rank, self.replicate_pg, self.sink = None, 0, None, None
        self.backward_started, self.second_order = False, False  # (first order)
        self.checks = _Checks()
        self.groups = {g.name: StandIn(g, ledger, g.name in frozen, g.name in trainable) for g in plan.groups}
        self.runs = {name: GroupRun(self, gb, _Slots()) for name, gb in self.groups.items()}
        self.prefetcher = Prefetcher(self)
        self.frozen = FrozenRelease(self)
        self.reduce_queue = _Queue(self, ledger)
        self.saved = None  # (no autograd: no saved-tensor hooks)

    def where(self, kind: str, name: str) -> None:
        return None

    def fail(self, error: BaseException) -> None:
        pass

    def used(self, name: str, *, watched: bool, unwatched: bool) -> None:
        """A frozen group's forward use as the traced step saw it (``FrozenRelease``'s counts): its inputs' gradients
        watched (``FrozenRelease.watch_inputs``), or not watchable (kept until the end of backward); one gather with
        autograd history when it takes a gradient (``FrozenRelease.node_made``)."""
        c = self.runs[name].counts
        if unwatched:
            c.unwatched = True
        elif watched:
            c.uses += 1
            c.inputs_left += 1
        if self.groups[name].trainable:
            self.frozen.node_made(name)

    def post_backward(self, name: str) -> None:
        """The group's gradients are complete (``GroupRun.reduce_later``): ``ReduceQueue.start`` frees it (or counts
        it, with frozen parameters), takes the reduce-scatter in flight and issues the group's, left in flight."""
        pending = self.reduce_queue.start(name, [])
        if pending is not None:
            self.reduce_queue.defer(name, pending, None, None)
