"""What the notebooks run on their gloo ranks (spawned processes import their functions from here), and checks.

``spawn(fn, world, *args)`` runs ``fn(*args)`` on ``world`` local CPU ranks (gloo) and returns every rank's result.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the repository's funcshard, also in the spawned ranks
    sys.path.insert(0, str(ROOT))

# imported here, once: forked ranks inherit them (importing them in each rank takes seconds)
import funcshard  # noqa: E402,F401
import funcshard.cost  # noqa: E402,F401
import funcshard.demo  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402,F401

# a small GPT (funcshard.demo's): vocab, dim, heads, layers, seq; and sequences per rank per step
GPT_CONFIG = dict(vocab=256, d=64, heads=2, layers=4, seq=16)
BATCH = 4
SEED = 0


def gpt(device="cpu"):
    from funcshard.demo import GPT

    torch.manual_seed(SEED)
    with torch.device(device):
        return GPT(**GPT_CONFIG)


def batch(step: int, rank: int, world: int):
    """This rank's slice of step ``step``'s global batch (the same global batch whatever the world): counting
    sequences ``start, start + k, start + 2k, ...`` (mod vocab), ``k`` in 1..3, so a model can learn them."""
    g = torch.Generator().manual_seed(1000 + step)
    n, v, t = BATCH * world, GPT_CONFIG["vocab"], GPT_CONFIG["seq"] + 1
    start = torch.randint(0, v, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    data = (start + stride * torch.arange(t)) % v
    mine = data.chunk(world)[rank]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def loss_of(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(*args)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


def spawn(fn, world: int, *args):
    """``fn(*args)`` on ``world`` gloo ranks (``fn`` defined in an importable module); every rank's result. The
    ranks are forked from this process where the platform can (Linux: a second each, where spawning a fresh
    interpreter that imports torch takes several), else spawned."""
    method = "fork" if "fork" in mp.get_all_start_methods() and sys.platform == "linux" else "spawn"
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank_main, args=(world, _port(), d, fn, args), nprocs=world, join=True,
                           start_method=method)
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


def nbytes(tree) -> int:
    from funcshard._tree import tree_leaves

    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


# ---- notebook 1: functional training ----------------------------------------------------------------------


def train_functional(steps: int, make_tx=None):
    """funcshard.plan/shard/apply + funcshard.optim on this rank; losses (global mean) and bytes held. ``make_tx``:
    ``make_tx(plan)`` gives the optimizer (default AdamW)."""
    import funcshard
    from funcshard import optim
    from funcshard.demo import Block
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    model = gpt()
    plan = funcshard.plan(model, mesh, groups=(Block,))
    state = funcshard.shard(plan)
    tx = optim.adamw(lr=3e-3, weight_decay=0.1) if make_tx is None else make_tx(plan)
    opt_state = tx.init(state)
    losses = []

    def loss_fn(s, x, y):
        return loss_of(funcshard.apply(plan, s, x), y)

    for i in range(steps):
        x, y = batch(i, rank, world)
        loss, grads = funcshard.value_and_grad(loss_fn)(state, x, y)
        updates, opt_state = tx.update(grads, opt_state, state)
        state = optim.apply_updates(state, updates)
        t = loss.detach().reshape(1)
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return {"losses": losses, "params": nbytes(state), "grads": nbytes(grads), "optimizer": nbytes(opt_state),
            "unsharded_params": nbytes(dict(model.named_parameters())),
            "owners": _owner_printout(plan, tx, state)}


def _owner_printout(plan, tx, state):
    """The optimizer step's part of the plan's printout (``plan.with_optimizer(tx)``): its all-to-alls, then who owns
    which matrix with every rank's FLOPs, bytes and extra memory; None for an optimizer without owners."""
    steps = plan.with_optimizer(tx, state).owner_steps
    if not steps:
        return None
    return "\n".join([*(c.line() for s in steps for c in s.collectives), *(str(s) for s in steps)])


def muon_adamw(plan):
    """Muon for the blocks' weight matrices, AdamW for the rest (embeddings, norms, biases): one optimizer."""
    from funcshard import optim

    def label(path, spec):
        return "muon" if path.startswith("blocks.") and len(spec.shape) == 2 else "adamw"

    return optim.multi_transform({"muon": optim.muon(0.02, plan=plan), "adamw": optim.adamw(lr=3e-3, weight_decay=0.1)},
                                 label, plan=plan)


# ---- notebook 2: FSDP2 -> funcshard.fully_shard -> the functional API --------------------------------------


def _module_losses(fully_shard, steps):
    from funcshard.demo import Block
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    model = gpt()
    for m in model.modules():
        if isinstance(m, Block):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for i in range(steps):
        x, y = batch(i, rank, world)
        loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().reshape(1)
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def three_ways(steps: int):
    """The same training on this rank three ways: torch's FSDP2, funcshard.fully_shard, the functional API."""
    import funcshard
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return {"FSDP2 (torch.distributed.fsdp.fully_shard)": _module_losses(torch_fully_shard, steps),
            "funcshard.fully_shard": _module_losses(funcshard.fully_shard, steps),
            "funcshard functional (plan/apply/optim)": train_functional(steps)["losses"]}


# ---- notebook 3: plans measured -------------------------------------------------------------------------


def measure_plans(settings: list[dict], steps: int = 3):
    """Per plan setting (``funcshard.plan`` keyword arguments): this rank's measured peak live bytes of a training
    step (forward, backward, AdamW update), its median step time, the calibrated hardware figures, the prediction
    for the same plan, and (first setting) the traced step's events."""
    import dataclasses

    import funcshard
    import funcshard.cost as C
    from funcshard import optim
    from funcshard.demo import Block
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from instruments import LiveBytes

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    hw = C.calibrate(mesh, quick=True)
    x, y = batch(0, rank, world)
    out = {"hardware": dataclasses.asdict(hw), "plans": []}
    profiles: dict = {}
    for k, kw in enumerate(settings):
        with torch.device("meta"):
            skeleton = gpt("meta")
        plan = funcshard.plan(skeleton, mesh, groups=(Block,), **kw)
        state = funcshard.shard(plan, dict(gpt().named_parameters()))
        tx = optim.adamw(lr=3e-3)
        box = {"state": state, "opt": tx.init(state)}

        def step():
            loss, grads = funcshard.value_and_grad(lambda s: loss_of(funcshard.apply(plan, s, x), y))(box["state"])
            updates, box["opt"] = tx.update(grads, box["opt"], box["state"], donate=True)
            box["state"] = optim.apply_updates(box["state"], updates, donate=True)

        step()
        lb = LiveBytes(roots=[box])
        with lb:
            step()
        times = []
        for _ in range(steps):
            dist.barrier()  # (the slowest rank's pace)
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        rec = {"plan": kw, "measured_peak": lb.peak, "measured_s": sorted(times)[len(times) // 2]}
        if k == 0:
            dist.barrier()
            with funcshard.trace.trace() as tr:
                step()
            rec["trace"] = {"memory": tr.memory(), "spans": tr.spans(), "overlap": tr.overlap()}
        cost = C.estimate(plan, x, loss=lambda out: loss_of(out, y), optimizer=tx, hardware=hw, profiles=profiles)
        rec.update(predicted_peak=cost.peak_bytes, predicted_s=cost.step_s,
                   predicted_points=[(p.t, p.bytes) for p in cost.points],
                   predicted_intervals=[(i.lane, i.what, i.start, i.end) for i in cost.intervals])
        out["plans"].append(rec)
    return out


# ---- plots ----------------------------------------------------------------------------------------------


def check_axes(fig) -> None:
    """Every axis with data has both labels, and each label names its unit in parentheses (raises otherwise)."""
    for ax in fig.axes:
        for what, text in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
            if not text or "(" not in text:
                raise AssertionError(f"plot '{ax.get_title()}': the {what} axis needs a label with its unit in "
                                     f"parentheses, got {text!r}")
