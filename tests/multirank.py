"""Multi-rank test harness: run a function on W local CPU ranks under torch.distributed (gloo).

Usage, from a test module in ``tests/``::

    import torch
    import torch.distributed as dist
    from multirank import run_ranks, RankError, RankTimeout

    def _sum_of_ranks(scale):                   # module level: pickled by reference
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item() * scale

    def test_sum_of_ranks():
        assert run_ranks(4, _sum_of_ranks, 2.0) == [12.0] * 4

``run_ranks(world_size, fn, *args, timeout=120.0, **kwargs)`` runs ``fn(*args, **kwargs)`` on every
rank of a pool of ``world_size`` spawned worker processes and returns ``[rank0_result, ...]``.
Inside ``fn`` the default process group (gloo, collectives time out after ``GLOO_TIMEOUT`` s)
spans the pool, so ``dist.get_rank()`` / ``dist.get_world_size()`` / collectives just work.
``fn``, args, kwargs and results travel by plain pickle (tensors are fine; lambdas and nested
functions are not: they fail in the caller before anything is sent).

Pools start lazily, one per world size, and are reused for the rest of the session; they are shut
down at interpreter exit (``shutdown_pools``).  Workers are forked from one fork server per session
(``multiprocessing``'s forkserver; spawned where there is none) that imported torch and the modules
named in ``PRELOAD`` once, so a pool (a fresh one after a failure included) starts in a fraction of a
second instead of each rank importing torch and funcshard again (about 5 s of CPU per rank).  The
workers inherit the environment the fork server started with (the caller's at the first pool).
Failures:

* a rank raises -> ``RankError`` whose message holds every failing rank's formatted traceback.
  The other ranks get ``GRACE`` seconds to answer (they may be blocked in a collective).
* a rank dies (``os._exit``, segfault) -> ``RankError`` naming the rank and its exit code.
* the job runs past ``timeout`` with no rank failing -> ``RankTimeout`` (a ``RankError``).

Ranks that did not answer have their Python stacks (via faulthandler) put in the message, then
the pool is killed and the next call starts a fresh one.  After every job in which all ranks
answered, an all_reduce on the default group checks that the pool is still in step (no rank left
a collective behind, nobody destroyed the default group); if not, the pool is discarded too; if so, every rank
destroys the process groups the job made (``_release_groups``; a job's groups, meshes and plans do not outlive it: a
module-level cache of them in a test module sees its groups destroyed between jobs).
Worker stdout/stderr (file descriptors 1 and 2) go where the parent's went when the pool started (pytest
captures them).
"""
from __future__ import annotations

import atexit
import faulthandler
import gc
import importlib
import json
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["run_ranks", "shutdown_pools", "RankError", "RankTimeout", "Died"]

GLOO_TIMEOUT = 60.0     # s before a stuck collective raises inside a worker (harness never waits on it)
STARTUP_TIMEOUT = 120.0  # s for a fresh pool to import torch and rendezvous
GRACE = 3.0             # s the other ranks get to answer once one rank has failed
SYNC_TIMEOUT = 10.0     # s for the post-job health check
# whether pools started from now on destroy a job's process groups after it (_release_groups) and gc.freeze() their
# workers at start; False: a test module that manages its groups itself (test_divergence)
RELEASE = True
# imported once by the fork server, so that no worker imports them again (comma separated; "" for none)
PRELOAD = os.environ.get("MULTIRANK_PRELOAD", "funcshard.fsdp,torch.distributed.fsdp,torch.distributed.checkpoint")
_FORKSERVER_ENV = "_MULTIRANK_FORKSERVER_PRELOAD"  # set only while the fork server starts (see _context)

if _FORKSERVER_ENV in os.environ:  # this process is the fork server, importing this module (see _context)
    _setup = json.loads(os.environ.pop(_FORKSERVER_ENV))
    sys.path[:] = _setup["sys_path"]  # the caller's (python 3.11's fork server does not apply it)
    os.environ.pop("PYTHONPATH")
    if _setup["PYTHONPATH"] is not None:
        os.environ["PYTHONPATH"] = _setup["PYTHONPATH"]
    for _name in filter(None, _setup["preload"].split(",")):
        try:
            importlib.import_module(_name)
        except Exception:  # pragma: no cover (a worker imports it itself and its job reports the error)
            pass


class RankError(RuntimeError):
    """Some rank raised, died or did not answer; the message tells each such rank's story."""


class RankTimeout(RankError):
    """The job did not finish on every rank within ``timeout`` seconds (and no rank failed)."""


# ----------------------------------------------------------------------------- worker side
class _Fd:
    """A file descriptor of the parent's, duplicated into the worker when the process object is pickled."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _Fd._detach, (DupFd(self.fd),)

    @staticmethod
    def _detach(dup):
        return dup.detach()


def _worker(rank, world_size, port, conn, stack_path, stdio, release):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    for target, fd in stdio:  # the parent's at the pool's start (the fork server's: another test's capture)
        os.dup2(fd, target)
        os.close(fd)
    stack_file = open(stack_path, "w")  # kept open: faulthandler writes here on SIGUSR1
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(1)
    loopback = [n for _, n in socket.if_nameindex() if n.startswith("lo")]
    if loopback:  # all ranks are local: keep gloo off hostname resolution and real NICs
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback[0])
    try:
        timeout = timedelta(seconds=GLOO_TIMEOUT)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        reply = ("ok", os.getpid())
        if release:
            gc.freeze()  # (torch's and the preloaded modules' objects: the release's gc.collect skips them: ~30 ms)
    except BaseException:
        reply = ("err", traceback.format_exc())
    conn.send_bytes(pickle.dumps(reply))
    while reply[0] == "ok":
        try:
            cmd, path, cwd, job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # parent gone
            break
        if cmd == "stop":
            break
        try:
            if cmd == "sync":
                groups = _job_groups()
                t = torch.tensor([1.0, float(len(groups))])  # (and whether any rank has groups to release)
                dist.all_reduce(t)
                if t[0].item() != world_size:
                    raise RuntimeError(f"health check all_reduce gave {t[0].item()}, not {world_size}")
                if t[1].item() and release:
                    _release_groups(groups)
                del groups
                result = None
            else:
                sys.path[:] = path  # the parent's, so fn pickled by reference imports the same
                os.chdir(cwd)
                fn, args, kwargs = pickle.loads(job)
                result = fn(*args, **kwargs)
            out = pickle.dumps(("ok", result))
        except BaseException:
            out = pickle.dumps(("err", traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send_bytes(out)
        except OSError:
            break
    if dist.is_initialized():
        dist.destroy_process_group()


_KEPT: list = []  # destroyed groups that may hold a pending gloo collective: kept alive, never freed (_release_groups)


def _job_groups() -> list:
    """The process groups registered on this rank besides the default group: the last job's (earlier ones' are
    destroyed after each job)."""
    from torch.distributed import distributed_c10d as c10d

    return [pg for pg in c10d._world.pg_map if pg is not c10d.GroupMember.WORLD]


def _release_groups(groups: list) -> None:
    """After a job every rank answered (the health check's all_reduce: every rank has left the job), destroy the
    process groups it made (``groups``, this rank's), on every rank alike, so that their gloo threads and sockets go
    (~3 threads a group: never destroyed, a worker grew by ~95 threads in tests/test_mesh2d.py alone). torch's caches
    that keep meshes by equality (DeviceMesh compares by layout, not by its groups) are cleared first: a later job's
    equal mesh got the destroyed group's name from them ("Could not resolve the process group registered under the
    name 3"), and they would keep the groups alive.

    A rank that issued more collectives on a group than one of its peers (gloo's sequence numbers, gathered over the
    default group; e.g. a funcshard collective that timed out, or ranks waiting for one that raised) may hold a
    pending gloo collective on it: there the group is destroyed but kept alive (``_KEPT``, never freed), because
    freeing it waits in gloo's threads for that collective until the group's timeout while a peer's object lives
    (~25-30 s inside a later job's garbage collection, or this health check timing out: measured). The ranks that
    issued the fewest have none pending and free theirs, which ends the others' pending collective with an error at
    once, as before this release (test_divergence kept such a group on the rank that failed only)."""
    seqs = [None] * dist.get_world_size()
    dist.all_gather_object(seqs, {pg.group_name: (tuple(dist.get_process_group_ranks(pg)), _seq(pg))
                                  for pg in groups})
    _clear_mesh_caches()
    collectives = sys.modules.get("funcshard._collectives")
    for pg in groups:
        ranks, mine = seqs[dist.get_rank()][pg.group_name]
        members = [other[pg.group_name][1] for other in seqs if other.get(pg.group_name, (None,))[0] == ranks]
        if mine is None or None in members or mine > min(members):  # (issued more than a peer: may be pending)
            _KEPT.append(pg)
        dist.destroy_process_group(pg)
        if collectives is not None:
            collectives.forget(pg)
    groups.clear()  # (the caller's list)
    pg = None  # (the last one's reference: every group is freed here unless _KEPT or a job's own leftovers hold it)
    gc.collect()  # (a fully_shard model's mesh sits in reference cycles: its groups go now, not in a later job)


def _seq(pg) -> int | None:
    """The number of collectives this rank issued on ``pg`` (gloo's sequence number; None where there is none)."""
    try:
        return pg._get_sequence_number_for_group()
    except (AttributeError, RuntimeError):
        return None


def _clear_mesh_caches() -> None:
    """Clear torch's caches keyed by (or holding) DeviceMeshes: DTensor's sharding propagation (Python and C++), its
    redistribute plans and transforms, its mesh topology and tensor-meta caches (each guarded: not every torch version
    has all of them)."""
    for module, path in [("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
                         ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
                         ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
                         ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
                         ("torch.distributed.tensor._sharding_prop",
                          "ShardingPropagator._propagate_tensor_meta_cached.cache_clear")]:
        try:
            fn = importlib.import_module(module)
        except ImportError:
            continue
        for name in path.split("."):
            fn = getattr(fn, name, None)
        if callable(fn):
            fn()


# ----------------------------------------------------------------------------- parent side
def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _context():
    """The fork server's context, the server started (importing this module and ``PRELOAD``) if it is not running;
    "spawn" where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload([__name__])
    saved = os.environ.get("PYTHONPATH")
    # the fork server finds this module through PYTHONPATH, then takes the caller's sys.path and PYTHONPATH back
    os.environ[_FORKSERVER_ENV] = json.dumps({"preload": PRELOAD, "sys_path": sys.path, "PYTHONPATH": saved})
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__))] + [saved] * bool(saved))
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[_FORKSERVER_ENV]
        os.environ.pop("PYTHONPATH")
        if saved is not None:
            os.environ["PYTHONPATH"] = saved
    return mp.get_context("forkserver")


class _Pool:
    def __init__(self, world_size):
        self.world_size = world_size
        ctx = _context()
        self.tmpdir = tempfile.TemporaryDirectory(prefix=f"multirank{world_size}-")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs, self.conns = [], []
        stdio = [(fd, _Fd(fd)) for fd in (1, 2) if _is_open(fd)]
        for r in range(world_size):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_worker, name=f"multirank-w{world_size}-rank{r}", daemon=True,
                            args=(r, world_size, self.store.port, there, self._stack_path(r), stdio, RELEASE))
            p.start()
            there.close()
            self.procs.append(p)
            self.conns.append(here)
        replies, dead, missing = self.collect(STARTUP_TIMEOUT)
        if dead or missing or any(s != "ok" for s, _ in replies.values()):
            self.kill()
            raise RankError(_report(f"starting a pool of {world_size} ranks failed", world_size,
                                    replies, dead, missing, {}))
        self.pids = [replies[r][1] for r in range(world_size)]

    def _stack_path(self, rank):
        return os.path.join(self.tmpdir.name, f"rank{rank}.stack")

    def send(self, cmd, job=None):
        msg = pickle.dumps((cmd, list(sys.path), os.getcwd(), job))
        for c in self.conns:
            try:
                c.send_bytes(msg)
            except OSError:  # a dead worker: collect() will notice
                pass

    def collect(self, timeout, grace=GRACE):
        """Wait for one reply per rank -> (replies {rank: (status, value)}, dead {rank: exitcode},
        missing [ranks]).  Once a rank fails, the others get at most ``grace`` more seconds."""
        deadline, grace_end = time.monotonic() + timeout, None
        replies, dead, pending = {}, {}, set(range(self.world_size))
        while pending:
            if grace_end is None and (dead or any(s != "ok" for s, _ in replies.values())):
                grace_end = time.monotonic() + grace
            left = min(deadline, grace_end or deadline) - time.monotonic()
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                         timeout=max(left, 0))
            if not ready:
                break
            for r in sorted(pending):
                conn, proc = self.conns[r], self.procs[r]
                if conn not in ready and proc.sentinel not in ready:
                    continue
                pending.discard(r)
                try:
                    data = conn.recv_bytes() if conn.poll() else None
                except (EOFError, OSError):
                    data = None
                if data is None:
                    proc.join(1.0)
                    dead[r] = proc.exitcode
                    continue
                try:
                    replies[r] = pickle.loads(data)
                except Exception:
                    replies[r] = ("err", "the result could not be unpickled in the parent:\n"
                                  + traceback.format_exc())
        return replies, dead, sorted(pending)

    def dump_stacks(self, ranks):
        """Python stacks of live ranks ``ranks`` (faulthandler, SIGUSR1) -> {rank: text}."""
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.3)
        stacks = {}
        for r in ranks:
            with open(self._stack_path(r)) as f:
                stacks[r] = f.read().strip() or "(no stack dump)"
        return stacks

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self._reap(5.0)

    def close(self):
        self.send("stop")
        self._reap(5.0)

    def _reap(self, timeout):
        end = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(end - time.monotonic(), 0))
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        self.tmpdir.cleanup()
        self.store = None


def _report(header, world_size, replies, dead, missing, stacks):
    parts = [header]
    for r in range(world_size):
        if r in replies and replies[r][0] != "ok":
            parts.append(f"--- rank {r} raised:\n{replies[r][1].rstrip()}")
        elif r in dead:
            code = dead[r]
            how = f" (signal {signal.Signals(-code).name})" if code is not None and code < 0 else ""
            parts.append(f"--- rank {r} died with exit code {code}{how}")
        elif r in missing:
            parts.append(f"--- rank {r} did not answer (killed); its stack was:\n{stacks.get(r, '?')}")
    return "\n".join(parts)


_pools: dict[int, _Pool] = {}


def shutdown_pools():
    """Stop every pool (registered with atexit; harmless to call at any time)."""
    while _pools:
        _pools.popitem()[1].close()


atexit.register(shutdown_pools)


def fresh_pool(world_size: int) -> None:
    """Stop the pool of ``world_size`` ranks, if any: the next job starts one afresh (a job whose ranks must not share
    a history of process groups with earlier jobs')."""
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.close()


class Died(NamedTuple):
    """``run_ranks(..., dead_ok=True)``'s result for a rank that died: its exit code (negative: the signal)."""

    exitcode: int | None


def run_ranks(world_size, fn, *args, timeout=120.0, grace=GRACE, dead_ok=False, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ranks 0..world_size-1; return the list of their results.

    ``grace``: the seconds the other ranks get to answer once one has failed. ``dead_ok``: a rank that died is no
    failure (fault injection): its result is ``Died(exitcode)``, the others' are their results (the pool is started
    afresh for the next job)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    job = pickle.dumps((fn, args, kwargs))  # unpicklable fn/args fail here, pool untouched
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = _Pool(world_size)  # raises RankError (pool killed) on failure
    start = time.monotonic()
    stacks, unsynced = {}, None
    try:
        pool.send("run", job)
        replies, dead, missing = pool.collect(timeout, grace)
        if missing:
            stacks = pool.dump_stacks(missing)
        elif not dead:  # everyone answered: is the default group still usable and in step?
            pool.send("sync")
            unsynced = pool.collect(SYNC_TIMEOUT)
            if unsynced[1] or unsynced[2] or any(s != "ok" for s, _ in unsynced[0].values()):
                stacks = pool.dump_stacks(unsynced[2]) if unsynced[2] else {}
            else:
                unsynced = None
    except BaseException:  # e.g. KeyboardInterrupt or pytest-timeout mid-job: state unknown
        _pools.pop(world_size).kill()
        raise
    discarded = bool(dead or missing or unsynced)
    if discarded:
        _pools.pop(world_size).kill()
    elapsed = time.monotonic() - start
    where = f"{name} on {world_size} rank(s)"
    note = "; pool killed" if discarded else ""
    bad = sorted([r for r, (s, _) in replies.items() if s != "ok"] + ([] if dead_ok else list(dead)))
    if bad:
        also = f"; ranks {missing} did not answer" if missing else ""
        raise RankError(_report(f"{where} failed on ranks {bad}{also}{note}",
                                world_size, replies, dead, missing, stacks))
    if missing:
        raise RankTimeout(_report(
            f"{where} timed out after {elapsed:.1f} s (timeout={timeout}): ranks {missing} did not "
            f"answer (stalled collective? deadlock?){note}", world_size, replies, dead, missing, stacks))
    if unsynced:
        raise RankError(_report(
            f"{where} returned on every rank, but the post-job health check (an all_reduce on the "
            f"default group) failed: mismatched collectives or destroyed default group?{note}",
            world_size, *unsynced, stacks))
    return [Died(dead[r]) if r in dead else replies[r][1] for r in range(world_size)]
