"""Whole-matrix optimizers over sharded parameters (issue 33): ``optim.muon`` / ``optim.Muon`` against
``torch.optim.Muon`` on the unsharded model, the owner table, ``optim.owner_compute`` against a one-process
reference, ``optim.multi_transform``, and checkpoints at another world size.

Parity is fed the same full gradients at every world size (each rank takes its shard of them), so the arithmetic is
the same: the momentum and the parameter update are element-wise on the shards, and Newton-Schulz runs on the owner
on exactly the whole bfloat16 matrix torch sees. Hence bit for bit at W=1, and bit for bit measured at W=2 and W=4
too (the issue asks 1e-6 there; the tests assert equality where it was measured, and say so).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import funcshard
from funcshard import checkpoint, optim
from funcshard._owner import assign_owners, ns_flops
from multirank import run_ranks

SHAPES = [(11, 6), (9, 11), (9, 9), (5, 9), (3, 5)]  # rows > cols, rows < cols, square; (3, 5) at W=4: an empty shard


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    dims = [6, 11, 9, 9, 5, 3]
    return nn.Sequential(*(nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:]))).to(dtype)


def _grads(plan_specs, step, dtype):
    out = {}
    for i, (k, s) in enumerate(plan_specs.items()):
        g = torch.Generator().manual_seed(1000 * step + i)
        out[k] = torch.randn(s.shape, generator=g).to(dtype)
    return out


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _parity(mode="step", dtype=torch.float32, steps=10, layout="per_param", nesterov=True, dim=0, lr=0.02):
    """Muon on this rank's shards vs torch.optim.Muon on the unsharded model, fed the same full gradients; returns
    (max abs difference of the gathered parameters, whether bitwise equal, the owner table)."""
    model = _model(dtype)
    ref = copy.deepcopy(model)
    plan = funcshard.plan(model, _mesh(), layout=layout, shard_placement_fn=(lambda n, p: dim) if dim else None)
    state = funcshard.shard(plan)
    rank = plan.shard_group()[1]
    tx = optim.muon(lr, plan=plan, nesterov=nesterov)
    opt_state = tx.init(state)
    torch_opt = torch.optim.Muon(ref.parameters(), lr=lr, nesterov=nesterov)
    for step in range(steps):
        full = _grads(plan.specs, step, dtype)
        local = {k: plan.specs[k].local_shard(g, rank) for k, g in full.items()}
        if mode == "step":
            state, opt_state = optim.step(tx, local, opt_state, state)
        elif mode == "donate":
            state, opt_state = optim.step(tx, local, opt_state, state, donate=True)
        else:
            updates, opt_state = tx.update(local, opt_state, state)
            state = optim.apply_updates(state, updates)
        for name, p in ref.named_parameters():
            p.grad = full[name]
        torch_opt.step()
    got = funcshard.gather(plan, state)
    want = dict(ref.named_parameters())
    diff = max((got[k].float() - want[k].detach().float()).abs().max().item() for k in got)
    equal = all(torch.equal(got[k], want[k].detach()) for k in got)
    return diff, equal, str(tx.owners(state))


def test_w1_bit_for_bit_torch_muon():
    diff, equal, _ = run_ranks(1, _parity)[0]
    assert equal, diff


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_equals_torch_muon(world):
    # fp32, 10 steps, uneven shapes (padding), an empty shard at W=4: bit for bit measured (1e-6 asked)
    for diff, equal, _ in run_ranks(world, _parity):
        assert equal and diff == 0.0, diff


def test_update_path_dim1_flat_bf16_donate():
    out = run_ranks(2, _parity, "update")  # the optax update + apply_updates: within rounding
    assert all(d < 1e-6 for d, _, _ in out), out
    out = run_ranks(2, _parity, "step", dim=1)  # sharded on dim 1
    assert all(e for _, e, _ in out), out
    out = run_ranks(2, _parity, "step", layout="flat")
    assert all(e for _, e, _ in out), out
    out = run_ranks(2, _parity, "donate")
    assert all(e for _, e, _ in out), out
    # bf16 params and momentum (torch keeps the buffer in the gradient's dtype): W=1 bit for bit; sharded, torch's
    # CPU kernels round a bf16 add_/lerp_ differently in a vector's tail than in its body, and the shards' tails are
    # elsewhere: measured 1 bf16 ulp (2**-8 at |p| < 1) after 10 steps; asserted within 2
    assert run_ranks(1, _parity, "step", dtype=torch.bfloat16)[0][1]
    out = run_ranks(2, _parity, "step", dtype=torch.bfloat16)
    assert all(d <= 2**-7 for d, _, _ in out), out


def test_owner_table_lpt():
    shapes = [(1024, 256), (256, 256), (512, 512), (64, 64), (512, 128)]
    owners = assign_owners([(f"w{i}", s, ns_flops(s)) for i, s in enumerate(shapes)], 2)
    # the costliest first, each to the least loaded rank
    # (512, 512) to rank 0; then (1024, 256), (256, 256), (512, 128), (64, 64) all to the less loaded rank 1
    assert [e.owner for e in owners.entries] == [1, 1, 0, 1, 1]
    text = str(owners)
    assert "w0" in text and "(1024, 256)" in text and "busiest / mean" in text
    assert owners.loads()[0] == ns_flops((512, 512)) == 5 * 6 * 512**3
    assert assign_owners([("a", (4, 4), 5), ("b", (4, 4), 5)], 4).loads() == [5, 5, 0, 0]


def _refusals():
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    plan = funcshard.plan(model, _mesh())
    state = funcshard.shard(plan)
    tx = optim.muon(plan=plan)
    msgs = []
    for bad in (state, {"0.weight": state["0.weight"], "nope": state["0.weight"]}):
        try:
            tx.init(bad)
        except (ValueError, TypeError) as e:
            msgs.append(str(e))
    return msgs


def test_non_matrix_refused_naming_path_and_fix():
    msgs = run_ranks(2, _refusals)[0]
    assert "'0.bias'" in msgs[0] and "multi_transform" in msgs[0]
    assert "not parameters of the plan" in msgs[1]
