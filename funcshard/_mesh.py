"""Meshes: which axes are data parallel (the one owner of that rule), their process groups, the default mesh, its
checks, its device, and how it is printed in errors.

Vocabulary (as in torchtitan): an *axis* is a DeviceMesh axis, a *dim* is a tensor dimension.

The axis rule (FSDP2's): a 1-D mesh shards over its one axis; a 2-D mesh is ``(replicate, shard)`` (HSDP): parameters
are sharded over axis 1 and replicated over axis 0, gradients reduce-scattered over axis 1 and then all-reduced over
axis 0. ``dp_axes(mesh)`` says it; every other module asks it (``plan``, ``fully_shard``, the collectives,
``optim``'s norm).

FSDP over parameters the model already shards (tensor parallel; FSDP2's 2-D recipe and torch 2.12+'s
``dp_mesh_dims``): ``model_sharding`` is the one rule for which axes of a DTensor parameter's mesh are the model's and
which are data parallel, and what the sharded parameter is as a DTensor; ``spmd_dp_mesh`` picks the data-parallel
sub-mesh of a full SPMD mesh named by ``DataParallelMeshDims``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from funcshard._compat import StridedShard, concatenate_meshes, root_mesh
from funcshard._spec import ModelSharding, ShardingError, shard_placements


@dataclasses.dataclass(frozen=True)
class DPAxes:
    """The data-parallel axes of a mesh: ``shard`` (parameters are sharded over it), ``replicate`` (None: none; HSDP:
    parameters are replicated over it and gradients all-reduced over it after the reduce-scatter)."""

    shard: int
    replicate: int | None = None


def dp_axes(mesh: DeviceMesh) -> DPAxes:
    """The one rule for which mesh axis shards and which replicates (see the module docstring)."""
    if mesh.ndim == 1:
        return DPAxes(0)
    if mesh.ndim == 2:
        return DPAxes(1, 0)
    raise ShardingError(
        f"mesh {mesh_str(mesh)} has {mesh.ndim} axes; funcshard shards over a 1-D mesh (FSDP) or a 2-D "
        f"(replicate, shard) mesh (HSDP): pass mesh[('replicate', 'shard')] or one axis, mesh['shard']"
    )


def dp_placements(mesh: DeviceMesh, dim: int) -> tuple:
    """The DTensor placements of a parameter sharded on tensor dim ``dim`` over ``mesh``'s data-parallel axes:
    ``(Shard(dim),)`` on a 1-D mesh, ``(Replicate(), Shard(dim))`` on an HSDP mesh (FSDP2's)."""
    return shard_placements(mesh.ndim, dp_axes(mesh).shard, dim)


def axis_name(mesh: DeviceMesh, axis: int) -> str:
    """A mesh axis as printed: its name, else its index."""
    names = mesh.mesh_dim_names
    return repr(names[axis]) if names else str(axis)


def shard_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group parameters are sharded over (and ``clip_by_global_norm`` sums over: replicas hold the
    same shards)."""
    return mesh.get_group(dp_axes(mesh).shard)


def replicate_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group gradients are all-reduced over after the reduce-scatter (HSDP); None without one, or when
    it has a single rank (nothing to all-reduce)."""
    axis = dp_axes(mesh).replicate
    if axis is None or mesh.size(axis) == 1:
        return None
    return mesh.get_group(axis)


# axis group -> {(the mesh's ranks, its shape, axis, k): (weak reference to the post-forward group, rank in it)}.
# Weak both ways and holding no mesh (a mesh holds its groups): a group destroyed (``dist.destroy_process_group``) is
# freed with its last reference, gloo's threads and sockets with it, and made again at the next use; equal meshes
# (DeviceMesh compares by layout) over another axis group get groups of their own.
_POST_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def post_forward_group(mesh: DeviceMesh, axis: int, k: int) -> tuple[dist.ProcessGroup, int]:
    """The process group of ``k`` ranks this rank keeps its parameters sharded over after forward (int
    ``reshard_after_forward``, FSDP2's post-forward mesh, ZeRO++ hpZ): the shard axis ``axis`` cut into consecutive
    blocks of ``k`` ranks (``k`` divides its size), and this rank's index in its block. Made once per axis group,
    mesh layout and ``k`` (again once destroyed), on every rank in the same order: one ``new_group`` per block, as
    ``DeviceMesh`` makes its axis of size ``k`` (not the other axis, which nothing uses)."""
    per_axis = _POST_FORWARD.setdefault(mesh.get_group(axis), {})  # (ranks run as threads have a group each)
    key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), axis, k)
    hit = per_axis.get(key)
    pg = None if hit is None else hit[0]()
    if pg is not None and live_group(pg):
        return pg, hit[1]
    me = dist.get_rank()
    for ranks in mesh.mesh.movedim(axis, -1).reshape(-1, k).tolist():
        group = dist.new_group(ranks)
        if me in ranks:
            pg, rank = group, ranks.index(me)
    per_axis[key] = (weakref.ref(pg), rank)
    return pg, rank


def live_group(pg) -> bool:
    """Whether a process group funcshard keeps is still registered (not destroyed since, e.g. by a test harness
    between jobs; a destroyed group may still answer ``size()``)."""
    try:
        dist.get_process_group_ranks(pg)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def mesh_str(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    axes = ", ".join(f"{n}={s}" if n else str(s) for n, s in zip(names or [None] * mesh.ndim, mesh.shape))
    return f"DeviceMesh({mesh.device_type!r}, shape ({axes}))"


def resolve_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        if not dist.is_initialized():
            raise ShardingError(
                "plan() needs a DeviceMesh, and torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) (or launch with torchrun) first, then pass "
                "mesh=init_device_mesh(device_type, (world_size,)) or mesh=None for the default group"
            )
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = DeviceMesh.from_group(dist.group.WORLD, device_type)
    if not isinstance(mesh, DeviceMesh):
        raise ShardingError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; build one "
            f"with init_device_mesh(device_type, (world_size,))"
        )
    check_mesh(mesh)
    return mesh


def resolve_full_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    """A full SPMD mesh (``dp_mesh_dims``): a DeviceMesh of any number of axes; its data-parallel part is checked
    by ``resolve_mesh`` once picked."""
    if not isinstance(mesh, DeviceMesh):
        raise ShardingError(f"dp_mesh_dims needs the full SPMD DeviceMesh as mesh, got {type(mesh).__name__}; build "
                            f"it with init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp'))")
    return mesh


def check_mesh(mesh: DeviceMesh) -> None:
    """Raise if ``mesh`` is not a data-parallel mesh (``dp_axes``) or does not match its process groups (sizes), or a
    group is gone."""
    axes = dp_axes(mesh)
    # A mesh over part of the world is fine where this rank is on it (as in FSDP2): DeviceMesh.from_group over a
    # data-parallel subgroup gives each rank a mesh of its own group. A rank off its mesh raises.
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ShardingError(_off_mesh(mesh))
    for axis in (axes.shard,) if axes.replicate is None else (axes.replicate, axes.shard):
        try:
            pg = mesh.get_group(axis)
            pg_size = dist.get_world_size(pg)
        except Exception as e:  # destroyed or never-initialized process group
            raise ShardingError(
                f"mesh {mesh_str(mesh)} has no live process group on axis {axis} ({e}); "
                f"re-create the mesh (and the plan) after init_process_group"
            ) from None
        if pg_size != mesh.size(axis):
            raise ShardingError(
                f"mesh {mesh_str(mesh)} has {mesh.size(axis)} ranks on axis {axis} but its process group has "
                f"{pg_size}; build the mesh from the current group: init_device_mesh(device_type, ({pg_size},))"
            )


def _off_mesh(mesh: DeviceMesh) -> str:
    """The error for a rank that is not on its mesh (e.g. init_device_mesh over fewer ranks than the world)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    root = root_mesh(mesh)
    on = sorted(set(root.mesh.flatten().tolist()))
    shown = f"{on[:8]}"[:-1] + (f", ... ({len(on)} ranks)]" if len(on) > 8 else "]")
    return (f"mesh {mesh_str(mesh)} does not contain this rank ({rank} of a world of {world}; the mesh spans ranks "
            f"{shown}): every rank that trains needs a place on its mesh. Build the mesh over every rank: "
            f"init_device_mesh({mesh.device_type!r}, ({world},)) (HSDP: (replicate, shard) with replicate * shard = "
            f"{world}), or give each rank the mesh of its own data-parallel group: "
            f"DeviceMesh.from_group(dp_group, {mesh.device_type!r})")


def default_fsdp_mesh() -> DeviceMesh:
    """FSDP2's default: a 1-D mesh over every rank on the current accelerator (or the CPU), initializing the
    default process group if needed (``plan`` instead asks for an initialized one: ``resolve_mesh``)."""
    if not dist.is_initialized():
        dist.init_process_group()
    acc = torch.accelerator.current_accelerator()
    return init_device_mesh(acc.type if acc is not None else "cpu", (dist.get_world_size(),))


def device_of(mesh: DeviceMesh, api: str = "funcshard") -> torch.device:
    """The device this process computes on for ``mesh``; ``api`` (the function the user called, e.g.
    ``"funcshard.apply"``; every caller in funcshard passes its own) names it in the error for a device this process
    does not have."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, kind, None)
    if handle is None or not getattr(handle, "is_available", lambda: False)():
        raise ValueError(f"{api} got a mesh of device type {kind!r}, and this process has no {kind} "
                         f"device; build the mesh for the device the model trains on, e.g. "
                         f"init_device_mesh('cpu', (world_size,)) with gloo")
    return torch.device(kind, handle.current_device())


# ---- FSDP over tensor parallel ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _DataParallelMeshDims:
    """Which axes of a full SPMD mesh are data parallel, by name (torch 2.12+'s ``DataParallelMeshDims``, the same
    fields; torch's own is accepted too): ``shard`` (parameters are sharded over it), ``replicate`` (HSDP: replicated
    over it, gradients all-reduced). The other axes are the model's own (tensor parallel).

    Attributes:
        shard: the name of the axis parameters are sharded over (funcshard takes one axis per role).
        replicate: the name of the axis parameters are replicated over (HSDP); None: none.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")


# torch's own where it has one (2.12+: code written for FSDP2 passes it, and isinstance checks hold), else ours. Looked
# up when first read (module ``__getattr__`` below): torch.distributed.fsdp is not part of ``import funcshard`` (~0.1 s
# and 80 modules, issue 36). (Under TYPE_CHECKING: what the documentation and type checkers read.)
if TYPE_CHECKING:
    DataParallelMeshDims = _DataParallelMeshDims
    """Which axes of a full SPMD mesh are data parallel (``shard=``, ``replicate=``, by name): torch's own class where
    it has one (2.12+), on torch 2.11 funcshard's with the same fields. ``fully_shard(..., dp_mesh_dims=...)``,
    ``funcshard.plan(..., dp_mesh_dims=...)``."""


def __getattr__(name: str):
    """``DataParallelMeshDims``, bound here when first read (torch.distributed.fsdp imported then)."""
    if name != "DataParallelMeshDims":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch.distributed.fsdp

    value = globals()[name] = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None) or _DataParallelMeshDims
    return value


def spmd_dp_mesh(mesh: DeviceMesh, dims) -> tuple[DeviceMesh, frozenset[int]]:
    """The data-parallel sub-mesh of the full SPMD mesh ``mesh`` named by ``dims`` (a ``DataParallelMeshDims``):
    ``mesh[shard]`` (FSDP) or ``mesh[(replicate, shard)]`` (HSDP), and the indices of those axes in ``mesh``."""
    names = mesh.mesh_dim_names
    shard, replicate = getattr(dims, "shard", None), getattr(dims, "replicate", None)
    if names is None:
        raise ShardingError(f"dp_mesh_dims names mesh axes, and mesh {mesh_str(mesh)} has no names; build it with "
                            f"init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    for kind, value in (("shard", shard), ("replicate", replicate)):
        if value is not None and not isinstance(value, str):
            raise NotImplementedError(
                f"dp_mesh_dims.{kind}={value!r} names several axes (flattened into one by FSDP2); funcshard takes "
                f"one axis name each: flatten them into one named axis of the mesh first")
        if value is not None and value not in names:
            raise ShardingError(f"dp_mesh_dims.{kind}={value!r} is not an axis of mesh {mesh_str(mesh)}; its axes "
                                f"are {list(names)}")
    if shard is None:
        raise NotImplementedError(f"dp_mesh_dims without a shard axis (replicate={replicate!r} only: DDP) is not "
                                  f"built; name a shard axis (a size-1 one shards nothing)")
    picked = (shard,) if replicate is None else (replicate, shard)
    if len(set(picked)) != len(picked):
        raise ShardingError(f"dp_mesh_dims names axis {shard!r} as both shard and replicate; name two axes")
    dp = mesh[shard] if replicate is None else concatenate_meshes([mesh[replicate], mesh[shard]])  # (any axis order)
    return dp, frozenset(names.index(n) for n in picked)


def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def model_sharding(fqn: str, param, mesh: DeviceMesh, dim: int, spmd: frozenset[int] | None = None) -> ModelSharding:
    """How the DTensor ``param`` is sharded by the model, for FSDP over ``mesh`` (the data-parallel mesh: 1-D or
    (replicate, shard)) on tensor dim ``dim`` of its local tensor. Two forms, FSDP2's:

    - ``spmd`` None (the 2-D recipe, ``fully_shard(block, mesh=mesh['dp'])``): ``param`` lives on a mesh of its own
      (``mesh['tp']``) sliced from the same root mesh as ``mesh``, on other axes. The sharded parameter lives on the
      data-parallel axes followed by the model's.
    - ``spmd`` the data-parallel axes' indices (``dp_mesh_dims``): ``param`` lives on the full SPMD mesh, the one
      ``mesh`` was sliced from, with ``Replicate()`` on those axes; the sharded parameter too.

    On the shard axis the sharded parameter is ``Shard(dim)``, or ``_StridedShard(dim, split_factor)`` where the
    model shards ``dim`` too on axes after it (its local rows are strided pieces of the global ones). Raises a
    ShardingError naming the parameter, the meshes and the fix."""
    from torch.distributed.tensor import Replicate, Shard

    pmesh, placements = param.device_mesh, tuple(param.placements)
    dp_names = _names(mesh)
    where = f"{fqn}: a DTensor on mesh {mesh_str(pmesh)} with placements {list(placements)}"
    for p in placements:
        if not (type(p) is Replicate or type(p) is Shard):
            raise ShardingError(f"{where}; FSDP shards a parameter the model shards with Shard(dim) or Replicate() "
                                f"placements, not {p}: redistribute it to those first")
    if spmd is None:
        if root_mesh(pmesh) is not root_mesh(mesh) and root_mesh(pmesh) != root_mesh(mesh):
            raise ShardingError(
                f"{where}, and the data-parallel mesh {mesh_str(mesh)} is not sliced from the same mesh; build one "
                f"mesh, init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp')), and use mesh['tp'] "
                f"for tensor parallel and mesh['dp'] for fully_shard (or pass the whole mesh with dp_mesh_dims=)")
        shared = [n for n in _names(pmesh) if n in dp_names] if _names(pmesh) else list(dp_names)
        if shared or pmesh == mesh:
            what = f"uses the data-parallel axes {shared} of mesh" if shared else "is the data-parallel mesh"
            raise ShardingError(
                f"{where}: its mesh {what} {mesh_str(mesh)}, which fully_shard shards over; tensor-parallelize over "
                f"the other axes "
                f"(parallelize_module(module, mesh['tp'], ...)), or pass the full mesh with dp_mesh_dims= and "
                f"Replicate() placements on its data-parallel axes")
        sharded_mesh = concatenate_meshes([mesh, pmesh])
        model_axes = range(mesh.ndim, mesh.ndim + pmesh.ndim)
        sharded = list(dp_placements(mesh, dim)) + list(placements)
        shard_axis = dp_axes(mesh).shard
    else:
        if pmesh != root_mesh(mesh) and pmesh is not root_mesh(mesh):
            raise ShardingError(
                f"{where}; with dp_mesh_dims every parameter must be a DTensor on the mesh passed to fully_shard "
                f"(the full SPMD mesh {mesh_str(root_mesh(mesh))}): distribute it there")
        bad = [(pmesh.mesh_dim_names[i], placements[i]) for i in sorted(spmd) if type(placements[i]) is not Replicate]
        if bad:
            raise ShardingError(
                f"{where}: it is sharded on the data-parallel axes {[n for n, _ in bad]} ({[p for _, p in bad]}), "
                f"which FSDP shards over; give it Replicate() there (the model's own sharding goes on the other axes)")
        sharded_mesh = pmesh
        model_axes = [i for i in range(pmesh.ndim) if i not in spmd]
        sharded = list(placements)
        shard_axis = pmesh.mesh_dim_names.index(dp_names[dp_axes(mesh).shard])
        sharded[shard_axis] = Shard(dim)
    later = [a for a in model_axes if a > shard_axis]  # the model's shards of ``dim`` inside the data-parallel one's
    split = 1
    for a in later:
        if sharded[a] == Shard(dim):
            split *= sharded_mesh.size(a)
    if split > 1:
        sharded[shard_axis] = StridedShard(dim, split_factor=split)
    shape = tuple(param.shape)
    return ModelSharding(mesh=pmesh, placements=placements, shape=shape, stride=tuple(param.stride()),
                         dp_axes=frozenset(spmd or ()), sharded_mesh=sharded_mesh, sharded_placements=tuple(sharded),
                         offsets=_local_offsets(shape, pmesh, placements))


def _local_offsets(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple) -> tuple[int, ...]:
    """Where this rank's local tensor of a DTensor with ``Shard`` / ``Replicate`` placements starts in the global one
    (torch.chunk's split on each axis, in axis order, as DTensor does)."""
    coord = mesh.get_coordinate()
    sizes, offsets = list(shape), [0] * len(shape)
    for axis, p in enumerate(placements):
        d = getattr(p, "dim", None)
        if d is None:
            continue
        n, k = sizes[d], mesh.size(axis)
        chunk = -(-n // k) if n else 0
        start = min(coord[axis] * chunk, n)
        offsets[d] += start
        sizes[d] = max(0, min(chunk, n - start))
    return tuple(offsets)
