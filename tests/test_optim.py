"""Tests for funcshard.optim: parity with torch.optim / clip_grad_norm_, purity, errors."""
from __future__ import annotations

import math

import optree
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import funcshard.optim as optim
from multirank import run_ranks

ATOL = 1e-6
STEPS = 12


# ----------------------------------------------------------------------------- helpers
def _model_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """Params of a small random model, as a dict of plain tensors (nn init ranges)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 16),
        torch.nn.LayerNorm(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
    )
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params["scalar"] = torch.tensor(0.25)  # a 0-dim leaf
    return params


def _random_grads(params, gen: torch.Generator):
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}


def _run_parity(params, make_tx, make_torch_opt, steps=STEPS, seed=1, make_sched=None):
    """Run our tx and a torch optimizer side by side on the same random grads."""
    gen = torch.Generator().manual_seed(seed)
    torch_params = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = make_torch_opt(list(torch_params.values()))
    sched = make_sched(opt) if make_sched is not None else None
    tx = make_tx()
    state = tx.init(params)
    ours = params
    for _ in range(steps):
        grads = _random_grads(params, gen)
        for k, p in torch_params.items():
            p.grad = grads[k].clone()
        opt.step()
        if sched is not None:
            sched.step()
        updates, state = tx.update(grads, state, ours)
        ours = optim.apply_updates(ours, updates)
    for k in params:
        torch.testing.assert_close(ours[k], torch_params[k].detach(), atol=ATOL, rtol=0, msg=lambda m: f"{k}: {m}")
    return ours, state


def _clone_tree(tree):
    return optree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree, namespace="funcshard")


def _assert_trees_equal(a, b):
    la, sa = optree.tree_flatten(a, namespace="funcshard")
    lb, sb = optree.tree_flatten(b, namespace="funcshard")
    assert sa == sb
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


# ----------------------------------------------------------------------------- AdamW parity
ADAMW_CONFIGS = [
    dict(),  # torch defaults
    dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    dict(lr=3e-3, weight_decay=0.0),
    dict(lr=5e-2, betas=(0.0, 0.5), eps=1e-3, weight_decay=0.5),
]


@pytest.mark.parametrize("kwargs", ADAMW_CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
def test_adamw_matches_torch(kwargs):
    params = _model_params()
    _, state = _run_parity(
        params, lambda: optim.adamw(**kwargs), lambda ps: torch.optim.AdamW(ps, **kwargs)
    )
    adam_state = state[0]
    assert isinstance(adam_state, optim.ScaleByAdamState)
    assert adam_state.count == STEPS  # == torch's state["step"]


def test_adamw_defaults_equal_torch():
    import inspect

    ours = inspect.signature(optim.adamw).parameters
    theirs = inspect.signature(torch.optim.AdamW).parameters
    for name in ("lr", "betas", "eps", "weight_decay"):
        assert ours[name].default == theirs[name].default, name


def test_adamw_amsgrad_not_supported():
    with pytest.raises(TypeError, match="amsgrad"):
        optim.adamw(amsgrad=True)  # type: ignore[call-arg]


def test_adamw_state_after_one_step_matches_torch_moments():
    params = _model_params()
    grads = _random_grads(params, torch.Generator().manual_seed(3))
    tp = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(tp.values()))
    for k, p in tp.items():
        p.grad = grads[k].clone()
    opt.step()
    tx = optim.adamw()
    _, state = tx.update(grads, tx.init(params), params)
    for k, p in tp.items():
        torch.testing.assert_close(state[0].mu[k], opt.state[p]["exp_avg"], atol=0, rtol=0)
        torch.testing.assert_close(state[0].nu[k], opt.state[p]["exp_avg_sq"], atol=0, rtol=0)


# ----------------------------------------------------------------------------- SGD parity
SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.1, weight_decay=0.05),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.02, momentum=0.8, dampening=0.1, weight_decay=0.01),
    dict(lr=0.02, momentum=0.7, weight_decay=0.1, nesterov=True),
]


@pytest.mark.parametrize("kwargs", SGD_CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sgd_matches_torch(kwargs):
    params = _model_params()
    _run_parity(params, lambda: optim.sgd(**kwargs), lambda ps: torch.optim.SGD(ps, **kwargs))


def test_sgd_without_momentum_keeps_no_buffer():
    params = _model_params()
    state = optim.sgd(0.1).init(params)
    assert not any(isinstance(s, optim.TraceState) for s in state)
    leaves = optree.tree_leaves(state, namespace="funcshard")
    assert not any(isinstance(x, torch.Tensor) for x in leaves)


def test_sgd_nesterov_validation():
    with pytest.raises(ValueError, match="nesterov momentum requires a momentum > 0 and zero dampening"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="nesterov momentum requires"):
        optim.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True)


# ----------------------------------------------------------------------------- schedules
def _schedule(count: int) -> float:
    return 0.05 * (count + 1) / 4 if count < 4 else 0.05 * 0.8 ** (count - 4)


def test_adamw_schedule_matches_torch_lambdalr():
    params = _model_params()
    _run_parity(
        params,
        lambda: optim.adamw(lr=_schedule, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1.0, weight_decay=0.1),
        make_sched=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _schedule),
    )


def test_sgd_schedule_matches_torch_lambdalr():
    params = _model_params()
    _run_parity(
        params,
        lambda: optim.sgd(_schedule, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9, weight_decay=0.01),
        make_sched=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _schedule),
    )


def test_schedule_called_with_count_from_zero():
    calls = []

    def sched(count):
        calls.append(count)
        return 0.5

    params = {"w": torch.ones(3)}
    tx = optim.adamw(lr=sched)
    state = tx.init(params)
    for _ in range(4):
        _, state = tx.update({"w": torch.ones(3)}, state, params)
    assert calls == [0, 1, 2, 3]
    assert isinstance(state[2], optim.ScaleByScheduleState) and state[2].count == 4
    assert state[0].count == 4


def test_constant_lr_equals_constant_schedule():
    params = _model_params()
    grads = _random_grads(params, torch.Generator().manual_seed(0))
    a, b = optim.sgd(0.1, momentum=0.5), optim.sgd(lambda c: 0.1, momentum=0.5)
    ua, _ = a.update(grads, a.init(params), params)
    ub, _ = b.update(grads, b.init(params), params)
    for k in params:
        assert torch.equal(ua[k], ub[k])


def test_tensor_lr_rejected_with_fix():
    with pytest.raises(TypeError, match=r"lr must be a float or a callable.*Fix: pass float\(lr\)"):
        optim.adamw(lr=torch.tensor(1e-3))


def test_negative_lr_rejected():
    with pytest.raises(ValueError, match="invalid learning rate -0.1"):
        optim.sgd(-0.1)


# ----------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e4])
def test_clip_by_global_norm_matches_torch(max_norm):
    params = _model_params()
    grads = _random_grads(params, torch.Generator().manual_seed(5))
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(ref, grads.values()):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    tx = optim.clip_by_global_norm(max_norm)
    state = tx.init(params)
    assert state == optim.ClipByGlobalNormState() and len(state) == 0
    clipped, state2 = tx.update(grads, state, params)
    assert state2 == state
    for p, k in zip(ref, grads):
        torch.testing.assert_close(clipped[k], p.grad, atol=1e-7, rtol=1e-6)
    if max_norm > total:
        for k in grads:
            torch.testing.assert_close(clipped[k], grads[k], atol=1e-7, rtol=1e-6)


def test_clip_by_global_norm_no_reduction_without_dist(monkeypatch):
    assert not dist.is_initialized()
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a))
    tx = optim.clip_by_global_norm(1.0)
    out, _ = tx.update({"a": torch.full((4,), 3.0)}, tx.init(None))
    assert calls == []
    torch.testing.assert_close(out["a"].norm(), torch.tensor(1.0), atol=1e-5, rtol=0)


def test_clip_by_global_norm_keeps_dtypes_and_handles_empty_leaves():
    grads = {"bf": torch.full((8,), 2.0, dtype=torch.bfloat16), "f": torch.full((2, 2), 2.0), "e": torch.zeros(0, 3)}
    tx = optim.clip_by_global_norm(1.0)
    out, _ = tx.update(grads, tx.init(grads))
    assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in grads.items()}
    assert out["e"].shape == (0, 3)
    coef = 1.0 / (math.sqrt(12 * 4.0) + 1e-6)
    torch.testing.assert_close(out["f"], torch.full((2, 2), 2.0 * coef))
    torch.testing.assert_close(out["bf"], torch.full((8,), 2.0 * coef, dtype=torch.bfloat16))


def test_clip_by_global_norm_empty_tree():
    tx = optim.clip_by_global_norm(1.0)
    assert tx.update({}, tx.init({})) == ({}, optim.ClipByGlobalNormState())


# ----------------------------------------------------------------------------- chain
def test_chain_composes_left_to_right():
    grads = {"a": torch.full((4,), 3.0)}  # norm 6
    clip_then_scale = optim.chain(optim.clip_by_global_norm(1.0), optim.scale(2.0))
    scale_then_clip = optim.chain(optim.scale(2.0), optim.clip_by_global_norm(1.0))
    u1, s1 = clip_then_scale.update(grads, clip_then_scale.init(grads))
    u2, s2 = scale_then_clip.update(grads, scale_then_clip.init(grads))
    torch.testing.assert_close(u1["a"].norm(), torch.tensor(2.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(u2["a"].norm(), torch.tensor(1.0), atol=1e-5, rtol=0)
    assert s1 == (optim.ClipByGlobalNormState(), optim.ScaleState())
    assert s2 == (optim.ScaleState(), optim.ClipByGlobalNormState())


def test_adamw_is_chain_of_building_blocks():
    params = _model_params()
    grads = _random_grads(params, torch.Generator().manual_seed(2))
    manual = optim.chain(
        optim.scale_by_adam(0.9, 0.999, 1e-8), optim.add_decayed_weights(0.1), optim.scale_by_learning_rate(1e-3)
    )
    u1, s1 = manual.update(grads, manual.init(params), params)
    u2, s2 = optim.adamw(weight_decay=0.1).update(grads, optim.adamw().init(params), params)
    _assert_trees_equal(u1, u2)
    _assert_trees_equal(s1, s2)


def test_chain_of_clip_and_adamw_passes_extra_kwargs():
    params = _model_params()
    grads = _random_grads(params, torch.Generator().manual_seed(2))
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw())
    state = tx.init(params)
    u, state = tx.update(grads, state, params, value=torch.tensor(1.0), anything="ignored")
    assert set(u) == set(params)
    assert isinstance(state, tuple) and len(state) == 2 and len(state[1]) == 3


def test_chain_rejects_wrong_state():
    tx = optim.chain(optim.scale(1.0), optim.scale(2.0))
    with pytest.raises(ValueError, match=r"chain: expected opt_state as a tuple of 2 inner states, got a tuple of 1.*Fix"):
        tx.update({"a": torch.ones(1)}, (optim.ScaleState(),))


def test_chain_rejects_non_transform():
    with pytest.raises(TypeError, match="chain: argument 1 is a int, not a GradientTransformation"):
        optim.chain(optim.identity(), 3)


# ----------------------------------------------------------------------------- purity / structure
def test_apply_updates_is_pure():
    params = _model_params()
    updates = _random_grads(params, torch.Generator().manual_seed(4))
    p0, u0 = _clone_tree(params), _clone_tree(updates)
    new = optim.apply_updates(params, updates)
    _assert_trees_equal(params, p0)
    _assert_trees_equal(updates, u0)
    for k in params:
        assert new[k] is not params[k]
        assert new[k].data_ptr() != params[k].data_ptr()
        torch.testing.assert_close(new[k], params[k] + updates[k], atol=0, rtol=0)


def test_apply_updates_casts_to_param_dtype_and_nested_trees():
    params = {"a": (torch.ones(2, dtype=torch.bfloat16), [torch.zeros(())]), "b": None}
    updates = {"a": (torch.full((2,), 0.5), [torch.ones((), dtype=torch.float64)]), "b": None}
    new = optim.apply_updates(params, updates)
    assert new["b"] is None
    assert new["a"][0].dtype == torch.bfloat16 and new["a"][1][0].dtype == torch.float32
    torch.testing.assert_close(new["a"][0], torch.full((2,), 1.5, dtype=torch.bfloat16))
    assert new["a"][1][0].item() == 1.0


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optim.adamw(weight_decay=0.1),
        lambda: optim.sgd(0.1, momentum=0.9, weight_decay=0.1, nesterov=True),
        lambda: optim.chain(optim.clip_by_global_norm(0.1), optim.sgd(0.1, momentum=0.9, dampening=0.5)),
    ],
    ids=["adamw", "sgd-nesterov", "clip+sgd"],
)
def test_update_does_not_mutate_inputs(make_tx):
    params = _model_params()
    gen = torch.Generator().manual_seed(7)
    tx = make_tx()
    state = tx.init(params)
    for _ in range(3):
        grads = _random_grads(params, gen)
        g0, s0, p0 = _clone_tree(grads), _clone_tree(state), _clone_tree(params)
        updates, new_state = tx.update(grads, state, params)
        _assert_trees_equal(grads, g0)
        _assert_trees_equal(state, s0)
        _assert_trees_equal(params, p0)
        state = new_state


def test_optimizer_state_sharded_like_params():
    params = {"w": torch.randn(3, 4), "b": torch.randn(4, dtype=torch.float64), "s": torch.randn(()), "e": torch.zeros(0, 2)}
    spec = optree.tree_structure(params, namespace="funcshard")
    adam = optim.adamw().init(params)[0]
    momentum = optim.sgd(0.1, momentum=0.9).init(params)[1]
    assert type(adam).__name__ == "ScaleByAdamState" and adam._fields == ("count", "mu", "nu")
    assert type(momentum).__name__ == "TraceState" and momentum._fields == ("count", "trace")
    assert adam.count == 0 and momentum.count == 0 and isinstance(adam.count, int)
    for tree in (adam.mu, adam.nu, momentum.trace):
        assert optree.tree_structure(tree, namespace="funcshard") == spec
        assert list(tree) == list(params)
        for k in params:
            assert tree[k].shape == params[k].shape and tree[k].dtype == params[k].dtype
            assert not tree[k].any()
    # ...and stays so after an update
    tx = optim.adamw()
    _, s = tx.update(_clone_tree(params), tx.init(params), params)
    for k in params:
        assert s[0].mu[k].shape == params[k].shape and s[0].nu[k].dtype == params[k].dtype


def test_empty_tree():
    tx = optim.adamw()
    state = tx.init({})
    updates, state = tx.update({}, state, {})
    assert updates == {} and state[0].count == 1
    assert optim.apply_updates({}, {}) == {}


def test_update_runs_without_autograd_graph():
    params = {k: v.requires_grad_() for k, v in _model_params().items()}
    tx = optim.adamw()
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    updates, state = tx.update(grads, tx.init(params), params)
    new = optim.apply_updates(params, updates)
    for tree in (updates, state[0].mu, new):
        assert all(not t.requires_grad for t in optree.tree_leaves(tree, namespace="funcshard"))


# ----------------------------------------------------------------------------- errors
def test_error_missing_key():
    params = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    tx = optim.adamw()
    with pytest.raises(
        ValueError,
        match=r"scale_by_adam: updates do not match the optimizer state: missing keys \['b'\] "
        r"\(in optimizer state, not in updates\)\. Fix: pass updates \(grads\) with exactly the structure",
    ):
        tx.update({"w": torch.zeros(2, 3)}, tx.init(params), params)


def test_error_extra_key():
    params = {"w": torch.zeros(2, 3)}
    tx = optim.sgd(0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"trace: updates do not match the optimizer state: unexpected keys \['x'\].*re-create the state with tx.init\(params\)"):
        tx.update({"w": torch.zeros(2, 3), "x": torch.zeros(1)}, tx.init(params), None)


def test_error_shape_mismatch():
    params = {"layer.weight": torch.zeros(4, 3)}
    tx = optim.adamw()
    with pytest.raises(
        ValueError,
        match=r"scale_by_adam: shape mismatch at \['layer\.weight'\]: updates has shape \(3, 4\) but the optimizer "
        r"state has shape \(4, 3\)\. Fix: .*local shard shapes",
    ):
        tx.update({"layer.weight": torch.zeros(3, 4)}, tx.init(params), params)


def test_error_shape_mismatch_params_vs_updates():
    tx = optim.sgd(0.1, weight_decay=0.1)
    params = {"w": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"add_decayed_weights: shape mismatch at \['w'\]: updates has shape \(4,\) but the params has shape \(5,\)"):
        tx.update({"w": torch.zeros(4)}, tx.init(params), {"w": torch.zeros(5)})


def test_error_params_required_for_weight_decay():
    params = {"w": torch.zeros(2)}
    tx = optim.adamw(weight_decay=0.1)
    with pytest.raises(ValueError, match=r"add_decayed_weights: params are required but got None\. Fix: .*tx\.update\(grads, opt_state, params\)"):
        tx.update({"w": torch.zeros(2)}, tx.init(params))
    # no weight decay: params are optional
    optim.adamw(weight_decay=0.0).update({"w": torch.zeros(2)}, optim.adamw(weight_decay=0.0).init(params))


def test_error_apply_updates_mismatch():
    with pytest.raises(ValueError, match=r"apply_updates: updates do not match the params: missing keys \['b'\].*unexpected keys \['c'\]"):
        optim.apply_updates({"a": torch.zeros(1), "b": torch.zeros(1)}, {"a": torch.zeros(1), "c": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"apply_updates: shape mismatch at \['a'\]\[1\]: updates has shape \(2,\) but the params has shape \(\)"):
        optim.apply_updates({"a": [torch.zeros(1), torch.zeros(())]}, {"a": [torch.zeros(1), torch.zeros(2)]})


def test_error_container_type_mismatch():
    with pytest.raises(ValueError, match="same keys but different container types"):
        optim.apply_updates({"a": (torch.zeros(1),)}, {"a": [torch.zeros(1)]})


def test_error_non_tensor_leaf():
    params = {"w": torch.zeros(2)}
    tx = optim.adamw()
    with pytest.raises(TypeError, match=r"scale_by_adam: updates leaf at \['w'\] is a float, not a torch\.Tensor\. Fix"):
        tx.update({"w": 1.0}, tx.init(params), params)
    with pytest.raises(TypeError, match=r"params leaf at \['n'\] is a int"):
        tx.init({"n": 3})
    with pytest.raises(TypeError, match=r"clip_by_global_norm: updates leaf at \['x'\] is a str"):
        optim.clip_by_global_norm(1.0).update({"x": "nope"}, optim.ClipByGlobalNormState())


def test_error_wrong_state_type():
    tx = optim.scale_by_adam()
    with pytest.raises(TypeError, match=r"scale_by_adam: expected opt_state of type ScaleByAdamState, got TraceState\. Fix"):
        tx.update({"w": torch.zeros(1)}, optim.TraceState(0, {"w": torch.zeros(1)}))


@pytest.mark.parametrize(
    "factory,match",
    [
        (lambda: optim.adamw(betas=(1.0, 0.999)), r"invalid beta1 1\.0"),
        (lambda: optim.adamw(betas=(0.9, -0.1)), r"invalid beta2 -0\.1"),
        (lambda: optim.adamw(eps=-1.0), r"invalid eps -1\.0"),
        (lambda: optim.adamw(weight_decay=-0.1), r"invalid weight_decay -0\.1"),
        (lambda: optim.sgd(0.1, momentum=-0.5), r"invalid momentum -0\.5"),
        (lambda: optim.clip_by_global_norm(-1.0), r"invalid max_norm -1\.0"),
    ],
)
def test_error_bad_hyperparameters(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


# ----------------------------------------------------------------------------- hypothesis
_shape = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.dictionaries(st.text("abcxyz.", min_size=1, max_size=6), _shape, min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
    lr=st.floats(1e-4, 1e-1),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    weight_decay=st.sampled_from([0.0, 1e-2, 0.3]),
    steps=st.integers(1, 6),
)
def test_adamw_parity_property(shapes, seed, lr, b1, b2, eps, weight_decay, steps):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen) * 0.5 for k, s in shapes.items()}
    kwargs = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay)
    _run_parity(
        params, lambda: optim.adamw(**kwargs), lambda ps: torch.optim.AdamW(ps, **kwargs), steps=steps, seed=seed
    )


# ----------------------------------------------------------------------------- multi-rank
def _shard_dim0(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank's chunk of dim 0 split into ``world`` equal chunks, zero-padded at the end."""
    chunk = -(-t.shape[0] // world)
    padded = torch.zeros((chunk * world, *t.shape[1:]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded[rank * chunk : (rank + 1) * chunk].clone()


def _clip_worker(full_grads, max_norm):
    """On every rank: shard the full grads, clip them with several ``mesh`` arguments."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    real_all_reduce = dist.all_reduce
    calls = []

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    mesh1d = init_device_mesh("cpu", (world,))
    variants = {"default": None, "group": dist.group.WORLD, "mesh": mesh1d}
    try:
        dist.all_reduce = counting_all_reduce
        shards = {k: _shard_dim0(v, world, rank) for k, v in full_grads.items()}
        for name, mesh in variants.items():
            calls.clear()
            tx = optim.clip_by_global_norm(max_norm, mesh=mesh)
            out, _ = tx.update(shards, tx.init(shards))
            results[name] = (out, len(calls))
    finally:
        dist.all_reduce = real_all_reduce
    if world == 4:
        # HSDP-style 2-D mesh (replicate, shard): reduce over the last (shard) axis only.
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        shard_rank = mesh2d.get_local_rank(1)
        shards = {k: _shard_dim0(v, 2, shard_rank) for k, v in full_grads.items()}
        try:
            dist.all_reduce = counting_all_reduce
            calls.clear()
            tx = optim.clip_by_global_norm(max_norm, mesh=mesh2d)
            out, _ = tx.update(shards, tx.init(shards))
            results["mesh2d"] = (out, len(calls), shard_rank)
        finally:
            dist.all_reduce = real_all_reduce
    return results


def _unshard(per_rank_shards, full):
    return {k: torch.cat([s[k] for s in per_rank_shards])[: v.shape[0]] for k, v in full.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_clip_by_global_norm_multirank(world):
    gen = torch.Generator().manual_seed(world)
    full = {
        "w": torch.randn(10, 3, generator=gen),  # not divisible by 4: padded shards
        "b": torch.randn(3, generator=gen),  # fewer rows than ranks at W=4: all-padding shards
        "v": torch.randn(8, generator=gen),
    }
    max_norm = 1.0
    ref = [torch.nn.Parameter(torch.zeros_like(v)) for v in full.values()]
    for p, v in zip(ref, full.values()):
        p.grad = v.clone()
    total = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert total > 2 * max_norm  # the test really clips
    expected = {k: p.grad for k, p in zip(full, ref)}

    results = run_ranks(world, _clip_worker, full, max_norm, timeout=120.0)
    for name in ("default", "group", "mesh"):
        assert [r[name][1] for r in results] == [1] * world, f"{name}: expected exactly one all_reduce per rank"
        got = _unshard([r[name][0] for r in results], full)
        for k in full:
            torch.testing.assert_close(got[k], expected[k], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}/{k}: {m}")
    if world == 4:
        assert [r["mesh2d"][1] for r in results] == [1] * 4
        for replica in (0, 1):
            ranks = [r for r in results[2 * replica : 2 * replica + 2]]
            assert [r["mesh2d"][2] for r in ranks] == [0, 1]
            got = _unshard([r["mesh2d"][0] for r in ranks], full)
            for k in full:
                torch.testing.assert_close(got[k], expected[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: optim.adamw(lr=1e-2, weight_decay=0.1),
    lambda: optim.sgd(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda: optim.sgd(lr=1e-2, momentum=0.9, dampening=0.1),
    lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(lr=lambda c: 1e-2 / (c + 1))),
])
def test_donation_gives_the_same_numbers_in_place(make):
    """donate=True reuses updates, optimizer state and params in place, with the pure form's numbers."""
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 3), "b": torch.randn(3), "s": torch.randn(())}
    tx = make()
    pure_p, pure_s = dict(params), tx.init(params)
    don_p, don_s = {k: v.clone() for k, v in params.items()}, tx.init(params)
    ids = {k: id(v) for k, v in don_p.items()}
    for step in range(4):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        u, pure_s = tx.update(dict(grads), pure_s, pure_p)
        pure_p = optim.apply_updates(pure_p, u)
        g2 = {k: v.clone() for k, v in grads.items()}
        u2, don_s = tx.update(g2, don_s, don_p, donate=True)
        assert all(u2[k] is g2[k] for k in g2)  # the donated updates were reused
        don_p = optim.apply_updates(don_p, u2, donate=True)
    assert {k: id(v) for k, v in don_p.items()} == ids
    for k in params:
        torch.testing.assert_close(don_p[k], pure_p[k], atol=0, rtol=0)


# ----------------------------------------------------------------------------- bit for bit with torch.optim (issue 20)
TORCH_PAIRS = {
    "adamw": (lambda: optim.adamw(lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)),
    "adamw_no_decay": (lambda: optim.adamw(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
                       lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0,
                                                    foreach=True)),
    "sgd": (lambda: optim.sgd(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True)),
    "sgd_nesterov": (lambda: optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True,
                                                foreach=True)),
    "sgd_dampening": (lambda: optim.sgd(lr=0.1, momentum=0.9, dampening=0.3),
                      lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, foreach=True)),
}


def _shards(tree, world, rank):
    """Rank ``rank``'s dim-0 shards (0-dim leaves as 1-element vectors), as funcshard.shard lays them out."""
    return {k: _shard_dim0(v.reshape(-1) if v.dim() == 0 else v, world, rank) for k, v in tree.items()}


def _torch_step(opt, theirs, params, gen):
    """Draw the next gradients, step torch's optimizer on them, return them (for funcshard's step)."""
    grads = _random_grads(params, gen)
    for t, g in zip(theirs, grads.values()):
        t.grad = g.clone()
    opt.step()
    return grads


@pytest.mark.parametrize("name", sorted(TORCH_PAIRS))
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("donate", [False, True])
def test_step_is_torch_bit_for_bit(name, world, donate):
    """optim.step = torch.optim's foreach step, 0.0 difference after each of 6 steps; sharded over ``world`` ranks
    (the optimizer is elementwise: each rank's shards step alone), chained after clipping too."""
    make, make_torch = TORCH_PAIRS[name]
    params = _model_params()
    theirs = [v.clone().requires_grad_() for v in params.values()]
    opt = make_torch(theirs)
    txs = [make() if r % 2 == 0 else optim.chain(optim.clip_by_global_norm(1e9), make()) for r in range(world)]
    ours = [_shards(params, world, r) for r in range(world)]
    states = [tx.init(p) for tx, p in zip(txs, ours)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        grads = _torch_step(opt, theirs, params, gen)
        for r in range(world):
            ours[r], states[r] = optim.step(txs[r], _shards(grads, world, r), states[r], ours[r], donate=donate)
        for k, t in zip(params, theirs):
            full = torch.cat([ours[r][k] for r in range(world)])[: max(t.numel(), 1) if t.dim() == 0 else t.shape[0]]
            assert torch.equal(full.reshape(t.shape), t.detach()), (name, k)


def test_step_with_a_schedule_is_torch_lambdalr_bit_for_bit():
    params = _model_params()
    theirs = [v.clone().requires_grad_() for v in params.values()]
    opt = torch.optim.AdamW(theirs, lr=1.0, weight_decay=0.1, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    tx = optim.adamw(lr=_schedule, weight_decay=0.1)
    ours, state = dict(params), tx.init(params)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        grads = _torch_step(opt, theirs, params, gen)
        sched.step()
        ours, state = optim.step(tx, grads, state, ours)
    assert all(torch.equal(ours[k], t.detach()) for k, t in zip(params, theirs))
    assert tx.torch_param_group(state[-1].count)["lr"] == opt.param_groups[0]["lr"]


def test_step_without_torch_form_is_update_then_apply():
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.scale(-0.1))
    assert not isinstance(tx, optim.TorchOptimizer)
    params = _model_params()
    grads = _random_grads(params, torch.Generator().manual_seed(3))
    new, _ = optim.step(tx, grads, tx.init(params), params)
    u, _ = tx.update(grads, tx.init(params), params)
    assert all(torch.equal(new[k], params[k] + u[k]) for k in params)


def test_step_errors_name_the_fix():
    tx = optim.adamw()
    params = _model_params()
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"adamw: expected opt_state as a tuple of 3 inner states"):
        optim.step(tx, params, state[:2], params)
    with pytest.raises(ValueError, match=r"missing"):
        optim.step(tx, {k: v for k, v in params.items() if k != "scalar"}, state, params)


def test_optimizer_state_loads_with_torch_load_defaults(tmp_path):
    """torch.load's default weights_only=True accepts funcshard.optim's state classes."""
    params = _model_params()
    for tx in (optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=_schedule)),
               optim.sgd(0.1, momentum=0.9)):
        state = tx.init(params)
        _, state = optim.step(tx, _random_grads(params, torch.Generator().manual_seed(0)), state, params)
        torch.save(state, tmp_path / "s.pt")
        back = torch.load(tmp_path / "s.pt")
        assert optree.tree_structure(back, namespace="funcshard") == optree.tree_structure(state, namespace="funcshard")
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(optree.tree_leaves(back, namespace="funcshard"),
                                   optree.tree_leaves(state, namespace="funcshard")))


def test_tree_flatten_of_a_dict_of_tensors_is_optrees():
    """funcshard._tree.tree_flatten's cached key order for a plain dict of plain tensors: the same leaves and spec as
    optree's, whatever the insertion order, and optree's own answer when a value is None or not a plain tensor."""
    from funcshard import _tree

    class Sub(torch.Tensor):
        pass

    base = {f"b.{i}.w": torch.randn(2) for i in (3, 1, 2)} | {"a": torch.nn.Parameter(torch.randn(1))}
    sub = torch.ones(1).as_subclass(Sub)
    for d in ({"x": [torch.ones(1)]}, {"x": torch.ones(1)}, base, dict(reversed(list(base.items()))),
              base | {"b.1.w": None}, base | {"a": sub}, {"x": {"y": torch.ones(1)}}, {}, {1: torch.ones(1)},
              {1.0: torch.ones(1)}):  # (a list first: one leaf)
        want = optree.tree_flatten(d, none_is_leaf=False, namespace=_tree.NAMESPACE)
        for _ in range(2):  # (the second from the cache)
            leaves, spec = _tree.tree_flatten(d)
            assert spec == want[1] and len(leaves) == len(want[0])
            assert list(map(repr, optree.tree_unflatten(spec, leaves))) == list(map(repr, d))
            assert all(a is b for a, b in zip(leaves, want[0]))
