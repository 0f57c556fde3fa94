"""Groups of several modules: one forward tracker for apply and fully_shard (issue 13), and the 0-dim rule."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import funcshard
from models import Block
from multirank import run_ranks
from test_foundation import CollectiveCounter


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


class _Pair(nn.Module):
    """``a`` and ``b`` form one group; ``forward`` may call ``a`` twice, or skip ``b``; big blocks follow."""

    def __init__(self, d=16, big=64, blocks=4):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, big) for _ in range(blocks))
        self.mode = "ab"

    def forward(self, x):
        if self.mode == "aab":
            x = self.b(self.a(self.a(x)))
        elif self.mode == "a":  # b skipped (a data-dependent branch)
            x = self.a(x)
        else:
            x = self.b(self.a(x))
        for blk in self.blocks:
            x = blk(x)
        return x


def _plan(model, **kw):
    return funcshard.plan(model, _mesh(), groups=[("a", "b"), *[f"blocks.{i}" for i in range(len(model.blocks))]],
                          **kw)


def _pair_called_twice():
    """apply: a group of two modules whose first module runs twice in forward is gathered once for forward and once
    for backward, like any group (it was gathered a third time: the group was taken as done after two calls)."""
    torch.manual_seed(0)
    model = _Pair(blocks=2)
    model.mode = "aab"
    plan = _plan(model)
    state = funcshard.shard(plan)
    x = torch.randn(3, 16)
    with CollectiveCounter() as cc:
        grads = torch.func.grad(lambda s: funcshard.apply(plan, s, x).square().sum())(state)
    leaves = {k: v.detach().requires_grad_() for k, v in state.items()}
    with CollectiveCounter() as cc2:
        funcshard.apply(plan, leaves, x).square().sum().backward()
    full = funcshard.gather(plan, state)
    ref = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).square().sum())(full)
    ok = all(torch.allclose(grads[k], spec.local_shard(ref[k], dist.get_rank()), atol=1e-5)
             and torch.allclose(leaves[k].grad, grads[k], atol=1e-6) for k, spec in plan.specs.items())
    expected = sum(1 if g.is_root else 2 for g in plan.groups if g.params)  # root kept for backward: once
    return cc.count("all_gather"), cc2.count("all_gather"), expected, ok


def test_a_module_called_twice_in_a_group_of_two():
    ag_func, ag_autograd, expected, ok = run_ranks(2, _pair_called_twice)[0]
    assert ok
    # every group once in forward and once in backward (6 here: no root parameters)
    assert ag_func == ag_autograd == expected == 6, (ag_func, ag_autograd, expected)


def _pair_skipped():
    """Live bytes once forward has returned (its output kept for backward), with ``b`` run and skipped: a group
    whose modules did not all run is finished at the end of forward (freed, gathered again for its backward), as
    FSDP2 and fully_shard do; it was kept gathered until its backward."""
    from memtrack import PeakBytes

    out = {}
    for skip in (False, True):
        torch.manual_seed(0)
        model = _Pair(d=16, big=16, blocks=4)
        model.mode = "a" if skip else "ab"
        plan = _plan(model, prefetch=0)
        state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
        x = torch.randn(2, 16)
        with PeakBytes([*state.values(), x]) as tracker:
            y = funcshard.apply(plan, state, x)
            out[skip] = sum(tracker.sizes.values())
            y.sum().backward()
        full = funcshard.gather(plan, state)
        ref = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(full)
        out[f"grads {skip}"] = all(torch.allclose(state[k].grad, spec.local_shard(ref[k], dist.get_rank()), atol=1e-5)
                                   for k, spec in plan.specs.items())
    return out


def test_a_group_whose_second_module_is_skipped_is_freed_after_forward():
    out = run_ranks(2, _pair_skipped)[0]
    assert out["grads False"] and out["grads True"], out
    # b skipped: one Linear's activation less, and the pair freed at the end of forward, as when b ran
    assert out[True] <= out[False], out


# ---- the 0-dim rule: one spec builder ------------------------------------------------------------------------


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def _zero_dim():
    torch.manual_seed(0)
    model = _Scalar()
    plan = funcshard.plan(model, _mesh())
    spec = plan.specs["scale"]
    state = funcshard.shard(plan)
    full = funcshard.gather(plan, state)
    roundtrip = torch.equal(full["scale"], model.scale.detach()) and full["scale"].shape == ()
    placement = funcshard.plan(model, _mesh(), shard_placement_fn=lambda fqn, p: -1 if fqn == "scale" else None)
    try:
        funcshard.plan(model, _mesh(), shard_placement_fn=lambda fqn, p: 1 if fqn == "scale" else None)
        bad = "no error"
    except funcshard.ShardingError as e:
        bad = str(e)
    try:
        funcshard.fully_shard(_Scalar(), mesh=_mesh())
        fs = "no error"
    except ValueError as e:
        fs = str(e)
    return (spec.shape, spec.sharded_shape, spec.local_shape, roundtrip, placement.specs["scale"].dim, bad, fs)


def test_zero_dim_parameters_one_rule():
    """The functional path shards a 0-dim parameter as a 1-element vector (dims -1 and 0 name it); fully_shard
    refuses it with FSDP2's error (a DTensor Shard(0) of a scalar does not exist), before changing the module."""
    shape, sharded, local, roundtrip, dim, bad, fs = run_ranks(2, _zero_dim)[0]
    assert (shape, sharded, local, roundtrip, dim) == ((), (1,), (1,), True, 0)
    assert re.search(r"scale: shape \(\) has no dim 1; shard_placement_fn must return a dim in \[-1, 0\]", bad), bad
    assert re.search(r"fully_shard doesn't support scalar parameters\. Change scale to a 1D tensor with numel "
                     r"equal to 1\.", fs), fs
