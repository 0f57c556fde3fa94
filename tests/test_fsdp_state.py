"""``fully_shard.state(module)``: FSDP2's per-call state object, as its users and its own tests read it (is-root,
the states under a root, module and parameter paths, lazy initialization), and the type of the error for a second
``fully_shard`` on one module. Found by running pytorch's FSDP2 tests against funcshard (issue 22)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

import funcshard
from models import MLP, Block
from multirank import run_ranks
from test_fsdp import _local, _mesh


def _two_mlps():
    """FSDP(Sequential(0: MLP(FSDP(inp), FSDP(out)), 1: MLP)): the root takes model[1] and model[0]'s blocks."""
    model = nn.Sequential(MLP(layers=1), MLP(d_in=3, layers=1))
    funcshard.fully_shard(model[0].inp, mesh=_mesh())
    funcshard.fully_shard(model[0].out, mesh=_mesh())
    funcshard.fully_shard(model, mesh=_mesh())
    return model


def _states():
    model = _two_mlps()
    state = funcshard.fully_shard.state
    root, inp, out = state(model), state(model[0].inp), state(model[0].out)
    before = (root._is_root, inp._is_root)
    root._lazy_init()
    group = root._fsdp_param_group
    facts = {
        "before": before,
        "is_root": (root._is_root, inp._is_root, out._is_root),
        "all_states": root._state_ctx.all_states == [root, inp, out],
        "distinct": len({id(root), id(inp), id(out), id(state(model))}) == 3,
        "plain_module": state(model[1]) is None,
        "method": model._get_fsdp_state() is root,
        "root_group": (group._module_fqn, sorted(p._param_fqn for p in group.fsdp_params)),
        "inp_group": (inp._fsdp_param_group._module_fqn, sorted(p._param_fqn for p in inp._fsdp_param_group.fsdp_params)),
    }
    # lazy initialization of a nested unit first, then of the root: refused as FSDP2 does
    model = _two_mlps()
    state(model[0].inp)._lazy_init()
    try:
        state(model)._lazy_init()
        facts["double"] = "no error"
    except RuntimeError as e:
        facts["double"] = str(e)
    # a grouped outermost call: no single root
    model = nn.Sequential(Block(4), Block(4))
    funcshard.fully_shard([model[0], model[1]], mesh=_mesh())
    try:
        state(model[0])._lazy_init()
        facts["multi_root"] = "no error"
    except RuntimeError as e:
        facts["multi_root"] = str(e)
    facts["grouped_share"] = state(model[0]) is state(model[1])
    # training still works after an explicit lazy init
    model = _two_mlps()
    state(model)._lazy_init()
    import torch

    model(torch.randn(2, 7)).sum().backward()
    facts["trains"] = all(p.grad is not None for p in model.parameters())
    return facts


def test_fully_shard_state():
    facts = run_ranks(2, _states)[0]
    assert facts["before"] == (None, None)
    assert facts["is_root"] == (True, False, False)
    assert facts["all_states"] and facts["distinct"] and facts["plain_module"] and facts["method"]
    mlp1 = [f"1.{m}.{k}" for m in ("blocks.0.l1", "blocks.0.l2", "inp", "out") for k in ("bias", "weight")]
    mlp0_blocks = [f"0.blocks.0.{m}.{k}" for m in ("l1", "l2") for k in ("bias", "weight")]
    assert facts["root_group"] == ("", sorted(mlp0_blocks + mlp1))
    assert facts["inp_group"] == ("0.inp", ["0.inp.bias", "0.inp.weight"])
    assert facts["double"] == ("FSDP state has already been lazily initialized for 0.inp\n"
                               "FSDP requires running forward through the root module first")
    assert facts["multi_root"].startswith("FSDP requires a single root module but got the modules [Block, Block]")
    assert facts["grouped_share"] and facts["trains"]


def _fsdp2_style_errors():
    """Code written for FSDP2 catches AssertionError with FSDP2's text; funcshard's ValueErrors are both."""
    from torch.distributed.tensor import Shard

    out = {}
    model = funcshard.fully_shard(MLP(), mesh=_mesh())
    for name, fn in {"twice": lambda: funcshard.fully_shard(model, mesh=_mesh()),
                     "bad_dim": lambda: funcshard.fully_shard(nn.Sequential(nn.Linear(16, 16)), mesh=_mesh(),
                                                              shard_placement_fn=lambda p: Shard(1))}.items():
        try:
            fn()
            out[name] = "no error"
        except AssertionError as e:
            out[name] = (isinstance(e, ValueError), str(e))
    return out


def test_fully_shard_input_errors_are_value_and_assertion_errors():
    out = run_ranks(2, _fsdp2_style_errors)[0]
    assert out["twice"][0] and "Each distinct composable distributed API can only be applied to a module once." in (
        out["twice"][1])
    assert out["bad_dim"][0] and "Shard dim 1 is invalid for 1D tensor" in out["bad_dim"][1]


class _NormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def forward(self, x):
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


def _replaced_before_first_forward(fs):
    """Built on meta, sharded, materialised with ``to_empty``, then a parameter replaced by one computed from the
    sharded ones (a DTensor): the first forward takes the new parameter (FSDP2 resets it at lazy init)."""
    with torch.device("meta"):
        model = _NormModel()
    fs.fully_shard(model.layer1, mesh=_mesh())
    fs.fully_shard(model.layer2, mesh=_mesh())
    fs.fully_shard(model, mesh=_mesh())
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in (model.layer1.weight, model.layer2.weight):
            p.to_local().copy_(torch.randn(p.to_local().shape))
        model.weight_norm = nn.Parameter(torch.linalg.norm(model.layer1.weight, dim=1)
                                         + torch.linalg.norm(model.layer2.weight, dim=1))
    loss = model(torch.ones(3, 3))
    loss.backward()
    return loss.item(), [_local(p.grad) for p in model.parameters()]


def _replaced_both():
    return _replaced_before_first_forward(torch_fsdp), _replaced_before_first_forward(funcshard)


def test_parameter_replaced_before_the_first_forward_is_resharded():
    for (ref_loss, ref_grads), (loss, grads) in run_ranks(2, _replaced_both):
        assert loss == ref_loss and all(torch.equal(a, b) for a, b in zip(ref_grads, grads))
