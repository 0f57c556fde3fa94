"""Groups of several modules: one forward tracker for apply and fully_shard (issue 13), and the 0-dim rule."""

from __future__ import annotations

import re

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


# ---- fully_shard: settings and unshard() while a step runs (review of the redesign) -------------------------


class _Twice(nn.Module):
    """``blk`` is used twice in one forward; ``mid`` runs between the two uses."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(7, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.blk = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 6))

    def forward(self, x):
        return self.out(self.blk(self.mid(self.blk(self.inp(x)))))


def _local_full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _unshard_between_uses():
    """``blk.unshard()`` from ``mid``'s pre-hook, between blk's two uses: its second use must record autograd
    history again (it ran on the unshard()'s plain views, and its gradient was dropped)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
    torch.manual_seed(0)
    ref = _Twice()
    F.mse_loss(ref(x), y).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    out = []
    for async_op in (False, True):
        torch.manual_seed(0)
        model = _Twice()
        for m in (model.blk, model.mid, model):
            funcshard.fully_shard(m, mesh=_mesh())
        model.mid.register_forward_pre_hook(lambda mod, a: model.blk.unshard(async_op=async_op) and None)
        F.mse_loss(model(x), y).backward()
        rp = dict(ref.named_parameters())
        out.append(max((_local_full(p.grad) - rp[n].grad).abs().max().item() for n, p in model.named_parameters()))
    return out


def test_unshard_between_two_uses_of_a_unit_keeps_its_gradient():
    assert all(d < 1e-6 for d in run_ranks(2, _unshard_between_uses)[0])


def _settings_during_a_step():
    """Unit settings changed after the step began (after unshard() or after forward) apply to that step, as FSDP2
    reads them when it uses them: the divide factor (with force-sum, which FSDP2 needs for it on gloo) and
    reshard_after_backward, against torch's FSDP2."""
    import torch.distributed.fsdp as torch_fsdp

    from models import MLP

    def run(fs, when):
        torch.manual_seed(0)
        model = MLP(layers=2)
        for b in model.blocks:
            fs.fully_shard(b, mesh=_mesh())
        fs.fully_shard(model, mesh=_mesh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        losses = []
        for step in range(3):
            if when == "after_unshard":
                model.unshard()
            x = torch.randn(4, 7, generator=g)
            loss = model(x).square().mean()
            for m in (model, *model.blocks):
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0 + step)
            model.set_reshard_after_backward(step != 1)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [_local_full(p.detach()) for p in model.parameters()]

    out = {}
    for when in ("after_forward", "after_unshard"):
        (la, pa), (lb, pb) = run(torch_fsdp, when), run(funcshard, when)
        out[when] = (la == lb, max((a - b).abs().max().item() for a, b in zip(pa, pb)))
    return out


def test_settings_changed_during_a_step_apply_to_it():
    for when, (same_losses, diff) in run_ranks(2, _settings_during_a_step)[0].items():
        assert same_losses and diff == 0, (when, same_losses, diff)


class _FrozenTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.weight.requires_grad_(False)

    def forward(self, pair):
        return self.lin(sum(pair))


class _Prompted(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.blk, self.post = nn.Linear(4, 4), _FrozenTuple(), nn.Linear(4, 4)

    def forward(self, x, prompt):
        return self.post(self.blk((prompt,))) + self.pre(x)


def _hook_outlives_step():
    """A group with a frozen weight whose input sits in a container is watched by a multi-grad hook on the input;
    that hook may fire after its step is gone (a leaf reused by the next step): nothing to free, no error."""
    torch.manual_seed(0)
    model = _Prompted()
    plan = funcshard.plan(model, _mesh(), groups=["blk"])
    state = {k: v.detach().requires_grad_(plan.specs[k].requires_grad) for k, v in funcshard.shard(plan).items()}
    prompt, x = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4)
    for _ in range(3):
        funcshard.apply(plan, state, x, prompt).sum().backward()
    funcshard.apply(plan, state, x, prompt)  # output dropped: its step dies
    (prompt * 2).sum().backward()  # the old hook on the leaf's graph does not fire for this, nor fail
    return prompt.grad is not None


def test_a_hook_outliving_its_step_does_nothing():
    assert run_ranks(2, _hook_outlives_step) == [True, True]
