"""Binding a step's parameters to the module: which tensor each parameter slot holds, and when a group's forward
is over.

- ``Slots``: a group's (module, attribute) slots of its parameters (every alias of a tied one; one per group run:
  ``GroupRun.slots``); ``swap_in`` puts the group's unsharded views there, ``swap_out`` puts back what the slots hold
  at rest: placeholders while
  ``apply`` runs (a read from outside the group's forward raises instead of silently using the module's stale
  parameters), the module's own parameters otherwise.
- ``ForwardTracker``: the one rule for "the group's forward is done", for groups of one module and of several
  (``apply`` and ``fully_shard`` alike, as FSDP2 does it): a pass starts when one of the group's modules starts
  and no pass is open; it is done when every module of the group has run once since. A module run again within
  the pass does not end it; modules that never run are finished by ``unfinished()`` at the end of forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from funcshard._compat import DisableTorchFunctionSubclass, make_subclass, param_slots
from funcshard._plan import Group, Plan
from funcshard._spec import ShardingError
from funcshard._tree import module_io_leaves


class Slots:
    """A group's parameter slots in the module (see the module docstring)."""

    __slots__ = ("slots", "originals", "rest", "swapped", "views", "present")

    def __init__(self, slots: list[tuple[nn.Module, str, int]], present: tuple | None = None):
        self.slots = slots
        self.present = present  # per parameter, ShardSpec.present for a model-sharded (TP) one, else None
        self.originals: list[Any] | None = None  # what the slots held before the step
        self.rest: list | None = None  # what they hold while not swapped in (None: the originals)
        self.swapped = False
        # the autograd-visible unsharded parameters the slots get on swap_in (set by the gather strategy)
        self.views: tuple[torch.Tensor, ...] | None = None


    def swap_in(self) -> bool:
        """Put the group's views on the module (False: it has none)."""
        b = self
        if b.swapped:
            return True
        views = b.views
        if views is None:
            return False
        if b.originals is None:
            b.originals = [param_slots(mod)[attr] for mod, attr, _ in b.slots]
        if b.present is not None:  # the model's DTensors over the gathered local tensors (FSDP over TP)
            # (with autograd history whenever the local views have it: a swap_in under no_grad, e.g. at a pre-backward
            # inside backward, makes the DTensors an activation-checkpoint recomputation then reads with grad)
            with torch.set_grad_enabled(torch.is_grad_enabled() or any(v.requires_grad for v in views)):
                views = tuple(v if f is None else f(v) for f, v in zip(b.present, views))
        for mod, attr, i in b.slots:
            param_slots(mod)[attr] = views[i]
        b.swapped = True
        return True

    def swap_out(self) -> None:
        b = self
        if not b.swapped:
            return
        for (mod, attr, _), orig in zip(b.slots, b.rest or b.originals):
            param_slots(mod)[attr] = orig
        b.swapped = False

    def set_rest(self, placeholders: list | None) -> None:
        """What the group's slots hold while it is not swapped in (None: the module's own parameters)."""
        b = self
        if b.originals is None:
            b.originals = [param_slots(mod)[attr] for mod, attr, _ in b.slots]
        b.rest = placeholders
        if not b.swapped:
            for (mod, attr, _), t in zip(b.slots, placeholders or b.originals):
                param_slots(mod)[attr] = t


def slots(plan: Plan, group: Group) -> list[tuple[nn.Module, str, int]]:
    """(module, attribute, param index) for every path of the group's parameters."""
    out = []
    for i, p in enumerate(group.params):
        for path in plan.specs[p].aliases:
            mod_path, _, attr = path.rpartition(".")
            out.append((plan.module.get_submodule(mod_path), attr, i))
    return out


def presents(plan: Plan, group: Group) -> tuple | None:
    """Per parameter of the group, how the module sees it gathered (``ShardSpec.present``: a DTensor for one the
    model shards itself), None for a plain one; None when the group has none."""
    out = tuple(plan.specs[p].present if plan.specs[p].model is not None else None for p in group.params)
    return out if any(f is not None for f in out) else None


class ForwardTracker:
    """When a group's forward pass starts and ends (see the module docstring)."""

    def __init__(self, members: dict[str, frozenset[int]]):
        self.members = members  # group -> ids of its modules
        self.running: dict[str, set[int]] = {}  # group -> modules still to run in its open pass
        self.used: set[str] = set()  # groups whose forward ran in this step

    def enter(self, name: str) -> bool:
        """A module of the group starts its forward; True when that opens a pass of the group."""
        self.used.add(name)
        if self.running.get(name):
            return False
        self.running[name] = set(self.members[name])
        return True

    def exit(self, name: str, module: nn.Module) -> bool:
        """A module of the group finished its forward; True when that closes the group's pass."""
        left = self.running.get(name)
        if not left or id(module) not in left:
            return False
        left.discard(id(module))
        return not left

    def is_open(self, name: str) -> bool:
        """Whether the group's pass is open (some of its modules have not run since it started)."""
        return bool(self.running.get(name))

    def unfinished(self) -> list[str]:
        """At the end of forward: the groups whose pass is still open (some module never ran); closes them."""
        out = [n for n, left in self.running.items() if left]
        for n in out:
            self.running[n].clear()
        return out


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__repr__,
             torch.Tensor.is_floating_point, torch.Tensor.element_size}  # and every attribute read (__get__)


class NotGathered(torch.Tensor):
    """Stands in for a group's parameter while ``apply`` runs and the group is not gathered: reading it
    (from code outside the group's modules, or a checkpoint region spanning several groups) raises."""

    @staticmethod
    def __new__(cls, spec, group: str):
        t = make_subclass(cls, torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
        t._funcshard_where = (spec.fqn, group)
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        fqn, group = next(a._funcshard_where for a in module_io_leaves((args, kwargs)) if isinstance(a, cls))
        raise ShardingError(
            f"parameter {fqn!r} (group {group!r}) was read by {getattr(func, '__name__', func)} outside its "
            f"group's forward, where it is not gathered. funcshard.apply gathers a group only around the forward "
            f"of the group's modules: move the code that uses it into one of those modules, tie it properly "
            f"(the same nn.Parameter registered in both places, so the plan puts it in a common group), or put "
            f"both users in one group (funcshard.plan(..., groups=[(module_a, module_b), ...]))"
        )
