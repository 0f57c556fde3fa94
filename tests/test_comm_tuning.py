"""FSDP2 2.13's comm tuning on funcshard (issue 36): the K-deep reduce-scatter queue
(``set_reduce_scatter_max_input_buffers``, the plan's ``reduce_scatter_buffers``) and buffers from the process group's
allocator (``set_allocate_memory_from_process_group_for_comm``: NCCL's; a no-op on gloo).

The queue: up to K reduce-scatters in flight in backward, on both paths (``apply`` under plain autograd, through its
relays; ``fully_shard``), the same gradients bit for bit as K = 1 and as FSDP2 with the same K (torch 2.13; torch
2.11's FSDP2 lacks the method and those comparisons are skipped there), FSDP2's validation errors, the plan printout,
and the cost model's buffers (its peak against the runtime's measured one: ``tests/test_cost.py``'s variants). One
2-rank job for the runtime; the rest in this process on the fake process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import funcshard
import funcshard.cost as C
from funcshard import ShardingError
from funcshard._runtime.observe import LISTENERS
from funcshard._schedule import schedule
from multirank import run_ranks

K = 3
HAS_FSDP2_QUEUE = hasattr(torch_fsdp.FSDPModule, "set_reduce_scatter_max_input_buffers")  # torch 2.13+


class _Depth:
    """The most reduce-scatters in flight at once in a backward (the runtime's events)."""

    def __init__(self):
        self.live = self.most = 0

    def __call__(self, event, group, obj):
        if event == "reduce-scatter issued":
            self.live += 1
            self.most = max(self.most, self.live)
        elif event == "reduce-scatter done":
            self.live -= 1

    def __enter__(self):
        LISTENERS.append(self)
        return self

    def __exit__(self, *exc):
        LISTENERS.remove(self)


def _batch(i):
    g = torch.Generator().manual_seed(100 * i + dist.get_rank())
    return torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)


def _apply_grads(mesh, k):
    """``value_and_grad`` over ``apply`` (its relays): gradients of two steps (the second after an SGD update), the
    deepest queue seen; and of a block used twice, once under activation checkpointing, with a frozen weight
    (``test_apply``'s ``_SharedFrozen``: its group is reduce-scattered twice, and its relay sums both)."""
    from models import MLP, Block
    from test_apply import _SharedFrozen

    torch.manual_seed(0)
    shared = funcshard.plan(_SharedFrozen(), mesh, groups=(Block,), reduce_scatter_buffers=k)
    train = {n: v for n, v in funcshard.shard(shared).items() if shared.specs[n].requires_grad}
    frozen = {n: v for n, v in funcshard.shard(shared).items() if not shared.specs[n].requires_grad}
    x, y = _batch(7)
    _, twice = funcshard.value_and_grad(lambda t: F.mse_loss(funcshard.apply(shared, {**t, **frozen}, x), y))(train)
    plan = funcshard.plan(MLP(layers=4), mesh, groups=(Block,), reduce_scatter_buffers=k)
    state = funcshard.shard(plan)
    out = []
    with _Depth() as depth:
        for i in range(2):
            x, y = _batch(i)
            _, grads = funcshard.value_and_grad(lambda s: F.mse_loss(funcshard.apply(plan, s, x), y))(state)
            out.append(grads)
            state = {n: v - 0.1 * grads[n] for n, v in state.items()}
    return [twice, *out], depth.most


def _fsdp_train(fs, mesh, k, micro=2):
    """Nested ``fully_shard`` (4 blocks + root), ``set_reduce_scatter_max_input_buffers(k)`` where ``k`` is given,
    2 AdamW steps of ``micro`` microbatches with ``set_requires_gradient_sync`` (the last one syncs): the losses,
    the final full parameters, the deepest queue seen (funcshard)."""
    from models import MLP

    torch.manual_seed(0)
    model = MLP(layers=4)
    for b in model.blocks:
        fs.fully_shard(b, mesh=mesh)
    fs.fully_shard(model, mesh=mesh)
    if k is not None:
        model.set_reduce_scatter_max_input_buffers(k)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with _Depth() as depth:
        for s in range(2):
            for m in range(micro):
                model.set_requires_gradient_sync(m == micro - 1)
                x, y = _batch(10 * s + m)
                loss = F.mse_loss(model(x), y) / micro
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    return losses, [p.full_tensor() for p in model.parameters()], depth.most


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _errors(mesh):
    """FSDP2's validation on both systems: ``(text of ours, text of FSDP2's or None)`` per case."""
    from models import MLP

    out = {}

    def catch(fn):
        try:
            fn()
            return "no error"
        except Exception as e:  # noqa: BLE001 - the message is the point
            return f"{type(e).__name__}: {e}"

    systems = {"funcshard": funcshard}
    if HAS_FSDP2_QUEUE:
        systems["torch"] = torch_fsdp
    for key, fs in systems.items():
        m = fs.fully_shard(nn.Linear(16, 16), mesh=mesh)
        for case, value in (("zero", 0), ("float", 2.5), ("bool", True)):
            out.setdefault(case, {})[key] = catch(lambda: m.set_reduce_scatter_max_input_buffers(value))
        # the process-group allocator and custom comms (FSDP2's upstream test_exception_when_used_together_...)
        from unittest.mock import MagicMock

        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

        m = fs.fully_shard(nn.Linear(16, 16), mesh=mesh)
        out.setdefault("alloc_then_custom", {})[key] = catch(
            lambda: (m.set_allocate_memory_from_process_group_for_comm(True),
                     m.set_custom_all_gather(MagicMock(spec=AllGather))))
        out.setdefault("alloc_after_custom", {})[key] = catch(
            lambda: m.set_allocate_memory_from_process_group_for_comm(True))
    # the symmetric-memory reduce-scatter with K > 1: refused at the first forward (FSDP2's lazy initialization)
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    symm = getattr(_fsdp_collectives, "SymmMemReduceScatter", None)
    if symm is not None:
        m = MLP(layers=1)
        funcshard.fully_shard(m.blocks[0], mesh=mesh)
        funcshard.fully_shard(m, mesh=mesh)
        m.blocks[0].set_custom_reduce_scatter(object.__new__(symm))  # (its __init__ needs NCCL: never called here)
        m.set_reduce_scatter_max_input_buffers(2)
        out["symm_mem"] = {"funcshard": catch(lambda: m(torch.randn(2, 7)))}
    # gloo offers no allocator: the setting changes nothing (the plan's group keeps torch's collectives)
    m = funcshard.fully_shard(nn.Linear(4, 4), mesh=mesh)
    m.set_allocate_memory_from_process_group_for_comm(True)
    m(torch.randn(2, 4)).sum().backward()
    out["gloo_comm"] = str(m._get_fsdp_state()._unit.ctx.plan().groups[0].comm)
    return out


def _job():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    (g1, most1), (gk, mostk) = _apply_grads(mesh, 1), _apply_grads(mesh, K)
    apply_same = all(g1[i].keys() == gk[i].keys() and all(torch.equal(g1[i][n], gk[i][n]) for n in g1[i])
                     for i in range(3))
    ours1, oursk = _fsdp_train(funcshard, mesh, None), _fsdp_train(funcshard, mesh, K)
    out = {"apply": (apply_same, most1, mostk),
           "fsdp": (ours1[0] == oursk[0] and _same(ours1[1], oursk[1]), ours1[2], oursk[2])}
    if HAS_FSDP2_QUEUE:
        theirs = _fsdp_train(torch_fsdp, mesh, K)
        out["vs_fsdp2"] = (theirs[0] == oursk[0], _same(theirs[1], oursk[1]))
    out["errors"] = _errors(mesh)
    return out


ERRORS = {
    "zero": r"ValueError: max_input_buffers must be a positive int, got 0",
    "float": r"TypeError: max_input_buffers must be an int, got float",
    "bool": r"TypeError: max_input_buffers must be an int, got bool",
    "alloc_then_custom": r"no error",
    "alloc_after_custom": r"AssertionError: cannot call set_allocate_memory_from_process_group\(\) when all gather "
                          r"comm is custom: AllGather",
    "symm_mem": r"ValueError: set_reduce_scatter_max_input_buffers\(>1\) is not supported with the symmetric-memory "
                r"reduce-scatter comm, but got 2 for module 'blocks.0' using SymmMemReduceScatter. Keep "
                r"max_input_buffers=1 with symmetric memory, or use the default reduce-scatter comm.",
}


def test_reduce_scatter_queue_keeps_k_in_flight_with_the_same_results():
    """K in flight on both paths; the gradients bit for bit those of K = 1 (and FSDP2's with the same K); FSDP2's
    validation errors, word for word where FSDP2 (2.13) raises them; the allocator setting a no-op on gloo."""
    for res in run_ranks(2, _job):
        same, most1, mostk = res["apply"]
        assert same and (most1, mostk) == (1, K)
        same, most1, mostk = res["fsdp"]
        assert same and (most1, mostk) == (1, K)
        if HAS_FSDP2_QUEUE:
            assert res["vs_fsdp2"] == (True, True)
        errors = res["errors"]
        assert errors.pop("gloo_comm") == "None"
        assert errors.keys() <= ERRORS.keys() and {"zero", "float", "bool", "alloc_after_custom"} <= errors.keys()
        for case, texts in errors.items():
            with pytest.raises(AssertionError, match=ERRORS[case]):  # pin the text
                raise AssertionError(texts["funcshard"])
            if "torch" in texts:  # FSDP2's own words
                assert texts["torch"] == texts["funcshard"], case


# ---- one process: the plan field, its printout, the cost model ------------------------------------------------


def test_the_plan_field_its_printout_and_the_cost_models_buffers(fake_mesh2):
    from models import MLP, Block

    model = MLP(d_in=32, d=32, layers=4)
    plan = funcshard.plan(model, fake_mesh2, groups=(Block,), prefetch=0,
                          reduce_scatter_buffers=K)  # (no prefetch: no all-gather in flight beside the queue)
    assert plan.reduce_scatter_buffers == K and "; reduce-scatters in flight up to 3" in str(plan).splitlines()[0]
    assert "in flight" not in str(plan.replace(reduce_scatter_buffers=1)).splitlines()[0]
    hsdp = funcshard.plan(model, init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")),
                          groups=(Block,), reduce_scatter_buffers=K)
    assert str(hsdp).splitlines()[0].endswith("; reduce-scatters in flight up to 1 (reduce_scatter_buffers=3; HSDP: "
                                              "each all-reduce follows its reduce-scatter)")
    for bad in (0, True, 1.5):
        with pytest.raises(ShardingError, match=rf"reduce_scatter_buffers must be an int >= 1 .*, got {bad!r}"):
            plan.replace(reduce_scatter_buffers=bad)
    # the schedule's collectives do not change; the cost model keeps K reduce-scatters' buffers in flight
    base = plan.replace(reduce_scatter_buffers=1)
    assert base.collective_order() == plan.collective_order()
    x = torch.randn(8, 32)
    loss = lambda out: out.square().sum()  # noqa: E731
    traced: dict = {}  # (one traced step serves both plans)
    one, deep = C.estimate(base, x, loss=loss, profiles=traced), C.estimate(plan, x, loss=loss, profiles=traced)
    assert [c for c in one.collectives] == [c for c in deep.collectives]
    rs, = (c for op in schedule(plan).ops if op.kind == "reduce-scatter" and op.group == "blocks.0"
           for c in op.collectives)  # a block's: its input (the padded unsharded gradients) and its output
    most = lambda est: max(p.bytes["comm_buffers"] for p in est.points)  # noqa: E731
    assert most(deep) - most(one) == (K - 1) * (rs.nbytes + rs.nbytes // plan.world)  # K - 1 more inputs and outputs
    assert deep.peak_bytes > one.peak_bytes
