"""FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on a shard's tensor subclass):
the copy-in's inputs are what ``fsdp_pre_all_gather`` returns, fed to the one all-gather pipeline
(``_pipeline.issue_all_gather``); the copy-out is ``fsdp_post_all_gather``. ``_comm.check_extension`` says which
shards have one (``plan`` asks it too); what the extension cannot do (flat layout, dim > 0, int reshard) raises here.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from funcshard._collectives import group_label, unwrapped
from funcshard._comm import _PLAIN, CommHook, check_extension, patched
from funcshard._pipeline import PendingGather, issue_all_gather
from funcshard._policy import MixedPrecisionPolicy
from funcshard._spec import ShardingError, contiguous_stride


def extension_of(group, layout, shards, plan) -> Extension | None:
    """The group's all-gather extension when a shard's class defines FSDP2's ``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather`` (None: none does). Raises for a class with only one of them, a tensor subclass with
    neither (its all-gather would move its plain data and hand the module a plain tensor, silently), and for what is
    not built with the extension (the flat layout, shards on a dim other than 0, an int ``reshard_after_forward``)."""
    if all(type(t) in _PLAIN and not patched(t) for t in shards):  # (the common case, per step)
        return None
    marks = [check_extension(t, group.name, p) for p, t in zip(group.params, shards)]
    if not any(marks):
        return None
    name = [p for p, m in zip(group.params, marks) if m][0]
    label = group_label(group.name)
    if layout.flat:
        raise ShardingError(f"group {label}: parameter {name!r} has an all-gather extension "
                            f"(fsdp_pre_all_gather), which layout='flat' does not run; use layout='per_param'")
    if any(s.dim != 0 for s, m in zip(layout.specs, marks) if m):
        raise NotImplementedError(f"group {label}: an all-gather extension on a parameter sharded on a "
                                  f"dim other than 0 is not built; shard it on dim 0")
    if not isinstance(group.reshard_after_forward, bool):
        raise NotImplementedError(f"group {label}: an all-gather extension (parameter {name!r}) with an "
                                  f"int reshard_after_forward is not built (FSDP2 raises there too); use True or "
                                  f"False")
    return Extension(group, layout, tuple(marks), plan)


class Extension:
    """A group with all-gather extensions: per parameter, its all-gather inputs (the class's ``fsdp_pre_all_gather``,
    or the shard in its compute dtype), one all-gather of them all (in their dtype, or as bytes when they differ, as
    FSDP2 does), and the unsharded parameter (``fsdp_post_all_gather``: made the first time in a step, refilled in
    place with ``out=`` later; the tensors it returns to free are freed and refilled with the group's buffers)."""

    def __init__(self, group, layout, marks: tuple[bool, ...], plan):
        self.group, self.layout, self.marks = group, layout, marks
        self.inner: list[tuple | None] = [None] * len(marks)  # per parameter: the tensors post_all_gather returned
        # per parameter: the all-gather outputs handed to its first post_all_gather, kept (freed and refilled with the
        # group) and refilled by every later gather before post_all_gather(..., out=): what it returned may alias
        # them and expect the new data there (FSDP2's all_gather_outputs: torchao's float8 post only sets the scale)
        self.outs: list[tuple | None] = [None] * len(marks)
        mesh = plan.mesh
        if mesh.ndim > 1 and mesh.mesh_dim_names:
            mesh = mesh[mesh.mesh_dim_names[plan.shard_axis]]
        self.mesh = mesh
        self.modules = [plan.module.get_submodule(p.rpartition(".")[0]) for p in group.params]
        self.mp = MixedPrecisionPolicy(group.param_dtype, group.reduce_dtype, group.output_dtype,
                                       group.cast_forward_inputs)

    def storages(self, bases) -> list[torch.Tensor]:
        """What is freed and refilled with the group: the plain parameters' buffers, the extension's inner tensors."""
        out = [b for b, m in zip(bases, self.marks) if not m]
        kept = [t for inner in (*self.inner, *self.outs) if inner for t in inner]
        return out + list({id(t): t for t in kept}.values())

    def _inputs(self, i: int, shard: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        spec, fn = self.layout.specs[i], shard.fsdp_pre_all_gather
        if len(inspect.signature(fn).parameters) == 1:  # FSDP2's old signature: the mesh only
            got = fn(self.mesh)
        else:
            got = fn(self.mesh, torch.Size(spec.shape), contiguous_stride(spec.shape), self.modules[i], self.mp)
        try:
            inputs, meta = got
            inputs = list(inputs)
            assert all(isinstance(t, torch.Tensor) for t in inputs) and inputs
        except (TypeError, ValueError, AssertionError):
            raise ShardingError(f"group {group_label(self.group.name)}, parameter {self.group.params[i]!r}: "
                                f"{type(shard).__name__}.fsdp_pre_all_gather returned {type(got).__name__}; it must "
                                f"return (a tuple of tensors to all-gather along dim 0, metadata)") from None
        return inputs, meta

    def start(self, shards, group, rank: int, comm: CommHook | None, where) -> PendingExtension:
        """The copy-in's inputs (``fsdp_pre_all_gather``'s, or the plain shards in their compute dtype), into the one
        all-gather pipeline (``_pipeline.issue_all_gather``)."""
        world = self.layout.world
        inputs, metas, sizes, posts = [], [], [], []
        with torch.no_grad():
            for i, (t, m) in enumerate(zip(shards, self.marks)):
                t = unwrapped(t)
                posts.append(t.fsdp_post_all_gather if m else None)
                if m:
                    ins, meta = self._inputs(i, t)
                else:
                    ins, meta = [t.to(self.layout.compute[i])], None
                metas.append(meta)
                sizes.append([x.shape for x in ins])
                inputs.extend(x.contiguous() for x in ins)
            dtypes = {x.dtype for x in inputs}
            dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8  # (FSDP2's rule: bytes when they differ)
            flat = [x.reshape(-1).view(dtype) if x.dtype != dtype else x.reshape(-1) for x in inputs]
            numels = [x.numel() for x in flat]
            n = sum(numels)
            out, work, owned = issue_all_gather(flat, n, dtype, world, rank, group, comm, self.group.name, valid=n)
        gather = PendingGather([out], [work], [False], [numels], where, owned)
        return PendingExtension(self, gather, numels, [x.dtype for x in inputs], sizes, metas, posts)


class PendingExtension:
    """An extension group's all-gather in flight (the pipeline's ``PendingGather``, one bucket of every input);
    ``finish(bases)`` waits, takes the output's columns per input, runs each extended parameter's
    ``fsdp_post_all_gather`` and copies the plain ones out into their buffers."""

    in_place = False  # (as PendingGather's: the output is never the unsharded buffers)

    def __init__(self, ext: Extension, gather: PendingGather, numels, dtypes, sizes, metas, posts):
        self.ext, self.gather, self.posts = ext, gather, posts
        self.numels, self.dtypes, self.sizes, self.metas = numels, dtypes, sizes, metas

    @property
    def outs(self) -> list | None:  # (observers read a pending gather's buffers: funcshard.trace)
        return self.gather.outs

    def finish(self, bases: list) -> None:
        ext, lay = self.ext, self.ext.layout
        world = lay.world
        with torch.no_grad():
            chunks = iter(self.gather.chunks(0, world, self.numels))
            dts = iter(self.dtypes)
            for i, (m, sizes) in enumerate(zip(ext.marks, self.sizes)):
                outs = []
                first = m and ext.inner[i] is None  # (outputs fsdp_post_all_gather keeps: storage of their own, not
                # a view of the all-gather buffer freed below, which .contiguous() returns for a contiguous chunk:
                # a group of one input, or one rank)
                for size in sizes:
                    c, dt = next(chunks), next(dts)
                    c = c.clone(memory_format=torch.contiguous_format) if first else c.contiguous()
                    outs.append((c.view(dt) if c.dtype != dt else c).view(-1, *size[1:]))
                spec = lay.specs[i]
                if not m:
                    spec.split_view(bases[i]).copy_(outs[0].view(world, *spec.local_shape))
                    continue
                dtype = lay.compute[i]
                if ext.inner[i] is None:  # the first gather in this step: the class makes the parameter
                    got = self._post(i, outs, dtype)
                    bases[i], ext.inner[i] = got
                    ext.outs[i] = tuple(outs)
                else:  # the same output tensors again, refilled (GroupBuffers.allocate gave their storage back)
                    for kept, new in zip(ext.outs[i], outs):
                        kept.copy_(new)
                    self._post(i, ext.outs[i], dtype, out=bases[i])
        self.gather.release()

    def _post(self, i: int, outs, dtype, out=None):
        ext = self.ext
        fn = self.posts[i]
        where = f"group {group_label(ext.group.name)}, parameter {ext.group.params[i]!r}"
        if out is not None:
            fn(tuple(outs), self.metas[i], dtype, out=out)
            return None
        got = fn(tuple(outs), self.metas[i], dtype)
        spec = ext.layout.specs[i]
        try:
            t, inner = got
            inner = tuple(inner)
        except (TypeError, ValueError):
            raise ShardingError(f"{where}: fsdp_post_all_gather returned {type(got).__name__}; it must return "
                                f"(the unsharded tensor, a tuple of tensors to free after use)") from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(spec.padded_shape) or t.dtype != dtype:
            shown = f"shape {tuple(t.shape)}, dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShardingError(f"{where}: fsdp_post_all_gather returned {shown}; it must return the unsharded "
                                f"parameter, shape {tuple(spec.padded_shape)} (padding included), dtype {dtype}")
        return t, inner
