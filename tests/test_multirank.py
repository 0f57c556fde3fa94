"""Tests for the multi-rank harness (tests/multirank.py)."""
import os
import pickle
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

import multirank
from multirank import RankError, RankTimeout, run_ranks


def _whoami(scale, *, offset=0.0):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item() * scale + offset


def _pid():
    return os.getpid()


def _gather_tensor(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x * (dist.get_rank() + 1))
    return torch.stack(out), torch.get_num_threads()


def _raise_on(bad, collective_after):
    if dist.get_rank() == bad:
        raise ValueError(f"boom from rank {bad}")
    if collective_after:  # the healthy ranks then wait for the failed one in a collective
        dist.all_reduce(torch.ones(1))
    return "fine"


def _exit_on(bad, code):
    if dist.get_rank() == bad:
        os._exit(code)
    dist.barrier()
    return "unreachable?"


def _stall():
    if dist.get_rank() == 0:  # nobody else joins: this blocks until killed
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def _skip_a_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never matched, never waited on
    return "ok"


def _child_states():
    """{pid: state letter} of this process's children (Linux /proc), zombies included."""
    states = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if d.isdigit() and int(fields[1]) == os.getpid():
            states[int(d)] = fields[0]
    return states


def _assert_no_zombies():
    if sys.platform.startswith("linux"):
        assert "Z" not in _child_states().values(), _child_states()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_per_rank(world_size):
    total = world_size * (world_size + 1) / 2
    got = run_ranks(world_size, _whoami, 2.0, offset=0.5)
    assert got == [(r, world_size, 2 * total + 0.5) for r in range(world_size)]


def test_pool_is_reused_and_tensors_travel():
    first = run_ranks(2, _pid)
    assert len(set(first)) == 2 and os.getpid() not in first
    stacked, threads = zip(*run_ranks(2, _gather_tensor, torch.arange(3.0)))
    expected = torch.stack([torch.arange(3.0), 2 * torch.arange(3.0)])
    for s in stacked:
        torch.testing.assert_close(s, expected)
    assert threads == (1, 1)
    assert run_ranks(2, _pid) == first


def test_unpicklable_fn_fails_in_caller():
    pids = run_ranks(2, _pid)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        run_ranks(2, lambda: 1)
    assert run_ranks(2, _pid) == pids


def test_raising_rank_reports_traceback_and_pool_is_kept():
    pids = run_ranks(2, _pid)
    with pytest.raises(RankError, match=r"(?s)rank 1 raised:\nTraceback.*_raise_on.*"
                                        r"ValueError: boom from rank 1") as info:
        run_ranks(2, _raise_on, 1, collective_after=False)
    assert not isinstance(info.value, RankTimeout)
    assert "rank 0" not in str(info.value)
    assert run_ranks(2, _pid) == pids  # every rank answered and the group is in step: reused


def test_raising_rank_while_others_wait_in_collective(monkeypatch):
    monkeypatch.setattr(multirank, "GRACE", 1.0)
    pids = run_ranks(2, _pid)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 0 did not answer.*_raise_on.*"
                                        r"rank 1 raised:.*ValueError: boom from rank 1"):
        run_ranks(2, _raise_on, 1, collective_after=True, timeout=30)
    assert time.monotonic() - t0 < 10
    assert run_ranks(2, _whoami, 1.0) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert run_ranks(2, _pid) != pids  # fresh pool
    _assert_no_zombies()


def test_dead_rank_is_named_and_next_call_works():
    run_ranks(2, _pid)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 died with exit code 3"):
        run_ranks(2, _exit_on, 1, 3, timeout=30)
    assert time.monotonic() - t0 < 10
    _assert_no_zombies()
    assert run_ranks(2, _whoami, 1.0) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_stalled_collective_times_out():
    run_ranks(2, _pid)
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"(?s)timed out.*rank 0 did not answer.*_stall") as info:
        run_ranks(2, _stall, timeout=2)
    assert time.monotonic() - t0 < 2 + 5
    assert "rank 1 " not in str(info.value)  # rank 1 returned fine
    _assert_no_zombies()
    assert run_ranks(2, _whoami, 1.0) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_out_of_step_pool_is_detected_and_replaced(monkeypatch):
    monkeypatch.setattr(multirank, "SYNC_TIMEOUT", 1.0)
    monkeypatch.setattr(multirank, "GRACE", 1.0)
    pids = run_ranks(2, _pid)
    with pytest.raises(RankError, match="health check"):
        run_ranks(2, _skip_a_collective)
    assert run_ranks(2, _pid) != pids


class _Interrupt(Exception):
    pass


def _raise_interrupt(signum, frame):
    raise _Interrupt


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX signals")
def test_interrupted_job_kills_pool(monkeypatch):
    """An exception in the caller mid-job (e.g. pytest-timeout's signal method) discards the pool."""
    pids = run_ranks(2, _pid)
    old = signal.signal(signal.SIGALRM, _raise_interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(_Interrupt):
            run_ranks(2, _stall, timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    _assert_no_zombies()
    assert run_ranks(2, _pid) != pids


def _cwd():
    return os.getcwd()


def test_workers_follow_callers_cwd(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert run_ranks(2, _cwd) == [str(tmp_path)] * 2


def _groups_job():
    """A group over every rank, a DTensor sum gathered over a mesh of it (DTensor's caches keep the mesh, and an earlier
    job's mesh over its own such group is equal to this one: DeviceMesh compares by layout), and a 2-D mesh (a group
    of its own on its axis of 1): the gathered values and this worker's OS threads (gloo's C++ threads included)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    pg = dist.new_group(list(range(dist.get_world_size())))
    dt = distribute_tensor(torch.arange(8.0), DeviceMesh.from_group(pg, "cpu"), [Shard(0)])
    full = (dt + 1).full_tensor()  # (the sum's mesh: from DTensor's sharding propagation cache)
    init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
    return full.tolist(), len(os.listdir("/proc/self/task"))


def _group_on_rank_0_only():
    dist.new_group([0])  # (every rank calls it; only rank 0 is in it: rank 1 has no group to release)
    return os.getpid()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")
def test_a_jobs_process_groups_do_not_outlive_it():
    """Each _groups_job makes 2 gloo groups on each rank (3 threads each); the harness destroys them after the job
    (and after a job that made a group on one rank only), so a worker's thread count stays flat over jobs (it grew
    by 6 threads a job: 10, 16, ..., 34 over 5 jobs), and the next job's equal mesh over its own group works (torch's
    caches that keep meshes by equality are cleared: else "Could not resolve the process group registered under the
    name ...")."""
    threads, pids = [], run_ranks(2, _pid)
    for _ in range(5):
        assert run_ranks(2, _group_on_rank_0_only) == pids  # (the pool kept: the release ran on both)
        out = run_ranks(2, _groups_job)
        assert [full for full, _ in out] == [list(map(float, range(1, 9)))] * 2
        threads.append([n for _, n in out])
    assert all(n <= first + 2 for first, n in zip(threads[1], threads[-1])), threads


_HELD: list = []  # (a group kept alive across jobs by a test module, as test_divergence's and test_muon's lists do)


def _leave_a_collective_pending():
    """Rank 0 issues a collective on a new group that rank 1 never joins; rank 1 keeps its object of the group alive."""
    from datetime import timedelta

    pg = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(1), group=pg)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), group=pg, async_op=True)
    else:
        _HELD.append(pg)
    return os.getpid()


def test_a_group_left_with_a_pending_collective_is_not_freed():
    """Freeing a gloo group whose collective is pending waits in gloo's threads until the group's timeout while the
    peer's object lives: the harness keeps such a group (its ranks' sequence numbers differ) alive instead, so the
    health check after the job and the next job are not held up (freed, the health check timed out and the pool was
    killed)."""
    pids = run_ranks(2, _pid)
    t0 = time.monotonic()
    assert run_ranks(2, _leave_a_collective_pending) == pids
    assert run_ranks(2, _pid) == pids and time.monotonic() - t0 < 5
