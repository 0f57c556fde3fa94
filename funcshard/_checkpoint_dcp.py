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
tensors are shards of a multi-rank plan (``shard``, ``funcshard.optim`` and ``funcshard.checkpoint.load`` mark
what they return; the optimizers pass the mark on to the moments they make, ``_spec.shard_like``) by giving each such
tensor its own answer to DCP's protocol names (instance attributes; nothing is set on ``torch.Tensor``, so no
other tensor changes; the answer is the mark, ``_spec.label_shard``'s label: ``spec_of`` reads it): a
:class:`_Refusal`, which raises a ``ShardingError`` pointing to ``funcshard.checkpoint``. The optimizer states (tuples,
which DCP pickles whole without looking inside) answer the same way when they hold a marked shard
(:func:`refuse_container`). A marked shard pickles
(``torch.save``) as a plain tensor: its instance attributes (the answers, and any of the user's) are left out of its
pickled state.

What it cannot see: a tensor the user derives from a shard (``clone()``, ``.to()``, ``detach()``, arithmetic) is a
new tensor without the mark, which DCP saves as a replica again, and so is a shard that went through
``torch.save``/``torch.load``; gradients are not marked; and a list or tuple the user wraps around optimizer
states is pickled whole by DCP without asking its items. Save such objects with ``funcshard.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from funcshard._compat import (DCP_CHUNK_LIST, DCP_TENSOR_SHARD, DCP_WRITE_ITEMS, dcp_bytes_write_items,
                              dtensor_local)
from funcshard._spec import ShardingError, ShardSpec, label_shard, shard_label
from funcshard._tree import tree_leaves


class _Refusal:
    """A marked shard's answer to DCP (see the module docstring): calling it raises. It is the mark itself (the one
    record of which tensors are shards and of what); tensors of one parameter and shape share one."""

    __slots__ = ("shape", "spec")

    def __init__(self, spec: ShardSpec, shape: tuple[int, ...]):
        self.spec, self.shape = spec, shape

    def error(self, holder: str = "") -> ShardingError:
        spec = self.spec
        return ShardingError(
            f"torch.distributed.checkpoint got a funcshard local shard as a plain tensor{holder} (a shard of "
            f"{spec.fqn}: local {self.shape} of global {spec.shape} over {spec.world} ranks); DCP would take the "
            f"ranks' different shards for replicas and keep one rank's. Save and load funcshard state with "
            f"funcshard.checkpoint.save(plan, state, opt_state, checkpoint_id=..., tx=tx) / "
            f"funcshard.checkpoint.load(...), or put funcshard.checkpoint.state_dict(plan, state, opt_state, tx=tx) "
            f"(global DTensors) in your DCP state dict")

    def __call__(self, *args, **kwargs):
        raise self.error()

    def install(self, t: torch.Tensor) -> None:  # (_spec.label_shard: the answers to DCP's protocol names)
        own = t.__dict__
        own[DCP_WRITE_ITEMS] = own[DCP_CHUNK_LIST] = self
        own["__getstate__"] = _no_pickled_state

    def reshaped(self, shape: tuple[int, ...]) -> _Refusal:
        return _Refusal(self.spec, shape)

    def __deepcopy__(self, memo):  # a deep copy of a shard is a shard of the same spec
        return self


def _no_pickled_state():  # a marked shard's ``__getstate__``: pickle it as the plain tensor it is
    return None


def _refusal_of(t) -> _Refusal | None:
    r = shard_label(t)
    return r if type(r) is _Refusal else None


def mark(specs: Iterable[ShardSpec], tensors: Iterable[torch.Tensor]) -> None:
    """Record ``tensors`` as the local shards of ``specs`` (only for multi-rank plans: one rank's shards are the
    whole tensors, which plain DCP handles). What is derived from them as optimizer state carries the mark on
    (``_spec.shard_like``)."""
    for spec, t in zip(specs, tensors):
        if spec.world > 1 and type(t) is torch.Tensor:
            label_shard(t, _Refusal(spec, tuple(t.shape)))


def spec_of(t: torch.Tensor) -> ShardSpec | None:
    refusal = _refusal_of(t)
    return None if refusal is None else refusal.spec


def refuse_container(obj, fqn: str, _obj=None) -> list:
    """DCP's ``__create_write_items__`` for an optimizer state (a tuple: DCP pickles it whole, one copy kept for
    all ranks): refused when a leaf is a marked shard, else pickled as DCP would."""
    for leaf in tree_leaves(obj):
        refusal = _refusal_of(leaf)
        if refusal is not None:
            raise refusal.error(f" inside an optimizer state ({type(obj).__name__} at {fqn!r}, which DCP would "
                                f"pickle whole from one rank)")
    return dcp_bytes_write_items(fqn, obj)


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
    own = carried.__dict__
    own[DCP_WRITE_ITEMS], own[DCP_CHUNK_LIST], own[DCP_TENSOR_SHARD] = (
        placed.write_items, placed.chunk_list, placed.tensor_shard)
    return out
