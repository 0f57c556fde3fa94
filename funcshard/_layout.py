"""Per-plan layout facts, computed once per Plan object and kept beside it (not in it: a Plan is frozen data).

``layouts(plan)``: each group's ``Buckets`` (one flat bucket per dtype, parameters at fixed offsets: what the
gather and the reduce-scatter move). ``expected_shards(plan)``: each parameter's local shard shape and dtype, for
``check_state``'s fast path.
"""

from __future__ import annotations

import weakref

import torch

from funcshard._collectives import Buckets
from funcshard._plan import Plan

_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EXPECTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layouts(plan: Plan) -> dict[str, Buckets]:
    hit = _LAYOUTS.get(plan)
    if hit is None:
        hit = _LAYOUTS[plan] = {g.name: Buckets([plan.specs[p] for p in g.params]) for g in plan.groups}
    return hit


def expected_shards(plan: Plan) -> dict[str, tuple[torch.Size, torch.dtype]]:
    hit = _EXPECTED.get(plan)
    if hit is None:
        hit = _EXPECTED[plan] = {k: (torch.Size(s.local_shape), s.dtype) for k, s in plan.specs.items()}
    return hit
