"""What ``model.parameters()`` are between forward and backward, as FSDP2 registers them: a group left gathered after
its forward (``reshard_after_forward=False``; the root under the default ``None``) shows its unsharded parameters as
plain tensors until it is resharded (after backward, or ``reshard()``); every other group shows its sharded DTensors.
Compared with torch's FSDP2 on the same model (found by pytorch's FSDP2 tests, issue 22)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import funcshard
from multirank import run_ranks
from test_fsdp import _local, _mesh


def _kinds(model):
    return tuple("D" if isinstance(p, DTensor) else "T" for p in model.parameters())


def _registration(fs, rsf):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3), nn.Linear(3, 3))
    full = {k: p.detach().clone() for k, p in model.named_parameters()}
    fs.fully_shard(model[0], mesh=_mesh(), reshard_after_forward=rsf)
    fs.fully_shard(model[2], mesh=_mesh(), reshard_after_forward=rsf)
    fs.fully_shard(model, mesh=_mesh(), reshard_after_forward=rsf)
    out = model(torch.randn(2, 3))
    after_forward = _kinds(model)
    values = all(torch.equal(_local(p), full[k]) for k, p in model.named_parameters())
    out.sum().backward()
    after_backward = _kinds(model)
    model(torch.randn(2, 3))
    for m in model.modules():
        if isinstance(m, fs.FSDPModule):
            m.reshard()
    after_reshard = _kinds(model)
    return after_forward, values, after_backward, after_reshard


def _both(rsf):
    return _registration(torch_fsdp, rsf), _registration(funcshard, rsf)


@pytest.mark.parametrize("rsf", [True, False, None, 2])
def test_parameters_registered_as_fsdp2_registers_them(rsf):
    for ref, got in run_ranks(2, _both, rsf):
        assert got == ref, (got, ref)
        assert got[1] and got[2] == got[3] == ("D",) * 6
    if rsf is False:
        assert got[0] == ("T",) * 6
    if rsf is None:
        assert got[0] == ("D", "D", "D", "D", "T", "T")  # only the root (model[3]) stays gathered
