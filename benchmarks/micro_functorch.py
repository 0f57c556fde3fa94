"""What torch.func costs the runtime, measured without funcshard (one process, CPU).

    python benchmarks/micro_functorch.py

1. The per-call cost of a custom ``autograd.Function`` (forward + backward) under ``torch.func.grad`` vs plain
   autograd, with 1..24 tensor inputs/outputs, next to a tensor hook (what replaced ``_PreBackward``) and a
   plain view op. ``apply`` pays one Function (``_GroupGather``) per group per step.
2. The functorch tax on the model itself: the unsharded GPT's forward+backward under
   ``torch.func.grad_and_value(functional_call)`` vs ``loss.backward()``.
3. Live tensor bytes at each Block's backward under both: ``torch.func.grad`` differentiates with
   ``create_graph=True``, so the backward keeps every finished block's activations and gradients alive.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import instruments
import systems as S
import torch


class _Ident(torch.autograd.Function):
    @staticmethod
    def forward(tag, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *g):
        return (None, *g)


def _timeit(fn, reps=20) -> float:
    fn()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts)


def function_cost(calls: int = 20) -> list[str]:
    """Extra microseconds per call (forward + backward) over the same chain of view ops without it."""
    out = ["| tensors in/out | autograd.Function under torch.func | autograd.Function, plain autograd | "
           "tensor hook under torch.func |", "|---|---|---|---|"]
    for n in (1, 4, 12, 24):
        xs = [torch.randn(4) for _ in range(n)]

        def chain(xs, kind):
            total = 0
            for _ in range(calls):
                if kind == "fn":
                    ys = _Ident.apply(None, *xs)
                elif kind == "hook":
                    ys = [x.view_as(x) for x in xs]
                    ys[0].register_hook(lambda g: None)
                else:
                    ys = [x.view_as(x) for x in xs]
                total = total + sum(y.sum() for y in ys)
            return total

        func, plain = {}, {}
        for kind in ("fn", "hook", "view"):
            f = torch.func.grad(lambda xs, kind=kind: chain(xs, kind))
            func[kind] = _timeit(lambda: f(xs)) / calls
        xr = [x.clone().requires_grad_() for x in xs]
        for kind in ("fn", "view"):
            plain[kind] = _timeit(lambda kind=kind: chain(xr, kind).backward()) / calls
        out.append(f"| {n} | {(func['fn'] - func['view']) * 1e6:.0f} us | {(plain['fn'] - plain['view']) * 1e6:.0f} us"
                   f" | {(func['hook'] - func['view']) * 1e6:.0f} us |")
    return out


def model_tax() -> list[str]:
    from bench import M10, TINY

    out = ["| model | fwd+bwd plain autograd (ms) | grad_and_value(functional_call) (ms) | tax per group (ms) |",
           "|---|---|---|---|"]
    for cfg in (TINY, M10):
        m = cfg.build("cpu")
        x, y = S.batch(cfg, 0, 1, "cpu")
        params = {k: v.detach() for k, v in m.named_parameters()}
        f = torch.func.grad_and_value(lambda p: S._loss(torch.func.functional_call(m, p, (x,)), y))

        def plain():
            S._loss(m(x), y).backward()
            m.zero_grad(set_to_none=True)

        a, b = _timeit(plain, 3), _timeit(lambda: f(params), 3)
        out.append(f"| {cfg.name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {(b - a) / cfg.groups * 1e3:.3f} |")
    return out


def retention() -> list[str]:
    from bench import M10

    cfg = M10
    m = cfg.build("cpu")
    x, y = S.batch(cfg, 0, 1, "cpu")
    params = {k: v.detach() for k, v in m.named_parameters()}
    timeline: list[float] = []
    box = {}

    def fwd_hook(mod, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: timeline.append(box["lb"].total / 2**20))

    for b in m.blocks:
        b.register_forward_hook(fwd_hook)
    rows = ["| mode | live MiB at each Block's backward (last block first) | peak MiB |", "|---|---|---|"]
    for mode in ("torch.func.grad_and_value", "loss.backward()"):
        timeline.clear()
        if mode.startswith("torch.func"):
            f = torch.func.grad_and_value(lambda p: S._loss(torch.func.functional_call(m, p, (x,)), y))
            lb = box["lb"] = instruments.LiveBytes(roots=[params])
            with lb:
                f(params)
        else:
            lb = box["lb"] = instruments.LiveBytes(roots=[m])
            with lb:
                S._loss(m(x), y).backward()
            m.zero_grad(set_to_none=True)
        rows.append(f"| {mode} | {' '.join(f'{v:.0f}' for v in timeline)} | {lb.peak / 2**20:.1f} |")
    return rows


def main() -> int:
    torch.set_num_threads(1)
    print("## autograd.Function per call (forward + backward), 1 thread\n")
    print("\n".join(function_cost()))
    print("\n## functorch tax on the unsharded model (1 thread)\n")
    print("\n".join(model_tax()))
    print("\n## live bytes during backward, unsharded gpt-10M\n")
    print("\n".join(retention()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
