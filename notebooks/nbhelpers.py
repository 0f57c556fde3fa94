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
from funcshard import apply, optim, traced_apply  # noqa: E402,F401  (lazy names: their modules imported now)
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


# ---- notebook 4: transforms that compose over sharded state -----------------------------------------------


def train_reference(model, loss_fn, batches, lr: float):
    """The unsharded reference's training: ``torch.optim.AdamW`` (no decay) on a copy of ``model``'s parameters,
    one step per batch with ``torch.func.grad_and_value(loss_fn)(params, *batch)``. Returns the losses, the first
    step's gradients and the trained parameters."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)
    losses, first = [], None
    for batch in batches:
        grads, loss = torch.func.grad_and_value(loss_fn)(params, *batch)
        first = grads if first is None else first
        losses.append(loss.item())
        for k, p in params.items():
            p.grad = grads[k]
        opt.step()
    return losses, first, params


def mlp(*sizes: int, act=torch.nn.Tanh, seed: int = SEED) -> torch.nn.Sequential:
    """A small MLP: ``Linear(sizes[0], sizes[1]), act, ..., Linear(sizes[-2], sizes[-1])``, seeded."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [torch.nn.Linear(a, b)] + ([act()] if i < len(sizes) - 2 else [])
    return torch.nn.Sequential(*layers)


def _mesh_plan(model, **kw):
    """This rank's 1-D mesh over every rank and a plan with one group per ``Linear`` (one all-gather each)."""
    import funcshard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return funcshard.plan(model, mesh, groups=(torch.nn.Linear,), **kw)


def count_collectives(fn):
    """``fn()``'s result and the tensor collectives it issued on this rank, by kind: ``{"all-gather": n,
    "reduce-scatter": n, "all-reduce": n}`` (torch.distributed's three functions counted while ``fn`` runs)."""
    from funcshard._compat import all_gather_name, reduce_scatter_name

    names = {all_gather_name: "all-gather", reduce_scatter_name: "reduce-scatter", "all_reduce": "all-reduce"}
    real = {n: getattr(dist, n) for n in names}
    counts = dict.fromkeys(names.values(), 0)

    def counted(n):
        def call(*a, **k):
            counts[names[n]] += 1
            return real[n](*a, **k)
        return call

    try:
        for n in names:
            setattr(dist, n, counted(n))
        out = fn()
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return out, counts


# DP-SGD: a 4-class problem of 8 features (a random linear teacher), the same global batch on every rank

DP_SIZES = (8, 32, 32, 4)


def dp_batch(step: int, n: int = 16):
    """Step ``step``'s ``n`` examples: features ``(n, 8)`` and labels ``(n,)`` (a fixed noisy linear teacher)."""
    g = torch.Generator().manual_seed(2000 + step)
    teacher = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    x = torch.randn(n, 8, generator=g)
    return x, (x @ teacher + 0.5 * torch.randn(n, 4, generator=g)).argmax(-1)


def dp_sgd(steps: int, clip: float, lr: float, noises=(0.0,)):
    """DP-SGD on this rank's shards, once per noise multiplier in ``noises``: per-example gradients
    (``vmap(grad)`` over ``funcshard.apply``: shards with a leading batch dim), each example's global norm (an
    all-reduce of the local squared sums), clipped to ``clip``, summed, Gaussian noise of std ``noise * clip``
    added to this rank's shard, divided by the batch size, then ``optim.sgd``. Every rank takes the same global
    batch (so that a shard's ``b``-th gradient is example ``b``'s). Per run: the losses, step 0's clipped sum
    (gathered, unsharded), every step's per-example norms and the per-example gradients' shard shapes."""
    import funcshard
    from funcshard import optim

    plan = _mesh_plan(mlp(*DP_SIZES))

    def loss_one(s, x, y):  # one example's loss
        return F.cross_entropy(funcshard.apply(plan, s, x[None]), y[None])

    per_example = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))

    def run(noise):
        state = funcshard.shard(plan)
        tx = optim.sgd(lr)
        opt_state = tx.init(state)
        gen = torch.Generator().manual_seed(3000 + dist.get_rank())  # (each rank: the noise of its own shard)
        losses, norms, first = [], [], None
        for step in range(steps):
            x, y = dp_batch(step)
            with torch.no_grad():
                losses.append(F.cross_entropy(funcshard.apply(plan, state, x), y).item())
            g = per_example(state, x, y)  # {path: (B, *shard shape)}
            sq = sum(t.flatten(1).pow(2).sum(1) for t in g.values())  # this rank's part of each squared norm
            norm = funcshard.all_reduce(sq, plan.mesh).sqrt()
            factor = (clip / (norm + 1e-6)).clamp(max=1.0)  # (Opacus's formula)
            summed = {k: torch.einsum("i,i...->...", factor, t) for k, t in g.items()}
            if first is None:
                first = funcshard.gather(plan, summed)
            grads = {k: (t + noise * clip * torch.randn(t.shape, generator=gen)) / len(x) for k, t in summed.items()}
            updates, opt_state = tx.update(grads, opt_state, state)
            state = optim.apply_updates(state, updates)
            norms.append(norm)
        return {"losses": losses, "clipped_sum": first, "norms": torch.stack(norms),
                "shapes": {k: tuple(v.shape) for k, v in g.items()}}

    return [run(noise) for noise in noises]


def opacus_dp_sgd(steps: int, clip: float, lr: float):
    """The reference, one process: Opacus (``GradSampleModule`` + ``DPOptimizer``, noise off) on the unsharded
    model, the same batches and SGD. Returns the losses and step 0's clipped gradient sum (``p.summed_grad``)."""
    import warnings

    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = mlp(*DP_SIZES)
    gsm = GradSampleModule(model)
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=lr), noise_multiplier=0.0, max_grad_norm=clip,
                      expected_batch_size=16)
    losses, first = [], None
    for step in range(steps):
        x, y = dp_batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(gsm(x), y)
        with warnings.catch_warnings():  # (torch's note that the inputs need no gradient: they do not)
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            loss.backward()
        losses.append(loss.item())
        opt.step()
        if first is None:
            first = {k: p.summed_grad.detach().clone() for k, p in model.named_parameters()}
    return {"losses": losses, "clipped_sum": first}


# MAML: sine waves y = a sin(x - p), a task's support and query points; one inner SGD step

MAML_SIZES = (1, 32, 32, 1)


def sine_tasks(step: int, n_tasks: int = 4, k: int = 10):
    """``n_tasks`` sine tasks: support ``(xs, ys)`` and query ``(xq, yq)``, each ``(n_tasks, k, 1)``, and (a, p)."""
    g = torch.Generator().manual_seed(4000 + step)
    a = 0.5 + 2.5 * torch.rand(n_tasks, 1, 1, generator=g)
    p = 3.0 * torch.rand(n_tasks, 1, 1, generator=g)
    xs, xq = (10 * torch.rand(n_tasks, k, 1, generator=g) - 5 for _ in range(2))
    return (xs, a * torch.sin(xs - p), xq, a * torch.sin(xq - p)), (a, p)


def maml_losses(apply, inner_lr: float, scale: float = 1.0):
    """``(task_loss, adapted, meta_loss)`` for a model ``apply(params, x)``: one task's MSE times ``scale``,
    the parameters after one inner SGD step on a support set, and the meta-batch's mean query loss after it
    (vmapped over tasks)."""
    def task_loss(p, x, y):
        return scale * (apply(p, x) - y).pow(2).mean()

    def adapted(p, xs, ys):
        g = torch.func.grad(task_loss)(p, xs, ys)
        return {k: v - inner_lr * g[k] for k, v in p.items()}

    def one_task(p, xs, ys, xq, yq):
        return task_loss(adapted(p, xs, ys), xq, yq)

    def meta_loss(p, xs, ys, xq, yq):
        return torch.func.vmap(one_task, in_dims=(None, 0, 0, 0, 0))(p, xs, ys, xq, yq).mean()

    return task_loss, adapted, meta_loss


def maml(steps: int, inner_lr: float, lr: float):
    """MAML on this rank's shards: ``funcshard.value_and_grad`` through one inner SGD step (``torch.func.grad``),
    vmapped over a meta-batch of tasks (the same tasks on every rank), with a plan of ``grad_divide_factor=1.0``
    (each gradient is then the sum over ranks, so every rank's loss is divided by the number of ranks) and
    ``optim.adamw``. Returns the meta-losses, step 0's meta-gradient (gathered), the trained parameters, and step 0's
    meta-gradient by ``torch.func.grad`` on a plan of the default divide factor (gathered: the same numbers)."""
    import funcshard
    from funcshard import optim

    W = dist.get_world_size()
    default = _mesh_plan(mlp(*MAML_SIZES))  # (the default divide factor: W)
    by_default = funcshard.gather(default, torch.func.grad(
        maml_losses(lambda p, x: funcshard.apply(default, p, x), inner_lr)[2])(
        funcshard.shard(default), *sine_tasks(0)[0]))
    plan = _mesh_plan(mlp(*MAML_SIZES), grad_divide_factor=1.0)
    state = funcshard.shard(plan)
    _, _, meta_loss = maml_losses(lambda p, x: funcshard.apply(plan, p, x), inner_lr, scale=1.0 / W)
    tx = optim.adamw(lr, weight_decay=0.0)
    opt_state = tx.init(state)
    losses, first = [], None
    for step in range(steps):
        batch, _ = sine_tasks(step)
        loss, grads = funcshard.value_and_grad(meta_loss)(state, *batch)
        if first is None:
            first = funcshard.gather(plan, grads)
        losses.append(W * loss.item())
        updates, opt_state = tx.update(grads, opt_state, state)
        state = optim.apply_updates(state, updates)
    return {"losses": losses, "meta_grad": first, "params": funcshard.gather(plan, state), "by_default": by_default}


def maml_reference(steps: int, inner_lr: float, lr: float):
    """The same MAML on the unsharded model, one process (``torch.func.functional_call``, ``torch.optim.AdamW``)."""
    model = mlp(*MAML_SIZES)
    _, _, meta_loss = maml_losses(lambda p, x: torch.func.functional_call(model, p, (x,)), inner_lr)
    losses, first, params = train_reference(model, meta_loss, (sine_tasks(step)[0] for step in range(steps)), lr)
    return {"losses": losses, "meta_grad": first, "params": params}


# Hessian-vector products: the sharpness (the Hessian's largest eigenvalue) by power iteration

HVP_SIZES = (4, 16, 16, 1)


def regression_data(n: int = 64):
    """``n`` inputs ``(n, 4)`` and targets ``(n, 1)``: the sine of a random projection, plus noise."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 4, generator=g)
    return x, torch.sin(x @ torch.randn(4, 1, generator=g)) + 0.1 * torch.randn(n, 1, generator=g)


def power_iteration(hvp, dot, v, iters: int):
    """The Rayleigh quotients ``v.Hv`` of ``iters`` power iterations from ``v`` (``hvp(v)``: H v; ``dot``: the
    inner product of two parameter trees)."""
    out = []
    for _ in range(iters):
        v = {k: t / dot(v, v).sqrt() for k, t in v.items()}
        hv = hvp(v)
        out.append(dot(v, hv))
        v = hv
    return torch.stack(out)


def sharpness(iters: int):
    """Power iteration on this rank's shards: ``jvp(grad(loss))`` (forward over reverse) for each H v, the inner
    products an all-reduce of the local ones. The start vector is the same on every rank (sharded)."""
    import funcshard

    model = mlp(*HVP_SIZES)
    plan = _mesh_plan(model)
    state = funcshard.shard(plan)
    x, y = regression_data()

    def loss(s):
        return (funcshard.apply(plan, s, x) - y).pow(2).mean()

    def hvp(v):
        return torch.func.jvp(torch.func.grad(loss), (state,), (v,))[1]

    def dot(a, b):
        return funcshard.all_reduce(sum((a[k] * b[k]).sum() for k in a), plan.mesh)

    g = torch.Generator().manual_seed(6)
    v0 = funcshard.shard(plan, {k: torch.randn(p.shape, generator=g) for k, p in model.named_parameters()})
    return power_iteration(hvp, dot, v0, iters)


def sharpness_reference(iters: int):
    """The same power iteration on the unsharded model (``functional_call``), and the Hessian's eigenvalues
    (``torch.func.hessian`` of the loss of the flattened parameters, dense)."""
    model = mlp(*HVP_SIZES)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = regression_data()

    def loss(p):
        return (torch.func.functional_call(model, p, (x,)) - y).pow(2).mean()

    def hvp(v):
        return torch.func.jvp(torch.func.grad(loss), (params,), (v,))[1]

    def dot(a, b):
        return sum((a[k] * b[k]).sum() for k in a)

    g = torch.Generator().manual_seed(6)
    v0 = {k: torch.randn(p.shape, generator=g) for k, p in params.items()}
    shapes = {k: p.shape for k, p in params.items()}
    sizes = [s.numel() for s in shapes.values()]

    def loss_flat(flat):  # (the loss of all parameters as one vector: its Hessian is a matrix)
        return loss({k: t.view(shapes[k]) for k, t in zip(shapes, flat.split(sizes))})

    flat = torch.cat([p.flatten() for p in params.values()])
    eig = torch.linalg.eigvalsh(torch.func.hessian(loss_flat)(flat))
    return {"estimates": power_iteration(hvp, dot, v0, iters), "eigenvalues": eig}


# MeanFlow (Geng et al., 2025): a network u(z, r, t) of the average velocity from time r to t, trained with the
# derivative du/dt along the flow (a jvp w.r.t. its inputs) in its target; one step samples x = e - u(e, 0, 1)

FLOW_SIZES = (4, 64, 64, 2)


def ring_data(step: int, n: int):
    """``n`` points of a ring of 8 Gaussians (radius 2, std 0.15), noise ``e`` and times ``r <= t`` (a quarter
    with ``r = t``: plain flow matching)."""
    g = torch.Generator().manual_seed(6000 + step)
    angle = torch.randint(0, 8, (n,), generator=g) * (torch.pi / 4)
    x = 2 * torch.stack([angle.cos(), angle.sin()], 1) + 0.15 * torch.randn(n, 2, generator=g)
    e = torch.randn(n, 2, generator=g)
    tr = torch.rand(n, 2, generator=g).sort(1).values
    r, t = tr[:, :1], tr[:, 1:]
    r = torch.where(torch.rand(n, 1, generator=g) < 0.25, t, r)
    return x, e, r, t


def meanflow_jvp(u, x, e, r, t):
    """MeanFlow's jvp for a network ``u(z, r, t)``: ``z = (1 - t) x + t e`` on the straight path from data ``x``
    to noise ``e``, velocity ``v = e - x``; returns ``z, v, u(z, r, t)`` and ``du/dt`` along the flow:
    ``jvp(u, (z, r, t), (v, 0, 1))``."""
    z, v = (1 - t) * x + t * e, e - x
    out, dudt = torch.func.jvp(u, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
    return z, v, out, dudt


def meanflow_loss(u, x, e, r, t):
    """MeanFlow's loss: ``u(z, r, t)`` against the target ``v - (t - r) du/dt`` (no gradient through it)."""
    z, v, out, dudt = meanflow_jvp(u, x, e, r, t)
    target = (v - (t - r) * dudt).detach()
    return (out - target).pow(2).sum(1).mean()


def meanflow(steps: int, batch_size: int, lr: float):
    """MeanFlow training on this rank's shards (data parallel: each rank its slice of the global batch),
    ``torch.func.grad_and_value`` of the loss (``jvp`` of ``funcshard.apply`` w.r.t. the inputs inside) and
    ``optim.adamw``. Returns the losses (global mean), step 0's gradient (gathered), one-step samples after
    training, and at the start, on this rank's slice of step 0's batch, ``du/dt`` by the jvp and by a central
    difference of the network along the same direction."""
    import funcshard
    from funcshard import optim

    plan = _mesh_plan(mlp(*FLOW_SIZES, act=torch.nn.SiLU))
    state = funcshard.shard(plan)
    W, rank = dist.get_world_size(), dist.get_rank()
    tx = optim.adamw(lr, weight_decay=0.0)
    opt_state = tx.init(state)

    def loss_fn(s, x, e, r, t):
        return meanflow_loss(lambda z, r, t: funcshard.apply(plan, s, torch.cat([z, r, t], 1)), x, e, r, t)

    def u0(z, r, t):  # (the network at the start)
        return funcshard.apply(plan, state, torch.cat([z, r, t], 1))

    x, e, r, t = [a.chunk(W)[rank] for a in ring_data(0, batch_size)]
    z, v, _, dudt = meanflow_jvp(u0, x, e, r, t)
    h = 1e-2  # (a central difference along the same direction)
    fd = (u0(z + h * v, r, t + h) - u0(z - h * v, r, t - h)) / (2 * h)
    losses, first = [], None
    for step in range(steps):
        mine = [a.chunk(W)[rank] for a in ring_data(step, batch_size)]
        grads, loss = torch.func.grad_and_value(loss_fn)(state, *mine)
        if first is None:
            first = funcshard.gather(plan, grads)
        losses.append(funcshard.all_reduce(loss.reshape(1), plan.mesh).item() / W)
        updates, opt_state = tx.update(grads, opt_state, state)
        state = optim.apply_updates(state, updates)
    e = torch.randn(512, 2, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        samples = e - funcshard.apply(plan, state, torch.cat([e, torch.zeros(512, 1), torch.ones(512, 1)], 1))
    return {"losses": losses, "grad": first, "samples": samples, "dudt": dudt.detach(), "fd": fd.detach()}


def meanflow_reference(steps: int, batch_size: int, lr: float):
    """The same training on the unsharded model, one process, the whole global batch (``torch.optim.AdamW``)."""
    model = mlp(*FLOW_SIZES, act=torch.nn.SiLU)

    def loss_fn(p, x, e, r, t):
        return meanflow_loss(lambda z, r, t: torch.func.functional_call(model, p, (torch.cat([z, r, t], 1),)),
                             x, e, r, t)

    losses, first, params = train_reference(model, loss_fn, (ring_data(step, batch_size) for step in range(steps)), lr)
    e = torch.randn(512, 2, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        samples = e - torch.func.functional_call(model, params, (torch.cat([e, torch.zeros(512, 1),
                                                                           torch.ones(512, 1)], 1),))
    return {"losses": losses, "grad": first, "samples": samples}


# An ensemble: members of one architecture, their shards stacked (a leading member dim), trained by vmap

ENS_SIZES = (1, 32, 32, 1)


def ens_data():
    """24 points of ``sin(2x)`` plus noise, on two intervals (a gap in between), and a grid to predict on."""
    g = torch.Generator().manual_seed(8)
    x = torch.cat([torch.rand(12, 1, generator=g) * 2 - 3, torch.rand(12, 1, generator=g) * 2 + 1])
    return x, torch.sin(2 * x) + 0.1 * torch.randn(24, 1, generator=g), torch.linspace(-4, 4, 81)[:, None]


def ensemble(members: int, steps: int, lr: float, counts_for=(1, 2, 4, 8)):
    """``members`` MLPs (seeds 0, 1, ...) trained at once: their shards stacked, ``vmap(grad(loss))`` over the
    stack (data parallel: each rank its slice of the points), ``optim.adamw`` on the stacked state. Returns the
    members' predictions on the grid, and the collectives of one ``vmap(grad)`` per member count."""
    import funcshard
    from funcshard import optim

    plan = _mesh_plan(mlp(*ENS_SIZES))
    W, rank = dist.get_world_size(), dist.get_rank()
    x, y, grid = ens_data()
    x, y = x.chunk(W)[rank], y.chunk(W)[rank]

    def stack(n):
        each = [funcshard.shard(plan, dict(mlp(*ENS_SIZES, seed=i).named_parameters())) for i in range(n)]
        return {k: torch.stack([e[k] for e in each]) for k in each[0]}

    def loss(s, x, y):
        return (funcshard.apply(plan, s, x) - y).pow(2).mean()

    grads_of = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None, None))
    counts = {n: count_collectives(lambda s=stack(n): grads_of(s, x, y))[1] for n in counts_for}
    state = stack(members)
    tx = optim.adamw(lr, weight_decay=0.0)
    opt_state = tx.init(state)
    for _ in range(steps):
        updates, opt_state = tx.update(grads_of(state, x, y), opt_state, state)
        state = optim.apply_updates(state, updates)
    with torch.no_grad():
        pred = torch.func.vmap(lambda s: funcshard.apply(plan, s, grid), in_dims=(0,))(state)
    return {"pred": pred, "counts": counts}


def ensemble_reference(members: int, steps: int, lr: float):
    """Each member trained alone on the unsharded model and all the points (``torch.optim.AdamW``)."""
    x, y, grid = ens_data()
    preds = []
    for i in range(members):
        model = mlp(*ENS_SIZES, seed=i)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for _ in range(steps):
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
        with torch.no_grad():
            preds.append(model(grid))
    return torch.stack(preds)
