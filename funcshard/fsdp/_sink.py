"""Where ``fully_shard``'s gradients go: the DTensor parameters and their ``.grad``.

``_Param``: one managed parameter, the registered DTensor ``nn.Parameter`` and the padded local shard behind it
(the runtime's state). ``GradSink``: the runtime's sink for a root's steps: reduce-scattered shards accumulate into
the DTensor ``.grad`` (with the post-accumulate-grad hooks); without gradient sync the unsharded gradients
accumulate here until a synced backward reduce-scatters their sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from funcshard._collectives import no_grad
from funcshard._comm import EXTENSION
from funcshard._compat import dtensor_local, dtensor_spec, new_dtensor, post_accumulate_grad_hooks
from funcshard._offload import drain
from funcshard._spec import ShardSpec, valid_rows

if TYPE_CHECKING:
    from funcshard.fsdp._units import _Context


class _Param:
    """One managed parameter: the registered DTensor parameter and the padded shard behind it."""

    __slots__ = ("padded", "param", "slots", "spec", "valid", "_leaf")

    def __init__(self, padded: torch.Tensor, spec: ShardSpec, valid: int, mesh: DeviceMesh, requires_grad: bool):
        self.padded, self.spec, self.valid = padded, spec, valid
        self.param = nn.Parameter(self.dtensor(self.local(padded), mesh), requires_grad=requires_grad)
        self.slots: list[tuple[nn.Module, str]] = []  # every (module, attribute) holding it
        self._leaf: tuple | None = None

    def local(self, padded: torch.Tensor) -> torch.Tensor:
        """The unpadded part of a padded local shard: what DTensor's ``Shard(dim)`` holds on this rank."""
        return valid_rows(padded, self.spec.dim, self.valid)

    def leaf(self) -> torch.Tensor:
        """The padded shard as the runtime's state (an autograd leaf that never gets a ``.grad``: the gradients
        go to the DTensor parameter), made again only when the shard or its requires_grad changed."""
        rg, hit = self.param.requires_grad, self._leaf
        if hit is None or hit[0] is not self.padded or hit[1] != rg:
            hit = self._leaf = (self.padded, rg, self.padded.detach().requires_grad_(rg))
        local = dtensor_local(self.param)
        cls = type(local)
        for name in EXTENSION:  # FSDP2's all-gather extension set on the local tensor object (monkey-patched, not the
            # class's): the state carries it
            fn = getattr(local, name, None)
            if fn is not None and getattr(cls, name, None) is None:
                setattr(hit[2], name, fn)
        return hit[2]

    def dtensor(self, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        return self.spec.dtensor(local, mesh)

    def grad_dtensor(self, local: torch.Tensor) -> DTensor:
        """A gradient with the parameter's DTensor spec, built directly (``from_local`` runs an autograd
        Function and rebuilds the spec: ~70 us per parameter per step)."""
        return new_dtensor(DTensor, local, dtensor_spec(self.param), requires_grad=False)


class GradSink:
    """The runtime's gradient sink for one root (see the module docstring)."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        self.paths = {g.name: g.params for g in ctx.base.groups}

    def watched(self, paths) -> list[torch.Tensor]:
        """The DTensor parameters at ``paths`` (an optimizer step or a no_grad edit moves their autograd version on,
        not their shards', ``ShardedParam.leaf``'s detached aliases)."""
        return [self.ctx.recs[p].param for p in paths]

    def collect(self, name: str, grads: list) -> tuple[list | None, Any]:
        """The full gradients of a group's post-backward: kept (None) without gradient sync, else with what earlier
        unsynced backwards accumulated added, and which parameters had a gradient on this rank."""
        unit = self.ctx.by_group[name]
        paths = self.paths[name]
        if not unit.sync:  # accumulate unsharded; the next synced backward reduce-scatters the sum
            # in the reduce dtype where the policy sets one (FSDP2: bf16 compute, fp32 reduce accumulates in fp32)
            rdt = unit.mp_policy.reduce_dtype
            with torch.no_grad():
                for p, g in zip(paths, grads):
                    if g is not None:
                        if p in unit.acc:
                            unit.acc[p].add_(g)
                        else:
                            unit.acc[p] = g.to(rdt) if rdt is not None and g.dtype != rdt else g.clone()
            return None, None
        for i, p in enumerate(paths):
            if p in unit.acc:
                grads[i] = unit.acc.pop(p) if grads[i] is None else unit.acc.pop(p).add_(grads[i])
        return grads, [g is not None for g in grads]

    def reduce_options(self, name: str) -> dict:
        """How the runtime finishes a group's reduce (``PendingReduce.finish``): HSDP's all-reduce or not
        (``set_requires_all_reduce``; the sums kept without it, in the unit), the all-reduce hook."""
        unit = self.ctx.by_group[name]
        out = {} if unit.all_reduce and not unit.partial else {"all_reduce": unit.all_reduce, "partial": unit.partial}
        if unit.all_reduce_hook is not None:
            out["hook"] = unit.all_reduce_hook
        return out

    def deliver(self, name: str, shards: list, had: list[bool]) -> None:
        """Accumulate a group's reduce-scattered shards into its parameters' DTensor ``.grad``."""
        reduce_unused, recs = self.ctx.by_group[name].reduce_unused, self.ctx.recs
        with no_grad():
            for p, g, o in zip(self.paths[name], had, shards):
                r = recs[p]
                param = r.param
                if o is None or not param.requires_grad or (not g and not reduce_unused):
                    continue  # like FSDP2: a parameter without a gradient on this rank gets none
                o = r.local(o)
                grad = param.grad
                hooks = post_accumulate_grad_hooks(param)
                if grad is not None or hooks:  # (CPU offload: the host reads it now; FSDP2 copies it blocking)
                    drain()
                if grad is None:
                    param.grad = r.grad_dtensor(o)
                else:  # (its local tensor: DTensor.to_local runs an autograd Function)
                    dtensor_local(grad).add_(o)
                if hooks:
                    for hook in hooks.values():
                        hook(param)
