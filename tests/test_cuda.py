"""CUDA checks (NCCL, one GPU): skipped without CUDA. Run on a GPU machine: python -m pytest -q -m cuda"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

import funcshard
from funcshard import optim
from models import GPT, GPTBlock
from multirank import run_ranks

pytestmark = pytest.mark.cuda


def _gpu_parity(mode):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    nccl = dist.new_group(backend="nccl")
    mesh = DeviceMesh.from_group(nccl, "cuda")
    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, heads=4, layers=4, seq=32).to(dev)
    ref = GPT(vocab=64, d=64, heads=4, layers=4, seq=32).to(dev)
    ref.load_state_dict(model.state_dict())
    plan = funcshard.plan(model, mesh, groups=(GPTBlock,))
    state = funcshard.shard(plan)
    assert all(v.is_cuda for v in state.values())
    tx = optim.adamw(lr=1e-3)
    opt_state = tx.init(state)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    for _ in range(5):
        x = torch.randint(0, 64, (8, 32), generator=g).to(dev)
        y = torch.randint(0, 64, (8, 32), generator=g).to(dev)

        def loss_fn(s):
            return F.cross_entropy(funcshard.apply(plan, s, x).flatten(0, 1), y.flatten())

        if mode == "torch.func":
            grads, loss = torch.func.grad_and_value(loss_fn)(state)
        else:
            loss, grads = funcshard.value_and_grad(loss_fn)(state)
        updates, opt_state = tx.update(grads, opt_state, state)
        state = optim.apply_updates(state, updates)
        ropt.zero_grad()
        rloss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        rloss.backward()
        ropt.step()
        losses.append((loss.item(), rloss.item()))
    full = funcshard.gather(plan, state)
    err = max((full[k] - v).abs().max().item() for k, v in ref.named_parameters() if k in full)
    dist.destroy_process_group(nccl)
    return losses, err


@pytest.mark.parametrize("mode", ["torch.func", "value_and_grad"])
def test_gpu_parity_nccl(mode):
    losses, err = run_ranks(1, _gpu_parity, mode)[0]
    for a, b in losses:
        assert abs(a - b) < 1e-4
    assert err < 1e-4
