"""Soak: many training steps of both paths on a small GPT at W=2 (gloo), watching for leaks.

    python benchmarks/soak.py                      # 1,000 steps of each path (a few minutes on 2 cores)
    python benchmarks/soak.py --steps 200 --every 20 --json out/soak.json

Each rank trains funcshard.demo's GPT (tied embedding/head, 2 blocks) twice, one path after the other, from the same
seed: ``functional`` (``funcshard.value_and_grad`` over ``funcshard.apply``, ``funcshard.optim`` clip + AdamW with
``donate=True``) and ``fully_shard`` (``funcshard.fully_shard`` per block and the root, ``clip_grad_norm_``,
``torch.optim.AdamW``). Every ``--every`` steps it records, per rank, the resident set size (``/proc/self/statm``,
MiB) and the live tensor count (``gc.collect()``, then every ``torch.Tensor`` among ``gc.get_objects()``). Verdict per
path and rank, after the warm-up (the first ``--warmup`` steps): the live tensor count must not change, and RSS must
not grow by more than ``--rss-slack`` MiB (least-squares slope over the samples, times the steps after warm-up;
glibc's allocator moves RSS by a few hundred KiB without anything leaking). Exit status 1 when a verdict fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's funcshard, also in the spawned ranks
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op object warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _model():
    from funcshard.demo import GPT

    torch.manual_seed(0)
    return GPT(vocab=256, d=32, heads=4, layers=2, seq=16)


def _batches(steps, rank, world):
    from funcshard.demo import batches

    return batches(seq=16, batch=4, rank=rank, world=world, steps=steps, device=torch.device("cpu"))


def _functional(steps, every, rank, world, mesh):
    import funcshard
    from funcshard import optim
    from funcshard.demo import Block

    model = _model()
    plan = funcshard.plan(model, mesh, groups=(Block,))
    state = funcshard.shard(plan)
    tx = optim.chain(optim.clip_by_global_norm(1.0, mesh=mesh), optim.adamw(lr=1e-3, weight_decay=0.01))
    opt_state = tx.init(state)
    del model  # the plan keeps the module: its parameters stay as built (the state holds the shards)

    def loss_fn(s, x, y):
        return F.cross_entropy(funcshard.apply(plan, s, x).flatten(0, 1), y.flatten())

    step_fn = funcshard.value_and_grad(loss_fn)
    samples = []
    for i, (x, y) in enumerate(_batches(steps, rank, world), 1):
        loss, grads = step_fn(state, x, y)
        updates, opt_state = tx.update(grads, opt_state, state, donate=True)
        state = optim.apply_updates(state, updates, donate=True)
        del loss, grads, updates
        if i % every == 0 or i == 1:
            samples.append((i, rss_mib(), live_tensors()))
    return samples


def _fully_shard(steps, every, rank, world, mesh):
    import funcshard

    model = _model()
    for b in model.blocks:
        funcshard.fully_shard(b, mesh=mesh)
    funcshard.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    samples = []
    for i, (x, y) in enumerate(_batches(steps, rank, world), 1):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        if i % every == 0 or i == 1:
            samples.append((i, rss_mib(), live_tensors()))
    return samples


PATHS = {"functional": _functional, "fully_shard": _fully_shard}


def _slope(points):
    """Least-squares slope of [(x, y)] (0 for fewer than two points)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def verdict(samples, warmup, steps, rss_slack):
    """-> dict: first/last RSS and tensor counts, after warm-up the tensor count's range and RSS growth (slope times
    the steps after warm-up), and ok."""
    after = [s for s in samples if s[0] >= warmup]
    counts = [c for _, _, c in after]
    growth = _slope([(i, r) for i, r, _ in after]) * (steps - warmup)
    return {"first_rss": samples[0][1], "last_rss": samples[-1][1], "first_tensors": samples[0][2],
            "last_tensors": samples[-1][2], "warm_rss": after[0][1] if after else None,
            "warm_tensors": counts[0] if counts else None,
            "tensor_range": (min(counts), max(counts)) if counts else None, "rss_growth_mib": growth,
            "ok": bool(counts) and min(counts) == max(counts) and growth <= rss_slack}


def soak_rank(steps, every, warmup, rss_slack, paths=tuple(PATHS)):
    """On this rank of an initialized process group (gloo): each path in turn -> {path: result}."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    result = {}
    for name in paths:
        t0 = time.perf_counter()
        samples = PATHS[name](steps, every, rank, world, mesh)
        result[name] = {"samples": samples, "seconds": time.perf_counter() - t0,
                        **verdict(samples, warmup, steps, rss_slack)}
        gc.collect()
        dist.barrier()
    return result


def _worker(rank, world, port, args, out_path):
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    lo = [n for _, n in socket.if_nameindex() if n.startswith("lo")]
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo[0])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        result = soak_rank(args.steps, args.every, args.warmup, args.rss_slack, args.paths)
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(steps=1000, every=50, warmup=None, rss_slack=2.0, world=2, paths=tuple(PATHS)):
    """Spawn ``world`` gloo ranks, soak each path; -> {rank: {path: result}}."""
    import tempfile

    args = argparse.Namespace(steps=steps, every=every, warmup=warmup if warmup is not None else max(steps // 5, every),
                              rss_slack=rss_slack, paths=list(paths))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="soak") as d:
        out = os.path.join(d, "soak.json")
        mp.start_processes(_worker, args=(world, port, args, out), nprocs=world, join=True, start_method="spawn")
        results = {}
        for r in range(world):
            with open(f"{out}.{r}") as f:
                results[r] = json.load(f)
    return results


def report(results) -> str:
    lines = []
    for r, by_path in sorted(results.items()):
        for name, res in by_path.items():
            lines.append(f"rank {r} {name}: {res['seconds']:.1f} s")
            for i, rss, n in res["samples"]:
                lines.append(f"  step {i:>5}  RSS {rss:8.2f} MiB  live tensors {n}")
            lines.append(
                f"  verdict: {'OK' if res['ok'] else 'LEAK?'}  RSS {res['first_rss']:.2f} -> {res['last_rss']:.2f} MiB "
                f"(after warm-up {res['warm_rss']:.2f} -> {res['last_rss']:.2f}, fitted growth "
                f"{res['rss_growth_mib']:+.2f} MiB); live tensors {res['first_tensors']} -> {res['last_tensors']} "
                f"(after warm-up {res['tensor_range'][0]}..{res['tensor_range'][1]})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50, help="sample RSS and live tensors every N steps")
    ap.add_argument("--warmup", type=int, default=None, help="steps before the verdict's window (default steps/5)")
    ap.add_argument("--rss-slack", type=float, default=2.0, help="MiB of RSS growth after warm-up still OK")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = run(a.steps, a.every, a.warmup, a.rss_slack, paths=a.paths)
    print(report(results))
    ok = all(res["ok"] for by_path in results.values() for res in by_path.values())
    print(f"soak: {a.steps} steps x {len(a.paths)} paths on 2 gloo ranks in {time.perf_counter() - t0:.0f} s: "
          f"{'OK, flat' if ok else 'FAILED: growth after warm-up'}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
