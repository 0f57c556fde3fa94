"""Meshes: the default mesh, its checks, its device, and how it is printed in errors.

Vocabulary (as in torchtitan): an *axis* is a DeviceMesh axis, a *dim* is a tensor dimension.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from funcshard._spec import ShardingError


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
    if mesh.ndim != 1:
        raise ShardingError(
            f"mesh {mesh_str(mesh)} has {mesh.ndim} axes; funcshard shards over a 1-D mesh for now "
            f"(HSDP over a 2-D (replicate, shard) mesh is not built yet): pass mesh[axis_name] for one axis"
        )
    check_mesh(mesh)
    return mesh


def check_mesh(mesh: DeviceMesh) -> None:
    """Raise if ``mesh`` does not match its process group (size) or the group is gone."""
    axis = mesh.ndim - 1
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
