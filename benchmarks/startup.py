"""Start-up time (issue 36): ``import funcshard`` against ``import torch`` and ``import torch.distributed.fsdp``.

Each case runs in a fresh interpreter (``python -c``), N rounds, the cases interleaved in every round (paired: the
machine's load changes from round to round, not from one case to the next of a round). Per case: the median of the
wall time of the timed statements, measured in the child with ``time.perf_counter`` around them (the interpreter's
own start excluded), and the median of the child's CPU time (user + sys, ``resource.getrusage`` of the child:
the whole process, interpreter start included, which load affects less than wall time).

    nice python benchmarks/startup.py -n 5                         # the table (markdown) on stdout
    git archive integ funcshard | tar -x -C /tmp/base               # a tree to compare with (optional)
    nice python benchmarks/startup.py -n 5 --base /tmp/base         # adds `import funcshard` from that tree
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (the directory funcshard is imported from, "" for this tree; the timed statements)
PLAN = ("from torch import nn; from funcshard.cost import fake_mesh; mesh = fake_mesh(8); "
        "model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])")
CASES = {
    "import torch": ("", "import torch"),
    "import torch + torch.distributed + DTensor": ("", "import torch, torch.distributed; "
                                                       "from torch.distributed.tensor import DTensor"),
    "import torch.distributed.fsdp": ("", "import torch.distributed.fsdp"),
    "import funcshard": ("", "import funcshard"),
    "import funcshard + first funcshard.plan": ("", f"import funcshard; {PLAN}; "
                                                    "funcshard.plan(model, mesh, groups=(nn.Linear,))"),
    "import funcshard + plan + shard (runtime: brings torch._dynamo)":
        ("", f"import funcshard; {PLAN}; funcshard.shard(funcshard.plan(model, mesh, groups=(nn.Linear,)))"),
}

CHILD = """import time, sys
t0 = time.perf_counter()
{timed}
print("WALL", time.perf_counter() - t0, "DYNAMO", "torch._dynamo" in sys.modules)
"""


def run_once(timed: str, path: str) -> tuple[float, float, bool]:
    """(wall s of the timed statements, child CPU s user+sys, whether torch._dynamo got imported), funcshard
    imported from ``path``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([sys.executable, "-c", CHILD.format(timed=timed)], capture_output=True, text=True,
                         env=env, cwd=path)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise RuntimeError(f"{timed!r} failed:\n{res.stderr}")
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("WALL")][-1].split()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(line[1]), cpu, line[3] == "True"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=7, help="rounds (each case once per round)")
    ap.add_argument("--base", type=Path, help="a directory holding another funcshard/ (e.g. the branch's base): "
                                              "adds `import funcshard` from there")
    args = ap.parse_args()
    cases = dict(CASES)
    if args.base:
        cases[f"import funcshard ({args.base})"] = (str(args.base), "import funcshard")
    names = list(cases)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    dynamo: dict[str, bool] = {}
    for r in range(args.n):
        order = names[r % len(names):] + names[:r % len(names)]  # (rotated: no case always first after a pause)
        for n in order:
            w, c, d = run_once(cases[n][1], cases[n][0] or str(ROOT))
            wall[n].append(w)
            cpu[n].append(c)
            dynamo[n] = d
        print(f"round {r + 1}/{args.n} done", file=sys.stderr)
    ref = statistics.median(wall["import torch.distributed.fsdp"])
    ref_cpu = statistics.median(cpu["import torch.distributed.fsdp"])
    # paired per round: case / fsdp in the same round, then the median of the ratios
    lines = [f"{args.n} rounds, fresh interpreters, python {sys.version.split()[0]}, "
             f"torch {__import__('torch').__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "",
             "| case | wall median (s) | min (s) | / fsdp (paired median) | child CPU user+sys median (s) | CPU / fsdp | torch._dynamo imported |",
             "|---|---|---|---|---|---|---|"]
    for n in names:
        paired = statistics.median(a / b for a, b in zip(wall[n], wall["import torch.distributed.fsdp"]))
        paired_cpu = statistics.median(a / b for a, b in zip(cpu[n], cpu["import torch.distributed.fsdp"]))
        lines.append(f"| `{n}` | {statistics.median(wall[n]):.2f} | {min(wall[n]):.2f} | {paired:.2f} | "
                     f"{statistics.median(cpu[n]):.2f} | {paired_cpu:.2f} | {'yes' if dynamo[n] else 'no'} |")
    lines.append("")
    lines.append(f"(fsdp: `import torch.distributed.fsdp`, wall median {ref:.2f} s, CPU median {ref_cpu:.2f} s. Wall: "
                 "the timed statements only; CPU: the whole child process, interpreter start included.)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
