"""The Muon optimizer step over sharded parameters (issue 33): owners (``optim.muon``: LPT-balanced owner ranks,
two all-to-alls) against gather-everywhere (every rank all-gathers every update matrix and runs Newton-Schulz on all
of them; correct, W times the compute) and against the per-shard update (each rank orthogonalizes its own row shard:
what ``torch.optim.Muon`` does on DTensor shards; wrong, shown for its cost only).

    nice python benchmarks/muon.py            # W=2 and 4 on gloo (spawned ranks), W=8 on the fake process group

Per system and world size: the step's median time (``optim.step``: momentum, orthogonalization, update), the bytes
each rank sends (all-to-all: its pieces for other ranks, both ways; all-gather: its shard to the W-1 others, per
matrix), the step's peak of transient tensor bytes (``tests/memtrack.PeakBytes``: storages made during the step;
parameters, gradients and momentum excluded), and the Newton-Schulz time of the busiest rank against the ranks' mean.
The fake process group (W=8) runs rank 0 alone with collectives that do nothing: its times are rank 0's compute only,
its bytes what rank 0 would send. Every rank runs one thread (``torch.set_num_threads(1)``); CPU bf16 matrix
products are slow (~1 GFLOP/s here), so the model is small: ``--d 96 --layers 2`` (8 matrices, 96x96 to 384x96).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import funcshard  # noqa: E402
from funcshard import _muon, optim  # noqa: E402
from funcshard._collectives import all_gather_into  # noqa: E402

SYSTEMS = ("owners", "gather_everywhere", "per_shard")


def _model(d: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False), nn.Linear(d, 4 * d, bias=False),
                 nn.Linear(4 * d, d, bias=False)]
    return nn.Sequential(*mods)


class _Timed:
    """Newton-Schulz wrapped to add up its time on this rank."""

    def __init__(self):
        self.seconds = 0.0
        self.real = _muon.newton_schulz

    def __call__(self, *a, **k):
        t = time.perf_counter()
        out = self.real(*a, **k)
        self.seconds += time.perf_counter() - t
        return out


def _other_step(plan, system, grads, bufs, params, rank, world, sent):
    """One step of gather-everywhere or per-shard Muon (the same momentum and update as optim.muon)."""
    keys = list(grads)
    upd = _muon.momentum_update([grads[k] for k in keys], [bufs[k] for k in keys], 0.95, True)
    ortho = []
    for k, u in zip(keys, upd):
        spec = plan.specs[k]
        if system == "per_shard":
            o = _muon.newton_schulz(spec.valid_part(u, rank).clone(), _muon.DEFAULT_NS_COEFFICIENTS, 5, _muon.EPS)
            out = torch.zeros_like(u)
            spec.valid_part(out, rank).copy_(o)
        else:
            full = u.new_empty((world * u.shape[0], *u.shape[1:]))
            if world > 1:
                all_gather_into(full, u.contiguous(), plan.shard_group()[0]).wait()
                sent[0] += (world - 1) * u.numel() * u.element_size()
            else:
                full.copy_(u)
            o = _muon.newton_schulz(spec.unpad(full).clone(), _muon.DEFAULT_NS_COEFFICIENTS, 5, _muon.EPS)
            out = spec.local_shard(o, rank)
        ortho.append(out)
    _muon.apply_muon([params[k] for k in keys], ortho, [plan.specs[k].shape for k in keys], 0.02, 0.1, None)


def _run(d: int, layers: int, steps: int, systems=SYSTEMS) -> dict:
    from memtrack import PeakBytes

    from funcshard import cost

    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    plan = funcshard.plan(_model(d, layers), mesh)
    rank = plan.shard_group()[1]
    fake = dist.get_backend() == "fake"
    out = {}
    for system in systems:
        state = funcshard.shard(plan)
        tx = optim.muon(0.02, plan=plan)
        opt_state = tx.init(state)
        bufs = {k: torch.zeros_like(v) for k, v in state.items()}
        g = torch.Generator().manual_seed(rank)
        grads = {k: torch.randn(v.shape, generator=g) for k, v in state.items()}
        timed = _Timed()
        _muon.newton_schulz = timed
        sent = [0]
        try:
            times = []
            for i in range(steps + 1):  # (the first: warm-up)
                if not fake:
                    dist.barrier()
                t = time.perf_counter()
                if system == "owners":
                    state, opt_state = optim.step(tx, grads, opt_state, state, donate=True)
                else:
                    _other_step(plan, system, grads, bufs, state, rank, world, sent)
                times.append(time.perf_counter() - t)
                if i == 0:
                    timed.seconds, sent[0] = 0.0, 0
            ns = timed.seconds / steps
            if system == "gather_everywhere":
                sent_b = sent[0] // steps
            elif system == "owners":
                (oc,) = cost.owner_costs(plan, tx) if world > 1 else (None,)
                sent_b = oc.to_owners_sent[rank] + oc.back_sent[rank] if oc else 0
                model_extra = oc.extra_bytes[rank] if oc else 0
            else:
                sent_b = 0
            held = [*state.values(), *grads.values(), *bufs.values(), *tree_leaves(opt_state)]
            with PeakBytes(ignore=held) as mem:
                if system == "owners":
                    state, opt_state = optim.step(tx, grads, opt_state, state, donate=True)
                else:
                    _other_step(plan, system, grads, bufs, state, rank, world, [0])
        finally:
            _muon.newton_schulz = timed.real
        out[system] = dict(step_s=statistics.median(times[1:]), ns_s=ns, sent=sent_b, peak=mem.peak,
                           owners=str(tx.owners(state)) if system == "owners" else None,
                           model_extra=model_extra if system == "owners" else None)
    return out


def tree_leaves(t):
    from funcshard._tree import tree_leaves as leaves

    return [x for x in leaves(t) if isinstance(x, torch.Tensor)]


def _table(world: int, ranks: list[dict], fake: bool) -> list[str]:
    lines = []
    for system in SYSTEMS:
        rs = [r[system] for r in ranks]
        step = max(r["step_s"] for r in rs)
        ns = [r["ns_s"] for r in rs]
        model = "" if rs[0]["model_extra"] is None else f"{max(r['model_extra'] for r in rs) / 2**10:.1f}"
        lines.append(f"| {world}{' (fake)' if fake else ''} | {system} | {step * 1e3:.0f} | "
                     f"{max(r['sent'] for r in rs) / 2**10:.1f} | {max(r['peak'] for r in rs) / 2**10:.1f} | "
                     f"{model} | {max(ns) * 1e3:.0f} | {statistics.mean(ns) * 1e3:.0f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--fake", type=int, default=8)
    a = ap.parse_args()
    from multirank import run_ranks

    rows, owners = [], {}
    for w in [int(x) for x in a.worlds.split(",") if x]:
        ranks = run_ranks(w, _run, a.d, a.layers, a.steps, timeout=900)
        rows += _table(w, ranks, False)
        owners[w] = ranks[0]["owners"]["owners"]
    if a.fake:
        from funcshard.cost import fake_mesh

        fake_mesh(a.fake)
        ranks = [_run(a.d, a.layers, a.steps)]
        rows += _table(a.fake, ranks, True)
        owners[a.fake] = ranks[0]["owners"]["owners"]
    print(f"d={a.d} layers={a.layers} steps={a.steps} (median; ms per step on the slowest rank)\n")
    print("| W | system | step ms | sent KiB/rank | peak transient KiB | cost model: owners' extra KiB | "
          "Newton-Schulz ms, busiest rank | mean rank |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for w, text in owners.items():
        print(f"\nW={w}:\n{text}")


if __name__ == "__main__":
    main()
