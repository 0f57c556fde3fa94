"""Mixed precision (issue 14): FSDP2's MixedPrecisionPolicy on fully_shard, bit for bit against torch's FSDP2, and
the same policy on the functional path (funcshard.plan(..., mp_policy=...)), identical to fully_shard.

Bit-identical is possible because funcshard casts where FSDP2 does: the copy-in casts the fp32 shards to
param_dtype (round to nearest even), the gradient copy-in casts to reduce_dtype, the reduce-scatter sums in
reduce_dtype (gloo's AVG is that sum divided by the world in the same dtype; funcshard sums and divides once), and
the result is cast to the shards' dtype before it is accumulated into ``.grad``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F

import funcshard
from models import GPT, MLP
from multirank import run_ranks
from test_fsdp import _fit, _gpt_batch, _gpt_loss, _local, _mesh, _nested

BF16 = torch.bfloat16
POLICIES = {
    "bf16_fp32": dict(param_dtype=BF16, reduce_dtype=torch.float32),
    "bf16_bf16": dict(param_dtype=BF16, reduce_dtype=BF16),
    "fp16_fp32": dict(param_dtype=torch.float16, reduce_dtype=torch.float32),
    "fp16_fp16": dict(param_dtype=torch.float16),  # reduced in fp16: FSDP2's divide before and after the sum
}


class _Gated(nn.Module):
    """Two parallel layers; ``b`` runs only when ``use`` is set (``zero``: it runs, times zero: zero gradients)."""

    def __init__(self, d=6):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.use, self.zero = True, False

    def forward(self, x):
        if self.use:
            return x + self.a(x) + self.b(x)
        return x + self.a(x) + (0 * self.b(x) if self.zero else 0)


@dataclasses.dataclass
class _Batch:  # a dataclass input: FSDP2's cast walks into it
    x: torch.Tensor
    scale: torch.Tensor


class _DataclassMLP(MLP):
    def forward(self, b):
        h = self.inp(b.x) * b.scale
        for blk in self.blocks:
            h = blk(h)
        return self.out(h)


class _Scaled(nn.Module):  # no parameters of its own: a fully_shard unit with no group, but a policy
    def forward(self, x):
        return x * 1.1


class _GatedMLP(MLP):
    def __init__(self):
        super().__init__(layers=2)
        self.blocks[1] = _Gated()


def _mixed_model(layers, *, whole_block=None, one_layer=None):
    """An MLP whose parameters already mix dtypes: block ``whole_block`` in bf16, or block ``one_layer``'s l1 in bf16
    beside its fp32 l2."""
    model = MLP(layers=layers)
    if whole_block is not None:
        model.blocks[whole_block].to(BF16)
    if one_layer is not None:
        model.blocks[one_layer].l1.to(BF16)
    return model


def _mse(pred, y):
    return F.mse_loss(pred.float(), y)


def _fit10(model, **kw):  # the parity runs: 10 optimizer steps
    return _fit(model, steps=10, **kw)


def _scenario(name, fs, mesh, policy):
    mp = fs.MixedPrecisionPolicy(**policy)
    torch.manual_seed(0)
    if name.startswith("reshard_"):
        rsf = {"reshard_true": True, "reshard_false": False, "reshard_none": None}[name]
        return _fit10(_nested(fs, MLP(layers=3), mesh, reshard_after_forward=rsf, mp_policy=mp), loss=_mse)
    if name == "accumulate_no_sync":
        model = _nested(fs, MLP(layers=2), mesh, mp_policy=mp)
        return _fit10(model, micro=3, each=lambda m, s, k: m.set_requires_gradient_sync(k == 2), loss=_mse)
    if name == "clip":
        return _fit10(_nested(fs, MLP(layers=2), mesh, mp_policy=mp), clip=0.05, loss=_mse)
    if name == "frozen":
        model = MLP(layers=3)
        model.blocks[0].l1.weight.requires_grad_(False)
        model.blocks[2].requires_grad_(False)
        return _fit10(_nested(fs, model, mesh, mp_policy=mp), loss=_mse)
    if name == "tied":
        model = _nested(fs, GPT(vocab=32, d=16, heads=2, layers=2, seq=8, tied=True), mesh, mp_policy=mp)
        return _fit10(model, batch=_gpt_batch, loss=_gpt_loss)
    if name == "nested_policies":  # blocks in bf16 with fp32 outputs, the root in fp32
        model = MLP(layers=2)
        for b in model.blocks:
            fs.fully_shard(b, mesh=mesh, mp_policy=fs.MixedPrecisionPolicy(**policy, output_dtype=torch.float32))
        fs.fully_shard(model, mesh=mesh, mp_policy=fs.MixedPrecisionPolicy(param_dtype=torch.float32))
        return _fit10(model)
    if name == "force_sum_divide":  # FSDP2 needs force-sum for a divide factor other than the world on gloo
        model = _nested(fs, MLP(layers=2), mesh, mp_policy=mp)
        for m in (model, *model.blocks):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(3.0)
        return _fit10(model, loss=_mse)
    if name == "dataclass_inputs":
        model = _nested(fs, _DataclassMLP(layers=2), mesh, mp_policy=mp)
        return _fit10(model, loss=_mse, call=lambda m, x: m(_Batch(x, torch.full((6,), 0.777))))
    if name == "units_without_parameters":  # a parameterless inner unit and a root whose parameters are all in
        # children, each with its own policy's casts (bf16 in, fp32 out)
        cast = fs.MixedPrecisionPolicy(**policy, output_dtype=torch.float32)
        model = torch.nn.Sequential(nn.Linear(7, 6), _Scaled(), nn.Linear(6, 3))
        for m in model:
            fs.fully_shard(m, mesh=mesh, mp_policy=cast)
        fs.fully_shard(model, mesh=mesh, mp_policy=cast)
        return _fit10(model, loss=_mse)
    if name == "mixed_dtypes":  # a model whose parameters already mix dtypes: one block in bf16, the rest fp32
        torch.manual_seed(0)
        model = _mixed_model(layers=3, whole_block=1)
        return _fit10(_nested(fs, model, mesh, mp_policy=mp), loss=_mse)
    if name == "mixed_dtypes_in_one_unit":
        # one unit holding bf16 and fp32 parameters: FSDP2 refuses ("uniform original parameter dtype"), funcshard
        # trains it. Reference: FSDP2 with the bf16 layer a unit of its own. Each element is cast, summed, divided
        # and cast back the same way whatever the grouping, so the results must be bit-identical.
        torch.manual_seed(0)
        model = _mixed_model(layers=2, one_layer=0)
        if fs is torch_fsdp:
            fs.fully_shard(model.blocks[0].l1, mesh=mesh, mp_policy=mp)
        return _fit10(_nested(fs, model, mesh, mp_policy=mp), loss=_mse)
    if name.startswith("fresh_param"):
        # pt#196996: without sync, a parameter first used in the last microbatch has a fresh gradient in param_dtype
        # beside its group's reduce_dtype accumulations. FSDP2 asserts ("expects uniform gradient dtype"); funcshard
        # casts it (exact) first. Reference: FSDP2 with the parameter used times zero before (zero gradients
        # accumulated in reduce_dtype, then the same sum), which funcshard must match bit for bit.
        model = _nested(fs, _GatedMLP(), mesh, mp_policy=mp)
        zero = name.endswith("zero")

        def each(m, s, k):
            m.set_requires_gradient_sync(k == 2)
            m.blocks[1].use, m.blocks[1].zero = k == 2, zero

        return _fit10(model, micro=3, each=each, loss=_mse)
    raise KeyError(name)


def _parity(names, policy):
    mesh = _mesh()
    out = {}
    for name in names:
        ref_name = "fresh_param_zero" if name == "fresh_param" else name
        n_ref, s_ref = _scenario(ref_name, torch_fsdp, mesh, POLICIES[policy])
        n_got, s_got = _scenario(name, funcshard, mesh, POLICIES[policy])
        out[name] = (max(abs(a - b) for a, b in zip(n_ref, n_got)),
                     max((s_ref[k] - s_got[k]).abs().max().item() for k in s_ref),
                     all(s_got[k].dtype == s_ref[k].dtype for k in s_ref))
    return out


SCENARIOS = ["reshard_true", "reshard_false", "reshard_none", "accumulate_no_sync", "clip", "frozen", "tied",
             "nested_policies", "force_sum_divide", "fresh_param", "dataclass_inputs", "units_without_parameters",
             "mixed_dtypes", "mixed_dtypes_in_one_unit"]


# W = 4: three of the W = 2 scenarios again at a larger W, slow
@pytest.mark.parametrize("policy,world", [("bf16_fp32", 2), ("bf16_bf16", 2),
                                          pytest.param("bf16_fp32", 4, marks=pytest.mark.slow),
                                          pytest.param("bf16_bf16", 4, marks=pytest.mark.slow),
                                          ("fp16_fp32", 2), ("fp16_fp16", 2)])
def test_fully_shard_matches_fsdp2_bit_for_bit(policy, world):
    names = SCENARIOS if world == 2 and policy.startswith("bf16") else ["reshard_none", "accumulate_no_sync",
                                                                         "force_sum_divide"]
    for res in run_ranks(world, _parity, names, policy):
        for name, (numbers, params, dtypes) in res.items():
            assert numbers == 0 and params == 0 and dtypes, (name, numbers, params, dtypes)


def _fsdp2_fresh_param():
    try:
        _scenario("fresh_param", torch_fsdp, _mesh(), POLICIES["bf16_fp32"])
        return "no error"
    except AssertionError as e:
        return str(e)


def test_fresh_gradient_beside_accumulated_ones_fsdp2_asserts():
    """What the fresh_param scenario works around in torch's FSDP2 (pt#196996); funcshard trains it (above)."""
    assert "uniform gradient dtype" in run_ranks(2, _fsdp2_fresh_param)[0]


def _functional_vs_fully_shard(policy):
    """One step's gradients: apply under value_and_grad with plan(mp_policy) vs fully_shard with the same policy;
    and the all-gather bytes of a step, counted at the process group, against the fp32 plan's."""
    from test_schedule import IssuedCollectives

    from models import Block

    mp = funcshard.MixedPrecisionPolicy(**POLICIES[policy])
    torch.manual_seed(0)
    model = MLP(layers=3)
    plan = funcshard.plan(model, _mesh(), groups=(Block,), mp_policy=mp)
    state = funcshard.shard(plan)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
    with IssuedCollectives() as rec:
        loss, grads = funcshard.value_and_grad(lambda s: _mse(funcshard.apply(plan, s, x), y))(state)
    torch.manual_seed(0)  # the same initial parameters as `model`
    fs_model = _nested(funcshard, MLP(layers=3), _mesh(), mp_policy=mp)
    with IssuedCollectives() as rec_fs:
        fs_loss = _mse(fs_model(x), y)
        fs_loss.backward()
    torch.manual_seed(0)
    ref_model = _nested(torch_fsdp, MLP(layers=3), _mesh(), mp_policy=torch_fsdp.MixedPrecisionPolicy(
        **POLICIES[policy]))
    with IssuedCollectives() as rec_ref:
        _mse(ref_model(x), y).backward()
    # every collective of the step, kind, dtype and bytes, as torch's FSDP2 issues them (the order may differ)
    same_as_fsdp2 = sorted(rec_fs.calls, key=str) == sorted(rec_ref.calls, key=str)
    rank = dist.get_rank()
    same = all(torch.equal(grads[k], plan.specs[k].local_shard(_local(p.grad), rank))
               for k, p in fs_model.named_parameters())
    ag = sum(b for kind, _, _, b in rec.calls if kind == "all-gather")
    fp32_plan = funcshard.plan(model, _mesh(), groups=(Block,))
    with IssuedCollectives() as rec32:
        funcshard.value_and_grad(lambda s: F.mse_loss(funcshard.apply(fp32_plan, s, x), y))(funcshard.shard(fp32_plan))
    ag32 = sum(b for kind, _, _, b in rec32.calls if kind == "all-gather")
    from funcshard._schedule import schedule

    return (loss.item() == fs_loss.item(), same, {k: v.dtype for k, v in grads.items()} == {
        k: v.dtype for k, v in state.items()}, ag, ag32, schedule(plan).totals()["all-gather"], str(plan),
        same_as_fsdp2)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_functional_path_matches_fully_shard_and_halves_the_all_gather(policy):
    for same_loss, same_grads, dtypes, ag, ag32, planned, printed, same_as_fsdp2 in run_ranks(
            2, _functional_vs_fully_shard, policy):
        assert same_loss and same_grads and dtypes and same_as_fsdp2
        assert ag * 2 == ag32 and planned == ag  # bf16 all-gathers: half the bytes, as the schedule says
        assert f"param_dtype={POLICIES[policy]['param_dtype']}" in printed


def _functional_edges():
    """gather under a policy returns the parameters as sharded (their dtype, bit for bit); a live step's hooks do
    not cast another call of the same modules (a plain call, or another plan's apply, before its backward)."""
    from models import Block

    torch.manual_seed(0)
    model = MLP(layers=2)
    mp = funcshard.MixedPrecisionPolicy(**POLICIES["bf16_fp32"])
    plan = funcshard.plan(model, _mesh(), groups=(Block,), mp_policy=mp)
    state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
    full = funcshard.gather(plan, state)
    exact = all(torch.equal(full[k], p) for k, p in model.named_parameters())
    x = torch.randn(4, 7)
    out = funcshard.apply(plan, state, x)  # its hooks live until its backward
    plain = model(x).dtype  # the module's own fp32 parameters, no cast
    fp32_plan = funcshard.plan(model, _mesh(), groups=(Block,))
    other = funcshard.apply(fp32_plan, funcshard.shard(fp32_plan), x).dtype
    out.float().sum().backward()
    return exact, plain, other, out.dtype


def test_gather_and_other_calls_under_a_policy():
    for exact, plain, other, out in run_ranks(2, _functional_edges):
        assert exact and plain == other == torch.float32 and out == BF16


def _flat_layout(policy):
    """layout="flat" under a policy: the same loss and gradients as the per-parameter layout (each element is cast,
    summed and divided alike; only where the padding sits differs), all-gather bytes as planned and half of fp32's;
    a group whose parameters of two dtypes would share one all-gather is refused."""
    from test_schedule import IssuedCollectives

    from models import Block

    mp = funcshard.MixedPrecisionPolicy(**POLICIES[policy])
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
    torch.manual_seed(0)
    model = _mixed_model(layers=3, whole_block=1)  # dtypes differ between groups, not within one
    out = {}
    for layout in ("per_param", "flat"):
        plan = funcshard.plan(model, _mesh(), groups=(Block,), mp_policy=mp, layout=layout)
        state = funcshard.shard(plan)
        with IssuedCollectives() as rec:
            loss, grads = funcshard.value_and_grad(lambda s: _mse(funcshard.apply(plan, s, x), y))(state)
        from funcshard._schedule import schedule

        out[layout] = (loss.item(), funcshard.gather(plan, grads), {k: v.dtype for k, v in grads.items()} == {
            k: v.dtype for k, v in state.items()}, sum(b for kind, _, _, b in rec.calls if kind == "all-gather")
            == schedule(plan).totals()["all-gather"])
    (l_pp, g_pp, _, _), (l_flat, g_flat, dtypes, as_planned) = out["per_param"], out["flat"]
    same = l_pp == l_flat and all(torch.equal(g_pp[k], g_flat[k]) for k in g_pp)
    torch.manual_seed(0)
    fp32 = MLP(layers=3)
    counted = []
    for policy_ in (mp, None):
        plan = funcshard.plan(fp32, _mesh(), groups=(Block,), mp_policy=policy_, layout="flat")
        with IssuedCollectives() as rec:
            funcshard.value_and_grad(lambda s: _mse(funcshard.apply(plan, s, x), y))(funcshard.shard(plan))
        counted.append(sum(b for kind, _, _, b in rec.calls if kind == "all-gather"))
    try:
        funcshard.plan(_mixed_model(layers=2, one_layer=0), _mesh(), groups=(Block,), mp_policy=mp, layout="flat")
        refused = "no error"
    except funcshard.ShardingError as e:
        refused = str(e)
    return same, dtypes, as_planned, counted[0] * 2 == counted[1], refused


@pytest.mark.parametrize("policy", ["bf16_fp32", "fp16_fp16"])
def test_flat_layout_under_a_policy(policy):
    for same, dtypes, as_planned, halved, refused in run_ranks(2, _flat_layout, policy):
        assert same and dtypes and as_planned and halved
        assert "group 'blocks.0': param_dtype=" in refused and "casts parameters of 2 dtypes" in refused
        assert "Use layout='per_param'" in refused


def _mixed_in_one_group(policy):
    """The functional path on a group that mixes bf16 and fp32 parameters: the same gradients as fully_shard (whose
    parity with FSDP2 is the 'mixed_dtypes_in_one_unit' scenario), each in its parameter's dtype."""
    from models import Block

    mp = funcshard.MixedPrecisionPolicy(**POLICIES[policy])
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
    torch.manual_seed(0)
    model = _mixed_model(layers=2, one_layer=0)
    plan = funcshard.plan(model, _mesh(), groups=(Block,), mp_policy=mp)
    state = funcshard.shard(plan)
    loss, grads = funcshard.value_and_grad(lambda s: _mse(funcshard.apply(plan, s, x), y))(state)
    torch.manual_seed(0)
    fs_model = _nested(funcshard, _mixed_model(layers=2, one_layer=0), _mesh(), mp_policy=mp)
    fs_loss = _mse(fs_model(x), y)
    fs_loss.backward()
    rank = dist.get_rank()
    same = all(torch.equal(grads[k], plan.specs[k].local_shard(_local(p.grad), rank))
               for k, p in fs_model.named_parameters())
    return loss.item() == fs_loss.item(), same, {k: str(v.dtype) for k, v in grads.items() if "blocks.0" in k}


@pytest.mark.parametrize("policy", ["bf16_fp32", "bf16_bf16"])
def test_functional_path_on_a_group_of_mixed_dtypes(policy):
    for same_loss, same_grads, dtypes in run_ranks(2, _mixed_in_one_group, policy):
        assert same_loss and same_grads
        assert dtypes == {"blocks.0.l1.weight": "torch.bfloat16", "blocks.0.l1.bias": "torch.bfloat16",
                          "blocks.0.l2.weight": "torch.float32", "blocks.0.l2.bias": "torch.float32"}
