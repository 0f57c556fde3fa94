"""Record what the runtime does on this rank: collectives, group lifetimes, waits, memory; write a Chrome trace.

    with funcshard.trace.trace("out/trace_rank{rank}.json") as tr:     # {rank}: this process's rank
        loss, grads = funcshard.value_and_grad(loss_fn)(state, x, y)
    tr.memory()      # [(seconds, {"unsharded_params": bytes, "comm_buffers": bytes}), ...]: the memory timeline
    tr.overlap()     # seconds of collectives in flight, of waits (exposed), and the part hidden behind other work

Open the JSON in https://ui.perfetto.dev or chrome://tracing: one process per rank; lanes for the main thread's
waits, the all-gathers and reduce-scatters in flight (issue to completion as the main thread sees it: the end of
its wait), each group's lifetime (all-gather issued -> unsharded -> freed), and counters of the bytes the runtime
holds (unsharded parameters, all-gather and reduce-scatter buffers; on CUDA also ``torch.cuda.memory_allocated``).

It listens to the runtime's events (``funcshard._runtime.observe``): nothing is recorded, and nothing costs more
than one test per event, outside the ``with``. Times are the host's (``time.perf_counter``); on CUDA a wait
returns once the compute stream is fenced, not when the collective is done, so the lanes show when the host
issued and waited, and the GPU's own timeline is torch.profiler's.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from funcshard._runtime.observe import LISTENERS

__all__ = ["Event", "Trace", "complement", "intersect", "length", "trace", "union"]


# ---- interval arithmetic (also what benchmarks/trace_overlap.py reads torch.profiler traces with) -------------


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge ``(start, end)`` intervals into disjoint sorted ones.

    Args:
        intervals: ``(start, end)`` pairs, in any order, overlapping or not.
    """
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    """The total length of disjoint ``(start, end)`` intervals.

    Args:
        intervals: disjoint ``(start, end)`` pairs (e.g. :func:`union`'s result).
    """
    return sum(b - a for a, b in intervals)


def intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two disjoint sorted interval lists.

    Args:
        xs: disjoint sorted ``(start, end)`` pairs.
        ys: disjoint sorted ``(start, end)`` pairs.
    """
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def complement(intervals: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """``[start, end]`` minus disjoint sorted ``intervals``.

    Args:
        intervals: disjoint sorted ``(start, end)`` pairs.
        start: where the span starts.
        end: where the span ends.
    """
    out, at = [], start
    for a, b in intervals:
        if a > at:
            out.append((at, min(a, end)))
        at = max(at, b)
    if at < end:
        out.append((at, end))
    return out


# ---- the recorder --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Event:
    """One runtime event: seconds since the trace started, what happened, to which group, bytes involved.

    Attributes:
        t: seconds since the trace started.
        what: the event: ``"all-gather issued"``, ``"all-gather wait"``, ``"gathered"``, ``"freed"``,
            ``"reduce-scatter issued"``, ``"reduce-scatter wait"`` or ``"reduce-scatter done"``.
        group: the group's name (``""``: the root).
        nbytes: the bytes the event concerns (buffers gathered, freed or in flight; 0 where none).
    """

    t: float
    what: str
    group: str
    nbytes: int


def _nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors or () if t is not None)


class Trace:
    """The events of one ``with trace(...)`` block on this rank (see the module docstring).

    Args:
        path: where the Chrome trace is written on exit (``{rank}`` replaced by the rank); None: kept in memory
            (:meth:`save` writes it).
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = path
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.events: list[Event] = []
        self.t0 = 0.0
        self.t1 = 0.0
        self._unsharded: dict[str, int] = {}  # group -> bytes of its unsharded buffers
        self._comm: dict[Any, int] = {}  # pending collective -> bytes of its buffers
        self._counters: list[tuple[float, dict[str, int]]] = []
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    # the listener
    def __call__(self, what: str, group: str, obj: Any) -> None:
        t = time.perf_counter() - self.t0
        nbytes = 0
        if what == "all-gather issued":
            key = ("ag", group)
            nbytes = self._comm[key] = _nbytes(obj.pending.outs if obj.pending is not None else ())
            if obj.layout.flat:  # the all-gather writes into the unsharded buffers themselves
                self._unsharded[group] = self._comm.pop(key)
        elif what == "gathered":
            self._comm.pop(("ag", group), None)
            nbytes = self._unsharded[group] = _nbytes(obj.bases)
        elif what == "freed":
            nbytes = self._unsharded.pop(group, 0)
        elif what == "reduce-scatter issued":
            nbytes = self._comm[("rs", id(obj))] = sum(_nbytes((inp, out)) for _, _, inp, out, *_ in obj.pending)
        elif what == "reduce-scatter done":
            nbytes = self._comm.pop(("rs", id(obj)), 0)
        self.events.append(Event(t, what, group, nbytes))
        counts = {"unsharded_params": sum(self._unsharded.values()), "comm_buffers": sum(self._comm.values())}
        if self._cuda:
            counts["cuda_allocated"] = torch.cuda.memory_allocated()
        self._counters.append((t, counts))

    def __enter__(self) -> Trace:
        if any(listener is self for listener in LISTENERS):
            raise RuntimeError("funcshard.trace: this Trace is already recording (entered twice, it would record "
                               "every event twice); nest a new one instead: with trace() as inner: ...")
        self.t0 = time.perf_counter()
        LISTENERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        LISTENERS.remove(self)
        self.t1 = time.perf_counter() - self.t0
        if self.path is not None:
            self.save(str(self.path).format(rank=self.rank))

    # reading it
    def memory(self) -> list[tuple[float, dict[str, int]]]:
        """The memory timeline: after each event, the bytes the runtime holds, by category."""
        return list(self._counters)

    def spans(self) -> dict[str, list[tuple[str, str, float, float]]]:
        """Intervals ``(name, group, start, end)`` in seconds per lane: ``"all-gather"`` (issued to gathered),
        ``"reduce-scatter"`` (issued to done), ``"wait"`` (the main thread blocked on either), ``"group"`` (a
        group's lifetime: all-gather issued to freed)."""
        out: dict[str, list] = {"all-gather": [], "reduce-scatter": [], "wait": [], "group": []}
        open_: dict[tuple[str, str], float] = {}
        end = self.t1 or (self.events[-1].t if self.events else 0.0)
        for e in self.events:
            for start_ev, end_ev, lane in (("all-gather issued", "gathered", "all-gather"),
                                           ("reduce-scatter issued", "reduce-scatter done", "reduce-scatter"),
                                           ("all-gather wait", "gathered", "wait"),
                                           ("reduce-scatter wait", "reduce-scatter done", "wait"),
                                           ("all-gather issued", "freed", "group")):
                if e.what == start_ev:
                    open_[(lane + start_ev, e.group)] = e.t
                elif e.what == end_ev and (lane + start_ev, e.group) in open_:
                    out[lane].append((lane if lane != "wait" else start_ev.split()[0], e.group,
                                      open_.pop((lane + start_ev, e.group)), e.t))
        for (key, group), t in open_.items():  # still open at the end (e.g. a group kept gathered)
            lane = next(ln for ln in out if key.startswith(ln))
            out[lane].append((lane, group, t, end))
        return out

    def overlap(self) -> dict[str, float]:
        """Seconds: collectives in flight (union), the main thread's waits, and the in-flight time not waited
        through (hidden behind compute or Python)."""
        sp = self.spans()
        comm = union((a, b) for lane in ("all-gather", "reduce-scatter") for _, _, a, b in sp[lane])
        waits = union((a, b) for _, _, a, b in sp["wait"])
        return {"comm_s": length(comm), "wait_s": length(waits), "hidden_s": length(comm) - length(intersect(comm, waits))}

    def chrome(self) -> dict:
        """The trace in Chrome's JSON format (``traceEvents``), one process per rank."""
        pid, us = self.rank, 1e6
        tids = {"wait": 1, "all-gather": 2, "reduce-scatter": 3}
        names = {1: "main thread: waits", 2: "all-gathers in flight", 3: "reduce-scatters in flight"}
        evs: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid}"}}]
        sp = self.spans()
        groups = sorted({g for _, g, _, _ in sp["group"]})
        for i, g in enumerate(groups):
            names[10 + i] = f"group {g or '<root>'}: gathered"
        for tid, n in names.items():
            evs.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": n}})
            evs.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for lane, items in sp.items():
            for name, g, a, b in items:
                tid = 10 + groups.index(g) if lane == "group" else tids[lane]
                label = f"{name} {g or '<root>'}" if lane != "group" else f"{g or '<root>'}"
                evs.append({"ph": "X", "name": label, "cat": lane, "pid": pid, "tid": tid, "ts": a * us,
                            "dur": max(b - a, 0.0) * us})
        for t, counts in self._counters:
            evs.append({"ph": "C", "name": "runtime memory (bytes)", "pid": pid, "ts": t * us, "args": counts})
        return {"traceEvents": evs, "displayTimeUnit": "ms",
                "otherData": {"funcshard": "funcshard.trace", "rank": pid}}

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`chrome` as JSON (gzip-compressed when ``path`` ends in ``.gz``).

        Args:
            path: the file to write (``.gz``: gzip-compressed); its folder is made if missing.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(self.chrome()).encode()
        if path.suffix == ".gz":
            with gzip.open(path, "wb") as f:
                f.write(data)
        else:
            path.write_bytes(data)
        return path


def trace(path: str | os.PathLike | None = None) -> Trace:
    """A context manager recording this rank's runtime events; on exit writes the Chrome trace to ``path`` (its
    ``{rank}`` replaced by the rank; None: keep it in memory, ``Trace.save`` later).

    Args:
        path: where to write the Chrome trace on exit (``{rank}`` replaced by the rank, ``.gz`` compressed); None: keep
            it in memory.
    """
    return Trace(path)
