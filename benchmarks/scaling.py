"""How a step's CPU cost grows with the work (issue 36): against the number of groups and against W.

One process on torch's fake process group (``backend="fake"``: collectives do nothing, so what is measured is the
systems' own work: copies, hooks, Python). The model is ``systems.ModelConfig``'s tiny GPT (dim 32, seq 16, batch
1), N-1 blocks + the root = N groups. Systems (``benchmarks/systems.py``): ``fs_apply`` (plan + shard + apply
under value_and_grad + funcshard.optim.adamw) and ``fs_fully_shard`` (funcshard.fully_shard + torch's AdamW);
``fsdp2`` (torch's fully_shard) as the reference with ``--fsdp2``. One step = forward, backward, optimizer.

Each system is built and stepped twice before it is timed: the first step of a system whose optimizer is torch's
AdamW on DTensor parameters (``fs_fully_shard``, ``fsdp2``) pays DTensor's sharding propagation for the foreach ops
once (not timed here; for ``fs_fully_shard`` it took 5 s at 13 groups and 17 s at 33 groups on the loaded machine,
most of this benchmark's run time). torch runs one intra-op thread (``torch.set_num_threads(1)``).

Measured per step: main-thread CPU time (``time.thread_time``: what the main thread itself ran, which the load of
other processes on the machine affects less than wall time), the process's CPU time (``time.process_time``, all
threads) and wall time; per point the median over ``--repeats`` repeats of ``--steps`` steps, systems interleaved.

Sweeps: groups in ``--groups`` at W = ``--world`` (default 8), and W in ``--worlds`` at ``--fixed-groups`` groups.
Per sweep and system, a least-squares line CPU = a + b x; its slope (per group, per rank) and the largest
relative residual show whether the cost is flat per group and whether a superlinear term in W shows (a
quadratic fit's relative curvature is reported too).

    nice python benchmarks/scaling.py                       # ~7 min on the loaded 2-core VM (see SCALING.md)
    nice python benchmarks/scaling.py --groups 13 --fsdp2   # the W sweep with FSDP2 alongside: ~2 min
    nice python benchmarks/scaling.py --out /tmp/s             # also /tmp/s.json and /tmp/s.png (matplotlib, Agg)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import systems as S  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import funcshard  # noqa: E402


def tiny(groups: int) -> S.ModelConfig:
    return S.ModelConfig(f"tiny-{groups}g", 128, 32, 2, groups - 1, 16, 1)


def measure(groups: int, world: int, names: list[str], repeats: int, steps: int) -> dict:
    """{system: {"thread": s/step, "process": s/step, "wall": s/step}} (medians over repeats) at one point."""
    mesh = funcshard.cost.fake_mesh(world)  # (re-made when the world size changes)
    torch.set_flush_denormal(True)  # the fake all-gathers leave garbage: keep it from turning slow
    cfg = tiny(groups)
    x, y = S.batch(cfg, 0, world, torch.device("cpu"))
    live = {n: S.build(n, cfg, mesh, torch.device("cpu"), x, y) for n in names}
    for s in live.values():  # warm-up: two steps each
        s.step()
        s.step()
    rec = {n: {"thread": [], "process": [], "wall": []} for n in names}
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            gc.collect()
            gc.disable()
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            for _ in range(steps):
                live[n].step()
            t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
            gc.enable()
            rec[n]["wall"].append((t1 - t0) / steps)
            rec[n]["thread"].append((c1 - c0) / steps)
            rec[n]["process"].append((p1 - p0) / steps)
    del live
    gc.collect()
    return {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rec.items()}


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares: the line a + b x (slope, intercept, largest |residual| / y) and the quadratic's
    curvature c x^2 at the largest x relative to the line's value there (what a superlinear term would add)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    resid = max(abs(y - (a + b * x)) / y for x, y in zip(xs, ys))
    out = {"slope": b, "intercept": a, "max_rel_residual": resid}
    if n >= 3:
        import numpy as np

        c2, c1, c0 = np.polyfit(xs, ys, 2)
        xm = max(xs)
        out["quad_rel_at_max"] = float(c2 * xm * xm / (a + b * xm))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[13, 33, 65, 129])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--fixed-groups", type=int, default=13)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--fsdp2", action="store_true", help="torch's FSDP2 as a reference system too")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.png (the table goes to stdout)")
    ap.add_argument("--replot", type=Path, nargs=2, metavar=("GROUPS_JSON", "WORLD_JSON"),
                    help="no run: OUT.png from the groups sweep of one run's json and the W sweep of another's")
    args = ap.parse_args()
    if args.replot:
        return replot(*args.replot, args.out)
    torch.set_num_threads(1)
    names = ["fs_apply", "fs_fully_shard"] + (["fsdp2"] if args.fsdp2 else [])
    t_start = time.perf_counter()
    by_groups, by_world = {}, {}
    for g in args.groups:
        by_groups[g] = measure(g, args.world, names, args.repeats, args.steps)
        print(f"groups={g} W={args.world}: " + ", ".join(f"{n} {v['thread'] * 1e3:.2f} ms"
                                                         for n, v in by_groups[g].items()), file=sys.stderr)
    for w in args.worlds:
        by_world[w] = measure(args.fixed_groups, w, names, args.repeats, args.steps)  # (all in one stretch)
        print(f"groups={args.fixed_groups} W={w}: " + ", ".join(f"{n} {v['thread'] * 1e3:.2f} ms"
                                                              for n, v in by_world[w].items()), file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    fits = {sweep: {n: fit(list(data), [data[x][n]["thread"] for x in data]) for n in names}
            for sweep, data in (("groups", by_groups), ("world", by_world)) if len(data) >= 2}
    lines = [f"torch {torch.__version__}, fake process group, one process, torch threads 1, {args.repeats} repeats x "
             f"{args.steps} steps per point (medians), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{time.perf_counter() - t_start:.0f} s in all", ""]
    head = " | ".join(f"{n} main-thread CPU ms/step | {n} process CPU ms | {n} wall ms" for n in names)
    lines += [f"### Against the number of groups (W = {args.world})", "",
              f"| groups | {head} |", "|---" * (1 + 3 * len(names)) + "|"]
    for g, r in by_groups.items():
        lines.append(f"| {g} | " + " | ".join(f"{r[n]['thread'] * 1e3:.2f} | {r[n]['process'] * 1e3:.2f} | "
                                               f"{r[n]['wall'] * 1e3:.2f}" for n in names) + " |")
    lines += ["", f"### Against W ({args.fixed_groups} groups)", "", f"| W | {head} |",
              "|---" * (1 + 3 * len(names)) + "|"]
    for w, r in by_world.items():
        lines.append(f"| {w} | " + " | ".join(f"{r[n]['thread'] * 1e3:.2f} | {r[n]['process'] * 1e3:.2f} | "
                                               f"{r[n]['wall'] * 1e3:.2f}" for n in names) + " |")
    lines += ["", "### Fits (main-thread CPU time per step: a + b x, least squares)", "",
              "| sweep | system | slope b | intercept a (ms) | largest residual / value | quadratic term at the "
              "largest x / line |", "|---|---|---|---|---|---|"]
    for sweep, unit in (("groups", "us per group"), ("world", "us per rank")):
        for n in names if sweep in fits else []:
            f = fits[sweep][n]
            lines.append(f"| {sweep} | {n} | {f['slope'] * 1e6:.1f} {unit} | {f['intercept'] * 1e3:.2f} | "
                         f"{f['max_rel_residual']:.1%} | {f.get('quad_rel_at_max', float('nan')):+.1%} |")
    print("\n".join(lines))
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "by_groups": by_groups, "by_world": by_world,
             "fits": fits}, indent=1))
        plot(by_groups, by_world, fits, names, args, args.out.with_suffix(".png"))


def replot(groups_json: Path, world_json: Path, out: Path) -> None:
    """OUT.png from two runs' json (the groups sweep of one, the W sweep of the other), with their fits."""
    a, b = json.loads(groups_json.read_text()), json.loads(world_json.read_text())
    by_groups = {int(k): v for k, v in a["by_groups"].items()}
    by_world = {int(k): v for k, v in b["by_world"].items()}
    names = list(dict.fromkeys([*by_groups[min(by_groups)], *by_world[min(by_world)]]))
    fits = {"groups": a["fits"]["groups"], "world": b["fits"]["world"]}
    args = argparse.Namespace(world=int(a["args"]["world"]), fixed_groups=int(b["args"]["fixed_groups"]))
    plot(by_groups, by_world, fits, names, args, out.with_suffix(".png"))


def plot(by_groups, by_world, fits, names, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, data, sweep, xlabel in ((axes[0], by_groups, "groups", f"groups (W = {args.world})"),
                                    (axes[1], by_world, "world", f"W ({args.fixed_groups} groups)")):
        xs = list(data)
        for n in [n for n in names if n in data[xs[0]]] if sweep in fits else []:
            ys = [data[x][n]["thread"] * 1e3 for x in xs]
            f = fits[sweep][n]
            line = ax.plot(xs, ys, "o", label=f"{n} (slope {f['slope'] * 1e6:.1f} us)")[0]
            ax.plot(xs, [(f["intercept"] + f["slope"] * x) * 1e3 for x in xs], "-", color=line.get_color(),
                    alpha=0.6)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("main-thread CPU ms / step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if sweep in fits:
            ax.legend(fontsize=8)
    fig.suptitle("step CPU time on the fake process group (tiny GPT): points and least-squares lines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
