"""torch.compile rows (issue 16): step time of compiled funcshard vs eager and vs FSDP2 with compiled blocks, on
gloo CPU ranks, compile time reported separately.

    python benchmarks/compile_bench.py [--model gpt-3M|tiny-13g|gpt-10M] [--world 2] [--steps 5] [--backend inductor]

Systems (same GPT, seed, batch and AdamW as bench.py; systems.py builds them):
  fsdp2                 torch's fully_shard, eager (the reference)
  fsdp2_cblocks         torch's fully_shard on blocks compiled first (torchtitan's order)
  fs_fully_shard_cblocks funcshard.fully_shard, the same
  fs_apply              apply under funcshard.value_and_grad, eager
  fs_apply_compiled     torch.compile(value_and_grad(loss over apply)): graph breaks at the runtime's entry points
  fs_traced             value_and_grad(torch.compile(loss over traced_apply, fullgraph=True)): one forward graph
                        and one backward graph, collectives inside (funcshard's fully traced mode); the blocks
                        reshard after forward (the plan's default): their all-gathers run again in the backward graph
  fs_traced_keep        the same with reshard_after_forward=False: every group gathered once, its unsharded
                        parameters kept from the forward graph to the backward graph (no re-gather)
Per system: the first step (compile included) and the median of ``--steps`` later steps; compile time = first step
minus the median. Systems run one after the other in the same ranks (not interleaved, unlike bench.py): ratios from
one run on a shared 2-core machine move by 10-20 %.

``--profile`` (issue 36: where a compiled apply step's time goes): fs_apply and fs_apply_compiled built side by side,
``--steps`` rounds of one step each, interleaved (the order alternating), wall and main-thread CPU time
(``time.thread_time``) per step; the graphs dynamo made (ops each), graph calls per step, recompiles and graph breaks
by function; and one step of each under cProfile with a CPU-time clock, its time split into buckets (the runtime's
Python, torch ops called eagerly, the compiled code's kernels, the dispatch into compiled code: dynamo, AOTAutograd
and inductor's wrappers). Then, without sharding (``--profile`` only), one Block's forward+backward eager and compiled
and the per-call cost of a compiled region (a 12-parameter graph of 12 multiplies, a block's parameter count).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "tests", HERE.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import systems as S  # noqa: E402

MODELS = {"gpt-3M": S.ModelConfig("gpt-3M", 2048, 128, 4, 12, 64, 2),
          "tiny-13g": S.ModelConfig("tiny-13g", 128, 32, 2, 12, 16, 1),
          "gpt-10M": S.ModelConfig("gpt-10M", 4096, 256, 4, 12, 128, 2)}
SYSTEMS = ("fsdp2", "fsdp2_cblocks", "fs_fully_shard_cblocks", "fs_apply", "fs_apply_compiled", "fs_traced",
           "fs_traced_keep")


def _build(name, cfg, mesh, x, y, backend):
    import torch

    import funcshard

    if name in ("fsdp2", "fs_apply"):
        return S.BUILDERS[name](cfg, mesh, "cpu", x, y)
    if name.endswith("_cblocks"):
        base = S.FSDP2 if name.startswith("fsdp2") else S.FSFullyShard
        build = cfg.build

        def compiled_blocks(device):  # blocks compiled before fully_shard
            model = build(device)
            for blk in model.blocks:
                blk.compile(backend=backend)
            return model

        cfg = type("Cfg", (), {"build": staticmethod(compiled_blocks)})()
        return base(cfg, mesh, "cpu", x, y)
    base = S.FSApply
    if name == "fs_traced_keep":
        base = type("FSApplyKeep", (S.FSApply,), {"plan_kwargs": {"reshard_after_forward": False}})
    sys_ = base(cfg, mesh, "cpu", x, y)
    plan = sys_.plan
    if name == "fs_apply_compiled":
        sys_.step_fn = torch.compile(sys_.step_fn, backend=backend)
    else:  # fs_traced, fs_traced_keep
        loss = torch.compile(lambda state, x, y: S._loss(funcshard.traced_apply(plan, state, x), y),
                             backend=backend, fullgraph=True)
        sys_.step_fn = funcshard.value_and_grad(loss)
    return sys_


def _job(model, systems, steps, backend):
    import torch
    import torch._dynamo
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    cfg = MODELS[model]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x, y = S.batch(cfg, dist.get_rank(), dist.get_world_size(), "cpu")
    out = {}
    for name in systems:
        torch._dynamo.reset()
        system = _build(name, cfg, mesh, x, y, backend)
        times, losses = [], []
        for _ in range(steps + 1):
            dist.barrier()
            t = time.perf_counter()
            losses.append(float(system.step()))
            times.append(time.perf_counter() - t)
        med = statistics.median(times[1:])
        out[name] = {"first_s": times[0], "step_ms": 1e3 * med, "compile_s": times[0] - med, "loss0": losses[0]}
        del system
    torch._dynamo.reset()
    return out


def _bucket(filename: str, func: str) -> str:
    """The profile bucket of one cProfile entry (its own time)."""
    if "/funcshard/" in filename or "/benchmarks/" in filename:
        return "funcshard's runtime and the step's own Python"
    if filename == "~":
        if ".kernel" in func:  # (the C++ kernels inductor compiled, called from its generated wrapper)
            return "inductor's C++ kernels"
        if "run_backward" in func:
            return "autograd engine (C++; eager backward kernels in it)"
        return "C++ calls from Python (torch ops: mm, linear, collectives, ...)"
    sub = filename.split("/torch/", 1)[1].split("/")[0] if "/torch/" in filename else ""
    names = {"_dynamo": "torch._dynamo (compiled frames' entry and guards; torch.compiler.disable's wrappers)",
             "_functorch": "torch._functorch (AOTAutograd's runtime wrappers)", "_inductor": "torch._inductor runtime",
             "autograd": "torch.autograd (Python)", "nn": "torch.nn (Python)",
             "distributed": "torch.distributed (Python)"}
    return names.get(sub, "other Python")


def _profiled_step(system) -> dict:
    import cProfile
    import pstats

    pr = cProfile.Profile(time.thread_time)
    pr.enable()
    system.step()
    pr.disable()
    out: dict = {}
    inductor_dir = _inductor_dir()
    for (filename, _, func), (_, _, tottime, _, _) in pstats.Stats(pr).stats.items():
        if inductor_dir and filename.startswith(inductor_dir):
            key = "inductor's generated Python wrapper"
        else:
            key = _bucket(filename, func)
        out[key] = out.get(key, 0.0) + 1e3 * tottime
    return out


def _inductor_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return None
    return cache_dir()


def _region_cost(backend: str) -> dict:
    """Main-thread CPU us per call (forward; forward+backward) of a graph of 12 multiplies by 12 parameters: eager, and
    compiled (one region: dynamo's guards, AOTAutograd's wrappers and autograd Function, the backend's code)."""
    import torch

    class Twelve(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4)) for _ in range(12))

        def forward(self, x):
            for p in self.ps:
                x = x * p
            return x

    m, x = Twelve(), torch.randn(4, requires_grad=True)
    return {"eager": _per_call(m, x, 1000), "compiled": _per_call(torch.compile(m, backend=backend), x, 1000)}


def _per_call(f, x, n) -> tuple[float, float]:
    for _ in range(3):
        f(x).sum().backward()
    out = []
    for backward in (False, True):
        best = []
        for _ in range(3):
            c = time.thread_time()
            for _ in range(n):
                y = f(x)
                if backward:
                    y.sum().backward()
            best.append((time.thread_time() - c) / n)
        out.append(1e6 * min(best))
    return out[0], out[1]


def _block_cost(cfg, backend) -> dict:
    """Main-thread CPU us per call (forward; forward+backward) of one Block at ``cfg``'s shapes, unsharded, eager
    and compiled, the compiled one measured between two eager runs."""
    import torch

    from funcshard.demo import Block

    torch.manual_seed(0)
    blk = Block(cfg.dim, cfg.heads)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, requires_grad=True)
    compiled = torch.compile(blk, backend=backend)
    t = time.perf_counter()
    compiled(x).sum().backward()
    first = time.perf_counter() - t
    return {"eager": _per_call(blk, x, 50), "compiled": _per_call(compiled, x, 50),
            "eager again": _per_call(blk, x, 50), "compile_s": first}


def _profile_job(model, steps, backend):
    import torch
    import torch._dynamo
    import torch.distributed as dist
    from test_compile import Graphs  # (tests/ is on the path: dynamo's graphs, their ops and breaks)
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    cfg = MODELS[model]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x, y = S.batch(cfg, dist.get_rank(), dist.get_world_size(), "cpu")
    torch._dynamo.reset()
    graphs, calls = Graphs(backend), [0]

    def counting(gm, example_inputs):
        compiled = graphs(gm, example_inputs)

        def run(*args):
            calls[0] += 1
            return compiled(*args)

        return run

    eager = _build("fs_apply", cfg, mesh, x, y, backend)
    comp = _build("fs_apply", cfg, mesh, x, y, backend)
    comp.step_fn = torch.compile(comp.step_fn, backend=counting)
    dist.barrier()
    t = time.perf_counter()
    loss0 = float(comp.step())
    first = time.perf_counter() - t
    eager_loss0 = float(eager.step())
    calls[0] = 0
    rows = {"eager": ([], []), "compiled": ([], [])}
    for i in range(steps):
        order = (("eager", eager), ("compiled", comp))
        for name, system in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            t, c = time.perf_counter(), time.thread_time()
            system.step()
            rows[name][0].append(time.perf_counter() - t)
            rows[name][1].append(time.thread_time() - c)
    calls_per_step = calls[0] / steps
    dist.barrier()
    buckets = {name: _profiled_step(system) for name, system in (("eager", eager), ("compiled", comp))}
    counters = graphs.counters
    out = {"first_s": first, "loss0": (eager_loss0, loss0), "graphs": graphs.ops, "calls_per_step": calls_per_step,
           "breaks": graphs.breaks(), "recompiles": sum(counters["recompiles"].values()),
           "stats": dict(counters["stats"]), "frames": dict(counters["frames"]),
           "wall_ms": {k: [1e3 * v for v in w] for k, (w, _) in rows.items()},
           "cpu_ms": {k: [1e3 * v for v in c] for k, (_, c) in rows.items()}, "buckets": buckets}
    del eager, comp
    torch._dynamo.reset()
    out["region_us"] = _region_cost(backend)
    torch._dynamo.reset()
    out["block_us"] = _block_cost(cfg, backend)
    torch._dynamo.reset()
    return out


def _report_profile(a, res):
    med = statistics.median
    r0 = res[0]
    print(f"{a.model}, W={a.world}, backend {a.backend}: eager and compiled apply steps interleaved, {a.steps} rounds")
    print(f"graphs (ops each): {r0['graphs']}; graph calls per step (forward, dynamo level): "
          f"{r0['calls_per_step']:.0f}; recompiles: {r0['recompiles']}; breaks: {r0['breaks']}; "
          f"first compiled step {max(r['first_s'] for r in res):.1f} s; loss step 0 eager/compiled {r0['loss0']}")
    print("| rank | eager wall ms | compiled wall ms | wall ratio | eager CPU ms | compiled CPU ms | CPU ratio |")
    print("|---|---|---|---|---|---|---|")
    for rank, r in enumerate(res):
        we, wc = med(r["wall_ms"]["eager"]), med(r["wall_ms"]["compiled"])
        ce, cc = med(r["cpu_ms"]["eager"]), med(r["cpu_ms"]["compiled"])
        print(f"| {rank} | {we:.1f} | {wc:.1f} | {wc / we:.2f} | {ce:.1f} | {cc:.1f} | {cc / ce:.2f} |")
    print("\nOne step under cProfile (CPU-time clock, rank 0; cProfile's own cost inflates the Python rows):")
    print("| bucket (own time) | eager ms | compiled ms |")
    print("|---|---|---|")
    b = r0["buckets"]
    for key in sorted(set(b["eager"]) | set(b["compiled"])):
        print(f"| {key} | {b['eager'].get(key, 0):.1f} | {b['compiled'].get(key, 0):.1f} |")
    print(f"| total | {sum(b['eager'].values()):.1f} | {sum(b['compiled'].values()):.1f} |")
    print("\nUnsharded, main-thread CPU us per call (forward; forward+backward), rank 0:")
    for what in ("region_us", "block_us"):
        for k, v in r0[what].items():
            print(f"  {what[:-3]} {k}: " + (f"{v:.1f} s" if k == "compile_s" else f"{v[0]:.0f}; {v[1]:.0f}"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-3M", choices=sorted(MODELS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="issue 36: where a compiled apply step's time goes (the module docstring)")
    a = ap.parse_args()
    from multirank import run_ranks

    if a.profile:
        res = run_ranks(a.world, _profile_job, a.model, a.steps, a.backend, timeout=3600)
        _report_profile(a, res)
        if a.json:
            Path(a.json).write_text(json.dumps({"args": vars(a), "ranks": res}, indent=1))
        return

    res = run_ranks(a.world, _job, a.model, a.systems.split(","), a.steps, a.backend, timeout=3600)
    rank0 = res[0]
    step = {n: max(r[n]["step_ms"] for r in res) for n in rank0}  # the slowest rank's step
    ref = step.get("fsdp2")
    cref = step.get("fsdp2_cblocks")
    print(f"{a.model}, W={a.world}, backend {a.backend}, median of {a.steps} steps after the first")
    print("| system | step ms | / fsdp2 eager | / fsdp2 compiled blocks | compile s (first step - median) | loss step 0 |")
    print("|---|---|---|---|---|---|")
    for n, r in rank0.items():
        rel = f"{step[n] / ref:.2f}" if ref else "-"
        crel = f"{step[n] / cref:.2f}" if cref else "-"
        comp = max(x[n]["compile_s"] for x in res)
        print(f"| {n} | {step[n]:.1f} | {rel} | {crel} | {comp:.1f} | {r['loss0']:.6f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "ranks": res}, indent=1))


if __name__ == "__main__":
    main()
