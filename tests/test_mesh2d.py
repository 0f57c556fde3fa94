"""2-D meshes (issue 15): HSDP over a (replicate, shard) mesh and int reshard_after_forward, on both paths (fully_shard
against torch's FSDP2 bit for bit; funcshard.apply against a one-process reference and against fully_shard), the
collectives each process group runs (counted at c10d dispatch, per group, against FSDP2's and against the schedule),
the memory an int reshard holds, and the errors for bad meshes and sizes.

Bit-identical to FSDP2: FSDP2 averages inside the collectives (gloo's AVG: the sum, then a divide by the group size in
the same dtype), reduce-scatter then all-reduce; funcshard sums in both and divides once by replicate * shard. With
group sizes that are powers of two every divide is exact, so the bits agree (2x2, 1x4, 4x1 here).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard
from funcshard._schedule import schedule
from memtrack import PeakBytes
from models import MLP, Block
from multirank import run_ranks
from test_fsdp import _fit, _local, _mlp_batch, _nested

STEPS = 10


def _mesh(shape):
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


# ---- collectives per process group, at c10d dispatch ------------------------------------------------------------


class GroupCollectives(TorchDispatchMode):
    """Every c10d op at dispatch (and DTensor's functional collectives): (kind, the ranks of its process group, dtype,
    elements per rank, bytes of the unsharded buffer; an all-reduce's buffer)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            if "allgather" in name:
                kind, full, part, pg = "all-gather", args[0], args[1], args[2]
            elif "reduce_scatter" in name:
                kind, full, part, pg = "reduce-scatter", args[1], args[0], args[2]
            elif "allreduce" in name:
                kind, full, part, pg = "all-reduce", args[0][0], args[0][0], args[1]
            else:
                kind, full, part, pg = name, None, None, None
            if isinstance(full, torch.Tensor):
                ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(pg)))
                self.calls.append((kind, ranks, part.dtype, part.numel(), full.numel() * full.element_size()))
            else:
                self.calls.append((kind, None, None, 0, 0))
        elif name.startswith("_c10d_functional.") and (kind := next(
                (k for k in ("all-gather", "reduce-scatter", "all-reduce") if k.replace("-", "_") in name), None)):
            from torch.distributed.distributed_c10d import _resolve_process_group  # DTensor's (TP's) collectives

            group = [a for a in args if isinstance(a, str)][-1]  # (its last str argument; a reduce op comes first)
            ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(group)))
            t = args[0]
            full = t.numel() * (len(ranks) if kind == "all-gather" else 1)
            part = t.numel() // (len(ranks) if kind == "reduce-scatter" else 1)
            self.calls.append((kind, ranks, t.dtype, part, full * t.element_size()))
        return func(*args, **(kwargs or {}))


def _per_group(calls, axes=None):
    """(kind, group size) -> (count, bytes): what each process group ran. ``axes`` (``_axes(mesh)``): key by the mesh
    axis name instead of the size (two axes of one size, e.g. dp and tp of a 2x2 mesh)."""
    out: dict = {}
    for kind, ranks, _, _, nbytes in calls:
        key = (kind, len(ranks or ()) if axes is None else axes.get(ranks, ranks))
        n, b = out.get(key, (0, 0))
        out[key] = (n + 1, b + nbytes)
    return out


def _axes(mesh):
    """{ranks of this rank's process group on an axis: the axis' name}, for ``_per_group``."""
    return {tuple(dist.get_process_group_ranks(mesh.get_group(n))): n for n in mesh.mesh_dim_names}


# ---- parity with torch's FSDP2 (fully_shard) ----------------------------------------------------------------------


def _scenario(name, fs, mesh):
    torch.manual_seed(0)
    if name == "plain":
        return _fit(_nested(fs, MLP(layers=3), mesh), steps=STEPS)
    if name == "reshard_2":
        return _fit(_nested(fs, MLP(layers=3), mesh, reshard_after_forward=2), steps=STEPS)
    if name == "clip":
        return _fit(_nested(fs, MLP(layers=3), mesh), steps=STEPS // 2, clip=0.05)
    if name == "bf16":
        mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return _fit(_nested(fs, MLP(layers=3), mesh, mp_policy=mp), steps=STEPS // 2,
                    loss=lambda p, y: F.mse_loss(p.float(), y))
    if name == "no_all_reduce":  # HSDP accumulation: reduce-scatter every microbatch, all-reduce the last
        model = _nested(fs, MLP(layers=3), mesh)
        return _fit(model, steps=3, micro=3, each=lambda m, s, k: m.set_requires_all_reduce(k == 2))
    if name == "hook":  # the all-reduce hook sees the averaged gradients (a scale by 0.5 shows where it runs)
        model = _nested(fs, MLP(layers=3), mesh)
        for m in (model, *model.blocks):
            m.set_all_reduce_hook(lambda t: t.mul_(0.5))
        return _fit(model, steps=3)
    raise KeyError(name)


def _parity(shape, names):
    mesh = _mesh(shape)
    out = {}
    for name in names:
        with GroupCollectives() as rec_ref:
            n_ref, s_ref = _scenario(name, torch_fsdp, mesh)
        with GroupCollectives() as rec_got:
            n_got, s_got = _scenario(name, funcshard, mesh)
        out[name] = (max(abs(a - b) for a, b in zip(n_ref, n_got)),
                     max((s_ref[k] - s_got[k]).abs().max().item() for k in s_ref),
                     _per_group(rec_ref.calls), _per_group(rec_got.calls))
    return out


def _same_traffic(ref, got):
    """The collectives of every process group of 2 or more ranks, counts and bytes (FSDP2 also runs an all-reduce on
    the 1-rank replicate group of a 1xN mesh, which moves nothing; funcshard issues no collective over one rank)."""
    ref = {k: v for k, v in ref.items() if k[1] > 1}
    return ref == got, ref, got


@pytest.mark.parametrize("shape,names", [
    ((2, 2), ["plain", "clip", "bf16", "no_all_reduce", "hook", "reshard_2"]),
    ((1, 4), ["plain", "reshard_2"]),
    ((4, 1), ["plain", "no_all_reduce"]),
    ((4,), ["reshard_2", "hook"]),  # (1-D: the hook after the reduce-scatter)
])
def test_fully_shard_matches_fsdp2_on_2d_meshes(shape, names):
    for res in run_ranks(4, _parity, shape, names):
        for name, (numbers, params, ref, got) in res.items():
            assert numbers == 0 and params == 0, (shape, name, numbers, params)
            same, ref, got = _same_traffic(ref, got)
            assert same, (shape, name, ref, got)


def _parities(cases):
    return {shape: _parity(shape, names) for shape, names in cases}


def test_fully_shard_matches_fsdp2_at_three_ranks():
    """W = 3 (a size that is not a power of two): 1-D (the reduce-scatter's divide) and 3x1 (the all-reduce's). Each
    gradient is divided once by 3 in both systems (FSDP2: gloo's AVG, the sum then a divide in the same dtype;
    funcshard: the sum, then one divide), so the bits agree: tolerance 0. They could differ only where FSDP2 averages
    twice (a divide on each axis of an HSDP mesh with both axes > 1 and one of them not a power of two, e.g. 2x3 = 6
    ranks, not run here: a rounding per divide, a few ulps)."""
    for res in run_ranks(3, _parities, [((3,), ["plain", "hook"]), ((3, 1), ["plain"])]):
        for shape, by_name in res.items():
            for name, (numbers, params, ref, got) in by_name.items():
                assert numbers == 0 and params == 0, (shape, name, numbers, params)
                same, ref, got = _same_traffic(ref, got)
                assert same, (shape, name, ref, got)


# ---- the functional path: against a one-process reference, and against fully_shard -------------------------------


def _global(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _functional(shape, rsf, layout):
    """funcshard.apply under value_and_grad with funcshard.optim's global-norm clip (its norm over the mesh's shard
    axis: replicas hold the same shards) and adamw, 10 steps, against one process training the same model on the
    global batch with clip_grad_norm_ and torch.optim.AdamW (losses and parameters); and one step's gradients against
    fully_shard on the same mesh (bit for bit)."""
    from funcshard import optim

    mesh = _mesh(shape)
    torch.manual_seed(0)
    model = MLP(layers=3)
    ref = MLP(layers=3)
    ref.load_state_dict(model.state_dict())
    plan = funcshard.plan(model, mesh, groups=(Block,), reshard_after_forward=rsf, layout=layout)
    state = funcshard.shard(plan)
    tx = optim.chain(optim.clip_by_global_norm(0.05, mesh=mesh), optim.adamw(lr=1e-2))
    opt_state = tx.init(state)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for s in range(STEPS):
        x, y = _mlp_batch(s)
        loss, grads = funcshard.value_and_grad(lambda st: F.mse_loss(funcshard.apply(plan, st, x), y))(state)
        if s == 0 and layout == "per_param":
            fs_model = MLP(layers=3)
            fs_model.load_state_dict(ref.state_dict())
            fs_model = _nested(funcshard, fs_model, mesh, reshard_after_forward=rsf)
            F.mse_loss(fs_model(x), y).backward()
            same = all(torch.equal(grads[k], plan.specs[k].local_shard(_local(p.grad), plan.mesh.get_local_rank(
                plan.shard_axis))) for k, p in fs_model.named_parameters())
        updates, opt_state = tx.update(grads, opt_state, state)
        state = optim.apply_updates(state, updates)
        xs, ys = _global(x), _global(y)
        ref_loss = sum(F.mse_loss(ref(a), b) for a, b in zip(xs, ys)) / len(xs)
        opt.zero_grad()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        losses.append(abs(sum(_global(loss.detach())).item() / len(xs) - ref_loss.item()))
    full = funcshard.gather(plan, state)
    params = max((full[k] - p).abs().max().item() for k, p in ref.named_parameters())
    return max(losses), params, same if layout == "per_param" else True


@pytest.mark.parametrize("shape,rsf,layout", [((2, 2), None, "per_param"), ((1, 4), 2, "per_param"),
                                              ((4, 1), None, "per_param"), ((2, 2), True, "flat"),
                                              ((4,), 2, "flat")])
def test_functional_path_on_2d_meshes(shape, rsf, layout):
    for losses, params, same in run_ranks(4, _functional, shape, rsf, layout):
        assert losses < 1e-5 and params < 1e-5 and same, (losses, params, same)


# ---- the schedule: what each process group runs, and the printed plan -----------------------------------------------


def _issued_vs_schedule(shape, rsf, layout):
    mesh = _mesh(shape)
    torch.manual_seed(0)
    plan = funcshard.plan(MLP(layers=3), mesh, groups=(Block,), layout=layout,
                          reshard_after_forward=None if rsf == "one group" else rsf)
    if rsf == "one group":  # the per-group equivalent: one group kept over blocks of 2 ranks, the others freed
        plan = plan.with_group("blocks.1", reshard_after_forward=2)
    state = funcshard.shard(plan)
    x = torch.randn(2, 7)
    with GroupCollectives() as rec:
        torch.func.grad(lambda s: funcshard.apply(plan, s, x).square().sum())(state)
    issued = [(kind, len(ranks), dt, n, b) for kind, ranks, dt, n, b in rec.calls]
    planned = [(c.kind, c.world, c.dtype, c.numel, c.nbytes) for c in schedule(plan).collectives()]
    axes = {(c.kind, c.axis, c.world) for c in schedule(plan).collectives()}
    return issued == planned, issued, planned, axes, str(plan), schedule(plan).totals()


def test_each_process_group_runs_the_schedules_collectives():
    for shape, rsf, layout, axes in [
        ((2, 2), None, "per_param", {("all-gather", 1, 2), ("reduce-scatter", 1, 2), ("all-reduce", 0, 2)}),
        ((4, 1), None, "per_param", {("all-reduce", 0, 4)}),  # one rank per shard: no all-gather, no reduce-scatter
        ((1, 4), 2, "flat", {("all-gather", 1, 4), ("all-gather", 1, 2), ("reduce-scatter", 1, 4)}),
        ((4,), 2, "per_param", {("all-gather", 0, 4), ("all-gather", 0, 2), ("reduce-scatter", 0, 4)}),
        ((2, 2), "one group", "per_param", {("all-gather", 1, 2), ("reduce-scatter", 1, 2), ("all-reduce", 0, 2)}),
        ((1, 4), "one group", "per_param", {("all-gather", 1, 4), ("all-gather", 1, 2), ("reduce-scatter", 1, 4)}),
    ]:
        for same, issued, planned, got_axes, printed, totals in run_ranks(4, _issued_vs_schedule, shape, rsf, layout):
            assert same, (shape, rsf, issued, planned)
            assert got_axes == axes, (shape, got_axes)
            if shape == (2, 2):
                assert "(shard axis 'shard' (2 ranks), replicate axis 'replicate' (2 ranks))" in printed
                assert ("[reduce-scatter on axis 'shard' (2 ranks), all-reduce on axis 'replicate' (2 ranks)]"
                        in printed)
                assert totals["all-reduce"] * 2 == totals["reduce-scatter"]  # each rank all-reduces its half
            if rsf == 2 or (rsf == "one group" and shape == (1, 4)):
                # the backward all-gathers run within blocks of 2 of the 4 ranks of the shard axis
                assert "(blocks of 2 of its 4 ranks)" in printed and "keep a 2-rank shard" in printed, printed
            if rsf == "one group":
                assert ("free blocks.1 (keep a 2-rank shard)" in printed) == (shape == (1, 4)), printed


# ---- memory: an int reshard holds a k-th of each group between forward and backward ----------------------------------


def _held_after_forward(rsf, system):
    mesh = _mesh((4,))
    torch.manual_seed(0)
    model = MLP(layers=4, d=32)
    x = torch.randn(2, 7)
    if system == "apply":
        plan = funcshard.plan(model, mesh, groups=(Block,), reshard_after_forward=rsf)
        state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
        # (x ignored: the caller's input, live throughout; apply's saved-tensor hooks pack it by an alias, which the
        # tracker's dispatch mode sees: 56 B counted to the step)
        with PeakBytes(ignore=[*state.values(), x]) as mem:
            out = funcshard.apply(plan, state, x)
            held = sum(mem.sizes.values())
            out.sum().backward()
        return held, mem.peak, schedule(plan).kept_after_forward()
    fs = funcshard if system == "fully_shard" else torch_fsdp
    for b in model.blocks:
        fs.fully_shard(b, mesh=mesh, reshard_after_forward=rsf)
    fs.fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model(x)  # (FSDP2's lazy init, and funcshard's plan, outside the measured step)
    model.zero_grad()
    with PeakBytes(ignore=list(model.parameters())) as mem:
        out = model(x)
        held = sum(mem.sizes.values())
        out.sum().backward()
    return held, mem.peak, None


def _memory():
    return {(rsf, system): _held_after_forward(rsf, system) for system in ("apply", "fully_shard")
            for rsf in (True, 2, False)}


def test_int_reshard_holds_a_kth_between_forward_and_backward():
    """MLP with 4 blocks of d=32 on 4 ranks, reshard_after_forward True / 2 / False: the bytes live after forward (and
    the step's peak) lie between True's and False's, and the plan predicts what is held (``kept_after_forward``: each
    group's unsharded size, halved for k=2). Measured on this model (apply): held 7.5 / 59.8 / 112.0 KB, peak 120.8 /
    129.0 / 141.9 KB; the plan predicts 0 / 52.3 / 104.5 KB above the sharded state."""
    for res in run_ranks(4, _memory):
        for system in ("apply", "fully_shard"):
            (h_true, p_true, k_true), (h_two, p_two, k_two), (h_false, p_false, k_false) = (
                res[(r, system)] for r in (True, 2, False))
            assert h_true < h_two < h_false and p_true < p_two < p_false, (system, res)
            if system == "apply":  # the plan's prediction, to the padding of a few bytes
                assert abs((h_two - h_true) - (k_two - k_true)) <= 64 and h_false - h_true == k_false - k_true, res
            # half of what False keeps above True (the blocks; fully_shard's root keeps its parameters in all three)
            assert abs(2 * (h_two - h_true) - (h_false - h_true)) <= 64, (system, res)


def _post_forward_group_made_again():
    """The int reshard's post-forward group of a 1-D mesh: made once (one group on this rank: the block of k, not the
    mesh's other axis), kept by nothing of funcshard once destroyed (its gloo threads go with it), and made again for
    an equal mesh after that (it was returned destroyed: a harness destroying a job's groups broke the next job)."""
    import gc
    import weakref

    from funcshard._mesh import post_forward_group

    before = len(dist.distributed_c10d._world.pg_map)
    pg, rank = post_forward_group(_mesh((4,)), 0, 2)
    made = len(dist.distributed_c10d._world.pg_map) - before
    cached = post_forward_group(_mesh((4,)), 0, 2)[0] is pg
    ref = weakref.ref(pg)
    dist.destroy_process_group(pg)
    del pg
    gc.collect()
    again, rank_again = post_forward_group(_mesh((4,)), 0, 2)
    t = torch.ones(1)
    dist.all_reduce(t, group=again)
    return made, cached, ref() is None, (rank, rank_again), dist.get_process_group_ranks(again), t.item()


def test_post_forward_group_made_once_and_again_once_destroyed():
    for r, (made, cached, freed, ranks, members, total) in enumerate(run_ranks(4, _post_forward_group_made_again)):
        assert (made, cached, freed, ranks, total) == (1, True, True, (r % 2, r % 2), 2.0)
        assert members == [r - r % 2, r - r % 2 + 1]


# ---- bad input ------------------------------------------------------------------------------------------------


def catch_into(out, name, fn):
    """Run ``fn``; ``out[name]`` is ``"no error"`` or ``"<type>: <message>"`` (errors are compared in the parent)."""
    try:
        fn()
        out[name] = "no error"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"


def _errors():
    out = {}

    catch = functools.partial(catch_into, out)

    model = MLP(layers=2)
    catch("plan_3d", lambda: funcshard.plan(model, init_device_mesh("cpu", (1, 2, 2)), groups=(Block,)))
    catch("plan_k", lambda: funcshard.plan(model, _mesh((4,)), groups=(Block,), reshard_after_forward=3))
    catch("plan_k_2d", lambda: funcshard.plan(model, _mesh((2, 2)), groups=(Block,), reshard_after_forward=4))
    plan = funcshard.plan(model, _mesh((1, 4)), groups=(Block,))
    catch("with_group_k", lambda: plan.with_group("blocks.0", reshard_after_forward=3))
    catch("fully_shard_k", lambda: funcshard.fully_shard(MLP(), mesh=_mesh((2, 2)), reshard_after_forward=3))
    part = DeviceMesh("cpu", torch.arange(2).view(1, 2), mesh_dim_names=("replicate", "shard"))  # ranks 0 and 1
    catch("not_on_mesh", lambda: funcshard.plan(model, part, groups=(Block,)))
    out["untouched"] = type(model) is MLP and not any(isinstance(p, torch.distributed.tensor.DTensor)
                                                      for p in model.parameters())
    return out


ERRORS = {
    "plan_3d": r"ShardingError: mesh DeviceMesh\('cpu', shape \(1, 2, 2\)\) has 3 axes; funcshard shards over a 1-D "
               r"mesh \(FSDP\) or a 2-D \(replicate, shard\) mesh \(HSDP\): pass mesh\[\('replicate', 'shard'\)\]",
    "plan_k": r"ShardingError: group '<root>': reshard_after_forward=3 must be a bool or an int that divides the "
              r"shard axis size 4 .*; pick one of \[2\]",
    "plan_k_2d": r"ShardingError: group '<root>': reshard_after_forward=4 must be .* divides the shard axis size 2",
    "with_group_k": r"ShardingError: group 'blocks.0': reshard_after_forward=3 .* shard axis size 4 .* \[2\]",
    "fully_shard_k": r"ValueError: fully_shard\(MLP\): reshard_after_forward=3 must be .* shard axis size 2",
}


def test_bad_meshes_and_sizes():
    results = run_ranks(4, _errors)
    for rank, out in enumerate(results):
        assert out.pop("untouched") is True
        not_on_mesh = out.pop("not_on_mesh")
        # ranks 2 and 3 are not on the 1x2 mesh: they raise; 0 and 1 are on it and plan (as in FSDP2; issue 22)
        if rank < 2:
            assert not_on_mesh == "no error"
        else:
            with pytest.raises(AssertionError, match=r"ShardingError: mesh DeviceMesh\('cpu', shape \(replicate=1, "
                               rf"shard=2\)\) does not contain this rank \({rank} of a world of 4; the mesh spans ranks "
                               r"\[0, 1\]\).*init_device_mesh\('cpu', \(4,\)\)"):
                raise AssertionError(not_on_mesh)
        assert out.keys() == ERRORS.keys()
        for name, pattern in ERRORS.items():
            with pytest.raises(AssertionError, match=pattern):
                raise AssertionError(out[name])


# ---- DCP: HSDP checkpoints cross-load with FSDP2's ----------------------------------------------------------------


def _dcp(shape, path):
    import torch.distributed.checkpoint as dcp

    mesh = _mesh(shape)
    x = _mlp_batch(0)[0]
    out = {}
    for src, dst in ((torch_fsdp, funcshard), (funcshard, torch_fsdp)):
        torch.manual_seed(0)
        saved = _nested(src, MLP(layers=2), mesh)
        _fit(saved, steps=2)
        where = f"{path}/{src.__name__}"
        dcp.save(saved.state_dict(), checkpoint_id=where)
        torch.manual_seed(1)  # other initial values
        loaded = _nested(dst, MLP(layers=2), mesh)
        sd = loaded.state_dict()
        dcp.load(sd, checkpoint_id=where)
        loaded.load_state_dict(sd)
        same = all(torch.equal(_local(p), _local(q)) for p, q in zip(saved.parameters(), loaded.parameters()))
        placements = {str(p.placements) for p in loaded.parameters()} == {str(p.placements) for p in saved.parameters()}
        with torch.no_grad():
            out[src.__name__] = (same, placements, torch.equal(saved(x), loaded(x)))
    return out


@pytest.mark.parametrize("shape", [(2, 2)])
def test_dcp_checkpoints_cross_load_with_fsdp2(shape, tmp_path):
    for res in run_ranks(4, _dcp, shape, str(tmp_path)):
        assert res == {"torch.distributed.fsdp": (True, True, True), "funcshard": (True, True, True)}, res
