"""Meshes: which axes are data parallel (the one owner of that rule), their process groups, the default mesh, its
checks, its device, and how it is printed in errors.

Vocabulary (as in torchtitan): an *axis* is a DeviceMesh axis, a *dim* is a tensor dimension.

The axis rule (FSDP2's): a 1-D mesh shards over its one axis; a 2-D mesh is ``(replicate, shard)`` (HSDP): parameters
are sharded over axis 1 and replicated over axis 0, gradients reduce-scattered over axis 1 and then all-reduced over
axis 0. ``dp_axes(mesh)`` says it; every other module asks it (``plan``, ``fully_shard``, the collectives,
``optim``'s norm).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from funcshard._compat import root_mesh
from funcshard._spec import ShardingError


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
    from torch.distributed.tensor import Replicate, Shard

    axes = dp_axes(mesh)
    out = [Replicate()] * mesh.ndim
    out[axes.shard] = Shard(dim)
    return tuple(out)


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


_POST_FORWARD: dict = {}  # (mesh, k) -> (process group, rank in it): made once (creating groups is collective)


def post_forward_group(mesh: DeviceMesh, axis: int, k: int) -> tuple[dist.ProcessGroup, int]:
    """The process group of ``k`` ranks this rank keeps its parameters sharded over after forward (int
    ``reshard_after_forward``, FSDP2's post-forward mesh, ZeRO++ hpZ): the shard axis ``axis`` cut into consecutive
    blocks of ``k`` ranks (``k`` divides its size), and this rank's index in its block. Made once per mesh, axis and
    ``k``, on every rank in the same order (it creates process groups)."""
    key = (mesh, axis, k)
    hit = _POST_FORWARD.get(key)
    if hit is not None:
        try:
            dist.get_world_size(hit[0])
        except Exception:  # (its process group was destroyed since: make it again)
            hit = None
    if hit is None:
        ranks = mesh.mesh.movedim(axis, -1).reshape(-1, k)
        sub = DeviceMesh(mesh.device_type, ranks)
        hit = _POST_FORWARD[key] = (sub.get_group(1), sub.get_local_rank(1))
    return hit


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


def check_mesh(mesh: DeviceMesh) -> None:
    """Raise if ``mesh`` is not a data-parallel mesh (``dp_axes``) or does not match its process groups (sizes), or a
    group is gone."""
    axes = dp_axes(mesh)
    if dist.is_initialized() and (root := root_mesh(mesh)).size() < dist.get_world_size():
        raise ShardingError(_partial_world(mesh, root))
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ShardingError(
            f"mesh {mesh_str(mesh)} does not contain this rank ({dist.get_rank()} of a world of "
            f"{dist.get_world_size()}); every rank that trains needs a place on the mesh: build it with axis sizes "
            f"whose product is the world size (or the data-parallel part of it), e.g. "
            f"init_device_mesh(device_type, (replicate, shard), mesh_dim_names=('replicate', 'shard'))"
        )
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


def _partial_world(mesh: DeviceMesh, root: DeviceMesh) -> str:
    """The error for a mesh made over part of the world (not sliced from a mesh over all of it): every rank raises
    it, the ranks on the mesh too (they would train alone, or wait for ranks that never come)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    on = set(root.mesh.flatten().tolist())
    off = [r for r in range(world) if r not in on]
    shown = f"{off[:8]}"[:-1] + (f", ... ({len(off)} ranks)]" if len(off) > 8 else "]")
    return (f"mesh {mesh_str(mesh)} spans {root.size()} of the {world} ranks of the world (ranks {shown} are not "
            f"on it; this is rank {rank}): the ranks off the mesh would fail while those on it train alone, or wait "
            f"for them. Build the mesh over every rank: init_device_mesh({mesh.device_type!r}, ({world},)) (HSDP: "
            f"(replicate, shard) with replicate * shard = {world}); to train on part of the world, slice that part "
            f"from a mesh over every rank (init_device_mesh(..., mesh_dim_names=('part', 'dp'))['dp'])")


def default_fsdp_mesh() -> DeviceMesh:
    """FSDP2's default: a 1-D mesh over every rank on the current accelerator (or the CPU), initializing the
    default process group if needed (``plan`` instead asks for an initialized one: ``resolve_mesh``)."""
    if not dist.is_initialized():
        dist.init_process_group()
    acc = torch.accelerator.current_accelerator()
    return init_device_mesh(acc.type if acc is not None else "cpu", (dist.get_world_size(),))


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device this process computes on for ``mesh``."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, kind, None)
    if handle is None or not getattr(handle, "is_available", lambda: False)():
        raise ValueError(f"fully_shard got a mesh of device type {kind!r}, and this process has no {kind} "
                         f"device; build the mesh for the device the model trains on, e.g. "
                         f"init_device_mesh('cpu', (world_size,)) with gloo")
    return torch.device(kind, handle.current_device())
