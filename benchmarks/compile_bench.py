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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-3M", choices=sorted(MODELS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from multirank import run_ranks

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
