"""Per-parameter shard specs: which mesh axis, which tensor dim, how much padding.

Vocabulary (as in torchtitan): an *axis* is a DeviceMesh axis, a *dim* is a tensor dimension.

A parameter of global size ``n`` along its shard dim, sharded over ``W`` ranks, is padded to
``W * chunk`` with ``chunk = ceil(n / W)``; rank ``r`` holds rows ``[r * chunk, (r + 1) * chunk)`` of the
padded tensor. The unpadded part of each rank's shard is exactly what ``torch.chunk`` (and so DTensor's
``Shard(dim)``) gives that rank. Padding entries are zeros and stay zeros under gradient descent, because
their gradient is zero. A 0-dim parameter is sharded as a 1-element vector.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch

from funcshard._compat import dtensor_over, get_interpreter_stack

__all__ = ["Box", "FlatSlot", "ModelSharding", "ShardSpec", "ShardingError", "dim_range", "make_spec", "reduced",
           "takes_grad"]


def _dtensor(local: torch.Tensor, mesh, placements, shape: torch.Size, stride: tuple):
    """``DTensor.from_local`` without its check, and without its move where ``local`` is not on the mesh's device
    type (a CPU-offloaded shard under a CUDA mesh stays the shard: ``_compat.dtensor_over``)."""
    from torch.distributed.tensor import DTensor

    if local.is_meta or local.device.type == mesh.device_type:
        with torch.no_grad():
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    return dtensor_over(local, mesh, placements, shape, stride)


@dataclasses.dataclass(frozen=True)
class FlatSlot:
    """Where a parameter lives in its group's flat buffer (``layout="flat"``).

    A group's parameters of one dtype are concatenated (flattened, in group order) into one buffer of
    ``total`` elements, padded to ``world * ceil(total / world)``; rank ``r`` holds the contiguous slice
    ``[r * chunk, (r + 1) * chunk)`` of it. The all-gathered buffer then *is* the parameters (each a view),
    so there is no copy-out; each parameter's local shard is its (possibly empty) piece of this rank's
    slice, which differs in size between ranks.
    """

    offset: int
    total: int
    rank: int

    def piece(self, numel: int, world: int, rank: int) -> tuple[int, int]:
        """(start within the flattened parameter, length) of the parameter's piece on ``rank``."""
        chunk = math.ceil(self.total / world)
        lo = max(self.offset, rank * chunk)
        hi = min(self.offset + numel, (rank + 1) * chunk)
        return lo - self.offset, max(0, hi - lo)


@dataclasses.dataclass(frozen=True)
class Box:
    """A rectangular piece of a parameter that one rank holds: ``offsets`` and ``sizes`` in the global tensor,
    and where it is in the rank's local shard (the rows ``[0, sizes[dim])`` of ``dim``, or the ``sizes``-shaped
    run of the flat piece starting at ``start``). What a checkpoint writes and reads (DCP's chunks)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dim: int | None = None  # per-parameter layout: narrow the local shard on this dim
    start: int = 0  # flat layout: the box is local[start : start + numel].view(sizes)

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The box as a view of the rank's local shard (writes through to it)."""
        if self.dim is not None:
            return local.narrow(self.dim, 0, self.sizes[self.dim]) if self.sizes else local.view(())
        return local.narrow(0, self.start, math.prod(self.sizes)).view(self.sizes)


def _range_boxes(shape: tuple[int, ...], lo: int, hi: int, base: int = 0):
    """Split the row-major range ``[lo, hi)`` of a tensor of ``shape`` into boxes that are each contiguous in it:
    a partial first row, whole rows, a partial last row (recursively). Yields (offsets, sizes, lo)."""
    if lo >= hi:
        return
    if not shape:
        yield (), (), lo
        return
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    if lo % inner:  # a partial first row
        row, end = lo // inner, min(hi, (lo // inner + 1) * inner)
        for off, size, at in _range_boxes(shape[1:], lo - row * inner, end - row * inner):
            yield (row, *off), (1, *size), at + row * inner
        lo = end
    first, last = lo // inner, hi // inner  # whole rows (lo is at a row start now, or past hi)
    if lo < hi and last > first:
        yield (first, *zeros), (last - first, *shape[1:]), lo
        lo = last * inner
    if lo < hi:  # a partial last row
        row = lo // inner
        for off, size, at in _range_boxes(shape[1:], lo - row * inner, hi - row * inner):
            yield (row, *off), (1, *size), at + row * inner


class ShardingError(ValueError):
    """Bad input to funcshard: the message names the parameter, the shapes, the mesh and the fix."""


@dataclasses.dataclass(frozen=True, eq=False)
class ModelSharding:
    """A parameter the model itself already shards: a DTensor (tensor parallel, or any placements on an SPMD mesh).
    Its *local* tensor is what FSDP shards over the data-parallel axes; gathering over them gives that local tensor
    back, which the module sees as a DTensor again (``ShardSpec.present``).

    Attributes:
        mesh: the module's DTensor's mesh (the TP mesh, or the full SPMD mesh with ``Replicate()`` on the
            data-parallel axes).
        placements: the DTensor's placements on ``mesh``.
        shape: its global shape.
        stride: its global stride.
        dp_axes: the axes of ``mesh`` that are data-parallel (an SPMD mesh; empty for a TP mesh): a gradient keeps
            its placements there (``Partial`` from a sharded batch is what the reduce-scatter sums), every other
            axis is redistributed to the parameter's own placements before the reduce-scatter (FSDP2's rule).
        sharded_mesh: the mesh of the sharded parameter as a DTensor (what ``fully_shard`` registers and checkpoints
            hold): the data-parallel axes and the model's.
        sharded_placements: its placements there: the model's, and ``Shard(dim)`` (``_StridedShard`` where the model
            shards the same dim on a later axis) on the shard axis.
        offsets: where this rank's local tensor starts in the global one (per dim).
    """

    mesh: object = dataclasses.field(repr=False)
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dp_axes: frozenset = frozenset()
    sharded_mesh: object = dataclasses.field(default=None, repr=False)
    sharded_placements: tuple = ()
    offsets: tuple[int, ...] = ()

    def present(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's local tensor, gathered over the data-parallel axes) as the module's DTensor,
        differentiably: the gradient comes back as the local tensor of the gradient redistributed to the
        parameter's placements on the model's axes (``_Present``).

        Args:
            local: this rank's local tensor, gathered over the data-parallel axes.
        """
        if get_interpreter_stack():
            raise NotImplementedError(
                "a model-sharded (tensor-parallel DTensor) parameter under a torch.func transform: torch's DTensor "
                "does not run under torch.func (DTensor.from_local's autograd Function has no setup_context); take "
                "gradients with funcshard.value_and_grad or loss.backward() (plain autograd)")
        return _Present.apply(local, self)


class _Present(torch.autograd.Function):
    """local tensor -> the module's DTensor (no copy); backward: the gradient DTensor redistributed to the
    parameter's own placements on every non-data-parallel axis (a ``Partial`` there is summed over that axis, e.g.
    the TP ranks), kept as it is on the data-parallel axes, and its local tensor (what the reduce-scatter takes)."""

    @staticmethod
    def forward(local, model):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, model.mesh, model.placements, run_check=False,
                                  shape=torch.Size(model.shape), stride=model.stride)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.model = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        if not isinstance(grad, DTensor):
            return grad, None
        model = ctx.model
        target = tuple(grad.placements[i] if i in model.dp_axes else p for i, p in enumerate(model.placements))
        if tuple(grad.placements) != target:
            grad = grad.redistribute(model.mesh, target)
        return grad.to_local(), None


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one parameter is sharded. Frozen, printable data.

    Attributes:
        fqn: the parameter's canonical path in the module (its first name when tied).
        shape: global (unsharded) shape.
        dtype: dtype of the parameter.
        dim: the tensor dim that is sharded (0 for a 0-dim parameter, sharded as shape ``(1,)``).
        axis: the mesh axis the dim is sharded over (an index into the mesh's axes).
        world: number of shards (the size of that mesh axis).
        requires_grad: whether the module's parameter requires grad.
        aliases: every path under which the parameter is reachable (tied parameters have several).
        flat: its slot in the group's flat buffer (``layout="flat"``); None in the per-parameter layout.
        model: the model's own sharding (a tensor-parallel DTensor, :class:`ModelSharding`): ``shape`` is then its
            local shape; None for a plain parameter.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    axis: int
    world: int
    requires_grad: bool = True
    aliases: tuple[str, ...] = ()
    flat: FlatSlot | None = None
    model: ModelSharding | None = None  # the model's own sharding (a TP DTensor): ``shape`` is then its local shape

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def sharded_shape(self) -> tuple[int, ...]:
        """The shape that is split: ``shape``, or ``(1,)`` for a 0-dim parameter."""
        return self.shape if self.shape else (1,)

    @functools.cached_property
    def size(self) -> int:
        """Global size of the shard dim."""
        return self.sharded_shape[self.dim]

    @functools.cached_property
    def chunk(self) -> int:
        """Size of every rank's shard along the shard dim, padding included."""
        return math.ceil(self.size / self.world)

    @functools.cached_property
    def padding(self) -> int:
        return self.chunk * self.world - self.size

    @functools.cached_property
    def padded_shape(self) -> tuple[int, ...]:
        s = list(self.sharded_shape)
        s[self.dim] = self.chunk * self.world
        return tuple(s)

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """This rank's shard shape (the same on every rank, except in the flat layout)."""
        if self.flat is not None:
            return (self.flat.piece(self.numel, self.world, self.flat.rank)[1],)
        s = list(self.sharded_shape)
        s[self.dim] = self.chunk
        return tuple(s)

    @functools.cached_property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def local_valid(self, rank: int) -> int:
        """How many rows of rank ``rank``'s shard along ``dim`` are real data (the rest is padding).

        Args:
            rank: the rank's index on the shard axis.
        """
        return max(0, min(self.chunk, self.size - rank * self.chunk))

    def split_view(self, padded: torch.Tensor) -> torch.Tensor:
        """View a padded full tensor as ``(W, *local_shape)`` (rank-major, the all-gather layout).

        The result is a strided view (no copy), with the rank index first; ``from_split`` is its inverse.

        Args:
            padded: the padded full tensor (``padded_shape``).
        """
        d = self.dim
        shp = list(self.padded_shape)
        shp[d : d + 1] = [self.world, self.chunk]
        return padded.view(shp).movedim(d, 0)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """The parameter as a view of its padded full tensor.

        Args:
            padded: the padded full tensor (``padded_shape``).
        """
        return unpad(padded, self.dim, self.size, self.padding, self.shape)

    def local_shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s padded shard of the full tensor, as a new contiguous tensor.

        Args:
            full: the full (unsharded) parameter.
            rank: the rank's index on the shard axis.
        """
        if self.flat is not None:
            start, n = self.flat.piece(self.numel, self.world, rank)
            return full.reshape(-1)[start : start + n].clone()
        full = full.reshape(self.sharded_shape)
        out = full.new_zeros(self.local_shape)
        n = self.local_valid(rank)
        if n:
            out.narrow(self.dim, 0, n).copy_(full.narrow(self.dim, rank * self.chunk, n))
        return out

    def valid_part(self, local: torch.Tensor, rank: int) -> torch.Tensor:
        """The real rows of rank ``rank``'s padded shard (a view): what DTensor's ``Shard(dim)`` holds there.

        Args:
            local: rank ``rank``'s padded shard.
            rank: the rank's index on the shard axis.
        """
        return valid_rows(local, self.dim, self.local_valid(rank))

    def dtensor(self, local: torch.Tensor, mesh, placements=None):
        """A DTensor of the global shape over ``local`` (no copy, no check): by default sharded on ``dim`` over the
        spec's ``axis`` of ``mesh`` (the shard axis ``_mesh.dp_axes`` chose when the spec was made) and replicated over
        the others (``Shard(dim)``, or ``(Replicate(), Shard(dim))`` on an HSDP mesh: ``shard_placements``) over the
        unpadded part of a rank's shard (``valid_part``), as ``fully_shard``'s parameters and checkpoints present it.
        A 0-dim parameter (sharded as a 1-element vector): a replicated 0-dim DTensor over ``local`` viewed as 0-dim
        (``from_local`` takes an empty ``shape`` for "none given", so it cannot be passed).

        Args:
            local: this rank's shard (its valid part, as DTensor's ``Shard(dim)`` holds it).
            mesh: the DeviceMesh of the DTensor.
            placements: its placements (default: ``Shard(dim)`` on the shard axis, ``Replicate()`` on the others).
        """
        from torch.distributed.tensor import Replicate

        if self.model is not None:  # over the data-parallel and the model's axes (``ModelSharding.sharded_*``)
            m = self.model  # (placements given: a carrier whose placements nobody reads, replicated on every axis)
            return _dtensor(local, m.sharded_mesh, m.sharded_placements if placements is None else
                            (Replicate(),) * m.sharded_mesh.ndim, torch.Size(m.shape), m.stride)
        if not self.shape:
            return _dtensor(local.view(()), mesh, placements or (Replicate(),) * mesh.ndim, torch.Size(()), ())
        return _dtensor(local, mesh, placements or shard_placements(mesh.ndim, self.axis, self.dim),
                        torch.Size(self.shape), contiguous_stride(self.shape))

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The parameter's global shape: ``shape``, or the model's DTensor's when the model shards it too."""
        return self.shape if self.model is None else self.model.shape

    def present(self, full: torch.Tensor) -> torch.Tensor:
        """A gathered parameter as the module uses it: itself, or the model's DTensor over it (``ModelSharding``).

        Args:
            full: the gathered (local, for a model-sharded parameter) tensor.
        """
        return full if self.model is None else self.model.present(full)

    def boxes(self, rank: int) -> list[Box]:
        """The pieces of the parameter that rank ``rank`` holds, in global coordinates (none: only padding).

        Per-parameter layout: one box, the rank's real rows (a 0-dim parameter: rank 0 holds it). Flat layout:
        the rank's run of the flattened parameter, split into row-major boxes. The layout-independent form of a
        shard: a checkpoint written from either layout, at any world size, is read by any other.

        Args:
            rank: the rank's index on the shard axis.
        """
        if self.flat is not None:
            start, n = self.flat.piece(self.numel, self.world, rank)
            shift = self.model.offsets if self.model is not None else (0,) * len(self.shape)
            return [Box(tuple(o + d for o, d in zip(off, shift)), tuple(size), start=at - start)
                    for off, size, at in _range_boxes(self.shape, start, start + n)]
        n = self.local_valid(rank)
        if not n:
            return []
        if not self.shape:
            return [Box((), (), dim=0)]
        offsets = list(self.model.offsets) if self.model is not None else [0] * len(self.shape)
        offsets[self.dim] += rank * self.chunk
        sizes = list(self.shape)
        sizes[self.dim] = n
        return [Box(tuple(offsets), tuple(sizes), dim=self.dim)]

    def describe(self) -> str:
        """One line for ``print(plan)``: path, global shape, dtype, the sharded dim and axis, the local shape."""
        if self.model is not None:  # the model's own sharding first: what the data-parallel axes shard is its local
            m = self.model
            return (f"{self.fqn}: {m.shape} {_placements_str(m)}, its local "
                    f"{dataclasses.replace(self, model=None).describe().split(': ', 1)[1]}")
        if self.flat is not None:
            start, n = self.flat.piece(self.numel, self.world, self.flat.rank)
            return (f"{self.fqn}: {tuple(self.shape)} {str(self.dtype).removeprefix('torch.')} flat "
                    f"[{self.flat.offset}, {self.flat.offset + self.numel}) of {self.flat.total} over axis "
                    f"{self.axis} -> local ({n},) on rank {self.flat.rank}")
        pad = f" pad {self.padding}" if self.padding else ""
        tied = f" tied {list(self.aliases[1:])}" if len(self.aliases) > 1 else ""
        frozen = "" if self.requires_grad else " frozen"
        return (
            f"{self.fqn}: {tuple(self.shape)} {str(self.dtype).removeprefix('torch.')} "
            f"dim {self.dim} over axis {self.axis} -> local {self.local_shape}{pad}{frozen}{tied}"
        )


# ---- the padded layout on plain arguments (ShardSpec's methods call these; so do the traced mode, whose constants
# are plain tuples, and the adapter's DTensor parameters) ----------------------------------------------------------


def unpad(padded: torch.Tensor, dim: int, size: int, padding: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A parameter of ``shape`` as a view of its padded full tensor (``size`` real rows along ``dim``, then
    ``padding`` rows of zeros)."""
    out = padded.narrow(dim, 0, size) if padding else padded
    return out.view(shape)


def from_split(stacked: torch.Tensor, dim: int, padded_shape: tuple[int, ...]) -> torch.Tensor:
    """Every rank's shard stacked rank-major, ``(W, *local_shape)`` (the all-gather layout), as the padded full
    tensor: the inverse of ``ShardSpec.split_view``."""
    return stacked.movedim(0, dim).reshape(padded_shape)


def valid_rows(local: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The first ``n`` rows along ``dim`` of a padded local shard, a view (itself when every row is real): what
    DTensor's ``Shard(dim)`` holds on that rank (``ShardSpec.local_valid`` says ``n``)."""
    return local if n == local.shape[dim] else local.narrow(dim, 0, n)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a DTensor's global stride)."""
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def differentiable(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` have gradients (floating point or complex; integer parameters have none)."""
    return dtype.is_floating_point or dtype.is_complex


def takes_grad(requires_grad: bool, dtype: torch.dtype) -> bool:
    """Whether a parameter's gradient is reduce-scattered: it requires grad and its dtype has gradients."""
    return requires_grad and differentiable(dtype)


def reduced(flat: bool, requires_grad: Sequence[bool], dtypes: Sequence[torch.dtype]) -> tuple[int, ...]:
    """The one rule for which of a group's parameters (by position) its gradient reduce-scatter covers: none if none
    takes a gradient; per-parameter layout, those that take one (a frozen parameter costs no traffic and no buffer,
    as in FSDP2); flat layout, every one whose dtype has gradients (each keeps its offset in the flat buffer). The
    schedule asks it with the plan's ``requires_grad`` (the module's), the runtime with the shards' it is given."""
    if not any(requires_grad):
        return ()
    return tuple(i for i, (g, dt) in enumerate(zip(requires_grad, dtypes)) if (g or flat) and differentiable(dt))


def shard_placements(ndim: int, axis: int, dim: int) -> tuple:
    """The DTensor placements of a tensor sharded on tensor dim ``dim`` over mesh axis ``axis`` of an ``ndim``-axis
    mesh: ``Shard(dim)`` there, ``Replicate()`` on every other axis (``_mesh.dp_placements`` asks it with the shard
    axis ``_mesh.dp_axes`` chose; ``ShardSpec.dtensor`` with its own ``axis``)."""
    from torch.distributed.tensor import Replicate, Shard

    return tuple(Shard(dim) if i == axis else Replicate() for i in range(ndim))


def _placements_str(m: ModelSharding) -> str:
    """The model's placements by axis name, e.g. ``"model-sharded (tp: Shard(dim=0))"``."""
    names = m.mesh.mesh_dim_names or tuple(str(i) for i in range(m.mesh.ndim))
    return "model-sharded (" + ", ".join(f"{n}: {p}" for n, p in zip(names, m.placements)) + ")"


def dim_range(shape: tuple[int, ...]) -> tuple[int, int]:
    """The dims a parameter of ``shape`` can be sharded on, ``(lowest, highest)``: a 0-dim parameter is sharded as a
    1-element vector, so -1 and 0 name its one dim."""
    n = max(len(shape), 1)
    return -n, n - 1


def placement_dim(fqn: str, chosen: object) -> int:
    """A ``shard_placement_fn``'s answer for ``fqn`` as a tensor dim: ``None`` (dim 0), an int, or a DTensor
    ``Shard(dim)``. Anything else (a str, a float, a bool) raises, naming the parameter, the value and the fix."""
    if chosen is None:
        return 0
    dim = chosen.dim if isinstance(getattr(chosen, "dim", None), int) else chosen  # Shard(dim) too
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ShardingError(
            f"{fqn}: shard_placement_fn returned {chosen!r} ({type(chosen).__name__}), not a tensor dim; return an "
            f"int (0 for the first dim, -1 for the last), a Shard(dim), or None for dim 0")
    return dim


def make_spec(fqn: str, param: torch.Tensor, dim: int, *, axis: int, world: int,
              aliases: tuple[str, ...] = (), model: ModelSharding | None = None,
              requires_grad: bool | None = None) -> ShardSpec:
    """The spec of ``param`` sharded on ``dim`` (in ``dim_range``: callers check it and word the error) over
    ``world`` ranks of mesh axis ``axis``. The one place a parameter becomes a spec, for ``plan`` and ``fully_shard``.
    ``model``: the parameter is a DTensor the model shards itself; ``param`` is then its local tensor.
    """
    lo, hi = dim_range(tuple(param.shape))
    if not lo <= dim <= hi:
        raise ShardingError(f"{fqn}: shape {tuple(param.shape)} has no dim {dim}; pick a dim in [{lo}, {hi}]")
    return ShardSpec(fqn=fqn, shape=tuple(param.shape), dtype=param.dtype, dim=dim % (hi + 1), axis=axis,
                     world=world, requires_grad=param.requires_grad if requires_grad is None else requires_grad,
                     aliases=aliases or (fqn,), model=model)


# ---- which tensors are local shards, and of what ----------------------------------------------------------------

_LABEL = "_funcshard_shard"  # a labelled tensor's instance attribute (nothing is set on torch.Tensor)
_labelled = False  # whether any tensor was ever labelled (shard_like does nothing until then)


def label_shard(t: torch.Tensor, label) -> None:
    """Record ``t`` as a local shard of ``label.spec``'s parameter. ``label``: what the record carries, its ``spec``
    and ``shape`` (``t``'s), ``reshaped(shape)`` (the label of a tensor of another shape of the same parameter) and
    ``install(t)`` (what else it puts on the tensor: ``_checkpoint_dcp``'s answers to plain DCP)."""
    global _labelled
    _labelled = True
    t.__dict__[_LABEL] = label
    label.install(t)


def shard_label(t):
    """The label ``label_shard`` recorded on ``t`` (a plain tensor), or None."""
    return t.__dict__.get(_LABEL) if type(t) is torch.Tensor else None


def shard_like(sources, results) -> None:
    """Each result is a local shard of the same parameter as its source: the optimizer state sharded like the
    parameters (an optimizer's new moments and new parameters are labelled like the ones they replace). A no-op until
    something is labelled."""
    if not _labelled:
        return
    for s, r in zip(sources, results):
        label = shard_label(s)
        if label is not None and r is not s and type(r) is torch.Tensor:
            shape = tuple(r.shape)
            label_shard(r, label if label.shape == shape else label.reshaped(shape))
