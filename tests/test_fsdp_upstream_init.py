"""``fully_shard``'s input checks and managed modules where PyTorch's own FSDP2 init tests
(``../shared/upstream-fsdp2/tests/test_fully_shard_init.py``, issue 22) found funcshard's differing, each checked here
against torch's FSDP2 on the same input: a 2-D mesh without axis names and a non-contiguous parameter are refused
with FSDP2's exception types and texts (and funcshard leaves the module as it was); a module torch's composable
``replicate`` manages is not sharded by a ``fully_shard`` on its parent, and ``replicate`` sees the modules funcshard
shards (torch's composable-API registry), so the two compose as they do with FSDP2: the same losses and parameters
bit for bit. (In-process over torch's fake process group; the training runs on 2 gloo ranks, one ``multirank`` pool.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import funcshard.fsdp
from funcshard.cost import fake_mesh
from multirank import run_ranks

IMPLS = [pytest.param(torch_fsdp, id="FSDP2"), pytest.param(funcshard.fsdp, id="funcshard")]


@pytest.fixture
def fake_world4():
    """The default process group: torch's fake one over 4 ranks in this process (destroyed afterwards)."""
    fake_mesh(4)
    yield
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


def _untouched(module: nn.Module, cls: type, params: dict) -> bool:
    """``module`` is still of class ``cls``, holds the same parameter objects, and no composable API is recorded."""
    from funcshard._compat import composable_apis

    return (type(module) is cls and dict(module.named_parameters()) == params
            and not any(isinstance(p, DTensor) for p in params.values())
            and not any(composable_apis(m) for m in module.modules()))


class _MLP(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.inp, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


@pytest.mark.parametrize("impl", IMPLS)
def test_2d_mesh_without_axis_names_is_refused(fake_world4, impl):
    """FSDP2 asserts a 2-D (HSDP) mesh has axis names; funcshard raises the same text as an AssertionError that is also
    a ValueError (its FullyShardError), says how to build the mesh, and leaves the module as it was."""
    mesh = init_device_mesh("cpu", (2, 2))
    model = _MLP()
    params = dict(model.named_parameters())
    with pytest.raises(AssertionError, match="Please init the 2D mesh for HSDP with mesh_dim_names specified") as e:
        impl.fully_shard(model, mesh=mesh)
    if impl is funcshard.fsdp:
        assert isinstance(e.value, ValueError)
        assert "mesh_dim_names=('replicate', 'shard')" in str(e.value)
        assert _untouched(model, _MLP, params)
        named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        assert isinstance(impl.fully_shard(model, mesh=named).inp.weight, DTensor)


@pytest.mark.parametrize("impl", IMPLS)
def test_noncontiguous_parameter_is_refused(fake_mesh2, impl):
    """A channels_last Conv2d weight: FSDP2 raises NotImplementedError (its DTensor parameter could not keep the
    strides); funcshard raises it with FSDP2's text, naming the call, the parameter, its shape and stride and the fix,
    and leaves the module as it was; the fix (contiguous_format) then shards."""
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    params = dict(conv.named_parameters())
    with pytest.raises(NotImplementedError, match="FSDP does not support non-contiguous parameters") as e:
        impl.fully_shard(conv, mesh=fake_mesh2)
    if impl is funcshard.fsdp:
        assert (r"fully_shard(Conv2d): 'weight' has shape (8, 8, 3, 3) and stride (72, 1, 24, 8); make it contiguous "
                r"before fully_shard, e.g. module.to(memory_format=torch.contiguous_format)") in str(e.value)
        assert _untouched(conv, nn.Conv2d, params)
        conv.to(memory_format=torch.contiguous_format)
        assert isinstance(impl.fully_shard(conv, mesh=fake_mesh2).weight, DTensor)


def _replicated_first(impl, mesh) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(_MLP(), _MLP(), _MLP())
    replicate(model[0])
    impl.fully_shard(model[2], mesh=mesh)
    impl.fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_shard_leaves_replicate_modules_alone(fake_mesh2, impl):
    """``fully_shard`` on a parent manages neither a nested ``fully_shard`` module's parameters nor those of a module
    torch's ``replicate`` manages (FSDP2's managed modules): model[0]'s parameters stay replicate's plain parameters,
    the parent shards model[1]'s (funcshard sharded model[0]'s too, under replicate's feet)."""
    model = _replicated_first(impl, fake_mesh2)
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    assert sharded == [f"{i}.{m}.{k}" for i in (1, 2) for m in ("inp", "out") for k in ("bias", "weight")]
    assert type(model[0].inp.weight) is nn.Parameter


def test_fully_shard_on_a_replicate_module_is_refused(fake_mesh2):
    """funcshard refuses ``fully_shard`` on the very module ``replicate`` manages (replicate refuses the converse);
    FSDP2 accepts it and manages nothing there, leaving two data-parallel wrappers on one module (a deliberate
    difference)."""
    model = _MLP()
    replicate(model)
    with pytest.raises(RuntimeError, match=r"Cannot apply `fully_shard\(\)` on a Module already managed by "
                                           r"`replicate`: fully_shard\(DDP_MLP\); replicate already synchronizes "
                                           r"its parameters. Apply fully_shard to its parent"):
        funcshard.fsdp.fully_shard(model, mesh=fake_mesh2)
    assert type(model.inp.weight) is nn.Parameter and not isinstance(model, funcshard.fsdp.FSDPModule)


@pytest.mark.parametrize("impl", IMPLS)
def test_replicate_refuses_a_fully_shard_module(fake_mesh2, impl):
    """torch's ``replicate`` reads the composable-API registry: it refuses a module either ``fully_shard`` manages."""
    model = nn.Sequential(_MLP(), _MLP())
    impl.fully_shard(model[0], mesh=fake_mesh2)
    with pytest.raises(RuntimeError, match="Cannot apply `replicate\\(\\)` on a Module already managed by `fully_shard`"):
        replicate(model[0])


def _train(impl_name: str, form: str) -> tuple[list[float], list[torch.Tensor]]:
    """3 SGD steps of three MLPs where replicate and fully_shard share the model: ``replicate_child``: replicate(model[0]),
    fully_shard(model[2]), fully_shard(model); ``replicate_parent``: fully_shard(model[0]), replicate(model). Losses and
    the full parameters."""
    impl = funcshard.fsdp if impl_name == "funcshard" else torch_fsdp
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if form == "replicate_child":
        model = _replicated_first(impl, mesh)
    else:
        torch.manual_seed(0)
        model = nn.Sequential(_MLP(), _MLP(), _MLP())
        impl.fully_shard(model[0], mesh=mesh)
        replicate(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def _parity(form: str):
    return _train("torch", form), _train("funcshard", form)


@pytest.mark.parametrize("form", ["replicate_child", "replicate_parent"])
def test_replicate_and_fully_shard_compose_as_with_fsdp2(form):
    """Trained where replicate and fully_shard share one model (each rank its own batch): the losses and parameters
    equal FSDP2's bit for bit (each parameter synchronized once, by the API managing it)."""
    for (ref_losses, ref_params), (losses, params) in run_ranks(2, _parity, form):
        assert losses == ref_losses
        assert len(params) == len(ref_params)
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
