"""Does communication overlap compute? Traced training steps of each system, on gloo, read off the trace.

    python benchmarks/trace_overlap.py               # gpt-10M, W = 2: FSDP2 (default; async unshard), apply,
                                                     # fully_shard (~1 min)
    python benchmarks/trace_overlap.py --model tiny  # the 33-group model

Each rank runs every system on the same model, batch and seeds (built one at a time), warms it up, then
profiles ``--steps`` steps of each in rotation under ``torch.profiler`` (CPU activities). While tracing,
``Work.wait`` runs inside a ``record_function("trace::wait")`` (for every system alike: funcshard's async
handles and the wait inside FSDP2's synchronous ``torch.distributed`` calls), so the trace shows when the
main thread is blocked on a collective. gloo runs each collective on its own worker threads, where the
profiler records it as ``gloo:<op>``.

Per profiled step (medians over steps, rank 0 and the slowest rank): step wall time; ``comm``: the time a
gloo thread is running a collective (union of the ``gloo:*`` intervals); ``hidden``: the part of ``comm``
during which the main thread is not blocked in a wait (it computes, or runs Python: hooks, copies), i.e.
communication overlapped with other work; ``blocked``: the main thread's time in waits (exposed
communication, including waiting for the other rank).

Writes ``benchmarks/out/trace_<system>_<model>.json.gz`` (rank 0's last traced step: open it in
https://ui.perfetto.dev or chrome://tracing), ``benchmarks/out/trace.md`` and ``trace.png`` (a timeline of
one step per system: main-thread ops, waits, and the gloo threads' collectives).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench
import systems as S
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from funcshard.trace import complement, intersect, length, union

WAIT = "trace::wait"
MODELS = {"tiny": bench.TINY, "m10": bench.M10}  # the benchmark's 33-group and 10M models


# ---- reading a chrome trace (interval arithmetic: funcshard.trace's) -----------------------------------


def lanes(events: list[dict], main_tid: int) -> dict:
    """The step's intervals (us): main-thread ops, main-thread waits, collectives on other threads."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    main = [e for e in xs if e.get("tid") == main_tid]
    comm = [e for e in xs if e.get("tid") != main_tid and str(e["name"]).startswith("gloo:")]
    return {"ops": union(span(e) for e in main if e.get("cat") == "cpu_op"),
            "wait": union(span(e) for e in main if e["name"] == WAIT),
            "comm": union(span(e) for e in comm),
            "by_op": {n: union(span(e) for e in comm if e["name"] == n) for n in sorted({e["name"] for e in comm})}}


def overlap(ln: dict) -> dict:
    """Milliseconds: comm, the part of it the main thread did not wait through, and the waits."""
    comm = length(ln["comm"])
    exposed = length(intersect(ln["comm"], ln["wait"]))
    return {"comm_ms": comm / 1e3, "hidden_ms": (comm - exposed) / 1e3, "blocked_ms": length(ln["wait"]) / 1e3,
            "hidden_frac": (comm - exposed) / comm if comm else None,
            "exposed_ms_by_op": {n: length(intersect(iv, ln["wait"])) / 1e3 for n, iv in ln.get("by_op", {}).items()}}


# ---- workers --------------------------------------------------------------------------------------------


def _traced_waits():
    """``Work.wait`` inside a record_function, for every system alike (restored by the caller)."""
    work = torch._C._distributed_c10d.Work
    orig = work.wait

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function(WAIT):
            return orig(self, *args, **kwargs)

    work.wait = wait
    return lambda: setattr(work, "wait", orig)


def _worker(rank, world, port, cfg_dict, names, steps, tmp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    mesh = init_device_mesh("cpu", (world,))
    cfg, dev = S.ModelConfig(**cfg_dict), torch.device("cpu")
    x, y = S.batch(cfg, rank, world, dev)
    restore = _traced_waits()
    out = {n: [] for n in names}
    try:
        systems = {}  # every system built once and warmed up, then traced in rotation
        for n in names:
            systems[n] = S.build(n, cfg, mesh, dev, x, y)
            for _ in range(2):
                systems[n].step()
        for k in range(steps):
            for n in names[k % len(names):] + names[: k % len(names)]:
                dist.barrier()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t = time.perf_counter()
                    systems[n].step()
                    wall = time.perf_counter() - t
                path = os.path.join(tmp, f"r{rank}_{n}_{k}.json")
                prof.export_chrome_trace(path)
                with open(path) as f:
                    events = json.load(f)["traceEvents"]
                rec = overlap(lanes(events, threading.get_native_id()))
                rec["step_ms"] = wall * 1e3
                out[n].append(rec)
                if rank != 0 or k != steps - 1:
                    os.remove(path)
    finally:
        restore()
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"r{rank}.json"), "w") as f:
        json.dump(out, f)


# ---- report ---------------------------------------------------------------------------------------------


def summarize(per_rank: list[dict], names) -> dict:
    res = {}
    for n in names:
        rows = [r[n] for r in per_rank]
        med = lambda rs, k: statistics.median(x[k] for x in rs if x[k] is not None)  # noqa: E731
        ops = sorted({op for x in rows[0] for op in x["exposed_ms_by_op"]})
        res[n] = {"rank0": {k: med(rows[0], k) for k in ("step_ms", "comm_ms", "hidden_ms", "blocked_ms",
                                                           "hidden_frac")},
                  "exposed_ms_by_op_rank0": {op: statistics.median(x["exposed_ms_by_op"].get(op, 0.0) for x in rows[0])
                                             for op in ops},
                  "blocked_ms_max_rank": max(med(r, "blocked_ms") for r in rows),
                  "step_ms_max_rank": max(med(r, "step_ms") for r in rows)}
    return res


def plot(traces: dict, main_tids: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(len(traces), 1, figsize=(15, 1.6 * len(traces) + 0.6), squeeze=False)
    for ax, (n, events) in zip(axes[:, 0], traces.items()):
        ln = lanes(events, main_tids[n])
        t0, t1 = ln["ops"][0][0], ln["ops"][-1][1]
        ln["work"] = complement(ln["wait"], t0, t1)  # the main thread's time not blocked in a wait
        for y, key, color in ((2, "work", "tab:blue"), (1, "wait", "tab:red"), (0, "comm", "tab:orange")):
            ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3) for a, b in ln[key]], (y - 0.4, 0.8), color=color)
        ax.set_yticks([0, 1, 2], ["gloo threads:\ncollectives", "main thread:\nblocked in wait",
                                  "main thread:\nworking"], fontsize=7)
        o = overlap(ln)
        ax.set_title(f"{n}: {o['comm_ms']:.0f} ms of collectives, {100 * (o['hidden_frac'] or 0):.0f}% hidden "
                     f"behind main-thread work; main thread blocked {o['blocked_ms']:.0f} ms", fontsize=9)
    axes[-1, 0].set_xlabel("ms since the step's first event (rank 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="m10")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="traced steps per system (default 5)")
    ap.add_argument("--systems", default="fsdp2,fsdp2_async,fs_apply,fs_fully_shard")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--write-results", action="store_true",
                    help="also publish: benchmarks/TRACE.md, benchmarks/trace.png, benchmarks/traces/*.json.gz")
    args = ap.parse_args(argv)
    names, cfg = args.systems.split(","), MODELS[args.model]
    args.out.mkdir(parents=True, exist_ok=True)
    port = bench._free_port()
    with tempfile.TemporaryDirectory(prefix="fstrace") as tmp:
        mp.start_processes(_worker, args=(args.world, port, dataclasses.asdict(cfg), names, args.steps, tmp),
                           nprocs=args.world, join=True, start_method="spawn")
        per_rank = []
        for r in range(args.world):
            with open(os.path.join(tmp, f"r{r}.json")) as f:
                per_rank.append(json.load(f))
        traces, tids = {}, {}
        for n in names:
            src = os.path.join(tmp, f"r0_{n}_{args.steps - 1}.json")
            with open(src) as f:
                traces[n] = json.load(f)["traceEvents"]
            tids[n] = next(e["tid"] for e in traces[n] if e.get("name") == WAIT)  # rank 0's main thread
            with open(src, "rb") as f, gzip.open(args.out / f"trace_{n}_{cfg.name}.json.gz", "wb") as g:
                shutil.copyfileobj(f, g)
    res = summarize(per_rank, names)
    L = [f"# Communication/compute overlap on gloo: {cfg.name}, W={args.world}", "",
         f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {bench.machine()}, "
         f"git {bench._git_rev()}; "
         f"torch {torch.__version__}; command: `python benchmarks/trace_overlap.py --model {args.model} "
         f"--world {args.world}`; medians of {args.steps} traced steps per system (under the profiler, so "
         "slower than untraced). fsdp2: FSDP2's defaults (on CPU every collective is waited for at once); "
         "fsdp2_async: with its private `_set_unshard_async_op(True)` (all-gathers waited for at first use). comm: "
         "time a gloo thread runs a collective; hidden: the part of it the main thread did not spend blocked in a "
         "wait; blocked: the main thread's waits. gloo runs a reduce-scatter as an all_reduce.", "",
         "| system | step ms (rank 0) | comm ms | hidden ms | hidden % | main thread blocked ms (rank 0 / max) | "
         "waited-through ms by gloo op (rank 0) |",
         "|---|---|---|---|---|---|---|"]
    for n in names:
        r0 = res[n]["rank0"]
        frac = "-" if r0["hidden_frac"] is None else f"{100 * r0['hidden_frac']:.0f}"
        L.append(f"| {n} | {r0['step_ms']:.1f} | {r0['comm_ms']:.1f} | {r0['hidden_ms']:.1f} | {frac} | "
                 f"{r0['blocked_ms']:.1f} / {res[n]['blocked_ms_max_rank']:.1f} | " +
                 ", ".join(f"{op.removeprefix('gloo:')} {v:.1f}" for op, v in res[n]["exposed_ms_by_op_rank0"].items())
                 + " |")
    text = "\n".join(L) + "\n"
    (args.out / "trace.md").write_text(text)
    (args.out / "trace.json").write_text(json.dumps(res, indent=1))
    plot(traces, tids, args.out / "trace.png")
    print(text)
    if args.write_results:
        (HERE / "traces").mkdir(exist_ok=True)
        for n in names:
            shutil.copy(args.out / f"trace_{n}_{cfg.name}.json.gz", HERE / "traces")
        shutil.copy(args.out / "trace.png", HERE / "trace.png")
        (HERE / "TRACE.md").write_text(text + "\n![timeline of one step per system](trace.png)\n\nTraces (rank 0, the "
                                       "last traced step; open in https://ui.perfetto.dev): " +
                                       ", ".join(f"`traces/trace_{n}_{cfg.name}.json.gz`" for n in names) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
