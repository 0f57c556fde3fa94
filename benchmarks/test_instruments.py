"""Checks of the benchmark's instruments (run: ``python -m pytest benchmarks/test_instruments.py``)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import instruments

MiB = 2**20


class _Holder:
    def __init__(self):
        self.kept = {"a": torch.zeros(MiB // 4)}  # 1 MiB of float32


def test_live_bytes_counts_roots_allocations_frees_and_resizes():
    h = _Holder()
    lb = instruments.LiveBytes(roots=[h])
    assert lb.baseline == MiB
    with lb:
        x = torch.ones(MiB // 2)  # +2 MiB
        y = x * 2  # +2 MiB: peak 5 MiB
        del x, y
        z = torch.empty(MiB // 4)  # +1 MiB
        z.untyped_storage().resize_(0)  # -1 MiB
        z.untyped_storage().resize_(MiB)  # +1 MiB
    assert lb.peak == 5 * MiB
    assert lb.total == 2 * MiB


def test_reachable_tensors_sees_grads_closures_and_nested_objects():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    hidden = torch.zeros(5)

    def closure():
        return hidden

    found = instruments.reachable_tensors([{"p": p, "f": closure}])
    ids = {id(t) for t in found}
    assert {id(p), id(p.grad), id(hidden)} <= ids


@pytest.fixture
def fake_pg():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collective_counter_catches_aliases_and_counts_nested_calls_once(fake_pg):
    from funcshard import _collectives

    inp = torch.zeros(8)
    out = torch.zeros(32)
    with instruments.CollectiveCounter() as cc:
        _collectives.all_gather_into(out, inp, None).wait()  # funcshard's import-time alias
        dist.all_gather_single(out, inp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.all_gather_into_tensor(out, inp)  # deprecated name forwarding to all_gather_single
        dist.reduce_scatter_single(inp, out)
        dist.all_reduce(inp)
    s = cc.summary()
    assert s["calls"] == {"all_gather": 3, "all_reduce": 1, "reduce_scatter": 1}
    assert s["bytes"] == {"all_gather": 3 * 128, "all_reduce": 32, "reduce_scatter": 128}
    # restored afterwards
    assert not getattr(dist.all_gather_single, "_counting", False)


def test_trace_overlap_arithmetic():
    import trace_overlap as T

    assert T.union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert T.intersect([(0, 3), (5, 8)], [(2, 6), (7, 9)]) == [(2, 3), (5, 6), (7, 8)]
    assert T.complement([(2, 3), (5, 6)], 0, 8) == [(0, 2), (3, 5), (6, 8)]
    main = 1
    events = [
        {"ph": "X", "tid": main, "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10},
        {"ph": "X", "tid": main, "cat": "user_annotation", "name": T.WAIT, "ts": 10, "dur": 4},
        {"ph": "X", "tid": 2, "cat": "cpu_op", "name": "gloo:all_gather", "ts": 6, "dur": 6},  # 4 hidden, 2 exposed
        {"ph": "X", "tid": 3, "cat": "cpu_op", "name": "gloo:all_reduce", "ts": 11, "dur": 1},  # exposed
        {"ph": "X", "tid": 2, "cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 30},  # not a collective
    ]
    o = T.overlap(T.lanes(events, main))
    assert o["comm_ms"] * 1e3 == 6 and o["blocked_ms"] * 1e3 == 4
    assert o["hidden_ms"] * 1e3 == 4 and o["hidden_frac"] == 4 / 6


def test_results_md_keeps_and_replaces_the_mixed_precision_section(tmp_path):
    import bench

    path = tmp_path / "RESULTS.md"
    bench.write_results("# fp32 run 1\n", mixed=False, path=path)
    fp32 = path.read_text()
    bench.write_results(f"{bench.MP_SECTION}\n\nA\n", mixed=True, path=path)
    assert path.read_text() == fp32 + f"\n{bench.MP_SECTION}\n\nA\n"  # appended, the fp32 part untouched
    bench.write_results(f"{bench.MP_SECTION}\n\nB\n", mixed=True, path=path)
    assert path.read_text() == fp32 + f"\n{bench.MP_SECTION}\n\nB\n"  # replaced
    bench.write_results("# fp32 run 2\n", mixed=False, path=path)
    text = path.read_text()
    assert text.startswith("# fp32 run 2\n") and text.endswith(f"\n{bench.MP_SECTION}\n\nB\n")  # kept


def test_mixed_precision_guard_compares_each_system_with_the_fsdp2_of_its_precision():
    import bench

    def run(**losses):
        return {"backend": "gloo", "world": 2, "model": {"name": "m"}, "precision": "bf16",
                "systems": {n: {"loss": v} for n, v in losses.items()}}

    ok = run(fsdp2=[2.0, 1.5], fs_fully_shard=[2.0, 1.5], fs_apply=[2.0, 1.5 + 1e-4], fsdp2_fp32=[2.001, 1.6],
             unsharded=[2.001, 9.0], ddp=[2.001, 1.6])
    assert bench.guard(ok) == []
    assert ok["systems"]["ddp"]["loss_ref"] == "fsdp2_fp32" and ok["systems"]["fs_apply"]["loss_ref"] == "fsdp2"
    assert ok["systems"]["fsdp2_fp32"]["loss_tol"] is None  # what bf16 does to the loss: recorded, not checked
    bad = run(fsdp2=[2.0, 1.5], fs_apply=[2.0 + 1e-5, 1.5], fsdp2_fp32=[2.001, 1.6], ddp=[2.001, 1.7])
    msgs = bench.guard(bad)
    assert len(msgs) == 2 and "fs_apply: step-1" in msgs[0] and "ddp: step-2" in msgs[1]
