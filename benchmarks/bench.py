"""funcshard against FSDP2, DDP and an unsharded model: step time, tokens/s, peak memory, collectives.

    python benchmarks/bench.py              # CPU gloo W = 2 and 4, ~10M..~100M params, + fake-PG W = 8 (~10 min)
    python benchmarks/bench.py --quick      # the same checks on smaller models (under 2 min)
    python benchmarks/bench.py --mp bf16    # mixed precision: every sharded system with the same bf16 policy
    python benchmarks/bench.py --no-cpu --no-fake-cpu --cuda-models gpt-100M-b8:5:3   # the CUDA runs only

Writes ``benchmarks/out/results.json``, ``results.md`` and ``results.png`` (needs matplotlib: the ``bench``
extra), and, for a full run (or ``--write-results``), ``benchmarks/RESULTS.md``.

Method. One process group per world size (spawned gloo workers; NCCL / the fake process group on CUDA)
serves every model and system of that world size. Per model, every system is built from the same seed on the
same per-rank slice of one global batch; step 1 and 2 losses are compared (the correctness guard: funcshard
and FSDP2 must agree on step 1 to 1e-5), then one step under the memory instrument, one under the collective
counter and one under torch.profiler (the counter's cross-check), then the timed repeats: in each repeat
every system runs its timed steps in turn (the order rotates), so machine noise hits all alike. A repeat's
time is the slowest rank's; we report medians and paired ratios against FSDP2 (the median over repeats of
system / FSDP2 in the same repeat), never one absolute time alone.

Memory (per rank): CPU: peak live tensor bytes (``instruments.LiveBytes``, a TorchDispatchMode tracker; one
tracker per iteration): what the system keeps between steps plus everything allocated during the step.
CUDA: ``torch.cuda.max_memory_allocated`` over one step minus what was allocated before the system was built.

Overhead per group, on the tiny model (many small blocks, where it dominates): (system step - unsharded step
of the same model and per-rank batch) / number of groups, paired per repeat. It includes the collectives'
own latency on gloo; the fake process group (W = 8, no communication) isolates copies, hooks and Python.

Mixed precision (``--mp bf16``): every sharded system gets the same policy, bf16 parameters (all-gather and
compute) and fp32 reduce-scatter, through its own API (FSDP2: torch's ``MixedPrecisionPolicy``; fs_fully_shard:
funcshard's; fs_apply*: ``plan(mp_policy=...)``); ``unsharded`` and ``ddp`` stay fp32, and ``fsdp2_fp32`` (FSDP2
without a policy) is added as the fp32 reference: bf16 all-gather bytes must be half of its, reduce-scatter bytes
equal to its. The guard compares the bf16 systems with FSDP2 in bf16 (``LOSS_TOL_MP``: fs_fully_shard and
fs_apply are bit-identical to FSDP2 at step 1 on CPU), the fp32 systems with ``fsdp2_fp32`` (``LOSS_TOL``). The
targets measured against the unsharded step (overhead per group, within 5 % of unsharded) are not evaluated: that
floor is fp32. The report is the ``## bf16 mixed precision`` section of ``RESULTS.md`` (a full run, or
``--write-results``, replaces that section only; an fp32 run keeps it).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import instruments
import systems as S
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOSS_TOL = 1e-5
# bf16 systems vs FSDP2 with the same policy (losses on fp32 logits), per step. Step 1: bit-identical on CPU
# (same bf16 parameters, same kernels; measured 0), and a forward that missed the policy is off by what bf16 does
# to the loss (2.6e-5 on gpt-3M: fsdp2_fp32 vs fsdp2). Step 2: fs_fully_shard uses torch's AdamW like FSDP2
# (measured 0); fs_apply* use funcshard.optim.adamw, whose fp32 updates differ from torch's foreach AdamW in the
# last bit for about half the elements (as in fp32, where step 2 agrees within 1e-5), and bf16 turns the few that
# sit on a rounding boundary into a whole bf16 step: 8.9e-5 on gpt-3M. A loose bound there: Adam's first update is
# scale-free, so no step-2 loss sees a wrong divide or reduce dtype; the bytes targets check the reduce dtype.
LOSS_TOL_MP = (1e-6, 1e-3)
MP_SECTION = "## bf16 mixed precision"  # the RESULTS.md section a --mp bf16 run writes (and an fp32 run keeps)
FS_SYSTEMS = ("fs_apply", "fs_apply_torchfunc", "fs_fully_shard")  # funcshard's systems, each held to the targets

# ---- what runs --------------------------------------------------------------------------------------------

# name, vocab, dim, heads, layers, seq, batch (sequences per rank per step)
TINY = S.ModelConfig("tiny-33g", 128, 32, 2, 32, 16, 1)  # 32 blocks + root: overhead per group
M10 = S.ModelConfig("gpt-10M", 4096, 256, 4, 12, 128, 2)
M30 = S.ModelConfig("gpt-30M", 8192, 448, 7, 12, 128, 1)
M100 = S.ModelConfig("gpt-100M", 8192, 768, 12, 12, 128, 1)
SMALL = S.ModelConfig("gpt-3M", 2048, 128, 4, 12, 64, 2)
TINY_Q = S.ModelConfig("tiny-13g", 128, 32, 2, 12, 16, 1)

# (model, repeats, timed steps per repeat)
CPU_PLAN = {
    2: [(TINY, 7, 2), (M10, 5, 1), (M100, 3, 1)],
    4: [(TINY, 5, 2), (M10, 5, 1), (M30, 3, 1)],  # gpt-10M: 5 repeats in both worlds
}
CPU_PLAN_QUICK = {
    2: [(TINY_Q, 5, 2), (SMALL, 3, 2)],
    4: [(TINY_Q, 3, 2), (SMALL, 3, 1)],
}
# on a GPU the per-rank batch is larger, so that the step is not just launch overhead
M10_CUDA = S.ModelConfig("gpt-10M-b8", 4096, 256, 4, 12, 256, 8)
M100_CUDA = S.ModelConfig("gpt-100M-b8", 8192, 768, 12, 12, 512, 8)
CUDA_PLAN = [(TINY, 10, 10), (M10_CUDA, 10, 10), (M100_CUDA, 10, 5)]
CUDA_PLAN_QUICK = [(TINY, 5, 5), (M10_CUDA, 5, 5)]
MODELS = {m.name: m for m in (TINY, M10, M30, M100, SMALL, TINY_Q, M10_CUDA, M100_CUDA)}  # --cuda-models' names
FAKE_WORLD = 8


# ---- one model, every system, on one rank ----------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mem_step(sysobj, device) -> dict:
    """Peak memory of one step, one tracker per iteration."""
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        sysobj.step()
        _sync(device)
        return {"peak": torch.cuda.max_memory_allocated(device), "between_steps": before, "instrument": "cuda"}
    tracker = instruments.LiveBytes(roots=[sysobj])
    with tracker:
        sysobj.step()
    return {"peak": tracker.peak, "between_steps": tracker.baseline, "instrument": "LiveBytes"}


def run_model(cfg: S.ModelConfig, repeats: int, steps: int, *, mesh, device, fake: bool, names,
              precision: str = "fp32") -> dict:
    pg = mesh.get_group(0)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    cdev = device if device.type == "cuda" else torch.device("cpu")  # where our own bookkeeping collectives run
    x, y = S.batch(cfg, rank, world, device)
    out = {"systems": {}}
    live = {}
    for name in names:
        rec = out["systems"][name] = {}
        why = S.available(name)
        if why:
            rec["status"] = why
            continue
        try:
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            sysobj = S.build(name, cfg, mesh, device, x, y, precision=precision)
            losses = [sysobj.step(), sysobj.step()]
            rec["loss"] = [S.world_loss(v, pg) for v in losses]
            mem = _mem_step(sysobj, device)
            if device.type == "cuda":  # this system's share: what it allocated since before it was built
                mem["peak"] -= base
                mem["between_steps"] -= base
            rec["memory"] = mem
            with instruments.CollectiveCounter() as cc:  # one step, seen by both instruments
                rec["c10d_ops"] = instruments.profiled_collectives(sysobj.step)
            rec["collectives"] = cc.summary()
            rec["status"] = "ok"
            live[name] = sysobj
        except Exception as e:  # noqa: BLE001 - reported, the other systems go on
            rec["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            rec["traceback"] = traceback.format_exc()[-4000:]
        # every rank must agree on which systems go on (a failure on one rank only would hang the others)
        ok = torch.tensor([1.0 if rec.get("status") == "ok" else 0.0], device=cdev)
        if not fake:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)
        if ok.item() < 1 and name in live:
            del live[name]
            rec["status"] = rec.get("status") if rec.get("status") != "ok" else "error on another rank"
    gc.collect()

    # timed repeats: every system in turn within each repeat, the order rotating
    order = list(live)
    times = {n: [] for n in order}
    cpus = {n: [] for n in order}
    for name in order:  # one untimed step each after the instruments (warm caches, no profiler aftermath)
        live[name].step()
    for r in range(repeats):
        k = r % max(len(order), 1)
        for name in order[k:] + order[:k]:
            sysobj = live[name]
            if not fake:
                dist.barrier(group=pg)
            _sync(device)
            gc.collect()
            gc.disable()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                sysobj.step()
            _sync(device)
            dt = (time.perf_counter() - t0) / steps
            dc = (time.thread_time() - c0) / steps
            gc.enable()
            times[name].append(dt)
            cpus[name].append(dc)
    # a repeat's time is its slowest rank's; CPU time (this rank's main thread) is averaged over ranks
    if order:
        t = torch.tensor([times[n] for n in order], dtype=torch.float64, device=cdev)
        c = torch.tensor([cpus[n] for n in order], dtype=torch.float64, device=cdev)
        if not fake:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
            dist.all_reduce(c, op=dist.ReduceOp.SUM, group=pg)
            c /= world
        t, c = t.cpu(), c.cpu()
        for i, n in enumerate(order):
            out["systems"][n]["step_s"] = t[i].tolist()
            out["systems"][n]["cpu_s"] = c[i].tolist()
    # memory per rank
    for name, rec in out["systems"].items():
        if "memory" in rec and not fake:
            m = torch.tensor([float(rec["memory"]["peak"]), float(rec["memory"]["between_steps"])],
                             dtype=torch.float64, device=cdev)
            allm = [torch.zeros_like(m) for _ in range(world)]
            dist.all_gather(allm, m, group=pg)
            allm = [v.cpu() for v in allm]
            rec["memory"]["peak_per_rank"] = [int(v[0]) for v in allm]
            rec["memory"]["between_steps_per_rank"] = [int(v[1]) for v in allm]
        elif "memory" in rec:
            rec["memory"]["peak_per_rank"] = [rec["memory"]["peak"]]
            rec["memory"]["between_steps_per_rank"] = [rec["memory"]["between_steps"]]
    del live
    gc.collect()
    return out


# ---- workers --------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, backend: str, jobs: list, result_path: str, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "gloo":
        lo = [n for _, n in socket.if_nameindex() if n.startswith("lo")]
        if lo:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo[0])
    torch.set_num_threads(threads)
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh

    fake = backend == "fake"
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dev_type = jobs[0]["device"]
        if dev_type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        torch.set_flush_denormal(True)  # the fake all-gathers leave garbage: keep it from turning slow
    else:
        dev_type = "cuda" if backend == "nccl" else "cpu"
        if dev_type == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    device = torch.device(dev_type, 0 if fake else rank) if dev_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(dev_type, (world,))
    results = []
    try:
        for job in jobs:
            cfg = S.ModelConfig(**job["model"])
            t0 = time.perf_counter()
            precision = job.get("precision", "fp32")
            res = run_model(cfg, job["repeats"], job["steps"], mesh=mesh, device=device, fake=fake,
                            names=job["systems"], precision=precision)
            res.update(world=world, backend=backend, device=dev_type, model=cfg.as_dict(), repeats=job["repeats"],
                       steps=job["steps"], wall_s=time.perf_counter() - t0, threads=threads)
            if precision != "fp32":
                res["precision"] = precision
            results.append(res)
            if rank == 0:
                print(f"  W={world} {backend:5s} {cfg.name:10s} done in {res['wall_s']:.0f} s", flush=True)
                with open(result_path, "w") as f:
                    json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, backend: str, jobs: list, nprocs: int | None = None) -> list:
    nprocs = nprocs or world
    threads = max(1, (os.cpu_count() or 1) // nprocs) if jobs[0]["device"] == "cpu" else 4
    with tempfile.TemporaryDirectory(prefix="fsbench") as d:
        path = os.path.join(d, "results.json")
        try:
            mp.start_processes(_worker, args=(world, _free_port(), backend, jobs, path, threads), nprocs=nprocs,
                               join=True, start_method="spawn")
        except Exception as e:  # noqa: BLE001 - whatever finished is still reported
            print(f"  W={world} {backend}: a worker failed: {e}", file=sys.stderr)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return json.load(f)


# ---- analysis -------------------------------------------------------------------------------------------


def _median(xs):
    return statistics.median(xs) if xs else None


def analyze(run: dict) -> None:
    """Adds medians, tokens/s, paired ratios vs FSDP2 and the overhead per group, in place."""
    sy = run["systems"]
    tokens = run["model"]["batch"] * run["model"]["seq"] * run["world"]
    groups = run["model"]["groups"]
    ref = sy.get("fsdp2", {}).get("step_s")
    base = sy.get("unsharded", {}).get("step_s")
    for rec in sy.values():
        ts = rec.get("step_s")
        if not ts:
            continue
        rec["median_s"] = _median(ts)
        rec["tokens_per_s"] = tokens / rec["median_s"]
        if ref:
            ratios = [a / b for a, b in zip(ts, ref)]
            rec["ratio_vs_fsdp2"] = _median(ratios)
            rec["ratio_vs_fsdp2_range"] = [min(ratios), max(ratios)]
        cs, cbase = rec.get("cpu_s"), sy.get("unsharded", {}).get("cpu_s")
        rec["median_cpu_s"] = _median(cs) if cs else None
        if base:
            rec["vs_unsharded"] = _median([a / b for a, b in zip(ts, base)])
            rec["overhead_per_group_s"] = _median([(a - b) / groups for a, b in zip(ts, base)])
        if cs and cbase:
            rec["cpu_overhead_per_group_s"] = _median([(a - b) / groups for a, b in zip(cs, cbase)])
        mem = rec.get("memory")
        fmem = sy.get("fsdp2", {}).get("memory")
        if mem and fmem:
            rec["memory_vs_fsdp2"] = max(mem["peak_per_rank"]) / max(fmem["peak_per_rank"])
        if run.get("precision", "fp32") != "fp32":  # mixed precision: bytes against FSDP2's and fp32 FSDP2's
            for ref_name, key in (("fsdp2", "bytes_vs_fsdp2"), ("fsdp2_fp32", "bytes_vs_fsdp2_fp32")):
                theirs = sy.get(ref_name, {}).get("collectives", {}).get("bytes")
                mine = rec.get("collectives", {}).get("bytes")
                if theirs is not None and mine and (mine.get("all_gather") or mine.get("reduce_scatter")):
                    rec[key] = {k: (mine.get(k, 0) / theirs[k] if theirs.get(k) else None)
                                for k in ("all_gather", "reduce_scatter")}


def _fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _coll(rec, kind):
    c = rec.get("collectives")
    if not c:
        return "-"
    n = c["calls"].get(kind, 0)
    b = c["bytes"].get(kind, 0)
    return "0" if not n else f"{n:g} / {b / 2**20:.2f}"


# ---- targets ------------------------------------------------------------------------------------------


def targets(runs: list, have_cuda: bool) -> list[dict]:
    out = []

    def add(name, where, value, threshold, ok, note="", status=None):
        status = status or ("PASS" if ok else "FAIL")
        if value is None:
            status = "N/A"
        out.append({"target": name, "where": where, "value": value, "threshold": threshold, "status": status,
                    "note": note})

    mixed = sorted({r["precision"] for r in runs if r.get("precision", "fp32") != "fp32"})
    cpu = [r for r in runs if r["device"] == "cpu" and r["backend"] == "gloo"]
    for r in cpu:
        where = f"CPU W={r['world']} {r['model']['name']}"
        sy = r["systems"]
        f = sy.get("fsdp2", {})
        for name, thr, label in (("fs_fully_shard", 0.9, "fully_shard step time <= 0.9x FSDP2"),
                                 ("fs_apply", 0.85, "apply step time <= 0.85x FSDP2"),
                                 ("fs_apply_torchfunc", 0.85, "apply under torch.func.grad step time <= 0.85x FSDP2")):
            rec = sy.get(name, {})
            if rec.get("status") != "ok":
                out.append({"target": label, "where": where, "value": None, "threshold": thr,
                            "status": "N/A", "note": rec.get("status", "not run")})
                continue
            v = rec.get("ratio_vs_fsdp2")
            add(label, where, v, thr, v is not None and v <= thr)
        for name in FS_SYSTEMS:
            rec = sy.get(name, {})
            if rec.get("status") != "ok" or f.get("status") != "ok":
                continue
            v = rec.get("memory_vs_fsdp2")
            add(f"{name} peak memory <= FSDP2", where, v, 1.0, v is not None and v <= 1.0)
            mine, theirs = rec["collectives"]["bytes"], f["collectives"]["bytes"]
            same = all(mine.get(k, 0) == theirs.get(k, 0) for k in ("all_gather", "reduce_scatter"))
            add(f"{name} bytes per step == FSDP2", where,
                f"AG {mine.get('all_gather', 0) / 2**20:.3f} + RS {mine.get('reduce_scatter', 0) / 2**20:.3f} MiB",
                "equal", same, note=f"FSDP2: AG {theirs.get('all_gather', 0) / 2**20:.3f} + RS "
                                    f"{theirs.get('reduce_scatter', 0) / 2**20:.3f} MiB")
        if mixed:
            _mp_byte_targets(r, where, add)
            continue  # the targets against the unsharded step: its floor is fp32 (see below)
        if r["model"]["name"].startswith("tiny"):
            fo = f.get("overhead_per_group_s")
            for name in FS_SYSTEMS:
                rec = sy.get(name, {})
                if rec.get("status") != "ok" or fo is None:
                    continue
                v = rec["overhead_per_group_s"] / fo if fo > 0 else None
                add(f"{name} overhead per group <= 0.5x FSDP2 (wall)", where, v, 0.5, v is not None and v <= 0.5,
                    note=f"{rec['overhead_per_group_s'] * 1e3:.3f} ms vs FSDP2 {fo * 1e3:.3f} ms",
                    status=_inconclusive(rec["overhead_per_group_s"], fo))
                fc, mc = f.get("cpu_overhead_per_group_s"), rec.get("cpu_overhead_per_group_s")
                if fc and mc is not None:
                    v = mc / fc
                    add(f"{name} overhead per group <= 0.5x FSDP2 (main-thread CPU time)", where, v, 0.5,
                        v <= 0.5, note=f"{mc * 1e3:.3f} ms vs FSDP2 {fc * 1e3:.3f} ms", status=_inconclusive(mc, fc))
    cuda1 = [r for r in runs if r["device"] == "cuda" and r["backend"] == "nccl"]
    fake = [r for r in runs if r["backend"] == "fake"]
    if mixed:
        out.append({"target": "overhead per group <= 0.5x FSDP2; CUDA W=1 within 5% of unsharded; fake-PG W=8 "
                    "copy+hook overhead <= 0.5x FSDP2", "where": "all", "value": None, "threshold": "-",
                    "status": "NOT EVALUATED", "note": f"measured against the unsharded step, which runs in fp32 "
                    f"while the sharded systems run {'/'.join(mixed)}: not like for like"})
        return out
    if not have_cuda:
        out.append({"target": "CUDA W=1 within 5% of unsharded", "where": "CUDA", "value": None,
                    "threshold": 1.05, "status": "NOT RUN", "note": "no GPU on this machine"})
        out.append({"target": "fake-PG W=8 copy+hook overhead <= 0.5x FSDP2", "where": "CUDA", "value": None,
                    "threshold": 0.5, "status": "NOT RUN", "note": "no GPU on this machine"})
    for r in cuda1:
        where = f"CUDA W=1 {r['model']['name']}"
        for name in FS_SYSTEMS:
            rec = r["systems"].get(name, {})
            if rec.get("status") == "ok":
                v = rec.get("vs_unsharded")
                add(f"{name} within 5% of unsharded", where, v, 1.05, v is not None and v <= 1.05)
    for r in fake:
        where = f"fake-PG W=8 {r['device']} {r['model']['name']}"
        fo = r["systems"].get("fsdp2", {}).get("overhead_per_group_s")
        for name in FS_SYSTEMS:
            rec = r["systems"].get(name, {})
            if rec.get("status") != "ok" or not fo:
                continue
            v = rec["overhead_per_group_s"] / fo
            label = f"{name} copy+hook overhead <= 0.5x FSDP2"
            note = f"{rec['overhead_per_group_s'] * 1e3:.3f} vs {fo * 1e3:.3f} ms per group"
            if r["device"] == "cpu":
                note += " (CPU proxy, informational: the target is for CUDA)"
            add(label, where, v, 0.5, v <= 0.5, note=note, status=_inconclusive(rec["overhead_per_group_s"], fo))
    return out


def _inconclusive(mine: float, fsdp2: float) -> str | None:
    """An overhead per group ratio's status when it cannot be read as one: a system's or FSDP2's overhead <= 0 (its
    step measured at or below the unsharded one's: noise, not a result); None otherwise (PASS/FAIL by the ratio)."""
    return "INCONCLUSIVE (overhead <= 0: noise)" if mine <= 0 or fsdp2 <= 0 else None


def _mp_byte_targets(r: dict, where: str, add) -> None:
    """Mixed precision: every sharded system's all-gather bytes are half of fp32 FSDP2's (bf16 parameters), its
    reduce-scatter bytes equal to fp32 FSDP2's (fp32 gradients)."""
    sy = r["systems"]
    ref = sy.get("fsdp2_fp32", {})
    if ref.get("status") != "ok":
        add("all-gather bytes == 0.5x fp32 FSDP2, reduce-scatter == fp32 FSDP2", where, None, "-", False,
            note="fsdp2_fp32 (the fp32 reference) not run: " + ref.get("status", "not in --systems"))
        return
    theirs = ref["collectives"]["bytes"]
    for name in ("fsdp2", *FS_SYSTEMS):
        rec = sy.get(name, {})
        if rec.get("status") != "ok":
            continue
        mine = rec["collectives"]["bytes"]
        ag, rs = mine.get("all_gather", 0), mine.get("reduce_scatter", 0)
        ag32, rs32 = theirs.get("all_gather", 0), theirs.get("reduce_scatter", 0)
        add(f"{name} all-gather bytes == 0.5x fp32 FSDP2 (bf16 params)", where, f"{ag / 2**20:.3f} MiB", "0.5x",
            ag32 > 0 and 2 * ag == ag32, note=f"fp32 FSDP2: {ag32 / 2**20:.3f} MiB")
        add(f"{name} reduce-scatter bytes == fp32 FSDP2 (fp32 reduce)", where, f"{rs / 2**20:.3f} MiB", "equal",
            rs32 > 0 and rs == rs32, note=f"fp32 FSDP2: {rs32 / 2**20:.3f} MiB")


def guard(run: dict) -> list[str]:
    """The correctness guard: step-1 (and step-2) losses of the data-parallel systems against FSDP2's."""
    msgs = []
    if run["backend"] == "fake":
        return msgs
    sy = run["systems"]
    ref = sy.get("fsdp2", {}).get("loss")
    if not ref:
        return [f"W={run['world']} {run['model']['name']}: no FSDP2 loss to compare against"]
    if run.get("precision", "fp32") != "fp32":
        return _guard_mixed(run)
    for name, rec in sy.items():
        if name == "fsdp2" or not rec.get("loss"):
            continue
        rec["loss_diff_vs_fsdp2"] = []
        steps = (0,) if name == "unsharded" else (0, 1)  # unsharded trains on its local batch only
        for i in steps:
            d = abs(rec["loss"][i] - ref[i])
            rec["loss_diff_vs_fsdp2"].append(d)
            if d > LOSS_TOL:
                msgs.append(f"W={run['world']} {run['model']['name']} {name}: step-{i + 1} loss "
                            f"{rec['loss'][i]:.7f} vs FSDP2 {ref[i]:.7f} (diff {d:.2e} > {LOSS_TOL:g})")
    return msgs


def _guard_mixed(run: dict) -> list[str]:
    """Mixed precision: each system against the FSDP2 of its own precision, the bf16 systems against FSDP2 (same
    policy) within LOSS_TOL_MP, the fp32 ones (unsharded, ddp) against fsdp2_fp32 within LOSS_TOL; fsdp2_fp32
    against FSDP2 is recorded (what bf16 does to the loss), not checked."""
    msgs = []
    sy, prec = run["systems"], run["precision"]
    for name, rec in sy.items():
        if name == "fsdp2" or not rec.get("loss"):
            continue
        fp32 = S.system_precision(name, prec) == "fp32"
        ref_name = "fsdp2_fp32" if fp32 and name != "fsdp2_fp32" else "fsdp2"
        ref = sy.get(ref_name, {}).get("loss")
        if not ref:
            continue  # fsdp2_fp32 not run: nothing of the fp32 systems' precision to compare against
        checked = name != "fsdp2_fp32"
        tols = (LOSS_TOL, LOSS_TOL) if fp32 else LOSS_TOL_MP
        rec["loss_ref"] = ref_name
        rec["loss_tol"] = list(tols) if checked else None
        rec["loss_diff_vs_ref"] = []
        steps = (0,) if name == "unsharded" else (0, 1)  # unsharded trains on its local batch only
        for i in steps:
            d, tol = abs(rec["loss"][i] - ref[i]), tols[i]
            rec["loss_diff_vs_ref"].append(d)
            if checked and d > tol:
                msgs.append(f"W={run['world']} {run['model']['name']} {name}: step-{i + 1} loss "
                            f"{rec['loss'][i]:.7f} vs {ref_name} {ref[i]:.7f} (diff {d:.2e} > {tol:g})")
    return msgs


# ---- report --------------------------------------------------------------------------------------------


def markdown(meta: dict, runs: list, tgts: list, guards: list) -> str:
    if meta.get("precision", "fp32") != "fp32":
        return markdown_mixed(meta, runs, tgts, guards)
    L = ["# funcshard vs FSDP2: benchmark results", "",
         f"- date: {meta['date']}", f"- machine: {meta['machine']}", f"- torch {meta['torch']}, funcshard "
         f"{meta['funcshard']} (git {meta['git']})", f"- command: `{meta['command'].strip()}`",
         f"- funcshard.fully_shard: {meta['fully_shard']}; fs_apply's optimizer: {meta['fs_apply_optimizer']}; "
         "torch systems: torch.optim.AdamW(foreach=True); same lr, betas, eps, weight decay; fp32",
         f"- wall time: {meta['wall_s']:.0f} s", ""]
    L += ["Times are medians over interleaved repeats of the slowest rank's step (forward, backward, AdamW). "
          "`vs FSDP2` is the median of paired per-repeat ratios (range in brackets). Peak memory is per rank "
          "(max over ranks): live tensor bytes on CPU (TorchDispatchMode tracker), "
          "`torch.cuda.max_memory_allocated` on CUDA. Collectives: calls / MiB of payload per rank per step "
          "(all-gather: output, reduce-scatter: input, all-reduce: tensor). Overhead per group: (step - "
          "unsharded step) / groups, paired per repeat; the CPU columns use each rank's main-thread CPU time "
          "(averaged over ranks), which leaves out time blocked in collectives or preempted by other "
          f"processes. Load average (1 min) at start / end: {meta['loadavg_start']:.1f} / "
          f"{meta['loadavg_end']:.1f} on {os.cpu_count()} cores.", ""]
    L += ["## Correctness guard", ""]
    L += ["All step-1 losses match FSDP2's within 1e-5 (step 2 too for the data-parallel systems)."
          if not guards else "**MISMATCH**:\n" + "\n".join(f"- {g}" for g in guards), ""]
    L += ["## Targets", ""] + _targets_table(tgts)
    for r in runs:
        L += [f"## {_run_title(r)}", ""]
        L += ["| system | step (ms) | vs FSDP2 | vs unsharded | tokens/s | peak MiB/rank | mem vs FSDP2 | "
              "between steps MiB | all-gather | reduce-scatter | all-reduce | overhead/group (ms) | "
              "CPU ms/step | CPU overhead/group (ms) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, rec in r["systems"].items():
            if rec.get("status") != "ok":
                L.append(f"| {name} | {rec.get('status')} |" + " |" * 12)
                continue
            cov = rec.get("cpu_overhead_per_group_s")
            cpu_cols = (f" {rec['median_cpu_s'] * 1e3:.2f} | "
                        f"{'-' if cov is None or name == 'unsharded' else f'{cov * 1e3:.3f}'} |"
                        if rec.get("median_cpu_s") is not None else " - | - |")
            ovh = rec.get("overhead_per_group_s")
            L.append(
                f"| {name} | {_common_cols(rec)} | "
                f"{'-' if ovh is None or name == 'unsharded' else f'{ovh * 1e3:.3f}'} |" + cpu_cols)
        L += ["", _counter_check(r), ""]
    return "\n".join(L)


def _targets_table(tgts: list) -> list[str]:
    L = ["| target | where | value | threshold | status | note |", "|---|---|---|---|---|---|"]
    for t in tgts:
        v = t["value"]
        vs = f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))
        L.append(f"| {t['target']} | {t['where']} | {vs} | {t['threshold']} | **{t['status']}** | {t['note']} |")
    return [*L, ""]


def _run_title(r: dict) -> str:
    m = r["model"]
    return (f"W={r['world']} {r['backend']} on {r['device']}: {m['name']} ({m['params'] / 1e6:.1f}M params, "
            f"{m['groups']} groups, {m['batch']}x{m['seq']} tokens per rank, {r['repeats']} repeats x "
            f"{r['steps']} steps, {r['threads']} thread(s) per rank)")


def _common_cols(rec: dict) -> str:
    """step | vs FSDP2 | vs unsharded | tokens/s | peak | mem vs FSDP2 | between steps | AG | RS | AR."""
    mem = rec.get("memory", {})
    rng = rec.get("ratio_vs_fsdp2_range")
    ratio = f"{rec['ratio_vs_fsdp2']:.3f} [{rng[0]:.2f}-{rng[1]:.2f}]" if rng else "-"
    return (f"{rec['median_s'] * 1e3:.2f} | {ratio} | {rec.get('vs_unsharded', 0):.3f} | "
            f"{rec['tokens_per_s']:,.0f} | {_fmt_bytes(max(mem.get('peak_per_rank', [0])))} | "
            f"{rec.get('memory_vs_fsdp2', float('nan')):.3f} | "
            f"{_fmt_bytes(max(mem.get('between_steps_per_rank', [0])))} | {_coll(rec, 'all_gather')} | "
            f"{_coll(rec, 'reduce_scatter')} | {_coll(rec, 'all_reduce')}")


def _counter_check(r: dict) -> str:
    checks = []
    for name, rec in r["systems"].items():
        if rec.get("status") != "ok":
            continue
        wrapped = sum(rec["collectives"]["calls"].values())
        seen = sum(rec.get("c10d_ops", {}).values())
        checks.append(f"{name} {wrapped:g}/{seen:g}")
    return ("Collective counter check (wrapped `torch.distributed` calls / c10d ops seen by torch.profiler, "
            "per step): " + ", ".join(checks))


def _byte_ratios(rec: dict, key: str) -> str:
    r = rec.get(key)
    if not r:
        return "-"
    return " / ".join("-" if r.get(k) is None else f"{r[k]:.3f}" for k in ("all_gather", "reduce_scatter"))


def _tols(tols: list) -> str:
    return f"{tols[0]:g}" if tols[0] == tols[1] else f"{tols[0]:g} / {tols[1]:g}"


def markdown_mixed(meta: dict, runs: list, tgts: list, guards: list) -> str:
    """The report of a mixed-precision run: the ``## bf16 mixed precision`` section of RESULTS.md."""
    prec = meta["precision"]
    L = [f"## {prec} mixed precision", "",
         f"- date: {meta['date']}", f"- machine: {meta['machine']}", f"- torch {meta['torch']}, funcshard "
         f"{meta['funcshard']} (git {meta['git']})", f"- command: `{meta['command'].strip()}`",
         f"- policy, the same for every sharded system ({', '.join(('fsdp2', *FS_SYSTEMS))}): "
         f"{S.policy_description(prec)} (fsdp2: torch's `MixedPrecisionPolicy`; fs_fully_shard: "
         "`funcshard.MixedPrecisionPolicy`; fs_apply*: `funcshard.plan(mp_policy=...)`); shards, gradients and "
         "AdamW state fp32 (master weights); loss on fp32 logits",
         f"- fp32, no mixed precision, no autocast: {', '.join(S.FP32_ONLY)} (`fsdp2_fp32`: FSDP2 without a "
         "policy, the fp32 reference for bytes and memory); `vs unsharded` therefore compares with an fp32 step",
         f"- funcshard.fully_shard: {meta['fully_shard']}; fs_apply's optimizer: {meta['fs_apply_optimizer']}; "
         "torch systems: torch.optim.AdamW(foreach=True); same lr, betas, eps, weight decay",
         f"- wall time: {meta['wall_s']:.0f} s", ""]
    L += ["Method as in the fp32 tables above (medians over interleaved repeats of the slowest rank's step, paired "
          "ratios vs FSDP2 with their range, peak live tensor bytes per rank, collectives as calls / MiB of "
          "payload per rank per step). `vs FSDP2` is against FSDP2 with the same policy. `AG / RS bytes vs "
          "FSDP2`: all-gather / reduce-scatter payload bytes over FSDP2's (same policy); `vs fp32 FSDP2`: over "
          f"fsdp2_fp32's. Load average (1 min) at start / end: {meta['loadavg_start']:.1f} / "
          f"{meta['loadavg_end']:.1f} on {os.cpu_count()} cores.", ""]
    L += ["### Correctness guard", ""]
    L += [f"Every {prec} system's step-1 and step-2 losses match FSDP2's (same policy) within {LOSS_TOL_MP[0]:g} and "
          f"{LOSS_TOL_MP[1]:g} (step 2: funcshard.optim's last-bit AdamW differences, rounded to {prec}), every fp32 "
          f"system's match fsdp2_fp32's within {LOSS_TOL:g} (unsharded: step 1 only)."
          if not guards else "**MISMATCH**:\n" + "\n".join(f"- {g}" for g in guards), ""]
    L += ["| run | system | precision | compared with | step-1 diff | step-2 diff | tolerance |",
          "|---|---|---|---|---|---|---|"]
    for r in runs:
        for name, rec in r["systems"].items():
            if "loss_diff_vs_ref" not in rec:
                continue
            d = rec["loss_diff_vs_ref"] + [None]
            tol = rec.get("loss_tol")
            L.append(f"| W={r['world']} {r['model']['name']} | {name} | {S.system_precision(name, prec)} | "
                     f"{rec['loss_ref']} | {d[0]:.2e} | {'-' if d[1] is None else f'{d[1]:.2e}'} | "
                     f"{'not checked (what ' + prec + ' does to the loss)' if tol is None else _tols(tol)} |")
    L.append("")
    L += ["### Targets", ""] + _targets_table(tgts)
    for r in runs:
        L += [f"### {_run_title(r)}", ""]
        L += ["| system | precision | step (ms) | vs FSDP2 | vs unsharded (fp32) | tokens/s | peak MiB/rank | "
              "mem vs FSDP2 | between steps MiB | all-gather | reduce-scatter | all-reduce | AG / RS bytes vs FSDP2 "
              "| AG / RS bytes vs fp32 FSDP2 | CPU ms/step |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, rec in r["systems"].items():
            if rec.get("status") != "ok":
                L.append(f"| {name} | {S.system_precision(name, prec)} | {rec.get('status')} |" + " |" * 12)
                continue
            cpu = "-" if rec.get("median_cpu_s") is None else f"{rec['median_cpu_s'] * 1e3:.2f}"
            L.append(f"| {name} | {S.system_precision(name, prec)} | {_common_cols(rec)} | "
                     f"{_byte_ratios(rec, 'bytes_vs_fsdp2')} | {_byte_ratios(rec, 'bytes_vs_fsdp2_fp32')} | {cpu} |")
        L += ["", _counter_check(r), ""]
    return "\n".join(L)


def plot(runs: list, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    names = ["ddp", *FS_SYSTEMS]
    labels = [f"W={r['world']} {r['backend']}\n{r['model']['name']}" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    width = 0.8 / len(names)
    for ax, key, title in ((axes[0], "ratio_vs_fsdp2", "step time / FSDP2 (lower is better)"),
                           (axes[1], "memory_vs_fsdp2", "peak memory per rank / FSDP2")):
        for j, n in enumerate(names):
            vals = [r["systems"].get(n, {}).get(key) or 0 for r in runs]
            ax.bar([i + j * width for i in range(len(runs))], vals, width, label=n)
        ax.axhline(1.0, color="k", lw=0.8)
        if key == "ratio_vs_fsdp2":  # the targets: fully_shard <= 0.9, apply <= 0.85
            ax.axhline(0.9, color="tab:green", lw=0.8, ls="--")
            ax.axhline(0.85, color="tab:orange", lw=0.8, ls="--")
        ax.set_xticks([i + width for i in range(len(runs))], labels, fontsize=7)
        ax.set_title(title)
        ax.legend(fontsize=8)
    over = [r for r in runs if r["model"]["name"].startswith("tiny")]
    ax = axes[2]
    on = ["fsdp2", *FS_SYSTEMS, "ddp"]
    w2 = 0.8 / len(on)
    for j, n in enumerate(on):
        vals = [(r["systems"].get(n, {}).get("overhead_per_group_s") or 0) * 1e3 for r in over]
        ax.bar([i + j * w2 for i in range(len(over))], vals, w2, label=n)
    ax.set_xticks([i + w2 for i in range(len(over))],
                  [f"W={r['world']} {r['backend']} {r['device']}" for r in over], fontsize=7)
    ax.set_title("overhead per group (ms), tiny model")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    return f"{cpu}, {os.cpu_count()} cores{mem}{gpu}, {platform.system()} {platform.release()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer repeats (under 2 min)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="CPU world sizes (default 2 4)")
    ap.add_argument("--fake-cpu", action=argparse.BooleanOptionalAction, default=None,
                    help="the fake-PG W=8 comparison on CPU too (default: on, off with --quick)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU (gloo) runs")
    ap.add_argument("--systems", nargs="+", default=None, choices=list(S.BUILDERS),
                    help="default: all but fsdp2_async (FSDP2 with its private async unshard, for comparison) and "
                         "fsdp2_fp32 (FSDP2 without mixed precision: added by default with --mp bf16)")
    ap.add_argument("--mp", choices=list(S.PRECISIONS), default="fp32",
                    help="precision of the sharded systems: fp32 (default, no mixed precision) or bf16 (bf16 params "
                         "and compute, fp32 reduce-scatter: the same MixedPrecisionPolicy for FSDP2, fully_shard and "
                         "plan/apply; unsharded and ddp stay fp32); the report is RESULTS.md's bf16 section")
    ap.add_argument("--cuda-models", nargs="+", metavar="NAME:REPEATS:STEPS", default=None,
                    help=f"the CUDA runs' models (default: {' '.join(f'{m.name}:{r}:{k}' for m, r, k in CUDA_PLAN)}; "
                         f"names: {', '.join(sorted(MODELS))})")
    ap.add_argument("--cuda-dry-run", action="store_true",
                    help="run the CUDA section (W=1, fake-PG W=8) on the CPU: gloo instead of NCCL, device cpu (a "
                         "check of the script on a machine without a GPU; its rows are CPU rows)")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--write-results", action="store_true", help="write benchmarks/RESULTS.md after --quick too")
    ap.add_argument("--no-write-results", action="store_true", help="never write benchmarks/RESULTS.md")
    ap.add_argument("--from-json", type=Path, help="only rebuild the reports from an earlier results.json")
    args = ap.parse_args(argv)
    if args.from_json:
        return report(json.loads(args.from_json.read_text()), args)
    if args.systems is None:
        args.systems = list(S.ALL_SYSTEMS) + (["fsdp2_fp32"] if args.mp != "fp32" else [])
    if "fsdp2" not in args.systems or "unsharded" not in args.systems:
        ap.error("--systems must include fsdp2 and unsharded (the references)")
    t_start = time.perf_counter()
    import funcshard

    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "torch": torch.__version__,
        "funcshard": getattr(funcshard, "__version__", "0.1.0"),
        "git": _git_rev(),
        "command": "python benchmarks/bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "fully_shard": "present" if hasattr(funcshard, "fully_shard") else "not built",
        "fs_apply_optimizer": "funcshard.optim.adamw" + (" with donate=True" if S.DONATE else " (pure)"),
    }
    if args.mp != "fp32":
        meta["precision"] = args.mp
    meta["loadavg_start"] = os.getloadavg()[0]
    print(f"funcshard benchmark: {meta['machine']}; funcshard.fully_shard {meta['fully_shard']}"
          + (f"; sharded systems in {args.mp} ({S.policy_description(args.mp)})" if args.mp != "fp32" else ""),
          flush=True)

    def jobs(plan_, device):
        extra = {"precision": args.mp} if args.mp != "fp32" else {}
        return [{"model": asdict(m), "repeats": r, "steps": k, "systems": args.systems, "device": device, **extra}
                for m, r, k in plan_]

    def fake_jobs(plan_, device):  # DDP's comm hook needs real results: not on the fake process group
        js = jobs(plan_, device)
        for j in js:
            j["systems"] = [n for n in j["systems"] if n != "ddp"]
        return js

    runs = []
    if not args.no_cpu:
        plan_ = CPU_PLAN_QUICK if args.quick else CPU_PLAN
        for w in args.worlds:
            runs += run_world(w, "gloo", jobs(plan_.get(w, plan_[2]), "cpu"))
    have_cuda = torch.cuda.is_available()
    if have_cuda or args.cuda_dry_run:
        cplan = CUDA_PLAN_QUICK if args.quick else CUDA_PLAN
        if args.cuda_models:
            cplan = [_model_spec(spec, ap) for spec in args.cuda_models]
        backend, device = ("gloo", "cpu") if args.cuda_dry_run else ("nccl", "cuda")
        runs += run_world(1, backend, jobs(cplan, device))
        runs += run_world(FAKE_WORLD, "fake", fake_jobs(cplan, device), nprocs=1)
    else:
        print("no GPU: the CUDA runs (W=1 NCCL, fake-PG W=8) are skipped", flush=True)
    if args.fake_cpu or (args.fake_cpu is None and not args.quick):
        runs += run_world(FAKE_WORLD, "fake", fake_jobs([(TINY_Q if args.quick else TINY, 7, 4)], "cpu"),
                          nprocs=1)
    meta["wall_s"] = time.perf_counter() - t_start
    meta["loadavg_end"] = os.getloadavg()[0]
    meta["have_cuda"] = have_cuda
    for r in runs:  # tracebacks go to the JSON only
        for rec in r["systems"].values():
            if "traceback" in rec:
                print(f"--- {rec['status']}\n{rec['traceback']}", file=sys.stderr)
    return report({"meta": meta, "runs": runs}, args)


def _model_spec(spec: str, ap) -> tuple:
    """``NAME:REPEATS:STEPS`` -> (ModelConfig, repeats, steps)."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in MODELS or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        ap.error(f"--cuda-models {spec!r}: expected NAME:REPEATS:STEPS with NAME one of {sorted(MODELS)} and two "
                 f"positive integers, e.g. tiny-33g:5:5")
    return MODELS[parts[0]], int(parts[1]), int(parts[2])


def report(data: dict, args) -> int:
    """Targets, guard, JSON, Markdown, plot (and RESULTS.md) from the measurements."""
    meta, runs = data["meta"], data["runs"]
    for r in runs:
        analyze(r)
    guards = [m for r in runs for m in guard(r)]
    tgts = targets(runs, meta.get("have_cuda", False))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs, "targets": tgts,
                                                       "guard": guards}, indent=1))
    md = markdown(meta, runs, tgts, guards)
    (args.out / "results.md").write_text(md)
    plotted = plot(runs, args.out / "results.png")
    if (not args.quick or args.write_results) and not args.no_write_results:
        write_results(md, mixed=meta.get("precision", "fp32") != "fp32")
    print(md)
    print(f"\nwrote {args.out}/results.json, results.md" + (", results.png" if plotted else ""))
    return 1 if guards else 0


def write_results(md: str, *, mixed: bool, path: Path = HERE / "RESULTS.md") -> None:
    """RESULTS.md: an fp32 run writes the file and keeps its mixed-precision section (from ``MP_SECTION`` on, at
    the end); a mixed-precision run replaces that section only (or appends it)."""
    old = path.read_text() if path.exists() else ""
    at = old.find("\n" + MP_SECTION + "\n")
    fp32_part, mp_part = (old, "") if at < 0 else (old[: at + 1], old[at + 1 :])
    if mixed:
        text = fp32_part.rstrip("\n") + "\n\n" + md.rstrip("\n") + "\n" if fp32_part else md.rstrip("\n") + "\n"
    else:
        text = (md + "\nThe plot of these numbers is written to `benchmarks/out/results.png` (not committed); "
                "the raw measurements (every repeat, every rank's memory) to `benchmarks/out/results.json`.\n")
        if mp_part:
            text += "\n" + mp_part
    path.write_text(text)


def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "funcshard"], cwd=HERE.parent,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
