"""Per-plan layout facts, computed once per Plan object (``Plan.derived``).

``layouts(plan)``: each group's ``Buckets`` (one flat bucket per dtype, parameters at fixed offsets: what the
gather and the reduce-scatter move). ``expected_shards(plan)``: each parameter's local shard shape and dtype, for
``check_state``'s fast path.
"""

from __future__ import annotations

import torch

from funcshard._pipeline import Buckets
from funcshard._plan import Plan

def layouts(plan: Plan) -> dict[str, Buckets]:
    return plan.derived("layouts", lambda plan: {
        g.name: Buckets([plan.specs[p] for p in g.params], param_dtype=g.param_dtype, reduce_dtype=g.reduce_dtype)
        for g in plan.groups})


def expected_shards(plan: Plan) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return plan.derived("expected_shards", lambda plan: {k: (torch.Size(s.local_shape), s.dtype)
                                                         for k, s in plan.specs.items()})


def full_layouts(plan: Plan) -> dict[str, Buckets]:
    """The layouts in the shards' own dtypes, whatever the groups' precision: ``gather`` returns the parameters as
    they were sharded, bit for bit (unshard(shard(x)) == x)."""
    return plan.derived("full_layouts", lambda plan: {
        g.name: Buckets([plan.specs[p] for p in g.params]) for g in plan.groups})
