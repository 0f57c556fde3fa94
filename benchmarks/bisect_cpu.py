"""Main-thread CPU time per step of several funcshard trees, paired in one run (issue 36: bisecting per-group cost).

One worker process per tree (``PYTHONPATH=<tree>``: that tree's ``funcshard``; this file's ``systems.py`` builds the
systems in every worker), on torch's fake process group (one process, collectives do nothing: what is measured is
each system's own Python, hook and copy work), or with ``--gloo`` as W gloo ranks per tree (rank 0 timed; its wall
time per step printed too). The driver interleaves them: each round, every (tree, system)
runs ``--steps`` steps in turn (the order rotated per round), timed by ``time.thread_time`` in the worker; the
median over ``--rounds`` rounds per (tree, system) is printed, with FSDP2 (run in the first tree's worker) as the
reference. Only one worker computes at a time.

    nice python benchmarks/bisect_cpu.py --trees /tmp/bis_577469a /work/main --groups 13 --world 4
    nice python benchmarks/bisect_cpu.py --gloo --world 2 --groups 33 --trees /tmp/bis_<sha> .   # ~5 min loaded
    git worktree add /tmp/bis_<sha> <sha>     # an old commit's tree

Prints ms per step, the ratio to FSDP2's step, the overhead per group ((system - unsharded) / groups, as bench.py's
row; FSDP2 and the unsharded step run in the first tree's worker) and its ratio to FSDP2's, and the per-group
difference against the first tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(groups: int, world: int, names: list[str], gloo: bool) -> None:
    sys.path.insert(0, str(HERE))
    import gc
    import time

    import systems as S
    import torch
    import torch.distributed as dist

    import funcshard

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    if gloo:
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    else:
        rank, mesh = 0, funcshard.cost.fake_mesh(world)
    cfg = S.ModelConfig(f"tiny-{groups}g", 128, 32, 2, groups - 1, 16, 1)
    x, y = S.batch(cfg, rank, world, torch.device("cpu"))
    live = {n: S.build(n, cfg, mesh, torch.device("cpu"), x, y) for n in names}
    for s in live.values():
        s.step()
        s.step()
    print(json.dumps({"ready": funcshard.__file__}), flush=True)
    for line in sys.stdin:
        name, steps = line.split()
        gc.collect()
        gc.disable()
        if gloo:
            dist.barrier()
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(int(steps)):
            live[name].step()
        c1, t1 = time.thread_time(), time.perf_counter()
        gc.enable()
        print(json.dumps({"cpu": (c1 - c0) / int(steps), "wall": (t1 - t0) / int(steps)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="+")
    ap.add_argument("--systems", nargs="+", default=["fs_apply", "fs_apply_torchfunc", "fs_fully_shard"])
    ap.add_argument("--groups", type=int, default=13)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gloo", action="store_true", help="W gloo ranks per tree (rank 0 timed), not the fake PG")
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        worker(a.groups, a.world, a.systems, a.gloo)
        return
    if not a.trees:
        ap.error("--trees: one or more source trees (the first also runs FSDP2 and the unsharded step)")
    procs = {}
    for i, t in enumerate(a.trees):
        names = a.systems + (["fsdp2", "unsharded"] if i == 0 else [])
        ranks = []
        for r in range(a.world if a.gloo else 1):
            env = {**os.environ, "PYTHONPATH": t, "RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(29650 + i), "WORLD_SIZE": str(a.world)}
            ranks.append(subprocess.Popen([sys.executable, __file__, "--worker", "--groups", str(a.groups),
                                           "--world", str(a.world), "--systems", *names] + ["--gloo"] * a.gloo,
                                          env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=t))
        procs[t] = (ranks, names)
    for t, (ranks, _) in procs.items():
        ready = [json.loads(p.stdout.readline())["ready"] for p in ranks][0]
        print(f"# {t}: {ready}", flush=True)
    cells = [(t, n) for t, (_, names) in procs.items() for n in names]
    rec = {c: [] for c in cells}
    wall = {c: [] for c in cells}
    for r in range(a.rounds):
        k = (r * 3) % len(cells)
        for t, n in cells[k:] + cells[:k]:
            for p in procs[t][0]:
                p.stdin.write(f"{n} {a.steps}\n")
                p.stdin.flush()
            got = [json.loads(p.stdout.readline()) for p in procs[t][0]]
            rec[(t, n)].append(got[0]["cpu"])
            wall[(t, n)].append(got[0]["wall"])
    for ranks, _ in procs.values():
        for p in ranks:
            p.stdin.close()
            p.wait()
    med = {c: statistics.median(v) for c, v in rec.items()}
    base = a.trees[0]
    f, u = med[(base, "fsdp2")], med[(base, "unsharded")]
    fw = statistics.median(wall[(base, "fsdp2")])
    fo = (f - u) / a.groups  # FSDP2's overhead per group (against the unsharded step, as bench.py's row)
    print(f"tiny-{a.groups}g W={a.world} {'gloo' if a.gloo else 'fake PG'}, main-thread CPU ms/step (median of "
          f"{a.rounds} x {a.steps} steps): fsdp2 {f * 1e3:.2f} (wall {fw * 1e3:.2f}), unsharded {u * 1e3:.2f}; "
          f"fsdp2 overhead per group {fo * 1e6:.1f} us")
    for n in a.systems:
        b = med[(base, n)]
        for t in a.trees:
            m = med[(t, n)]
            lo, hi = min(rec[(t, n)]), max(rec[(t, n)])
            ov = (m - u) / a.groups
            print(f"{n:20s} {Path(t).name:16s} {m * 1e3:8.2f} [{lo * 1e3:.2f}-{hi * 1e3:.2f}]  /fsdp2 {m / f:5.2f}  "
                  f"overhead/group {ov * 1e6:7.1f} us = {ov / fo:5.2f}x fsdp2's;  vs first tree "
                  f"{(m - b) / a.groups * 1e6:+7.1f} us/group; wall /fsdp2 {statistics.median(wall[(t, n)]) / fw:5.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
