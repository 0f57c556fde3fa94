"""funcshard: fully sharded data parallel training for PyTorch, done the JAX way.

```python
plan = funcshard.plan(model, mesh, groups=(Block,))      # specs, groups, schedule: frozen data
state = funcshard.shard(plan)                            # dict[str, Tensor] of this rank's shards
loss = lambda s, x, y: F.cross_entropy(funcshard.apply(plan, s, x), y)
loss_value, grads = funcshard.value_and_grad(loss)(state, x, y)   # sharded, averaged over ranks
# (torch.func transforms compose too, nested: vmap(grad(loss)), jvp(grad(loss)), ...: docs/transforms.md)
```
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

# Start-up (issue 36): ``import funcshard`` imports the core that planning needs (torch, torch.distributed, DTensor,
# the plan, specs and policies: the names bound below) and nothing more (not torch.distributed.fsdp). Each other
# public name is imported from its module the first time it is read (``funcshard.apply``, ``from funcshard import
# checkpoint``): the runtime's modules import torch._dynamo (their entry points are ``torch.compiler.disable``d, see
# funcshard._compile), the cost model's trace torch's flop counter, checkpoint torch.distributed.checkpoint when it
# saves or loads. (benchmarks/STARTUP.md; tests/test_startup.py keeps them out of ``import funcshard``)
from funcshard._collectives import CollectiveError, CollectiveTimeout, DivergenceError
from funcshard._comm import CommHook, bf16_reduce_scatter, int8_all_gather
from funcshard._plan import Group, Plan, plan
from funcshard._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from funcshard._primitives import all_gather, all_reduce, reduce_scatter
from funcshard._spec import ModelSharding, ShardingError, ShardSpec

if TYPE_CHECKING:  # (what the lazy names below are, for type checkers and editors)
    from funcshard import checkpoint, cost, optim, trace
    from funcshard._apply import apply
    from funcshard._grad import value_and_grad
    from funcshard._mesh import DataParallelMeshDims
    from funcshard._shard import check_state, gather, shard
    from funcshard._traced import traced_apply
    from funcshard.fsdp import (FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method,
                                share_comm_ctx)

# public name -> the module it is imported from when first read (a public submodule: itself)
_LAZY = {
    "checkpoint": "funcshard.checkpoint", "cost": "funcshard.cost", "optim": "funcshard.optim",
    "trace": "funcshard.trace",
    "apply": "funcshard._apply", "value_and_grad": "funcshard._grad", "traced_apply": "funcshard._traced",
    "check_state": "funcshard._shard", "gather": "funcshard._shard", "shard": "funcshard._shard",
    "DataParallelMeshDims": "funcshard._mesh",
    "FSDPModule": "funcshard.fsdp", "UnshardHandle": "funcshard.fsdp", "fully_shard": "funcshard.fsdp",
    "register_fsdp_forward_method": "funcshard.fsdp", "share_comm_ctx": "funcshard.fsdp",
}


def __getattr__(name: str):
    """The public names not imported with the package (``_LAZY``), imported on first read and bound here; any
    other submodule (``funcshard.fsdp``, ``funcshard._runtime``: attributes of the package once imported, as when
    the package imported them all) is imported when read too."""
    module = _LAZY.get(name)
    if module is None:
        if name.startswith("__") or importlib.util.find_spec(f"funcshard.{name}") is None:
            raise AttributeError(f"module 'funcshard' has no attribute {name!r}")
        module = f"funcshard.{name}"
    mod = importlib.import_module(module)
    value = mod if module == f"funcshard.{name}" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
