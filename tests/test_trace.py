"""funcshard.trace records what the runtime does: every collective the schedule lists, each group's lifetime, the
waits, and a memory timeline that agrees with the cost model's; it writes a Chrome trace; off, it records nothing."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import funcshard
import funcshard.cost as C
from funcshard._runtime.observe import LISTENERS
from funcshard._schedule import schedule
from funcshard.trace import complement, intersect, trace, union
from multirank import run_ranks


class _Blocks(nn.Module):
    def __init__(self, n=4, d=32):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return x


def _traced_step(tmp, layout, prefetch):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = funcshard.plan(_Blocks(), mesh, groups=(nn.Sequential,), layout=layout, prefetch=prefetch)
    state = funcshard.shard(plan)
    x = torch.randn(8, 32)
    loss = lambda out: out.square().mean()  # noqa: E731
    funcshard.value_and_grad(lambda s: loss(funcshard.apply(plan, s, x)))(state)  # (warm: not traced)
    with trace(f"{tmp}/trace_rank{{rank}}.json.gz") as tr:
        funcshard.value_and_grad(lambda s: loss(funcshard.apply(plan, s, x)))(state)
    untraced = len(tr.events)
    funcshard.value_and_grad(lambda s: loss(funcshard.apply(plan, s, x)))(state)
    assert len(tr.events) == untraced and not LISTENERS  # off after the block
    step = schedule(plan)
    ops = [(op.kind, op.group) for op in step.ops if op.kind in ("all-gather", "reduce-scatter") and op.collectives]
    recorded = [(e.what.split()[0], e.group) for e in tr.events if e.what.endswith("issued")]
    cost = C.estimate(plan, x, loss=loss)
    peak_unsharded = max(m["unsharded_params"] for _, m in tr.memory())
    return ops, recorded, tr.spans(), tr.overlap(), peak_unsharded, cost.max_by_category()["unsharded_params"]


def test_trace_records_the_schedules_collectives_and_writes_chrome_json(tmp_path):
    for layout, prefetch in (("per_param", 1), ("flat", 0)):
        for rank, (ops, recorded, spans, overlap, peak, predicted) in enumerate(
                run_ranks(2, _traced_step, str(tmp_path), layout, prefetch)):
            assert recorded == ops  # every all-gather and reduce-scatter, in the schedule's order
            assert peak == predicted  # the runtime's unsharded bytes at their highest: the cost model's
            assert len(spans["all-gather"]) == sum(k == "all-gather" for k, _ in ops)
            assert len(spans["reduce-scatter"]) == sum(k == "reduce-scatter" for k, _ in ops)
            # each gathered block lives once in forward, once in backward (it reshards after forward)
            assert sorted(g for _, g, _, _ in spans["group"] if g.startswith("blocks")) == sorted(
                [f"blocks.{i}" for i in range(4)] * 2)
            assert all(a <= b for lane in spans.values() for _, _, a, b in lane)
            assert 0 <= overlap["hidden_s"] <= overlap["comm_s"]
            with gzip.open(tmp_path / f"trace_rank{rank}.json.gz") as f:
                data = json.load(f)
            kinds = {e["ph"] for e in data["traceEvents"]}
            assert {"X", "C", "M"} <= kinds
            assert {e["pid"] for e in data["traceEvents"]} == {rank}
            names = {e["name"] for e in data["traceEvents"] if e["ph"] == "X"}
            assert "all-gather blocks.0" in names and "reduce-scatter blocks.3" in names


def test_interval_arithmetic():
    xs = union([(3, 4), (0, 1), (0.5, 2)])
    assert xs == [(0, 2), (3, 4)]
    assert intersect(xs, [(1, 3.5)]) == [(1, 2), (3, 3.5)]
    assert complement(xs, -1, 5) == [(-1, 0), (2, 3), (4, 5)]


def test_a_trace_entered_twice_is_refused():
    tr = trace()
    with tr:
        with pytest.raises(RuntimeError, match=r"already recording \(entered twice, it would record every event "
                                               r"twice\); nest a new one"):
            tr.__enter__()
        tr("freed", "blocks.0", None)
        assert len(tr.events) == 1 and LISTENERS == [tr]
    assert not LISTENERS
    with tr:  # entered again after its exit: records on
        tr("freed", "blocks.0", None)
    assert len(tr.events) == 2


def _traced_regather():
    """An int reshard_after_forward: each block's backward gather runs within its block of 2 ranks, from the shards it
    kept after forward (``start_regather``)."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = funcshard.plan(_Blocks(), mesh, groups=(nn.Sequential,), reshard_after_forward=2)
    state = funcshard.shard(plan)
    x = torch.randn(8, 32)
    with trace() as tr:
        funcshard.value_and_grad(lambda s: funcshard.apply(plan, s, x).square().mean())(state)
    return [(e.what, e.group) for e in tr.events if e.group.startswith("blocks")]


def test_trace_records_the_int_reshard_regather():
    """The all-gather of a group kept sharded over k ranks after forward is recorded like any other (issue 17: it
    was not): each block is issued twice (forward, then the re-gather for backward), each issue followed by its wait
    and its gathered event, and the re-gather's span ends at its own gathered event."""
    events = run_ranks(4, _traced_regather)[0]
    for i in range(4):
        mine = [what for what, g in events if g == f"blocks.{i}"]
        assert mine.count("all-gather issued") == 2, mine
        second = mine.index("all-gather issued", mine.index("all-gather issued") + 1)
        assert mine[second:second + 3] == ["all-gather issued", "all-gather wait", "gathered"], mine
