"""funcshard: fully sharded data parallel training for PyTorch, done the JAX way.

```python
plan = funcshard.plan(model, mesh, groups=(Block,))      # specs, groups, schedule: frozen data
state = funcshard.shard(plan)                            # dict[str, Tensor] of this rank's shards
loss = lambda s, x, y: F.cross_entropy(funcshard.apply(plan, s, x), y)
loss_value, grads = funcshard.value_and_grad(loss)(state, x, y)   # sharded, averaged over ranks
# (torch.func.grad(loss)(state, x, y) works too: one torch.func level; nested transforms are refused)
```
"""

from funcshard import checkpoint, cost, optim, trace
from funcshard._apply import apply
from funcshard._comm import CommHook, bf16_reduce_scatter, int8_all_gather
from funcshard._collectives import CollectiveError, CollectiveTimeout, DivergenceError
from funcshard._primitives import all_gather, all_reduce, reduce_scatter
from funcshard._grad import value_and_grad
from funcshard._plan import Group, Plan, plan
from funcshard._shard import check_state, gather, shard
from funcshard._spec import ModelSharding, ShardingError, ShardSpec
from funcshard._traced import traced_apply
from funcshard.fsdp import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)

__all__ = [
    "CPUOffloadPolicy",
    "CollectiveError",
    "CollectiveTimeout",
    "CommHook",
    "DivergenceError",
    "DataParallelMeshDims",
    "FSDPModule",
    "Group",
    "MixedPrecisionPolicy",
    "ModelSharding",
    "OffloadPolicy",
    "Plan",
    "ShardSpec",
    "ShardingError",
    "UnshardHandle",
    "all_gather",
    "all_reduce",
    "apply",
    "bf16_reduce_scatter",
    "check_state",
    "checkpoint",
    "cost",
    "fully_shard",
    "gather",
    "int8_all_gather",
    "optim",
    "plan",
    "reduce_scatter",
    "register_fsdp_forward_method",
    "shard",
    "share_comm_ctx",
    "trace",
    "traced_apply",
    "value_and_grad",
]
