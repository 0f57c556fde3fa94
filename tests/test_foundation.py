"""Foundation: plan, shard, gather, differentiable and bucketed collectives, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import funcshard
from funcshard import ShardingError, ShardSpec
from funcshard import _collectives
from models import MLP, Block, Leafy
from multirank import RankError, run_ranks

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


class CollectiveCounter:
    """Wraps torch.distributed's tensor collectives (what every caller goes through), counting them."""

    def __init__(self):
        self.calls: list[tuple[str, torch.dtype, int]] = []
        self._names = [(_collectives._AG_NAME, "all_gather"), (_collectives._RS_NAME, "reduce_scatter"),
                       ("all_reduce", "all_reduce")]
        self._saved = {name: getattr(dist, name) for name, _ in self._names}

    def __enter__(self):
        for name, kind in self._names:
            orig = self._saved[name]

            def counted(*args, _orig=orig, _kind=kind, **kwargs):
                t = args[0] if _kind == "all_reduce" else (args[0] if _kind == "all_gather" else args[1])
                self.calls.append((_kind, t.dtype, t.numel()))
                return _orig(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def count(self, kind):
        return sum(1 for k, *_ in self.calls if k == kind)


# ---- ShardSpec math, one process ---------------------------------------------------------------


@given(
    shape=st.lists(st.integers(1, 7), min_size=0, max_size=3),
    world=st.integers(1, 5),
    dim_seed=st.integers(0, 10),
)
@settings(max_examples=60, deadline=None)
def test_spec_local_shards_reassemble(shape, world, dim_seed):
    shape = tuple(shape)
    dim = dim_seed % max(len(shape), 1)
    spec = ShardSpec("p", shape, torch.float32, dim, 0, world)
    x = torch.randn(shape)
    shards = [spec.local_shard(x, r) for r in range(world)]
    assert all(s.shape == spec.local_shape for s in shards)
    padded = torch.cat(shards, dim=dim)
    assert padded.shape == spec.padded_shape
    assert torch.equal(spec.unpad(padded), x)
    # the rank-major view is the all-gather layout
    assert torch.equal(spec.split_view(padded), torch.stack(shards))
    # the unpadded part of each shard is torch.chunk's (and DTensor Shard(dim)'s) piece
    pieces = list(x.reshape(spec.sharded_shape).chunk(world, dim=dim))
    for r in range(world):
        n = spec.local_valid(r)
        expect = pieces[r] if r < len(pieces) else x.reshape(spec.sharded_shape).narrow(dim, 0, 0)
        assert torch.equal(shards[r].narrow(dim, 0, n), expect)
        assert not shards[r].narrow(dim, n, spec.chunk - n).any()


# ---- shard / gather round trips on W ranks -----------------------------------------------------

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i64": torch.int64}


def _roundtrip(param_specs, buffers, dims, group_prefixes, seed, layout="per_param"):
    torch.manual_seed(seed)
    specs = [(p, tuple(s), DTYPES[d]) for p, s, d in param_specs]
    model = Leafy(specs, [(b, tuple(s)) for b, s in buffers])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dim_of = dict(zip([p for p, _, _ in specs], dims))
    placement = (lambda fqn, p: dim_of[fqn] % max(p.dim(), 1)) if layout == "per_param" else None
    plan = funcshard.plan(model, _mesh(), groups=group_prefixes or None, shard_placement_fn=placement, layout=layout)
    world, rank = dist.get_world_size(), dist.get_rank()
    state = funcshard.shard(plan)
    # about 1/W of the bytes, plus padding
    for k, s in plan.specs.items():
        if layout == "per_param":
            assert state[k].numel() == math.ceil(s.size / world) * (max(math.prod(s.shape), 1) // max(s.size, 1))
    if layout == "flat":  # every rank's pieces together are each flattened parameter, exactly once
        pieces = [None] * world
        dist.all_gather_object(pieces, {k: v for k, v in state.items()})
        for k, v in model.named_parameters():
            assert torch.equal(torch.cat([pieces[r][k] for r in range(world)]), v.detach().reshape(-1)), k
    with CollectiveCounter() as cc:
        full = funcshard.gather(plan, state)
    n_buckets = sum(len({plan.specs[p].dtype for p in g.params}) for g in plan.groups if g.params)
    # (one rank: no collective, as in FSDP2)
    assert cc.count("all_gather") == (n_buckets if world > 1 else 0) and cc.count("reduce_scatter") == 0
    for k, v in model.named_parameters():
        assert full[k].dtype == v.dtype and torch.equal(full[k], v), k  # bit for bit
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "shard/gather changed the module"

    # the gradient through gather is the reduce-scatter (sum over ranks) of each rank's full gradient
    float_keys = [k for k in plan.specs if plan.specs[k].dtype.is_floating_point]
    if not float_keys:
        return True

    def cot(k, r):
        g = torch.Generator().manual_seed(1000 * r + 7)
        return torch.randn(plan.specs[k].shape, generator=g).to(plan.specs[k].dtype)

    def loss(fstate):
        f = funcshard.gather(plan, {**state, **fstate})
        return sum((f[k].float() * cot(k, rank).float()).sum() for k in float_keys)

    with CollectiveCounter() as cc:
        grads = torch.func.grad(loss)({k: state[k] for k in float_keys})
    float_buckets = sum(len({plan.specs[p].dtype for p in g.params if p in float_keys})
                        for g in plan.groups if g.params)
    assert cc.count("reduce_scatter") == (float_buckets if world > 1 else 0)
    for k in float_keys:
        total = sum(cot(k, r).float() for r in range(world)).to(plan.specs[k].dtype)
        expect = plan.specs[k].local_shard(total, rank)
        torch.testing.assert_close(grads[k], expect, rtol=1e-2 if expect.dtype == torch.bfloat16 else 1e-6,
                                   atol=1e-2 if expect.dtype == torch.bfloat16 else 1e-6)
    return True


@st.composite
def module_trees(draw):
    n = draw(st.integers(1, 6))
    paths = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=n, max_size=n))
    params = []
    for i, parent in enumerate(paths):
        shape = draw(st.lists(st.integers(1, 9), min_size=0, max_size=3))
        dtype = draw(st.sampled_from(["f32", "f32", "bf16", "i64"]))
        params.append((f"{parent}.p{i}", shape, dtype))
    dims = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    buffers = draw(st.lists(st.tuples(st.sampled_from(["buf0", "buf1"]), st.lists(st.integers(1, 4), max_size=2)),
                            max_size=2, unique_by=lambda b: b[0]))
    groups = draw(st.sampled_from([[], ["a"], ["a", "b"], [("a", "c")]]))
    groups = [g for g in groups if all(any(p.startswith(x + ".") for p, _, _ in params)
                                       for x in ((g,) if isinstance(g, str) else g))]
    return params, buffers, dims, groups


@pytest.mark.parametrize("layout", ["per_param", "flat"])
@pytest.mark.parametrize("world", [1, 2, 4])
@given(tree=module_trees(), seed=st.integers(0, 2**16))
@SETTINGS
def test_gather_of_shard_is_identity(world, layout, tree, seed):
    params, buffers, dims, groups = tree
    assert run_ranks(world, _roundtrip, params, buffers, dims, groups, seed, layout) == [True] * world


# ---- plans ---------------------------------------------------------------------------------------


def _plan_facts():
    model = MLP(layers=3)
    p = funcshard.plan(model, _mesh(), groups=(Block,))
    p_explicit = funcshard.plan(model, _mesh(), groups=["blocks.0", ("blocks.1", "blocks.2")])
    return (
        [(g.name, g.modules, g.params, g.reshard_after_forward) for g in p.groups],
        [(g.name, g.modules) for g in p_explicit.groups],
        str(p),
    )


def test_plan_groups_and_printing():
    groups, explicit, text = run_ranks(2, _plan_facts)[0]
    assert [g[0] for g in groups] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert groups[0][2] == ("inp.weight", "inp.bias", "out.weight", "out.bias")
    assert groups[0][3] is False and all(g[3] for g in groups[1:])  # reshard: all but the root
    assert groups[1][2] == ("blocks.0.l1.weight", "blocks.0.l1.bias", "blocks.0.l2.weight", "blocks.0.l2.bias")
    assert explicit == [("", ("",)), ("blocks.0", ("blocks.0",)), ("blocks.1", ("blocks.1", "blocks.2"))]
    assert "blocks.0.l1.weight: (19, 6) float32 dim 0 over axis 0 -> local (10, 6) pad 1" in text
    assert "all-gather blocks.1 (prefetch, while blocks.0 computes)" in text
    assert "reduce-scatter blocks.0, free it" in text


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(4), Block(4)])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.blocks[1].l1.weight = self.blocks[0].l1.weight  # tied across two groups


def _tied_plan():
    p = funcshard.plan(_Tied(), _mesh(), groups=(Block,))
    return {g.name: g.params for g in p.groups}, p.specs["emb.weight"].aliases


def test_tied_parameters_appear_once():
    groups, aliases = run_ranks(2, _tied_plan)[0]
    everything = [q for ps in groups.values() for q in ps]
    assert len(everything) == len(set(everything))
    assert "head.weight" not in everything and aliases == ("emb.weight", "head.weight")
    assert "blocks.0.l1.weight" in groups[""]  # tied across groups: the root gathers it


# ---- differentiable collectives ----------------------------------------------------------------


def _collectives_under_transforms():
    r, w = dist.get_rank(), dist.get_world_size()
    x = torch.arange(6.0).reshape(3, 2) + 10 * r
    out = {}
    # forward values
    out["ag"] = funcshard.all_gather(x)
    out["rs"] = funcshard.reduce_scatter(torch.ones(2 * w, 2) * (r + 1))
    out["ar"] = funcshard.all_reduce(x)
    # grads: d/dx sum(c_r * all_gather(x)) = reduce_scatter(c) ; transpose of rs is ag
    c = torch.randn(3 * w, 2, generator=torch.Generator().manual_seed(r))
    out["grad_ag"] = torch.func.grad(lambda t: (funcshard.all_gather(t) * c).sum())(x)
    xx = x.clone().requires_grad_()
    (funcshard.all_gather(xx) * c).sum().backward()
    out["grad_ag_autograd"] = xx.grad
    _, vjp = torch.func.vjp(funcshard.reduce_scatter, c)
    out["vjp_rs"] = vjp(torch.ones(3, 2))[0]
    out["jvp_ag"] = torch.func.jvp(funcshard.all_gather, (x,), (torch.ones_like(x),))[1]
    out["vmap_ag"] = torch.func.vmap(funcshard.all_gather)(torch.stack([x, 2 * x]))
    out["grad_ar"] = torch.func.grad(lambda t: (funcshard.all_reduce(t) * x).sum())(x)
    out["c"] = c
    return out


def test_differentiable_collectives():
    w = 2
    res = run_ranks(w, _collectives_under_transforms)
    xs = [torch.arange(6.0).reshape(3, 2) + 10 * r for r in range(w)]
    cs = [res[r]["c"] for r in range(w)]
    for r, o in enumerate(res):
        assert torch.equal(o["ag"], torch.cat(xs))
        assert torch.equal(o["rs"], torch.full((2, 2), 3.0))
        assert torch.equal(o["ar"], sum(xs))
        expect = sum(cs).chunk(w)[r]
        torch.testing.assert_close(o["grad_ag"], expect)
        torch.testing.assert_close(o["grad_ag_autograd"], expect)
        assert torch.equal(o["vjp_rs"], torch.ones(3 * w, 2))  # transpose of reduce-scatter: all-gather
        assert torch.equal(o["jvp_ag"], torch.ones(3 * w, 2))
        assert torch.equal(o["vmap_ag"], torch.stack([torch.cat(xs), 2 * torch.cat(xs)]))
        torch.testing.assert_close(o["grad_ar"], sum(xs))


def _gather_vmap():
    model = MLP()
    p = funcshard.plan(model, _mesh())
    s = funcshard.shard(p)
    full = funcshard.gather(p, s)
    batched = {k: torch.stack([v, 2 * v]) for k, v in s.items()}
    out = torch.func.vmap(lambda st: funcshard.gather(p, st))(batched)
    return all(torch.equal(out[k], torch.stack([v, 2 * v])) for k, v in full.items())


def test_gather_under_vmap_of_stacked_states():
    """vmap over stacked states (an ensemble): every member's full parameters (one all-gather for all of them:
    tests/test_transforms.py counts it)."""
    assert run_ranks(2, _gather_vmap) == [True, True]


# ---- bad input: clear errors that change nothing -----------------------------------------------


def _errors():
    model = MLP()
    mesh = _mesh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = {}

    def catch(name, fn):
        try:
            fn()
            out[name] = "no error"
        except ShardingError as e:
            out[name] = str(e)

    p = funcshard.plan(model, mesh, groups=(Block,))
    good = funcshard.shard(p)
    snapshot = {k: v.clone() for k, v in good.items()}
    catch("dim", lambda: funcshard.plan(model, mesh, shard_placement_fn=lambda n, q: 2 if n == "inp.weight" else None))
    catch("nontensor", lambda: funcshard.shard(p, {**dict(model.named_parameters()), "inp.bias": [1.0, 2.0]}))
    meta = MLP().to("meta")
    pm = funcshard.plan(meta, mesh)
    catch("meta", lambda: funcshard.shard(pm))
    catch("missing", lambda: funcshard.gather(p, {k: v for k, v in good.items() if k != "out.bias"}))
    catch("extra", lambda: funcshard.gather(p, {**good, "bogus": torch.zeros(1)}))
    catch("shape", lambda: funcshard.gather(p, {**good, "inp.weight": torch.zeros(2, 2)}))
    catch("state_nontensor", lambda: funcshard.gather(p, {**good, "inp.bias": 3.0}))
    other = funcshard.plan(model, mesh, shard_placement_fn=lambda n, q: q.dim() - 1)
    catch("other_plan", lambda: funcshard.apply(other, good, torch.randn(2, 7)))
    catch("bad_group", lambda: funcshard.plan(model, mesh, groups=["blocks.9"]))
    catch("dup_group", lambda: funcshard.plan(model, mesh, groups=["blocks.0", ("blocks.0", "blocks.1")]))
    catch("prefetch_list", lambda: funcshard.plan(model, mesh, groups=(Block,), forward_prefetch_lists={"x": ["y"]}))
    # a mesh whose process group is gone / does not match
    sub = dist.new_group(list(range(dist.get_world_size())))
    sub_mesh = DeviceMesh.from_group(sub, "cpu")
    p_sub = funcshard.plan(model, sub_mesh)
    dist.destroy_process_group(sub)
    catch("dead_mesh", lambda: funcshard.apply(p_sub, funcshard.shard(p, None) and good, torch.randn(2, 7)))
    fake = DeviceMesh("cpu", torch.arange(dist.get_world_size()), _init_backend=False)
    catch("mesh_no_group", lambda: funcshard.plan(model, fake))
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and all(
        torch.equal(snapshot[k], good[k]) for k in good
    )
    return out, unchanged


def test_bad_input_messages():
    out, unchanged = run_ranks(2, _errors)[0]
    assert unchanged
    expect = {
        "dim": r"inp\.weight: shape \(6, 7\) has no dim 2; shard_placement_fn must return a dim in \[-2, 1\]",
        "nontensor": r"inp\.bias: a list, not a tensor",
        "meta": r"on the meta device, it has no data; materialize it",
        "missing": r"out\.bias: missing[\s\S]*funcshard\.shard\(plan, \.\.\.\)",
        "extra": r"bogus: not a parameter of this plan \(extra key\)",
        "shape": r"inp\.weight: local shard \(2, 2\) torch\.float32, the plan expects \(3, 7\) torch\.float32 "
                 r"\(global \(6, 7\) sharded on dim 0 over 2 ranks\)",
        "state_nontensor": r"inp\.bias: a float, not a tensor",
        "other_plan": r"does not match the plan \(mesh DeviceMesh\('cpu', shape \(2\)\)\)[\s\S]*"
                      r"a state made by another plan",
        "bad_group": r"groups names module 'blocks\.9', which MLP does not have",
        "dup_group": r"module 'blocks\.0' is in two groups",
        "prefetch_list": r"forward_prefetch_lists names group 'x', which the plan does not have",
        "dead_mesh": r"has no live process group on axis 0 .*re-create the mesh",
        "mesh_no_group": r"has no live process group on axis 0",
    }
    for name, pattern in expect.items():
        with pytest.raises(AssertionError, match=pattern):  # pin the text
            raise AssertionError(out[name])


def test_rank_failures_surface():
    with pytest.raises(RankError, match="has no dim 5"):
        run_ranks(2, _plan_bad_dim)


def _plan_bad_dim():
    funcshard.plan(MLP(), _mesh(), shard_placement_fn=lambda n, p: 5)
