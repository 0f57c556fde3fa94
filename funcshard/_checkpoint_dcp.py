"""How a local shard meets ``torch.distributed.checkpoint`` (DCP): as the global tensor it is a piece of.

DCP asks each object of a state dict three things (its ``_Checkpointable`` protocol, which DTensor implements):
``__create_write_items__`` (what this rank writes: chunks, with offsets in the global tensor),
``__create_chunk_list__`` (what it holds, to plan reads) and ``__get_tensor_shard__`` (the tensor of one chunk). A
funcshard shard answers with its spec's boxes (``ShardSpec.boxes``), so DCP writes each real element once, skips
padding, and reshards on load between world sizes and layouts. ``present`` hands DCP a DTensor carrying the global
shape (DCP compares it with the checkpoint's) whose local tensor is a view of the shard that answers the protocol:
loads write straight into the shard.

The foot-gun guard: a plain ``dict`` of shards handed to ``dcp.save``/``dcp.load`` is, to DCP, a dict of replicas
(every rank the same key, so one rank's tensor is kept for each key: silent corruption). ``mark`` records which
tensors are shards of a multi-rank plan (weakly; ``shard``, ``funcshard.optim`` and ``funcshard.checkpoint.load``
mark what they return) and the first mark installs a class-level ``__create_write_items__`` /
``__create_chunk_list__`` lookup on ``torch.Tensor`` that is absent (``AttributeError``, so DCP's ``hasattr`` sees
nothing) for every tensor but a marked shard, for which it raises a ``ShardingError`` pointing to
``funcshard.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from funcshard._compat import dtensor_local
from funcshard._spec import ShardingError, ShardSpec

_marked = WeakIdKeyDictionary()  # a multi-rank plan's local shard -> its ShardSpec
_WATCHED = ("__create_write_items__", "__create_chunk_list__")


def _refuse(name: str):
    def get(t: torch.Tensor):
        own = t.__dict__.get(name)
        if own is not None:  # set on this tensor (``present``'s carriers)
            return own
        spec = _marked.get(t) if type(t) is torch.Tensor else None
        if spec is None:
            raise AttributeError(name)
        raise ShardingError(
            f"torch.distributed.checkpoint got a funcshard local shard as a plain tensor (a shard of {spec.fqn}: "
            f"local {tuple(t.shape)} of global {spec.shape} over {spec.world} ranks); DCP would take the ranks' "
            f"different shards for replicas and keep one rank's. Save and load funcshard state with "
            f"funcshard.checkpoint.save(plan, state, opt_state, checkpoint_id=..., tx=tx) / "
            f"funcshard.checkpoint.load(...), or put funcshard.checkpoint.state_dict(plan, state, opt_state, tx=tx) "
            f"(global DTensors) in your DCP state dict"
        )

    def set(t: torch.Tensor, value) -> None:
        t.__dict__[name] = value

    return property(get, set)


def mark(specs: Iterable[ShardSpec], tensors: Iterable[torch.Tensor]) -> None:
    """Record ``tensors`` as the local shards of ``specs`` (only for multi-rank plans: one rank's shards are the
    whole tensors, which plain DCP handles)."""
    for spec, t in zip(specs, tensors):
        if spec.world > 1:
            if "__create_write_items__" not in torch.Tensor.__dict__:
                for name in _WATCHED:
                    setattr(torch.Tensor, name, _refuse(name))
            _marked[t] = spec


def inherit(sources: Iterable[torch.Tensor], results: Iterable[torch.Tensor]) -> None:
    """Mark each result like its source (an optimizer's new moments, new parameters); a no-op when nothing is marked."""
    if not _marked:
        return
    for s, r in zip(sources, results):
        spec = _marked.get(s)
        if spec is not None and r is not s:
            _marked[r] = spec


def spec_of(t: torch.Tensor) -> ShardSpec | None:
    return _marked.get(t)


class _Placed:
    """The DCP protocol for one rank's local shard of ``spec`` (see the module docstring)."""

    __slots__ = ("boxes", "local", "spec")

    def __init__(self, spec: ShardSpec, local: torch.Tensor, rank: int):
        self.spec, self.local, self.boxes = spec, local, spec.boxes(rank)

    def write_items(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self.local)
        size = torch.Size(self.spec.global_shape)  # (a model-sharded parameter: its DTensor's)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets),
                                                                                 sizes=torch.Size(b.sizes)),
                                                      properties=props, size=size))
                for b in self.boxes]

    def chunk_list(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in self.boxes]

    def tensor_shard(self, index) -> torch.Tensor:
        for b in self.boxes:
            if tuple(index.offset) == b.offsets:
                return b.view(self.local)
        raise ValueError(f"{self.spec.fqn}: this rank holds no chunk at offset {tuple(index.offset)}")


def present(spec: ShardSpec, local: torch.Tensor, mesh, rank: int):
    """``local`` (a rank's padded shard of ``spec``) as a DTensor of the global shape for DCP: a genuine
    ``Shard(dim)`` DTensor in the per-parameter layout; in the flat layout (and for a 0-dim parameter) a carrier
    whose placement DCP does not read (only the protocol: what it writes and where loads go)."""
    from torch.distributed.tensor import Replicate

    if spec.flat is None and spec.shape:
        out = spec.dtensor(spec.valid_part(local, rank), mesh)
    else:  # a new tensor object (the protocol is set on it, not on ``local``); a flat piece without a 0-dim
        # parameter's element is empty: a 0-dim stand-in (no box on this rank: DCP reads and writes nothing there)
        carrier = local.view(local.shape) if spec.shape or local.numel() else local.new_zeros(())
        out = spec.dtensor(carrier, mesh, (Replicate(),) * mesh.ndim)
    placed = _Placed(spec, local, rank)
    carried = dtensor_local(out)  # the DTensor's own local tensor: DTensor hands DCP's calls to it
    carried.__create_write_items__ = placed.write_items
    carried.__create_chunk_list__ = placed.chunk_list
    carried.__get_tensor_shard__ = placed.tensor_shard
    return out
