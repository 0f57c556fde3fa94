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
