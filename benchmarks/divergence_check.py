"""The default divergence check's cost (``funcshard/_runtime/check.py``): step time with and without it.

    python benchmarks/divergence_check.py               # gloo W = 2 and 4, fake-PG W = 8 (about a minute)
    python benchmarks/divergence_check.py --worlds 2 --repeats 41

Method. A small MLP (``--blocks`` blocks of Linear(``--width``) + Tanh, one group per block, so the step is dominated
by per-group runtime work and the check's fixed cost shows as much as it can) trained with ``value_and_grad(apply)``
on CPU. Each repeat times ``--steps`` steps with the check on, then ``--steps`` with it off (``check.ENABLED``, the
order alternating from repeat to repeat), on every rank at once; the figures are the medians over repeats of the
slowest rank's mean step time, of the paired differences (on - off), and of the time spent inside the check
(``Checks.post``: the store exchange, including the wait for the last rank to arrive); and the exchange alone,
the ranks lined up by a barrier before each (the median over ranks' slowest of its latency). On the fake process group (no peers, one
process) the check does nothing but find that out, so its figure is the fake-PG per-group CPU time on and off.
The results of the run that wrote ``divergence_check.md`` are in that file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import funcshard  # noqa: E402
from funcshard._runtime import check  # noqa: E402


def _model(blocks: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)))


_IN_CHECK = [0.0]  # s spent in the default check (Checks.post)


def _timed_post(post):
    def timed(self):
        t0 = time.perf_counter()
        try:
            return post(self)
        finally:
            _IN_CHECK[0] += time.perf_counter() - t0

    return timed


def _measure(mesh, args) -> list[tuple[float, float, float]]:
    """[(mean step s with the check, without, in the check)] per repeat, this rank."""
    check.Checks.post = _timed_post(check.Checks.post)
    model = _model(args.blocks, args.width)
    plan = funcshard.plan(model, mesh, groups=(nn.Sequential,))
    state = funcshard.shard(plan)
    x = torch.randn(8, args.width)
    step = funcshard.value_and_grad(lambda s: funcshard.apply(plan, s, x).square().mean())
    for _ in range(5):
        step(state)
    out = []
    inside = 0.0
    for r in range(args.repeats):
        times = {}
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            check.ENABLED = on
            _IN_CHECK[0] = 0.0
            if dist.is_initialized() and dist.get_backend() != "fake":
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(state)
            times[on] = (time.perf_counter() - t0) / args.steps
            inside = _IN_CHECK[0] / args.steps if on else inside
        out.append((times[True], times[False], inside))
    check.ENABLED = True
    return out


def _exchange(pg, n: int) -> list[float]:
    """The exchange alone (``check._agree``), the ranks lined up by a barrier first: its own latency, s."""
    peers = check._peers(pg)
    out = []
    for i in range(n):
        dist.barrier(pg)
        t0 = time.perf_counter()
        check._agree("bench", peers, "0123456789abcdef0123456789abcdef", 60.0, "the benchmark")
        out.append(time.perf_counter() - t0)
    return out


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    res = _measure(mesh, args)
    t = torch.tensor(res, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's, per repeat
    ex = torch.tensor(_exchange(mesh.get_group(), args.repeats * args.steps), dtype=torch.float64)
    dist.all_reduce(ex, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put((t.tolist(), statistics.median(ex.tolist())))
    dist.destroy_process_group()


def _summary(label: str, res: list[list[float]], groups: int) -> str:
    on = statistics.median(r[0] for r in res) * 1e3
    off = statistics.median(r[1] for r in res) * 1e3
    diff = [(r[0] - r[1]) * 1e3 for r in res]
    q = statistics.quantiles(diff, n=4)
    inside = statistics.median(r[2] for r in res) * 1e3
    return (f"| {label} | {off:.3f} | {on:.3f} | {statistics.median(diff):+.3f} (IQR {q[0]:+.3f} .. {q[2]:+.3f}) | "
            f"{statistics.median(diff) / groups * 1e3:+.1f} | {inside:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--fake-world", type=int, default=8)
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        port = 29000 + os.getpid() % 1000 + world
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        res, ex = queue.get()
        for p in procs:
            p.join()
        rows.append(_summary(f"gloo W={world}", res, args.blocks) + f" {ex * 1e3:.3f} |")
    if args.fake_world:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.set_num_threads(1)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
        torch.set_flush_denormal(True)
        res = _measure(init_device_mesh("cpu", (args.fake_world,)), args)
        rows.append(_summary(f"fake PG W={args.fake_world}", [list(r) for r in res], args.blocks) + " - |")
        dist.destroy_process_group()
    print(f"{args.blocks} blocks of Linear({args.width}), {args.steps} steps x {args.repeats} repeats, torch "
          f"{torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    print("| process group | step ms, check off | step ms, check on | on - off, ms (median of paired repeats) | "
          "us per group | ms in the check (slowest rank) | ms per exchange, ranks lined up |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
