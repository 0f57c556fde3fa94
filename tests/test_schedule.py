"""The schedule (funcshard._schedule) is the one source of a step's collectives: the process group runs exactly
its collectives, in its order and of its sizes; the printed plan and the runtime's buckets take theirs from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard
from funcshard._plan import Group, Plan
from funcshard._schedule import bucket_sizes, schedule
from funcshard._spec import FlatSlot, ShardSpec
from models import MLP, Block
from multirank import run_ranks


class IssuedCollectives(TorchDispatchMode):
    """Records every c10d op at dispatch (what any caller of torch.distributed issues): (kind, dtype, elements
    per rank, bytes of the unsharded buffer). Kinds in the schedule's words; any other c10d op by its name."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, torch.dtype, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            full = part = None
            if "allgather" in name:  # _allgather_base_(output, input, ...): this rank's part is the input
                kind, full, part = "all-gather", args[0], args[1]
            elif "reduce_scatter" in name:  # _reduce_scatter_base_(output, input, ...): it is the output
                kind, full, part = "reduce-scatter", args[1], args[0]
            if isinstance(full, torch.Tensor):
                self.calls.append((kind, part.dtype, part.numel(), full.numel() * full.element_size()))
            else:  # any other c10d op (or a list form): recorded by name, so that it differs from the schedule
                self.calls.append((name, None, 0, 0))
        return func(*args, **(kwargs or {}))


class _HalfBf16(Block):
    """A block whose first layer is bf16, its second fp32: its group has one collective per dtype."""

    def __init__(self, d):
        super().__init__(d)
        self.l1.to(torch.bfloat16)

    def forward(self, x):
        return x + self.l2(F.gelu(self.l1(x.bfloat16())).float())


def _model(kind):
    torch.manual_seed(0)
    if kind == "mlp":  # blocks of different sizes: each collective's size names its group
        model, groups = MLP(layers=4), (Block,)
        for i, b in enumerate(model.blocks):
            model.blocks[i] = Block(6, hidden=5 + 3 * i)
    elif kind == "no-root":  # every parameter in a child group: the root group is empty
        model, groups = nn.Sequential(*[nn.Linear(7, 7) for _ in range(5)], nn.Linear(7, 3)), (nn.Linear,)
    elif kind == "settings":  # per-group settings: an embedding gathered only for forward, a layer kept after backward
        model = nn.Sequential(nn.Embedding(11, 7), nn.Linear(7, 7), nn.Linear(7, 3))
        groups = (nn.Embedding, nn.Linear)
    else:  # "mixed": bf16 and fp32 in one group, a frozen weight, a group with nothing trainable, an integer
        model, groups = MLP(layers=3), (Block,)
        model.blocks[0] = _HalfBf16(6)
        model.blocks[1].l1.weight.requires_grad_(False)
        model.blocks[2].requires_grad_(False)
        model.inp.register_parameter("count", nn.Parameter(torch.arange(5), requires_grad=False))
    return model, groups


def matrix_step(depth, reshard, model_kind, layout, lists):
    """One case of the matrix on this rank: (plan, trainable shards, frozen shards, input)."""
    model, groups = _model(model_kind)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = funcshard.plan(model, mesh, groups=groups, prefetch=depth, reshard_after_forward=reshard, layout=layout)
    if lists:  # explicit prefetch lists replace the depth-based default for the groups they name
        plan = plan.replace(forward_prefetch_lists={"": ("blocks.0", "blocks.1"), "blocks.1": ("blocks.3",)},
                            backward_prefetch_lists={"blocks.3": ("blocks.1",), "blocks.1": ()})
    if model_kind == "settings":
        plan = plan.with_group("0", unshard_in_backward=False).with_group("1", reshard_after_backward=False)
    names = dict(model.named_parameters())
    state = {k: v.requires_grad_(names[k].requires_grad) for k, v in funcshard.shard(plan).items()}
    trainable = {k: v for k, v in state.items() if v.requires_grad}
    frozen = {k: v for k, v in state.items() if not v.requires_grad}
    x = torch.arange(4).view(2, 2) if model_kind == "settings" else torch.randn(2, 7)
    return plan, trainable, frozen, x


def _step_vs_schedule(depth, reshard, model_kind, layout, lists):
    plan, trainable, frozen, x = matrix_step(depth, reshard, model_kind, layout, lists)
    with IssuedCollectives() as rec:
        torch.func.grad(lambda tr: funcshard.apply(plan, {**tr, **frozen}, x).float().square().sum())(trainable)
    step = schedule(plan)
    planned = [(c.kind, c.dtype, c.numel, c.nbytes) for c in step.collectives()]
    per_op = [(op.kind, op.group, len(op.collectives)) for op in step.ops
              if op.kind in ("all-gather", "reduce-scatter")]
    return rec.calls, planned, per_op, plan.collective_order(), step.lines(), step.totals()


MATRIX = [(0, None, "mlp", "per_param"), (1, None, "mlp", "per_param"), (2, None, "mlp", "per_param"),
          (1, False, "mlp", "per_param"), (1, True, "mlp", "per_param"), (1, None, "no-root", "per_param"),
          (1, None, "mlp", "flat"), (0, True, "no-root", "flat"), (0, None, "mlp", "lists"),
          (1, True, "mlp", "lists")]  # test_apply.py::test_collectives_follow_the_printed_plan's


@pytest.mark.parametrize("depth,reshard,kind,layout",
                         [*MATRIX, (1, None, "mixed", "per_param"), (1, True, "mixed", "flat"),
                          (1, None, "settings", "per_param"), (0, None, "settings", "flat")])
def test_issued_collectives_are_the_schedules(depth, reshard, kind, layout):
    lists = layout == "lists"
    layout = "per_param" if lists else layout
    for issued, planned, per_op, printed, lines, totals in run_ranks(2, _step_vs_schedule, depth, reshard, kind,
                                                                     layout, lists):
        assert issued == planned  # the same collectives, in the same order, of the same sizes, on every rank
        assert printed == lines  # Plan.collective_order() is the schedule's
        assert totals == {k: sum(b for kk, _, _, b in issued if kk == k) for k in ("all-gather", "reduce-scatter")}
        if kind == "mixed":  # bf16 and fp32 each their own collective; the root's int64 parameter is gathered,
            # not reduce-scattered; nothing in blocks.2 takes a gradient: no reduce-scatter
            assert {o for o in per_op if o[1] in ("", "blocks.0", "blocks.2")} == {
                ("all-gather", "", 2), ("reduce-scatter", "", 1), ("all-gather", "blocks.0", 2),
                ("reduce-scatter", "blocks.0", 2), ("all-gather", "blocks.2", 1), ("reduce-scatter", "blocks.2", 0)}
        elif kind == "settings":  # the embedding is gathered once (forward only); every group reduce-scattered
            assert [o for o in per_op if o[1] == "0"] == [("all-gather", "0", 1), ("reduce-scatter", "0", 1)]
            assert any("reduce-scatter 1, keep it gathered" in line for line in lines), lines
        else:  # one collective per printed all-gather / reduce-scatter (one dtype)
            assert [n for *_, n in per_op] == [1] * len(per_op) and len(per_op) == len(planned)


# ---- pure: sizes from specs alone (no process group) ----------------------------------------------


def _spec(fqn, shape, dtype=torch.float32, world=2, requires_grad=True, flat=None):
    return ShardSpec(fqn, shape, dtype, 0, 0, world, requires_grad=requires_grad, aliases=(fqn,), flat=flat)


def test_bucket_sizes_one_collective_per_dtype():
    w, b, v = _spec("w", (5, 3), torch.bfloat16), _spec("b", (5,)), _spec("v", (4,))
    # per parameter: the local shards, each padded on its dim: w (3, 3), b (3,), v (2,)
    assert bucket_sizes([w, b, v]) == {torch.bfloat16: (9, True), torch.float32: (5, True)}
    assert bucket_sizes([v]) == {torch.float32: (2, False)}
    # flat: one buffer per dtype split evenly, ceil(total / world)
    fw, fb, fv = (_spec(s.fqn, s.shape, s.dtype, flat=FlatSlot(off, tot, 0))
                  for s, off, tot in ((w, 0, 15), (b, 0, 9), (v, 5, 9)))
    assert bucket_sizes([fw, fb, fv]) == {torch.bfloat16: (8, True), torch.float32: (5, True)}
    assert bucket_sizes([]) == {}


def test_schedule_bytes_of_mixed_dtypes():
    """A group with bf16 and fp32 parameters: one all-gather per dtype; its reduce-scatter leaves out the frozen
    and the integer parameters; a group with no trainable parameter is gathered but not reduce-scattered."""
    specs = [_spec("a.w", (5, 3), torch.bfloat16), _spec("a.b", (5,)), _spec("a.f", (4, 4), requires_grad=False),
             _spec("a.n", (3,), torch.int64, requires_grad=False), _spec("r.w", (4, 2)),
             _spec("z.w", (2, 2), requires_grad=False)]
    plan = Plan(module=nn.Module(), mesh=None, shard_axis=0, specs={s.fqn: s for s in specs},
                groups=(Group("", ("",), ("r.w",), False), Group("a", ("a",), ("a.w", "a.b", "a.f", "a.n"), True),
                        Group("z", ("z",), ("z.w",), True)))
    step = schedule(plan)
    assert step is schedule(plan)  # made once per plan
    assert plan.collective_order() == step.lines() == [
        "all-gather <root>", "all-gather a (prefetch, while <root> computes)", "all-gather z (prefetch, while a "
        "computes)", "free a", "free z", "-- backward --", "all-gather z (prefetch, while <root> computes)",
        "all-gather a (prefetch, while z computes)", "reduce-scatter z, free it", "reduce-scatter a, free it",
        "reduce-scatter <root>, free it"]
    sizes = {(op.kind, op.group): [(c.dtype, c.numel, c.nbytes) for c in op.collectives] for op in step.ops}
    f32, bf16, i64 = torch.float32, torch.bfloat16, torch.int64
    assert sizes[("all-gather", "a")] == [(bf16, 9, 36), (f32, 3 + 8, 88), (i64, 2, 32)]
    assert sizes[("reduce-scatter", "a")] == [(bf16, 9, 36), (f32, 3, 24)]  # not the frozen a.f, not a.n
    assert sizes[("reduce-scatter", "z")] == []  # nothing in z takes a gradient
    assert sizes[("free", "a")] == [] and sizes[("all-gather", "")] == [(f32, 4, 32)]
    # a and z are gathered again for backward (they reshard after forward), the root once
    assert step.totals() == {"all-gather": 32 + 2 * (36 + 88 + 32) + 2 * 16, "reduce-scatter": 36 + 24 + 32}
    assert [c.kind for c in step.collectives()] == ["all-gather"] * 9 + ["reduce-scatter"] * 3
    assert step.unsharded_nbytes("a") == 6 * 3 * 2 + 6 * 4 + 4 * 4 * 4 + 4 * 8


def _pure_plan(module, groups, prefetch=0):
    """A plan over no process group (world 2 in the specs): groups as (name, modules, parameter paths)."""
    specs = {p: _spec(p, tuple(t.shape)) for p, t in module.named_parameters()}
    made = [Group("", ("",), tuple(p for p in specs if not any(p in ps for _, _, ps in groups)), False)]
    made += [Group(n, ms, ps, True) for n, ms, ps in groups]
    return Plan(module=module, mesh=None, shard_axis=0, specs=specs, groups=tuple(made), forward_prefetch=prefetch,
                backward_prefetch=prefetch)


def test_schedule_of_nested_groups():
    """A group whose module contains another's (issue 21): its pass encloses the child's (gathered before it, freed
    after it); backward in reverse of the order the passes closed: the parent gathered first, the child's backward
    inside its own, the parent reduce-scattered last. A group of two modules with another group's module between
    them encloses that group the same way. Backward prefetch follows that order."""
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    groups = [("0", ("0",), ("0.0.weight", "0.0.bias")), ("0.1", ("0.1",), ("0.1.weight", "0.1.bias"))]
    plan = _pure_plan(nested, groups)
    lines = [line.split(" (")[0] for line in schedule(plan).lines()]
    assert lines == ["all-gather 0", "all-gather 0.1", "free 0.1", "free 0", "-- backward --", "all-gather 0",
                     "all-gather 0.1", "reduce-scatter 0.1, free it", "reduce-scatter 0, free it"]
    assert schedule(plan).most_unsharded() == 2  # prefetch 0: the parent beside its child
    assert plan.prefetch_after("", backward=True) == ()
    deep = _pure_plan(nested, groups, prefetch=1)
    assert deep.prefetch_after("", backward=True) == ("0",) and deep.prefetch_after("0", backward=True) == ("0.1",)
    # a group of modules 0 and 2 around group 1 (module 1): open at 0, closed after 2
    three = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    plan = _pure_plan(three, [("0", ("0", "2"), ("0.weight", "0.bias", "2.weight", "2.bias")),
                              ("1", ("1",), ("1.weight", "1.bias"))])
    lines = [line.split(" (")[0] for line in schedule(plan).lines()]
    assert lines == ["all-gather 0", "all-gather 1", "free 1", "free 0", "-- backward --", "all-gather 0",
                     "all-gather 1", "reduce-scatter 1, free it", "reduce-scatter 0, free it"], lines
    # the plan's order differs from the module tree's (Plan.with_order): the plan's order, no nesting
    plan = _pure_plan(three, [("1", ("1",), ("1.weight", "1.bias")), ("0", ("0",), ("0.weight", "0.bias"))])
    assert [line.split(" (")[0] for line in schedule(plan).lines()] == [
        "all-gather <root>", "all-gather 1", "free 1", "all-gather 0", "free 0", "-- backward --", "all-gather 0",
        "reduce-scatter 0, free it", "all-gather 1", "reduce-scatter 1, free it", "reduce-scatter <root>, free it"]


def test_backward_reaches_the_groups_after_the_first_trained_parameter():
    """``backward_reaches``: the groups whose pass closes after the first parameter that takes a gradient is used,
    where each parameter is used by the module tree (a head after every group, a parent's first layer before its
    child, its last layer after it); without a module tree in the plan's order, first in its group's pass."""
    from funcshard._schedule import backward_reaches

    def reached(module, groups, trained, order=None):
        plan = _pure_plan(module, groups)
        plan = plan.replace(specs={k: dataclasses.replace(s, requires_grad=k.startswith(trained))
                                   for k, s in plan.specs.items()})
        return set(backward_reaches(plan.with_order(order) if order else plan))

    seq = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])  # groups 0, 1, 2; the root's 3 is the head
    groups = [(str(i), (str(i),), (f"{i}.weight", f"{i}.bias")) for i in range(3)]
    assert reached(seq, groups, ("3.",)) == set()  # the head alone
    assert reached(seq, groups, ("1.",)) == {"1", "2"}
    assert reached(seq, groups, ("3.",), order=["2", "1", "0"]) == {"0", "1", "2"}  # (no tree order: first)
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    groups = [("0", ("0",), ("0.0.weight", "0.0.bias", "0.2.weight", "0.2.bias")),
              ("0.1", ("0.1",), ("0.1.weight", "0.1.bias"))]
    assert reached(nested, groups, ("0.0.",)) == {"0", "0.1"}  # the parent's first layer: before its child
    assert reached(nested, groups, ("0.2.",)) == {"0"}  # its last layer: after its child
    assert reached(nested, groups, ("0.1.",)) == {"0", "0.1"}  # the child, and the parent enclosing it
    # a weight tied across groups (the root's: its first path, 0.0, inside group 0's module): used while 0 is open
    tied = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(3)])
    tied[2][0].weight = tied[0][0].weight
    blocks = [(str(i), (str(i),), tuple(p for p, _ in tied.named_parameters() if p.startswith(f"{i}.")
                                        and p != "0.0.weight")) for i in range(3)]
    assert reached(tied, blocks, ("0.0.weight",)) == {"0", "1", "2"}
    seq[2].weight = seq[0].weight  # (tied to group 0's own module)
    layers = [("0", ("0",), ("0.bias",)), ("1", ("1",), ("1.weight", "1.bias")), ("2", ("2",), ("2.bias",))]
    assert reached(seq, layers, ("0.weight",)) == {"0", "1", "2"}
    assert reached(seq, layers, ("2.bias",)) == {"2"}
    plan = _pure_plan(seq, layers)  # (used inside 0's pass, after it opens: no gradient reaches 0's inputs)
    lines = schedule(plan.replace(specs={k: dataclasses.replace(s, requires_grad=k == "0.weight")
                                         for k, s in plan.specs.items()})).lines()
    assert "reduce-scatter 0, free it at the end of backward (a frozen parameter, and no gradient reaches its " \
           "inputs: the step's inputs taken to take none)" in lines
    plan = _pure_plan(nested, groups)
    lines = schedule(plan.replace(specs={k: dataclasses.replace(s, requires_grad=k.startswith("0.2."))
                                         for k, s in plan.specs.items()})).lines()
    assert lines[lines.index("-- backward --"):] == [
        "-- backward --", "all-gather 0 (before its backward)",
        "reduce-scatter 0, free it at the end of backward (a frozen parameter, and no gradient reaches its inputs: the "
        "step's inputs taken to take none)",
        "reduce-scatter <root>, free it"]
