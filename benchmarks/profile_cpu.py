"""Where does funcshard.apply's step time go, next to FSDP2's? CPU, gloo, W=2.

    python benchmarks/profile_cpu.py                  # gpt-10M and the tiny 33-group model
    python benchmarks/profile_cpu.py --models tiny-33g --steps 4

For each model, on 2 spawned gloo ranks:

1. Phase breakdown (exclusive wall time per step, rank 0, median over interleaved repeats): timing wrappers
   on the runtime functions of both systems -- copy-in, issuing the all-gather, waiting on collectives
   (``Work.wait``, also inside synchronous collectives), copy-out, reduce-scatter input build / divide / split,
   runtime hooks and Python bookkeeping, per-call setup and checks, the optimizer; the rest is compute plus
   autograd / functorch. Wrappers cost ~1 us per call; totals are reported next to unwrapped step times.
2. Step times without wrappers for the variants, interleaved (the ablations: what a runtime change would buy):
   ``fs_apply`` as shipped, again (the A/A control), under plain autograd (no functorch), without donation,
   with ``prefetch=0`` and with ``layout="flat"``.
3. cProfile (top functions by own time) and torch.profiler (top ops by self CPU time) for fsdp2 and fs_apply,
   and where each one's peak memory is reached (op and stack).

Writes ``benchmarks/out/profile.json``, ``profile.md`` and the raw ``profile_*.txt`` tables.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import ClassVar

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import instruments
import systems as S
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench import M10, TINY

MODELS = {m.name: m for m in (TINY, M10)}

# ---- exclusive-time phases --------------------------------------------------------------------------------


class Phases:
    """A stack of named phases; each phase accumulates the wall time spent in it and not in a nested one."""

    def __init__(self) -> None:
        self.acc: Counter[str] = Counter()  # wall time
        self.cpu: Counter[str] = Counter()  # this thread's CPU time
        self.calls: Counter[str] = Counter()
        self.stack: list[str] = []
        self.t = 0.0
        self.c = 0.0
        self.on = False

    def enter(self, name: str) -> None:
        now, cnow = time.perf_counter(), time.thread_time()
        if self.stack:
            self.acc[self.stack[-1]] += now - self.t
            self.cpu[self.stack[-1]] += cnow - self.c
        self.stack.append(name)
        self.calls[name] += 1
        self.t, self.c = now, cnow

    def exit(self) -> None:
        now, cnow = time.perf_counter(), time.thread_time()
        top = self.stack.pop()
        self.acc[top] += now - self.t
        self.cpu[top] += cnow - self.c
        self.t, self.c = now, cnow

    mark_cb = None  # called when the optimizer phase starts (memory split in profile_model)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.on:
            yield
            return
        if name == OPTIM and self.mark_cb is not None:
            self.mark_cb()
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def wrap(self, fn, name: str):
        ph = self

        def wrapper(*a, **k):
            if not ph.on:
                return fn(*a, **k)
            ph.enter(name)
            try:
                return fn(*a, **k)
            finally:
                ph.exit()

        wrapper.__wrapped__ = fn
        return wrapper


PH = Phases()
PHASE_VARIANTS: list[str] = []

COPY_IN, ISSUE_AG, WAIT, COPY_OUT = "copy-in", "issue all-gather", "wait on collectives", "copy-out"
RS_BUILD, ISSUE_RS = "reduce-scatter input/divide/split", "issue reduce-scatter"
RUNTIME, SETUP, OPTIM, REST = "runtime hooks + Python", "per-call setup + checks", "optimizer", "compute + autograd"
PHASE_ORDER = [COPY_IN, ISSUE_AG, WAIT, COPY_OUT, RS_BUILD, ISSUE_RS, RUNTIME, SETUP, OPTIM, REST]


def _patch(obj, attr, name, static=False):
    if not hasattr(obj, attr):  # the runtime changes: time what exists
        return
    fn = getattr(obj, attr)
    raw = obj.__dict__.get(attr) if isinstance(obj, type) else None
    if isinstance(raw, staticmethod):
        static, fn = True, raw.__func__
    w = PH.wrap(fn, name)
    setattr(obj, attr, staticmethod(w) if static else w)


def install_phase_wrappers() -> None:
    """Call before building any system (FSDP2 registers bound methods as hooks at fully_shard time)."""
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg
    from torch.distributed.fsdp._fully_shard import _fsdp_state as fst

    from funcshard import _apply, _comm, _pipeline, _runtime

    # shared
    _patch(dist.distributed_c10d.Work, "wait", WAIT)
    for mod in (dist, c10d):
        _patch(mod, "all_gather_single", ISSUE_AG)
        _patch(mod, "reduce_scatter_single", ISSUE_RS)
    # funcshard
    from funcshard._runtime import backward as _rt_backward
    from funcshard._runtime import buffers as _rt_buffers
    from funcshard._runtime import strategies as _rt_strategies

    _patch(_rt_buffers, "start_gather", COPY_IN)
    _patch(_pipeline, "all_gather_into", ISSUE_AG)
    _patch(_comm, "all_gather_into", ISSUE_AG)
    _patch(_pipeline.PendingGather, "finish", COPY_OUT)
    _patch(_rt_backward, "start_reduce_scatter", RS_BUILD)  # input build + issue; divide + split in finish
    _patch(_pipeline.PendingReduce, "finish", RS_BUILD)
    _patch(_pipeline, "reduce_scatter_into", ISSUE_RS)
    _patch(_comm, "reduce_scatter_into", ISSUE_RS)
    # (not Step.run: the whole forward's compute runs inside it)
    for m in ("module_pre_forward", "module_post_forward", "gather_for_forward", "post_forward", "wrap_for_backward",
              "pre_backward", "post_backward", "reduce_later", "end_of_backward", "unshard", "wait", "reshard",
              "swap_in", "swap_out"):
        _patch(_runtime.Step, m, RUNTIME)
        if m != "pre_backward":  # (Step.pre_backward routes to the run's: timed once)
            _patch(_runtime.GroupRun, m, RUNTIME)
    _patch(_rt_buffers.GroupBuffers, "allocate", RUNTIME)
    _patch(_runtime.Step, "__init__", SETUP)
    _patch(_apply, "check_state", SETUP)
    _patch(_apply, "check_mesh", SETUP)
    for cls in (getattr(_rt_strategies, n, None) for n in ("_GroupGather", "_GroupGatherEager")):
        if cls is not None:
            _patch(cls, "forward", RUNTIME, static=True)
            _patch(cls, "backward", RUNTIME, static=True)
    # FSDP2
    for mod in (fc, fpg):
        if hasattr(mod, "foreach_all_gather"):
            _patch(mod, "foreach_all_gather", COPY_IN)
        if hasattr(mod, "foreach_all_gather_copy_out"):
            _patch(mod, "foreach_all_gather_copy_out", COPY_OUT)
        if hasattr(mod, "foreach_reduce"):
            _patch(mod, "foreach_reduce", RS_BUILD)
    for m in ("pre_forward", "post_forward", "pre_backward", "post_backward", "unshard", "wait_for_unshard",
              "reshard", "finalize_backward", "_backward_prefetch", "_prefetch_unshard"):
        _patch(fpg.FSDPParamGroup, m, RUNTIME)
    for m in ("_pre_forward", "_post_forward", "_root_pre_forward", "_pre_backward",
              "_root_post_backward_final_callback", "_register_pre_backward_hook"):
        _patch(fst.FSDPState, m, RUNTIME)


# ---- variants -------------------------------------------------------------------------------------------


class FSApplyAutograd(S.FSApply):
    """fs_apply under plain autograd: shards are leaves with requires_grad, loss.backward()."""

    name = "fs_apply_autograd"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.state = {n: t.requires_grad_() for n, t in self.state.items()}

    def step(self):
        from funcshard import optim

        loss = S._loss(__import__("funcshard").apply(self.plan, self.state, self.x), self.y)
        loss.backward()
        grads = {n: t.grad for n, t in self.state.items()}
        with PH.phase(OPTIM):
            updates, self.opt_state = self.tx.update(grads, self.opt_state, self.state)
            self.state = {n: t.requires_grad_() for n, t in optim.apply_updates(self.state, updates).items()}
        return loss.detach()


class FSApplyNoDonate(S.FSApply):
    """fs_apply with the pure optimizer (no buffer donation): what donation saves."""

    name = "fs_apply_nodonate"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.donate = False


class FSApplyFlat(S.FSApply):
    """fs_apply with ``layout="flat"`` (one flat buffer per group: the all-gather output is the parameters)."""

    name = "fs_apply_flat"
    plan_kwargs: ClassVar[dict] = {"layout": "flat"}


class FSApplyPrefetch0(S.FSApply):
    name = "fs_apply_pf0"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.plan = self.plan.replace(forward_prefetch=0, backward_prefetch=0)
        plan = self.plan

        def loss_fn(state, x, y):
            return S._loss(__import__("funcshard").apply(plan, state, x), y)

        self.step_fn = self.grad_transform(loss_fn)


class _OptPhase:
    """Wrap a system's optimizer in the OPTIM phase."""

    @staticmethod
    def fs(sysobj):
        def step():
            loss, grads = sysobj.step_fn(sysobj.state, sysobj.x, sysobj.y)
            with PH.phase(OPTIM):
                sysobj.update(grads)
            return loss.detach()

        return step

    @staticmethod
    def module(sysobj):
        def step():
            loss = S._loss(sysobj.model(sysobj.x), sysobj.y)
            loss.backward()
            with PH.phase(OPTIM):
                sysobj.opt.step()
                sysobj.opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step


def build_variants(cfg, mesh, device, x, y, names):
    out = {}
    for name in names:
        if name == "fsdp2":
            s = S.FSDP2(cfg, mesh, device, x, y)
            out[name] = (s, _OptPhase.module(s))
        elif name in ("fs_apply", "fs_apply_again"):  # the second: an A/A check of the noise floor
            s = S.FSApply(cfg, mesh, device, x, y)
            out[name] = (s, _OptPhase.fs(s))
        elif name == "fs_apply_autograd":
            s = FSApplyAutograd(cfg, mesh, device, x, y)
            out[name] = (s, s.step)
        elif name == "fs_apply_nodonate":
            s = FSApplyNoDonate(cfg, mesh, device, x, y)
            out[name] = (s, _OptPhase.fs(s))
        elif name == "fs_apply_flat":
            s = FSApplyFlat(cfg, mesh, device, x, y)
            out[name] = (s, _OptPhase.fs(s))
        elif name == "fs_apply_pf0":
            s = FSApplyPrefetch0(cfg, mesh, device, x, y)
            out[name] = (s, _OptPhase.fs(s))
    return out


# ---- one model on one rank ----------------------------------------------------------------------------------


def profile_model(cfg, repeats: int, steps: int, mesh, device, outdir: Path, variants: list[str]) -> dict:
    pg = mesh.get_group(0)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    x, y = S.batch(cfg, rank, world, device)
    vs = build_variants(cfg, mesh, device, x, y, variants)
    res = {"model": cfg.as_dict(), "world": world, "losses": {}}
    for name, (_, step) in vs.items():  # warm-up, and the correctness of the variants
        losses = [S.world_loss(step(), pg) for _ in range(2)]
        res["losses"][name] = losses

    def interleaved(with_phases: bool, names):
        times = {n: [] for n in names}
        cpus = {n: [] for n in names}
        phases = {n: [] for n in names}
        for r in range(repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                step = vs[name][1]
                dist.barrier(group=pg)
                gc.collect()
                gc.disable()
                PH.acc.clear()
                PH.cpu.clear()
                PH.calls.clear()
                PH.on = with_phases
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(steps):
                    step()
                dt = (time.perf_counter() - t0) / steps
                dc = (time.thread_time() - c0) / steps
                PH.on = False
                gc.enable()
                times[name].append(dt)
                cpus[name].append(dc)
                if with_phases:
                    acc = {p: v / steps for p, v in PH.acc.items()}
                    acc[REST] = dt - sum(acc.values())
                    cpu = {p: v / steps for p, v in PH.cpu.items()}
                    cpu[REST] = dc - sum(cpu.values())
                    phases[name].append((acc, cpu))
        t = torch.tensor([times[n] for n in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        return {n: t[i].tolist() for i, n in enumerate(names)}, phases, cpus

    # 1. phases (fsdp2 and fs_apply)
    main = [n for n in ("fsdp2", "fs_apply") if n in vs]
    with_phases = main + [n for n in PHASE_VARIANTS if n in vs and n not in main]
    t_ph, phases, c_ph = interleaved(True, with_phases)
    res["phases"] = {n: {p: statistics.median([d[0].get(p, 0.0) for d in phases[n]]) for p in PHASE_ORDER}
                     for n in with_phases}
    res["phases_cpu"] = {n: {p: statistics.median([d[1].get(p, 0.0) for d in phases[n]]) for p in PHASE_ORDER}
                         for n in with_phases}
    res["phase_step_s"] = {n: statistics.median(v) for n, v in t_ph.items()}
    res["phase_step_cpu_s"] = {n: statistics.median(v) for n, v in c_ph.items()}
    # calls per step
    res["phase_calls"] = {}
    for n in main:
        PH.calls.clear()
        PH.on = True
        vs[n][1]()
        PH.on = False
        res["phase_calls"][n] = dict(PH.calls)
    # 2. ablations, unwrapped
    names = list(vs)
    t_all, _, c_all = interleaved(False, names)
    res["step_s"] = t_all
    res["cpu_s"] = c_all
    res["median_s"] = {n: statistics.median(v) for n, v in t_all.items()}
    res["median_cpu_s"] = {n: statistics.median(v) for n, v in c_all.items()}
    res["cpu_ratio_vs_fs_apply"] = {n: statistics.median([a / b for a, b in zip(v, c_all["fs_apply"])])
                                    for n, v in c_all.items()}
    res["cpu_ratio_vs_fsdp2"] = {n: statistics.median([a / b for a, b in zip(v, c_all["fsdp2"])])
                                 for n, v in c_all.items()}
    res["loadavg"] = os.getloadavg()
    ref = t_all["fsdp2"]
    base = t_all["fs_apply"]
    res["ratio_vs_fsdp2"] = {n: statistics.median([a / b for a, b in zip(v, ref)]) for n, v in t_all.items()}
    res["ratio_vs_fs_apply"] = {n: statistics.median([a / b for a, b in zip(v, base)]) for n, v in t_all.items()}
    # 3. cProfile, torch.profiler, memory peaks (rank 0 writes)
    res["peak"] = {}
    for n, (sysobj, step) in vs.items():  # peak memory of every variant, split at the optimizer
        lb = instruments.LiveBytes(roots=[sysobj], where=True)
        marks = {}
        PH.on = True

        def mark(lb=lb, marks=marks):
            marks["fwd_bwd"], marks["fwd_bwd_at"] = lb.peak, lb.peak_at
            lb.peak = lb.total

        PH.mark_cb = mark
        with lb:
            step()
        PH.on = False
        PH.mark_cb = None
        marks["optimizer"] = lb.peak
        at = marks.pop("fwd_bwd_at", None) if marks.get("fwd_bwd", 0) >= marks["optimizer"] else lb.peak_at
        marks.pop("fwd_bwd_at", None)
        res["peak"][n] = {"peak": max(marks.values()), "between_steps": lb.baseline, **marks,
                          "op": at[0] if at else "?", "stack": at[1] if at else []}
    for n in main:
        sysobj, step = vs[n]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tp:
            for _ in range(steps):
                step()
        if rank == 0:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
            (outdir / f"profile_cprofile_{n}_{cfg.name}.txt").write_text(s.getvalue())
            (outdir / f"profile_ops_{n}_{cfg.name}.txt").write_text(
                tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=35))
            res.setdefault("top_ops", {})[n] = [
                (e.key, e.count / steps, e.self_cpu_time_total / steps / 1e3)
                for e in sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]]
    vs.clear()
    gc.collect()
    return res


def _worker(rank, world, port, jobs, outdir, result_path, variants, phase_variants=()):
    PHASE_VARIANTS[:] = phase_variants
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    lo = [n for _, n in socket.if_nameindex() if n.startswith("lo")]
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo[0])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    install_phase_wrappers()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = []
    try:
        for name, repeats, steps in jobs:
            t0 = time.perf_counter()
            out.append(profile_model(MODELS[name], repeats, steps, mesh, torch.device("cpu"), Path(outdir),
                                     variants))
            if rank == 0:
                print(f"  {name} profiled in {time.perf_counter() - t0:.0f} s", flush=True)
                Path(result_path).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def report(results: list) -> str:
    L = ["# Profile: funcshard apply vs FSDP2, CPU gloo W=2", ""]
    for r in results:
        m = r["model"]
        L += [f"## {m['name']} ({m['params'] / 1e6:.1f}M params, {m['groups']} groups; load average during the "
              f"run {r.get('loadavg', ['?'])[0]:.1f})", "",
              "Exclusive time per step on rank 0 (ms, median over interleaved repeats, timing wrappers on): wall "
              "time, and the main thread's CPU time (not counting time blocked or preempted):", "",
              "| phase | fsdp2 wall | fs_apply wall | delta wall | fsdp2 CPU | fs_apply CPU | delta CPU |",
              "|---|---|---|---|---|---|---|"]
        ph, pc = r["phases"], r["phases_cpu"]
        extra = [n for n in pc if n not in ("fsdp2", "fs_apply")]
        L[-2] = L[-2] + "".join(f" {n} CPU |" for n in extra)
        L[-1] = L[-1] + "---|" * len(extra)
        for p in PHASE_ORDER:
            a, b = ph["fsdp2"].get(p, 0) * 1e3, ph["fs_apply"].get(p, 0) * 1e3
            c, d = pc["fsdp2"].get(p, 0) * 1e3, pc["fs_apply"].get(p, 0) * 1e3
            e = "".join(f" {pc[n].get(p, 0) * 1e3:.2f} |" for n in extra)
            L.append(f"| {p} | {a:.2f} | {b:.2f} | {b - a:+.2f} | {c:.2f} | {d:.2f} | {d - c:+.2f} |" + e)
        a, b = r["phase_step_s"]["fsdp2"] * 1e3, r["phase_step_s"]["fs_apply"] * 1e3
        c, d = r["phase_step_cpu_s"]["fsdp2"] * 1e3, r["phase_step_cpu_s"]["fs_apply"] * 1e3
        e = "".join(f" **{r['phase_step_cpu_s'][n] * 1e3:.2f}** |" for n in extra)
        L += [f"| **step** | **{a:.2f}** | **{b:.2f}** | **{b - a:+.2f}** | **{c:.2f}** | **{d:.2f}** | "
              f"**{d - c:+.2f}** |" + e, ""]
        L += ["Calls per step: " + "; ".join(f"{n}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                                             for n, c in r["phase_calls"].items()), ""]
        L += ["Variants without timing wrappers (median; ratios paired per repeat). Wall: slowest rank's step; "
              "CPU: rank 0's main-thread CPU time per step:", "",
              "| variant | wall ms | wall vs fsdp2 | wall vs fs_apply | CPU ms | CPU vs fsdp2 | CPU vs fs_apply | "
              "step-1/2 loss |", "|---|---|---|---|---|---|---|---|"]
        for n, t in r["median_s"].items():
            lo = r["losses"].get(n, [])
            L.append(f"| {n} | {t * 1e3:.2f} | {r['ratio_vs_fsdp2'][n]:.3f} | {r['ratio_vs_fs_apply'][n]:.3f} | "
                     f"{r['median_cpu_s'][n] * 1e3:.2f} | {r['cpu_ratio_vs_fsdp2'][n]:.3f} | "
                     f"{r['cpu_ratio_vs_fs_apply'][n]:.3f} | " + " / ".join(f"{v:.6f}" for v in lo) + " |")
        L += ["", "Peak memory (rank 0, live tensor bytes, MiB; the last column: where the step's peak was reached):",
              "", "| variant | peak | forward+backward | optimizer | between steps | peak at |", "|---|---|---|---|---|---|"]
        for n, p in r["peak"].items():
            L.append(f"| {n} | {p['peak'] / 2**20:.2f} | {p.get('fwd_bwd', 0) / 2**20:.2f} | "
                     f"{p.get('optimizer', 0) / 2**20:.2f} | {p['between_steps'] / 2**20:.2f} | `{p['op']}` in "
                     + " <- ".join(reversed(p["stack"][-3:])) + " |")
        L += ["", "Top ops by self CPU time (ms per step):", ""]
        for n, ops in r.get("top_ops", {}).items():
            L.append(f"- {n}: " + ", ".join(f"{k} x{c:g} {t:.2f}" for k, c, t in ops[:12]))
        L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-33g", "gpt-10M"], choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", nargs="+",
                    default=["fsdp2", "fs_apply", "fs_apply_again", "fs_apply_autograd", "fs_apply_nodonate",
                             "fs_apply_pf0", "fs_apply_flat"])
    ap.add_argument("--phase-variants", nargs="*", default=[],
                    help="variants that also get the phase breakdown (besides fsdp2 and fs_apply)")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args(argv)
    PHASE_VARIANTS[:] = args.phase_variants
    args.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = args.out / "profile.json"
    jobs = [(m, args.repeats, args.steps) for m in args.models]
    mp.start_processes(_worker, args=(2, port, jobs, str(args.out), str(path), args.variants, args.phase_variants),
                       nprocs=2, join=True, start_method="spawn")
    results = json.loads(path.read_text())
    md = report(results)
    (args.out / "profile.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
