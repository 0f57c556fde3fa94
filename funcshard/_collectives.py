"""The raw collectives: the calls into ``torch.distributed``, their bounded waits, and the errors of a step.

The collectives in three modules, by concern: this one (the calls, ``wait_work``, ``CollectiveError``), the public
differentiable collectives (``_primitives``: ``funcshard.all_gather`` / ``reduce_scatter`` / ``all_reduce``), and a
group's bucketed pipeline (``_pipeline``: copy-in, issue, copy-out; the gradient reduce-scatter and its one divide).

Asynchrony: every collective is issued with ``async_op=True`` and its work handle is waited before the
result is read. On CUDA with NCCL the collective runs on the process group's own communication stream and
``Work.wait()`` makes the consuming stream wait on it (an event fence, the CPU does not block); on CPU with
gloo, the collective runs on gloo's threads while Python continues, and ``wait()`` blocks.

Bounded waits: every wait of the runtime goes through ``wait_work`` (the one owner). On a process group whose waits
block the CPU (gloo) it waits at most the plan's timeout (``Work.wait(timeout=...)``, c10d's own mechanism; gloo's
reduce-scatter ignores that timeout, so its wait runs in a helper thread, ``_Waiter``), then raises a
``CollectiveTimeout`` naming the collective, its group and the step's phase; a collective that fails (a peer that
died: gloo's "Connection reset by peer") raises a ``CollectiveError``. Either way the process group is marked broken
(``broken``): a collective of it may still be pending in gloo's threads, tags no longer pair up, so every later wait
on it raises at once (no second timeout) and nothing frees a buffer such a collective may still write. On NCCL
``wait()`` is a stream fence (the CPU does not wait; a bounded wait would block it), so there the bound is the process
group's own timeout, enforced by NCCL's watchdog (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from funcshard._compat import (
    DisableFuncTorch,
    all_gather_name,
    get_unwrapped,
    is_functorch_wrapped_tensor,
    reduce_scatter_name,
)
from funcshard._spec import ShardingError

__all__ = ["CollectiveError", "CollectiveTimeout", "DivergenceError"]

# torch 2.13 renamed the tensor collectives; keep working on older releases (the names: _compat). Looked up on
# every call, so that tools which wrap torch.distributed's functions (collective counters, tracers) see ours.
_AG_NAME = all_gather_name
_RS_NAME = reduce_scatter_name


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    return getattr(dist, _AG_NAME)(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    return getattr(dist, _RS_NAME)(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


# ---- bounded waits: the one owner of every wait of the runtime ---------------------------------


class CollectiveError(RuntimeError):
    """A collective of a step failed (a peer died) or timed out (``CollectiveTimeout``), or the ranks were found to
    disagree (``DivergenceError``): a runtime failure, not bad input (a ``RuntimeError``, never a ``ShardingError``).
    The message names the collective, the group, the phase of the step and the fix; after one, the process group is
    broken: ``funcshard`` refuses further collectives on it.

    Args:
        message: what failed, where, and what to do.
        repeat: raised again for a process group an earlier failure broke (cleanup code may ignore such repeats).
    """

    def __init__(self, message: str, *, repeat: bool = False):
        super().__init__(message)
        self.repeat = repeat  # raised again for a process group an earlier failure broke (cleanup may ignore it)


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the plan's ``timeout`` (a rank died, stalled, or ran another
    collective: a forward that skipped a group, another number of microbatches).

    Args:
        message: the collective, group, phase and bound that ran out, and what to do.
        repeat: as :class:`CollectiveError`'s.
    """


class DivergenceError(CollectiveError):
    """The ranks disagree on what the step does (which parameters take gradients; in check mode, the sequence of
    collectives): found before the mismatched collective runs, raised on every rank.

    Args:
        message: what differs, each rank's value, and what to do.
        repeat: as :class:`CollectiveError`'s.
    """


DEFAULT_TIMEOUT = 300.0  # s: torchtitan's bound for the first steps (compilation, warm-up), 1/6 of gloo's 30 min
TIMEOUT_ENV = "FUNCSHARD_TIMEOUT"  # seconds; overrides the default (0 or "none": unbounded, the group's own)


def resolve_timeout(timeout: float | None) -> float | None:
    """A plan's ``timeout`` in seconds (None: the ``FUNCSHARD_TIMEOUT`` environment variable, else
    ``DEFAULT_TIMEOUT``); None: unbounded (0, inf, or the variable set to 0 or "none")."""
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV, "").strip().lower()
        if not env:
            return DEFAULT_TIMEOUT
        if env in ("none", "inf", "0", "0.0"):
            return None
        try:
            timeout = float(env)
        except ValueError:
            raise ShardingError(f"{TIMEOUT_ENV}={env!r} is not a number of seconds; set it to e.g. 120, or to "
                                f"none for no bound") from None
    return None if timeout == 0 or timeout == float("inf") else float(timeout)


def check_timeout(timeout: Any, where: str) -> None:
    """A ``timeout`` given to ``plan`` or ``fully_shard``: None or seconds > 0 (0 or inf: unbounded)."""
    if timeout is None:
        return
    if isinstance(timeout, timedelta):
        raise ShardingError(f"{where}: timeout={timeout!r}; give seconds as a number, e.g. "
                            f"timeout={timeout.total_seconds():g}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0 or timeout != timeout:
        raise ShardingError(f"{where}: timeout={timeout!r} is not a number of seconds >= 0; pass e.g. timeout=120 "
                            f"(0 or float('inf'): no bound of funcshard's own, the process group's timeout applies)")


class Bound:
    """A step's bound on its waits over one process group: the timeout (None: unbounded, or a stream fence on NCCL),
    the plan's description for messages, and the API the user called (``"funcshard.apply"``, ``"fully_shard"``; None:
    the collective's own name says it)."""

    __slots__ = ("pg", "timeout", "seconds", "plan", "api")

    def __init__(self, pg, seconds: float | None, plan: str, api: str | None = None):
        self.pg, self.seconds, self.plan, self.api = pg, seconds, plan, api
        host = pg is not None and _host_waits(pg)
        self.timeout = timedelta(seconds=seconds) if seconds is not None and host else None


class Where(NamedTuple):
    """What a wait is for: the collective's kind, the plan's group, the step's phase, and the bound."""
    kind: str
    group: str
    phase: str
    bound: Bound
    pg: Any = None  # (None: the bound's process group)


# Per process group, weakly (a destroyed group's gloo threads and sockets go with its last reference):
_HOST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> whether its waits block the CPU
_BROKEN: dict[Any, str] = {}  # process group -> what broke it; strongly: a wrapper nobody holds would vanish from a
# weak map and its group be trusted again (pybind returns the same wrapper while one lives); ``forget`` drops it


def _host_waits(pg) -> bool:
    """Whether ``Work.wait()`` blocks the CPU on this process group (gloo), not a stream fence (NCCL), and there are
    peers to wait for (not the fake group: its works never complete, its waits return at once)."""
    hit = _HOST.get(pg)
    if hit is None:
        try:
            name = dist.get_backend(pg)
        except (RuntimeError, ValueError):
            name = "gloo"
        hit = _HOST[pg] = str(name) not in ("nccl", "xccl", "fake")
    return hit


def broken(pg) -> str | None:
    """What broke the process group (a collective of it failed or timed out), or None."""
    return None if pg is None else _BROKEN.get(pg)


def pg_desc(pg) -> str:
    """The process group as messages name it: its name and ranks."""
    try:
        ranks = dist.get_process_group_ranks(pg)
    except (RuntimeError, ValueError):
        ranks = "?"
    return f"process group {getattr(pg, 'group_name', '?')!r} (ranks {ranks})"


def group_label(name: str | None) -> str:
    """How errors name a group: its name quoted, the root group (``""``) said so."""
    return "'' (the root group)" if name == "" else repr(name) if name is not None else "(unnamed)"


def describe(where: Where) -> str:
    if where.group is None:  # (a public collective: funcshard.all_gather / reduce_scatter / all_reduce)
        return f"the {where.kind} of {where.phase}"
    return f"the {where.kind} of group {group_label(where.group)} ({where.phase})"


def public_where(kind: str, what: str, group, timeout: float | None = None) -> Where:
    """Where a collective outside a step (``what``, e.g. ``funcshard.all_gather``) waits: bounded by ``timeout``
    (a plan's; None: as a plan without one, ``FUNCSHARD_TIMEOUT``, else ``DEFAULT_TIMEOUT``); on a group broken by an
    earlier failure it is refused before it is issued."""
    if (cause := broken(group)) is not None:
        raise CollectiveError(f"funcshard: {what} was not issued: {pg_desc(group)} is broken by an earlier failure "
                              f"({cause}). " + _FIX.format(why=cause), repeat=True)
    seconds = resolve_timeout(timeout)
    bound = "unbounded" if seconds is None else f"{seconds:g} s"
    source = f"timeout={timeout:g}" if timeout is not None else TIMEOUT_ENV
    return Where(kind, None, what, Bound(group, seconds, f"none; {what} is bounded by {source} ({bound})"))


def bounded_all_reduce(t: torch.Tensor, group, what: str, op=dist.ReduceOp.SUM, timeout: float | None = None) -> None:
    """``dist.all_reduce`` of ``t`` in place, its wait bounded as ``public_where`` says (``what`` names it)."""
    where = public_where("all-reduce", what, group, timeout)
    wait_work(dist.all_reduce(t, op=op, group=group, async_op=True), where)


_FIX = ("Make every rank run the same groups in the same order (no data-dependent skipping of a group, the same "
        "number of microbatches and forwards), and find the rank that failed first in its own log. The process group "
        "can no longer be trusted ({why}): end the job and restart it (torchrun restarts it from the last checkpoint), "
        "or destroy it and make a new one with a new mesh, plan and state. Raise the bound with plan(..., timeout=s), "
        "model.set_timeout(s) (fully_shard) or FUNCSHARD_TIMEOUT=s if a rank is legitimately that slow.")


def wait_work(work, where: Where | None) -> None:
    """Wait for ``work`` (the one place the runtime waits), bounded by ``where.bound``; a failure or timeout raises
    a CollectiveError naming ``where`` and marks the process group broken."""
    if work is None:
        return
    if where is None:
        work.wait()
        return
    pg = where.pg if where.pg is not None else where.bound.pg
    if (cause := broken(pg)) is not None:
        raise CollectiveError(f"funcshard: {describe(where)} was not waited for: {pg_desc(pg)} is broken by an "
                              f"earlier failure ({cause})" + _called(where), repeat=True)
    bound = where.bound
    try:
        # Never ``work.is_completed()``: it takes the work's lock holding the GIL, while a gloo thread finishing the
        # work under torch.profiler holds that lock and waits for the GIL (its end callback restores the issuing
        # thread's saved-tensor hooks or dispatch modes: Python objects): a deadlock, as ranks that stop mid-step
        # (bench.py's profiled fs_apply step hung so: apply's forward issues its gathers under saved-tensor hooks).
        # ``wait`` lets go of the GIL. (gloo's reduce-scatter work never said it was completed before its wait: it
        # always went to the _Waiter, as now.)
        # A work wrapping a future (torch's threaded test process group, custom backends) has no finite-timeout
        # wait: the _Waiter bounds it, as gloo's reduce-scatter (whose work ignores wait's timeout). (Not
        # ``get_future()`` first: gloo's reduce-scatter work raises there, a C++ exception per wait, and torch's test
        # harness symbolizes each one's stack: seconds a wait, upstream FSDP2 tests past their 300 s limit.)
        if bound.timeout is None or pg is not bound.pg and not _host_waits(pg):
            work.wait()
        elif where.kind == "reduce-scatter" or not _wait_bounded(work, bound.timeout):
            if not _Waiter.wait(work, bound.seconds):
                raise collective_failed(where, pg, None, True)
    except RuntimeError as e:
        if isinstance(e, CollectiveError):
            raise
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        raise collective_failed(where, pg, e, timed_out) from e


def _wait_bounded(work, timeout) -> bool:
    """``work.wait(timeout)``; False where the work has no finite-timeout wait (``FutureWrappingWork``)."""
    try:
        work.wait(timeout=timeout)
    except RuntimeError as e:
        if "finite timeout not implemented" in str(e):
            return False
        raise
    return True


class _Waiter:
    """A thread that waits for works whose own ``wait(timeout)`` ignores the timeout (gloo's reduce-scatter runs
    inside its ``wait``); the caller waits for the thread, bounded. A thread left waiting for a collective that timed
    out is retired (it ends when gloo gives up) and a new one serves later waits."""

    current: _Waiter | None = None

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.retired = False
        threading.Thread(target=self._run, name="funcshard-wait", daemon=True).start()

    def _run(self) -> None:
        while not self.retired:
            work, done, box = self.queue.get()
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 (handed to the waiting caller)
                box.append(e)
            work = None  # (not held while the thread waits for the next: a work keeps its tensors alive)
            done.set()

    @classmethod
    def wait(cls, work, seconds: float) -> bool:
        """Wait for ``work`` at most ``seconds``; False if it did not complete (its exception, if any, raised)."""
        me = cls.current
        if me is None:
            me = cls.current = _Waiter()
        done, box = threading.Event(), []
        me.queue.put((work, done, box))
        if not done.wait(seconds):
            me.retired, cls.current = True, None
            return False
        if box:
            raise box[0]
        return True


def collective_failed(where: Where, pg, error: BaseException | None, timed_out: bool,
                      detail: str = "") -> CollectiveError:
    """The error for a collective that failed or timed out; marks its process group broken."""
    what = describe(where)
    if timed_out:
        head = (f"funcshard: {what} did not complete within {where.bound.seconds:g} s on {pg_desc(pg)} (plan: "
                f"{where.bound.plan}){detail}: a rank died, stalled, or is waiting in another collective (a forward "
                f"that skipped a group on some ranks, another number of microbatches or forwards, a rank that "
                f"raised).")
        why = "its collective is still pending in the backend"
    else:
        head = (f"funcshard: {what} failed on {pg_desc(pg)} (plan: {where.bound.plan}){detail}: "
                f"{str(error).strip().splitlines()[-1] if error is not None else 'unknown'}. A peer rank died or "
                f"ran a different collective.")
        why = "a collective of it failed"
    _BROKEN[pg] = f"{what} {'timed out' if timed_out else 'failed'}"
    cls = CollectiveTimeout if timed_out else CollectiveError
    return cls(head + " " + _FIX.format(why=why) + _called(where))


def _called(where: Where) -> str:
    """The end of a step's collective error: the API the user called (a public collective names itself)."""
    return f" (in a step of {where.bound.api})" if where.bound.api else ""


def mark_broken(pg, cause: str) -> None:
    _BROKEN[pg] = cause


def forget(pg) -> None:
    """Drop a destroyed process group (``dist.destroy_process_group``) from the broken ones, so that nothing of
    funcshard keeps it (its gloo threads and sockets): ``tests/multirank`` after each job."""
    _BROKEN.pop(pg, None)


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any functorch wrappers (itself if none)."""
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def raw(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any functorch wrappers, detached (shares storage)."""
    return unwrapped(t).detach()


def raw_grads(grads: list) -> None:
    """In place: each gradient as a plain tensor (``raw``); one that is already plain and has no autograd
    history (the usual case) is kept as it is. In place, so that no loop variable is left holding one."""
    grads[:] = [g if g is None or not (g.requires_grad or is_functorch_wrapped_tensor(g)) else raw(g)
                for g in grads]


def no_grad():
    """``torch.no_grad()``, or nothing where grad is already off (most calls on the hot path: the runtime turned
    it off; ``torch.no_grad()`` costs ~2.5 us a use, ~7 uses a group a step)."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


def no_functorch():
    """In-place and communication work inside a backward under a functorch transform runs with functorch off."""
    return DisableFuncTorch()


def free_buffers(buffers) -> None:
    """Release communication buffers whose collective has completed."""
    for b in buffers:
        b.untyped_storage().resize_(0)
