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


# ---- CPU offload (issue 19): the copies, their streams, placement and memory. Not yet run on a GPU ----------------


def _gpt_steps(model, dev, opt, steps=3):
    g = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 64, (8, 32), generator=g).to(dev)
        y = torch.randint(0, 64, (8, 32), generator=g).to(dev)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        place = {(p.device.type, p.to_local().is_pinned(), p.grad.device.type, p.grad.to_local().is_pinned())
                 for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, place


def _offload_fully_shard(mesh, dev, fs, offload):
    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, heads=4, layers=4, seq=32)  # on the host: offloaded shards stay there
    kw = {"offload_policy": fs.CPUOffloadPolicy(pin_memory=True)} if offload else {}
    for b in model.blocks:
        fs.fully_shard(b, mesh=mesh, **kw)
    fs.fully_shard(model, mesh=mesh, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses, place = _gpt_steps(model, dev, opt)
    return losses, place, torch.cuda.max_memory_allocated(), {n: p.to_local().cpu() for n, p in
                                                              model.named_parameters()}


def _offload_gpu():
    import torch.distributed.fsdp as torch_fsdp

    import funcshard._offload as off

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    nccl = dist.new_group(backend="nccl")
    mesh = DeviceMesh.from_group(nccl, "cuda")
    out = {}
    # fully_shard: funcshard's offload vs FSDP2's (pinned), and vs no offload
    out["fs"] = _offload_fully_shard(mesh, dev, funcshard, True)
    out["torch"] = _offload_fully_shard(mesh, dev, torch_fsdp, True)
    out["plain"] = _offload_fully_shard(mesh, dev, funcshard, False)
    # the functional path: host shards in, host gradients out, the same gradients as without offload
    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, heads=4, layers=4, seq=32).to(dev)
    plain = funcshard.plan(model, mesh, groups=(GPTBlock,))
    offloaded = funcshard.plan(model, mesh, groups=(GPTBlock,), offload_policy=funcshard.CPUOffloadPolicy())
    x = torch.randint(0, 64, (8, 32), device=dev)
    grads = {}
    for key, plan in (("plain", plain), ("offload", offloaded)):
        state = funcshard.shard(plan)

        def loss_fn(s, plan=plan):
            return F.cross_entropy(funcshard.apply(plan, s, x).flatten(0, 1), x.flatten())

        _, grads[key] = funcshard.value_and_grad(loss_fn)(state)
        grads[key + "_func"] = torch.func.grad(loss_fn)(state)
        if key == "offload":
            out["state"] = {(v.device.type, v.is_pinned()) for v in state.values()}
    out["grads_equal"] = all(torch.equal(grads["offload"][k], grads["plain"][k].cpu()) and
                             torch.equal(grads["offload_func"][k], grads["plain_func"][k].cpu())
                             for k in grads["plain"])
    out["grads_place"] = {(g.device.type, g.is_pinned()) for g in grads["offload"].values()}
    # optim.offload: moments on the host, stepped on the device group by group, bit for bit with the plain step
    state = funcshard.shard(plain)
    tx, otx = optim.adamw(lr=1e-3), optim.offload(optim.adamw(lr=1e-3), plain)
    p1, s1 = optim.step(tx, grads["plain"], tx.init(state), state)
    os0 = otx.init(state)
    out["moments"] = {(t.device.type, t.is_pinned()) for s in os0.groups.values() for t in s[0].mu.values()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        p2, s2 = optim.step(otx, grads["plain"], os0, state)
        torch.cuda.synchronize()
    out["optim_equal"] = all(torch.equal(p1[k], p2[k]) for k in p1) and all(
        torch.equal(s1[0].mu[k].cpu(), s2.groups[g][0].mu[k]) for g in s2.groups for k in s2.groups[g][0].mu)
    cuda = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    host_copies = ("Memcpy HtoD", "Memcpy DtoH")
    copies = {e.device_resource_id for e in cuda if e.name.startswith(host_copies)}
    compute = {e.device_resource_id for e in cuda if not e.name.startswith((*host_copies, "Memset"))}
    out["streams"] = (copies, compute, dev in off._STREAMS)
    dist.destroy_process_group(nccl)
    return out


def test_cpu_offload_on_gpu():
    r = run_ranks(1, _offload_gpu)[0]
    (l_fs, place_fs, peak_fs, p_fs), (l_t, place_t, _, p_t), (l_plain, _, peak_plain, p_plain) = (
        r["fs"], r["torch"], r["plain"])
    assert place_fs == place_t == {("cpu", True, "cpu", True)}  # FSDP2's placement: host, pinned, gradients too
    assert max(abs(a - b) for a, b in zip(l_fs, l_t)) < 1e-5 and max(abs(a - b) for a, b in zip(l_fs, l_plain)) < 1e-4
    assert all((p_fs[k] - p_t[k]).abs().max() < 1e-5 for k in p_t)
    assert peak_fs < peak_plain  # shards, gradients and moments off the device
    assert r["state"] == {("cpu", True)} and r["grads_place"] == {("cpu", True)} and r["grads_equal"]
    assert r["moments"] == {("cpu", True)} and r["optim_equal"]
    copies, compute, made = r["streams"]
    assert made and copies and not copies & compute  # the state copies ran on the copy stream, beside the step


# ---- set_allocate_memory_from_process_group_for_comm (issue 36): NCCL's allocator -------------------------------


def _group_allocated_gpu():
    from funcshard._comm import GroupAllocated
    from funcshard._compat import group_allocator

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    nccl = dist.new_group(backend="nccl", device_id=dev)
    mesh = DeviceMesh.from_group(nccl, "cuda")
    backend = group_allocator(nccl, dev)
    # FSDP2's condition (ProcessGroupAllocMixin): the backend says it allocates (NCCL >= 2.19 with its allocator
    # built in; torch 2.11+cu130's NCCL 2.28.9 on the H200 here says no: "NCCL mem allocator is not supported")
    out = {"allocator": backend is not None, "supports": nccl._get_backend(dev).supports_tensor_alloc(dev)}
    if backend is not None:  # the comm FSDP2's ProcessGroupAlloc* comms are: its buffers, torch's collectives
        comm = funcshard._comm.group_allocated(backend)
        buf = comm.all_gather.allocate((16,), dtype=torch.float32, device=dev)
        inp = torch.arange(16.0, device=dev)
        comm.all_gather(output_tensor=buf, input_tensor=inp, group=nccl, async_op=True).wait()
        rs = comm.reduce_scatter.allocate((16,), dtype=torch.float32, device=dev)
        comm.reduce_scatter(output_tensor=rs, input_tensor=inp, group=nccl, async_op=True).wait()
        out["collectives"] = buf.is_cuda and torch.equal(buf, inp) and torch.equal(rs, inp)
    # fully_shard with it: the units' groups run on it, the same losses and parameters bit for bit
    runs = {}
    for enable in (False, True):
        torch.manual_seed(0)
        model = GPT(vocab=64, d=64, heads=4, layers=2, seq=32).to(dev)
        for b in model.blocks:
            funcshard.fully_shard(b, mesh=mesh)
            b.set_allocate_memory_from_process_group_for_comm(enable)
        funcshard.fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, _ = _gpt_steps(model, dev, opt, steps=2)
        plan = model._get_fsdp_state()._unit.ctx.plan()
        runs[enable] = (losses, [p.full_tensor().cpu() for p in model.parameters()],
                        sorted({isinstance(g.comm.all_gather, GroupAllocated) for g in plan.groups if g.comm}))
    out["same"] = runs[False][0] == runs[True][0] and all(torch.equal(a, b) for a, b in zip(runs[False][1],
                                                                                            runs[True][1]))
    out["comms"] = (runs[False][2], runs[True][2])
    dist.destroy_process_group(nccl)
    return out


def test_allocate_memory_from_process_group_on_nccl():
    """Where NCCL offers an allocator the setting makes the units' buffers come from it (FSDP2's ProcessGroupAlloc
    comms), with the same results; where it does not (this NCCL build) it is a no-op, as FSDP2's falls back to
    torch's allocator. One GPU: a 1-rank group runs no collective in a step, so the step's own buffers come from
    torch's allocator there; the comm's allocate and collectives are run directly."""
    r = run_ranks(1, _group_allocated_gpu)[0]
    assert r["allocator"] == r["supports"] and r["same"]
    if r["supports"]:
        assert r["collectives"] and r["comms"] == ([], [True])
    else:
        assert r["comms"] == ([], [])
