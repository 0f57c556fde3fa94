"""fully_shard: FSDP2's module API (``torch.distributed.fsdp``) as a drop-in, built on funcshard's core.

    from funcshard import fully_shard           # was: from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())  # DTensor parameters, Shard(dim) over the mesh

How it maps onto the core. Each ``fully_shard`` call makes a *unit*. It shards the unit's parameters at
once (:meth:`ShardSpec.local_shard`: one padded shard per parameter, owned by the adapter) and registers each
as a DTensor ``nn.Parameter`` whose local tensor is the unpadded view of that padded shard, so optimizers,
``clip_grad_norm_``, ``state_dict`` and DCP read and update the shards in place. At the first forward (or
``unshard()``) the outermost unit, the root, builds one :class:`~funcshard.Plan` over its module with one
group per nested unit; unit settings (reshard after forward, prefetch lists) are edits of that Plan. Each
iteration runs one runtime ``Step`` (the runtime ``funcshard.apply`` uses) driven by the units' forward
hooks; at each group's post-backward the core's reduce-scatter output becomes the parameters' DTensor
``.grad``. No collective logic lives here.
"""

from funcshard._mesh import DataParallelMeshDims
from funcshard._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from funcshard.fsdp._api import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from funcshard.fsdp._units import unit_of as _unit_of  # noqa: F401 (tests reach a unit's step)

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
