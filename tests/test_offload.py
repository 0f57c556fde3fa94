"""CPU offload (issue 19): FSDP2's CPUOffloadPolicy on fully_shard and, per group, on plan; optim.offload (optimizer
state on the host, stepped on the device group by group).

This machine has no GPU: the host is the device, so what is tested here is placement (where every shard, gradient
and optimizer state lives, as FSDP2 reports it), the pinning requests (recorded: torch's CPU build cannot pin), bit
for bit parity with the run without offload and with torch's FSDP2 under the same policy, and bad input. The copies
and their overlap are in tests/test_cuda.py (marker ``cuda``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F

import funcshard
import funcshard._offload as offload_mod
from funcshard import optim
from models import GPT, MLP, Block
from multirank import run_ranks
from test_fsdp import _fit, _gpt_batch, _gpt_loss, _local, _mesh, _nested

NO_PIN = {"torch": torch_fsdp.CPUOffloadPolicy(pin_memory=False),
          "funcshard": funcshard.CPUOffloadPolicy(pin_memory=False)}
SYSTEMS = {"torch": torch_fsdp, "funcshard": funcshard}


# ---- fully_shard: parity with FSDP2's CPUOffloadPolicy and with no offload ----------------------------------------


def _scenario(name, system, offload):
    fs = SYSTEMS[system]
    kw = {"offload_policy": NO_PIN[system]} if offload else {}
    torch.manual_seed(0)
    if name == "mlp":
        model = _nested(fs, MLP(layers=3), _mesh(), **kw)
        return model, _fit(model, steps=3)
    if name == "bf16":
        mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = _nested(fs, MLP(layers=3), _mesh(), mp_policy=mp, **kw)
        return model, _fit(model, steps=3, loss=lambda p, y: F.mse_loss(p.float(), y))
    if name == "no_sync":
        model = _nested(fs, MLP(layers=2), _mesh(), **kw)
        return model, _fit(model, steps=3, micro=3, each=lambda m, s, k: m.set_requires_gradient_sync(k == 2))
    if name == "clip_tied":
        model = _nested(fs, GPT(vocab=32, d=16, heads=2, layers=2, seq=8, tied=True), _mesh(), **kw)
        return model, _fit(model, steps=2, batch=_gpt_batch, loss=_gpt_loss, clip=0.05)
    raise KeyError(name)


def _placement(model):
    """Where each parameter, its local shard and its gradient live, as the module reports them."""
    return {n: (str(p.device), str(_local_of(p).device), None if p.grad is None else str(p.grad.device),
                _local_of(p).is_pinned()) for n, p in model.named_parameters()}


def _local_of(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _fully_shard_parity(names):
    out = {}
    for name in names:
        ref_model, (n_ref, s_ref) = _scenario(name, "torch", offload=True)
        got_model, (n_got, s_got) = _scenario(name, "funcshard", offload=True)
        _, (n_plain, s_plain) = _scenario(name, "funcshard", offload=False)
        x = torch.randn(2, 7) if name != "clip_tied" else _gpt_batch(99)[0]
        for m in (ref_model, got_model):  # gradients present: their placement too
            m(x).float().sum().backward()
        out[name] = (n_got == n_ref, all(torch.equal(s_got[k], s_ref[k]) for k in s_ref),
                     n_got == n_plain, all(torch.equal(s_got[k], s_plain[k]) for k in s_plain),
                     _placement(got_model), _placement(ref_model))
    return out


def test_fully_shard_offload_matches_fsdp2_and_no_offload_bit_for_bit():
    for res in run_ranks(2, _fully_shard_parity, ["mlp", "bf16", "no_sync", "clip_tied"]):
        for name, (same_numbers, same_params, as_plain, as_plain_params, got, ref) in res.items():
            assert same_numbers and same_params, name  # vs torch's FSDP2 with CPUOffloadPolicy(pin_memory=False)
            assert as_plain and as_plain_params, name  # vs funcshard without offload
            assert got == ref, (name, got, ref)  # parameters, local shards and gradients where FSDP2 has them
            assert {v[:3] for v in got.values()} == {("cpu", "cpu", "cpu")}, name


# ---- the functional path: plan(offload_policy=...), per group --------------------------------------------------


def _functional(world_offload: bool):
    mesh = _mesh()
    pol = funcshard.CPUOffloadPolicy(pin_memory=False)
    torch.manual_seed(0)
    model = MLP(layers=3)
    plain = funcshard.plan(model, mesh, groups=(Block,))
    offloaded = (funcshard.plan(model, mesh, groups=(Block,), offload_policy=pol) if world_offload
                 else plain.with_group("blocks.1", offload_policy=pol))
    tx = optim.adamw(lr=1e-2)
    runs = {}
    for key, plan in (("plain", plain), ("offload", offloaded)):
        state = funcshard.shard(plan)
        opt_state = tx.init(state)
        losses = []
        for s in range(4):
            g = torch.Generator().manual_seed(100 * s + dist.get_rank())
            x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)

            def loss_fn(st):
                return F.mse_loss(funcshard.apply(plan, st, x), y)

            if s == 3:  # the torch.func path (one whole-step gather) too
                grads, loss = torch.func.grad_and_value(loss_fn)(state)
            else:
                loss, grads = funcshard.value_and_grad(loss_fn)(state)
            state, opt_state = optim.step(tx, grads, opt_state, state)
            losses.append(loss.item())
        devices = {k: (str(state[k].device), str(grads[k].device), str(opt_state[0].mu[k].device)) for k in state}
        runs[key] = (losses, funcshard.gather(plan, state), devices)
    (l_p, full_p, _), (l_o, full_o, devices) = runs["plain"], runs["offload"]
    printed = [line for line in str(offloaded).splitlines() if line.startswith("  group ")]
    return (l_p == l_o, all(torch.equal(full_p[k], full_o[k]) for k in full_p), devices,
            sorted(offload_mod.host_keys(offloaded)), printed)


@pytest.mark.parametrize("whole", [True, False], ids=["plan", "with_group"])
def test_functional_offload_matches_no_offload_bit_for_bit(whole):
    for same_losses, same_params, devices, host, printed in run_ranks(2, _functional, whole):
        assert same_losses and same_params
        assert set(devices.values()) == {("cpu", "cpu", "cpu")}  # shards, gradients, moments on the host
        if whole:
            assert len(host) == 16 and all("offload=cpu" in line for line in printed)
        else:
            assert host == ["blocks.1.l1.bias", "blocks.1.l1.weight", "blocks.1.l2.bias", "blocks.1.l2.weight"]
            assert [("offload=cpu" in line) for line in printed] == [False, False, True, False]


# ---- pinning requests (recorded: torch's CPU build cannot pin) --------------------------------------------------


@pytest.fixture
def pins(monkeypatch):
    """Every tensor funcshard asks to pin, in order (``_offload.pin`` records instead of pinning; ``can_pin`` says
    yes, as on a machine with an accelerator)."""
    seen: list[torch.Tensor] = []

    def record(t):
        seen.append(t)
        return t

    monkeypatch.setattr(offload_mod, "can_pin", lambda: True)
    monkeypatch.setattr(offload_mod, "pin", record)
    return seen


def _ptrs(ts):
    return {t.untyped_storage().data_ptr() for t in ts}


def test_pinning_requests_fully_shard(fake_mesh2, pins):
    torch.manual_seed(0)
    model = _nested(funcshard, MLP(layers=2), fake_mesh2, offload_policy=funcshard.CPUOffloadPolicy())
    params = list(model.parameters())
    assert len(pins) == len(params) == 12  # every sharded parameter once, at fully_shard (FSDP2: FSDPParam init)
    assert _ptrs(p.to_local() for p in params) == _ptrs(pins)
    assert all(p.device.type == "cpu" for p in params)
    del pins[:]
    model.to_empty(device="cpu")  # new local tensors: pinned again (FSDP2: reset_sharded_param)
    assert len(pins) == 12 and _ptrs(p.to_local() for p in model.parameters()) == _ptrs(pins)
    del pins[:]
    model.to(torch.float32)  # nothing replaced: nothing pinned
    assert pins == []


def test_pinning_requests_plan_and_optim(fake_mesh2, pins):
    torch.manual_seed(0)
    plan = funcshard.plan(MLP(layers=2), fake_mesh2, groups=(Block,)).with_group(
        "blocks.0", offload_policy=funcshard.CPUOffloadPolicy())
    assert "offload=cpu, pinned" in str(plan)
    state = funcshard.shard(plan)
    host = [k for k in state if k.startswith("blocks.0.")]
    assert _ptrs(pins) == _ptrs(state[k] for k in host) and len(pins) == 4  # that group only
    funcshard.check_state(plan, state)
    del pins[:]
    groups = [[k for k in state if k.startswith(p)] for p in ("blocks.0.", "blocks.1.", "inp.", "out.")]
    opt_state = optim.offload(optim.adamw(), groups).init(state)
    moments = [t for s in opt_state.groups.values() for d in (s[0].mu, s[0].nu) for t in d.values()]
    assert len(pins) == len(moments) == 2 * len(state) and _ptrs(pins) == _ptrs(moments)


# ---- optim.offload: the state on the host, stepped group by group -----------------------------------------------


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"{n}.{k}": torch.randn(*shape, generator=g) for n in ("a", "b", "c")
            for k, shape in (("w", (5, 3)), ("b", (3,)))}


GROUPS = [["a.w", "a.b"], ["b.w", "b.b", "c.w"], ["c.b"]]


@pytest.mark.parametrize("form", ["update", "step", "step_donate", "chain_clip"])
def test_optim_offload_bit_for_bit(form):
    inner = optim.adamw(lr=0.1, weight_decay=0.1)
    if form == "chain_clip":
        tx = optim.chain(optim.clip_by_global_norm(0.5), inner)
        off = optim.chain(optim.clip_by_global_norm(0.5), optim.offload(inner, GROUPS, pin_memory=False))
    else:
        tx, off = inner, optim.offload(inner, GROUPS, pin_memory=False)
    runs = []
    for t in (tx, off):
        params = _params()
        state = t.init(params)
        for s in range(4):
            grads = {k: v * 0.1 + s for k, v in _params(s + 1).items()}
            if form == "update" or form == "chain_clip":
                updates, state = t.update(grads, state, params)
                params = optim.apply_updates(params, updates)
            else:
                params, state = optim.step(t, grads, state, params, donate=form == "step_donate")
        runs.append((params, state))
    (p_ref, _), (p_off, s_off) = runs
    assert all(torch.equal(p_ref[k], p_off[k]) for k in p_ref)
    inner_state = s_off[1] if form == "chain_clip" else s_off
    assert isinstance(inner_state, optim.OffloadState) and sorted(inner_state.groups) == ["0", "1", "2"]
    leaves = [t for s in inner_state.groups.values() for d in (s[0].mu, s[0].nu) for t in d.values()]
    assert len(leaves) == 12 and all(t.device.type == "cpu" for t in leaves)
    assert sorted(inner_state.groups["1"][0].mu) == ["b.b", "b.w", "c.w"]


def test_optim_offload_bad_input():
    with pytest.raises(ValueError, match=r"optim.offload: tx reads every parameter's gradient at once "
                                         r"\(clip_by_global_norm\).*chain\(clip_by_global_norm\(...\), offload"):
        optim.offload(optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1)), GROUPS, pin_memory=False)
    with pytest.raises(ValueError, match=r"parameter 'a.w' is in two groups \(0 and 1\)"):
        optim.offload(optim.sgd(0.1), [["a.w"], ["a.w"]], pin_memory=False)
    with pytest.raises(TypeError, match=r"groups must be a Plan or a sequence of sequences"):
        optim.offload(optim.sgd(0.1), "a.w", pin_memory=False)
    tx = optim.offload(optim.sgd(0.1), GROUPS[:2], pin_memory=False)
    with pytest.raises(ValueError, match=r"params keys differ from the groups': in no group: \['c.b'\]"):
        tx.init(_params())
    tx = optim.offload(optim.sgd(0.1), GROUPS, pin_memory=False)
    params = _params()
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"updates keys differ from the groups': missing: \['a.b'\]"):
        tx.update({k: v for k, v in params.items() if k != "a.b"}, state, params)
    with pytest.raises(ValueError, match=r"expected the OffloadState this optimizer's init\(\) returned"):
        tx.update(params, optim.sgd(0.1).init(params), params)
    if not offload_mod.can_pin():
        with pytest.raises(RuntimeError, match=r"optim.offload: offload\(..., pin_memory=True\) needs pinned host "
                                               r"memory, which needs an accelerator.*pin_memory=False\)"):
            optim.offload(optim.sgd(0.1), GROUPS)


# ---- bad input: clear errors, the module untouched ---------------------------------------------------------------


def test_bad_offload_input_leaves_the_module_untouched(fake_mesh2):
    torch.manual_seed(0)
    model = MLP(layers=2)
    before = {k: (v, v.clone()) for k, v in model.named_parameters()}

    def untouched():
        return type(model) is MLP and all(
            getattr(model.get_submodule(k.rpartition(".")[0]), k.rpartition(".")[2]) is p and torch.equal(p, c)
            for k, (p, c) in before.items())

    with pytest.raises(TypeError, match=r"fully_shard\(MLP\): offload_policy must be an OffloadPolicy or a "
                                        r"CPUOffloadPolicy \(funcshard's or torch.distributed.fsdp's\), got dict"):
        funcshard.fully_shard(model, mesh=fake_mesh2, offload_policy={"pin_memory": False})
    assert untouched()
    if not offload_mod.can_pin():  # FSDP2 fails inside Tensor.pin_memory() here, its module half-sharded
        for policy in (funcshard.CPUOffloadPolicy(), torch_fsdp.CPUOffloadPolicy()):
            with pytest.raises(RuntimeError, match=r"fully_shard\(MLP\): CPUOffloadPolicy\(pin_memory=True\) needs "
                                                   r"pinned host memory.*Pass CPUOffloadPolicy\(pin_memory=False\)"):
                funcshard.fully_shard(model, mesh=fake_mesh2, offload_policy=policy)
            assert untouched()
        with pytest.raises(RuntimeError, match=r"group 'blocks.0': CPUOffloadPolicy\(pin_memory=True\) needs"):
            funcshard.plan(model, fake_mesh2, groups=(Block,)).with_group(
                "blocks.0", offload_policy=funcshard.CPUOffloadPolicy())
    with pytest.raises(TypeError, match=r"plan: offload_policy must be an OffloadPolicy"):
        funcshard.plan(model, fake_mesh2, groups=(Block,), offload_policy="cpu")
    # OffloadPolicy() (funcshard's or torch's): no offload
    plan = funcshard.plan(model, fake_mesh2, groups=(Block,), offload_policy=torch_fsdp.OffloadPolicy())
    assert not any(g.offload_to_cpu for g in plan.groups)


def test_offloaded_state_must_be_on_the_host(fake_mesh2):
    torch.manual_seed(0)
    plan = funcshard.plan(MLP(layers=2), fake_mesh2, groups=(Block,)).with_group(
        "blocks.1", offload_policy=funcshard.CPUOffloadPolicy(pin_memory=False))
    state = funcshard.shard(plan)
    state["blocks.1.l1.weight"] = state["blocks.1.l1.weight"].to("meta")
    with pytest.raises(funcshard.ShardingError, match=r"blocks.1.l1.weight: on meta, its group offloads to the host "
                                                      r"\(CPUOffloadPolicy\); make the state with funcshard.shard"):
        funcshard.check_state(plan, state)


def test_offloaded_parameters_left_on_meta_raise_at_lazy_init(fake_mesh2):
    """FSDP2's check at lazy initialization, with its message."""
    with torch.device("meta"):
        model = MLP(layers=2)
    _nested(funcshard, model, fake_mesh2, offload_policy=funcshard.CPUOffloadPolicy(pin_memory=False))
    with pytest.raises(RuntimeError, match=r"FSDP parameters should be materialized on CPU when enabling CPU "
                                           r"offloading.*\('blocks.0.l1.weight', device\(type='meta'\)\)"):
        funcshard.fully_shard.state(model)._lazy_init()
    model.to_empty(device="cpu")
    funcshard.fully_shard.state(model)._lazy_init()  # materialized on the host: fine


# ---- the cost model counts the host <-> device copies (funcshard.cost, Plan printing) ---------------------------


def _copying_run(variants):
    """Per variant, one training step (value_and_grad + optim.step) with the runtime's copies counted as they would
    be on an accelerator: ``GroupBuffers.issue``'s ``to_device`` returns copies (so nothing is cached between
    gathers, as there), ``HostReduce``'s shards and ``optim.offload``'s copy-in/out are recorded at their calls.
    Returns the recorded (kind, what, bytes), the cost model's, the plan's printed line and the cost's."""
    import collections

    import funcshard._runtime.backward as backward_mod
    import funcshard._runtime.buffers as buffers_mod
    from funcshard.cost import estimate

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    seen = []

    def to_device(tensors, device):
        seen.append(("host-to-device", "parameters", nbytes(tensors)))
        return [t.clone() for t in tensors]

    class Back:
        def __init__(self, inner):
            self.inner = inner

        def finish(self, *args, **kwargs):
            shards = self.inner.finish(*args, **kwargs)
            if shards is not None:
                seen.append(("device-to-host", "gradients", nbytes(shards)))
            return shards

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def host_reduce(pending, group, device, defer):
        return Back(pending) if group.offload_to_cpu else pending

    def start_to_device(tensors, device):
        seen.append(("host-to-device", "optimizer state", nbytes(tensors)))
        return offload_mod.start_to_device(tensors, device)

    def start_to_host(tensors, pinned, into=None):
        seen.append(("device-to-host", "optimizer state", nbytes(tensors)))
        return offload_mod.start_to_host(tensors, pinned, into)

    patches = [(buffers_mod, "to_device", to_device), (backward_mod, "host_reduce", host_reduce),
               (optim, "start_to_device", start_to_device), (optim, "start_to_host", start_to_host)]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    out, profiles = {}, {}
    pol = funcshard.CPUOffloadPolicy(pin_memory=False)
    try:
        for m, n, f in patches:
            setattr(m, n, f)
        for name in variants:
            torch.manual_seed(0)
            model = MLP(layers=3)
            if name == "one_group":  # blocks.1 offloaded, optimizer state on the device
                plan = funcshard.plan(model, _mesh(), groups=(Block,)).with_group("blocks.1", offload_policy=pol)
                tx = optim.adamw(lr=1e-2)
            elif name == "all_kept_optim":  # every group, kept gathered after forward; optim.offload
                plan = funcshard.plan(model, _mesh(), groups=(Block,), offload_policy=pol, reshard_after_forward=False)
                tx = optim.offload(optim.adamw(lr=1e-2), plan, pin_memory=False)
            else:  # "flat": the flat layout, every group offloaded, optim.offload
                plan = funcshard.plan(model, _mesh(), groups=(Block,), offload_policy=pol, layout="flat")
                tx = optim.offload(optim.adamw(lr=1e-2), plan, pin_memory=False)
            state = funcshard.shard(plan)
            opt_state = tx.init(state)
            x, y = torch.randn(4, 7), torch.randn(4, 3)
            del seen[:]
            loss, grads = funcshard.value_and_grad(lambda s: F.mse_loss(funcshard.apply(plan, s, x), y))(state)
            optim.step(tx, grads, opt_state, state)
            ran = collections.Counter(seen)  # (before the estimate, whose traced update calls optim.offload's too)
            cost = estimate(plan, x, loss=lambda out: F.mse_loss(out, y), optimizer=tx, profiles=profiles)
            printed = [line for line in str(plan).splitlines() if "copied between host and device" in line]
            out[name] = (ran, collections.Counter((c.kind, c.what, c.nbytes) for c in cost.copies),
                         cost.copy_bytes_by_kind(), printed,
                         [line for line in str(cost).splitlines() if "copies" in line])
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
    return out


def test_cost_counts_the_offload_copies_the_runtime_makes():
    """funcshard.cost (and str(plan)) count each offloaded group's shards copied in before every all-gather of them,
    its gradient shards copied out after the reduce-scatter, and optim.offload's state of each group in and out:
    equal, copy by copy, to what the runtime hands its copies in one step (W=2; on a CPU mesh nothing is copied,
    the calls are counted)."""
    out = run_ranks(2, _copying_run, ["one_group", "all_kept_optim", "flat"])[0]
    for name, (seen, counted, by_kind, printed, cost_lines) in out.items():
        assert seen == counted, (name, seen, counted)
        total = {k: sum(n * c for (kind, _, n), c in seen.items() if kind == k)
                 for k in ("host-to-device", "device-to-host")}
        assert by_kind == total, (name, by_kind, total)
        step = {k: sum(n * c for (kind, what, n), c in seen.items() if kind == k and what != "optimizer state")
                for k in total}  # (str(plan): the plan's own copies; the optimizer is not the plan's)
        assert printed == [f"  copied between host and device (CPU offload), per step: host-to-device "
                           f"{step['host-to-device'] / 2**20:.2f} MiB, device-to-host "
                           f"{step['device-to-host'] / 2**20:.2f} MiB"], printed
        assert any(line.startswith("  host-to-device copies (CPU offload): parameters")
                   for line in cost_lines), cost_lines
    one = out["one_group"][0]
    # blocks.1 (Linear(6, 19) and Linear(19, 6), fp32; rank 0's padded shards: 10x6 + 10 + 3x19 + 3 = 130 elements,
    # 520 B): in before its forward and its backward gather, its gradients out once
    assert one == {("host-to-device", "parameters", 520): 2, ("device-to-host", "gradients", 520): 1}, one
    kept = out["all_kept_optim"][0]
    assert sum(c for (k, w, _), c in kept.items() if w == "parameters") == 4, kept  # each group gathered once
    assert sum(c for (k, w, _), c in kept.items() if w == "optimizer state") == 8, kept  # 4 groups, in and out


def test_offloaded_parameters_stay_the_host_shards_under_an_accelerator_mesh(fake_mesh2, pins, monkeypatch):
    """CPU offload under a CUDA mesh (here a fake-PG mesh of device type "cuda"; the runtime's device faked too): each
    module parameter is a DTensor over the host shard itself, as FSDP2's. ``DTensor.from_local`` would have moved it to
    the mesh's device: a CUDA copy the optimizer updates instead of the shard, whose gradient (reduced to the host)
    then cannot be assigned (found on an H200: "attempting to assign a gradient with device type 'cpu' to a tensor
    with device type 'cuda'")."""
    import torch.distributed.fsdp as _  # noqa: F401  (torch's DTensor dispatch registered, as in a job)
    from torch.distributed.device_mesh import DeviceMesh

    import funcshard.fsdp._api as api

    cuda_mesh = DeviceMesh("cuda", torch.arange(2))
    monkeypatch.setattr(api, "device_of", lambda mesh, name: torch.device("cuda", 0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))  # (no buffers: those go to the device)
    funcshard.fully_shard(model, mesh=cuda_mesh, offload_policy=funcshard.CPUOffloadPolicy())
    params = list(model.parameters())
    assert params and all(p.device.type == "cpu" and p.to_local().device.type == "cpu" for p in params)
    assert all(p.device_mesh is cuda_mesh for p in params)
    assert _ptrs(p.to_local() for p in params) == _ptrs(pins)  # the pinned host shards themselves, no copies
