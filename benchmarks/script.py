"""The typical FSDP2 training script (issue 36), FSDP2 against funcshard's ``fully_shard``, paired step by step.

Two models built alike on the same 2 gloo ranks, one per system, each step: two microbatches of half the loss, the
first with ``set_requires_gradient_sync(False)``, then ``clip_grad_norm_(1.0)`` over the DTensor parameters and
``torch.optim.AdamW(foreach=True)``. The systems alternate within each step (the order flipping every step), so a
ratio compares two steps run back to back under the same load. Per phase: wall time and this rank's main-thread CPU
time (``time.thread_time``, which leaves out time blocked in collectives or preempted by other processes).

    nice python benchmarks/script.py                 # 4 blocks of dim 64 (bench.py's systems: fsdp2_script, ...)
    nice python benchmarks/script.py --layers 12 --dim 32
    nice python benchmarks/script.py --profile 8      # plus a cProfile of step 8 of each system (rank 0)

The first step is reported apart: DTensor's sharding propagation caches (one per process) are filled by whichever
system runs its first optimizer step and clip first, so that step's cost belongs to the process, not the system.
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

PHASES = ("total wall", "no-sync microbatch wall", "synced microbatch wall", "clip wall", "AdamW wall",
          "no-sync microbatch CPU", "synced microbatch CPU", "clip + AdamW CPU",
          "set_requires_gradient_sync x2 CPU", "no-sync forward+backward CPU", "synced forward+backward CPU",
          "clip_grad_norm_ CPU", "optimizer.step CPU", "zero_grad CPU", "total CPU")


def _profile_text(prof) -> str:
    """The profiled step's totals and its top functions by own time and by cumulative time, as text."""
    import io
    import pstats

    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def job(steps: int, layers: int, dim: int, vocab: int, first: str, profile_step: int) -> tuple:
    import torch
    import torch.distributed as dist
    from torch.distributed import fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard
    import systems as S

    cfg = S.ModelConfig("script", vocab, dim, 2, layers, 32, 2)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    built = {}
    for key, fs in (("fsdp2", torch_fsdp), ("funcshard", funcshard)):
        model = cfg.build(torch.device("cpu"))
        for b in model.blocks:
            fs.fully_shard(b, mesh=mesh)
        fs.fully_shard(model, mesh=mesh)
        built[key] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
    x, y = S.batch(cfg, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    times: dict[str, list] = {k: [] for k in built}
    profiles: dict[str, str] = {}
    order = [first, *(k for k in built if k != first)]
    for s in range(steps):
        for key in (order if s % 2 == 0 else order[::-1]):
            model, opt = built[key]
            dist.barrier()
            prof = cProfile.Profile(time.thread_time) if s == profile_step else None  # main-thread CPU
            if prof is not None:
                prof.enable()
            t0, c0 = time.perf_counter(), time.thread_time()
            model.set_requires_gradient_sync(False)
            ca = time.thread_time()
            S._loss(model(x), y).div(2).backward()
            t1, c1 = time.perf_counter(), time.thread_time()
            model.set_requires_gradient_sync(True)
            cb = time.thread_time()
            S._loss(model(x), y).div(2).backward()
            t2, c2 = time.perf_counter(), time.thread_time()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            t3, c3 = time.perf_counter(), time.thread_time()
            opt.step()
            c35 = time.thread_time()
            opt.zero_grad()
            t4, c4 = time.perf_counter(), time.thread_time()
            if prof is not None:
                prof.disable()
                profiles[key] = _profile_text(prof)
            times[key].append((t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3, c1 - c0, c2 - c1, c4 - c2,
                               (ca - c0) + (cb - c1), c1 - ca, c2 - cb, c3 - c2, c35 - c3, c4 - c35, c4 - c0))
    return times, profiles


def main() -> None:
    from multirank import run_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--first", choices=("fsdp2", "funcshard"), default="fsdp2", help="the system stepping first")
    ap.add_argument("--profile", type=int, default=-1, metavar="STEP",
                    help="cProfile this step of each system on rank 0 and print both profiles (e.g. 8)")
    a = ap.parse_args()
    times, profiles = run_ranks(2, job, a.steps, a.layers, a.dim, a.vocab, a.first, a.profile,
                                timeout=600)[0]  # rank 0's
    for key, text in profiles.items():
        print(f"===== cProfile of step {a.profile}, {key} (rank 0) =====")
        print(text)
    print(f"{a.layers} blocks of dim {a.dim}, W=2 gloo, {a.steps} steps alternating ({a.first} first)")
    print(f"first step: fsdp2 {times['fsdp2'][0][0]:.2f} s, funcshard {times['funcshard'][0][0]:.2f} s")
    print("| phase (steps 2+) | FSDP2 median (ms) | funcshard median (ms) | funcshard / FSDP2, paired median [range] |")
    print("|---|---|---|---|")
    for i, what in enumerate(PHASES):
        ref, got = ([t[i] for t in times[k][2:]] for k in ("fsdp2", "funcshard"))
        r = [g / f for g, f in zip(got, ref) if f > 0]
        print(f"| {what} | {1e3 * statistics.median(ref):.1f} | {1e3 * statistics.median(got):.1f} | "
              f"{statistics.median(r):.3f} [{min(r):.2f}-{max(r):.2f}] |")


if __name__ == "__main__":
    main()
