"""Saved views of a group's unsharded parameters: gathered again when autograd unpacks them (``SavedViews``).

A group freed after forward is gathered again by the pre-backward hook on its outputs. A backward that reaches the
group's operations without passing through those outputs never fires it: a loss taken only from an activation inside
the group, or a forward run under ``torch.func.jvp`` and differentiated by ``.backward()`` (the hook sits on the
transform's wrapper, not on the tensor the backward runs through). Autograd would then read a view of the freed
storage ("setStorage ... out of bounds for storage of size 0"; FSDP2 fails the same way). So, while a step's forward
runs, saved-tensor hooks mark what autograd saves that aliases a group's unsharded buffers, and unpacking such a
tensor runs the group's pre-backward first when the group is not gathered (a no-op in an ordinary backward, where the
output hook already ran: its schedule and collectives are unchanged). The caller's own saved-tensor hooks (e.g.
``save_on_cpu``) still get every other tensor.

Not under ``torch.func.grad`` / ``vjp`` / ``vmap`` (torch refuses saved-tensor hooks inside them): there the step's
whole-step gather keeps the parameters (``Fused``), and only a loss of an inner activation alone stays FSDP2's case
(docs/reliability.md).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from funcshard._compat import (TransformType, current_graph_task_id, get_interpreter_stack, storage_key,
                               top_saved_tensors_default_hooks)
from funcshard._runtime.buffers import Status

if TYPE_CHECKING:
    from funcshard._runtime.step import Step


class _Aliased:
    """A saved tensor that aliases group ``name``'s unsharded storage (what the pack hook returns for it)."""

    __slots__ = ("tensor", "name")

    def __init__(self, tensor: torch.Tensor, name: str):
        self.tensor, self.name = tensor, name


def _key(t: torch.Tensor) -> int | None:
    try:
        return storage_key(t)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # (no storage: a subclass, sparse, ...)
        return None


def hooks_allowed() -> bool:
    """Saved-tensor hooks may be pushed here: no functorch transform other than ``jvp`` is active."""
    stack = get_interpreter_stack()
    return not stack or all(i.key() == TransformType.Jvp for i in stack)


class SavedViews:
    """The step's saved-tensor hooks, pushed for its forward (``push`` / ``pop``) when a group can be freed after
    forward. ``owners``: storage id -> group name, noted as groups are gathered (``note``)."""

    def __init__(self, step: Step):
        self._step = weakref.ref(step)
        self.owners: dict[int, str] = {}
        self.hooks = None  # the saved_tensors_hooks context while pushed

    def note(self, name: str, tensors) -> None:
        for t in tensors:
            k = _key(t)
            if k is not None:
                self.owners[k] = name

    def push(self) -> None:
        step = self._step()
        if self.hooks is not None or not hooks_allowed():
            return
        if not any(g.shards and step.plan.post_forward_world(g.group) is not None or g.group.reshard_after_forward
                   for g in step.groups.values()):
            return  # nothing is freed after forward: nothing to gather again
        for name, gb in step.groups.items():
            if gb.bases is not None:
                self.note(name, gb.storages())
        outer = top_saved_tensors_default_hooks(False) if top_saved_tensors_default_hooks is not None else None
        ref, owners = self._step, self.owners
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t):
            # (detached: a tensor saved by its own node, an output, would otherwise hold that node in a reference
            # cycle through autograd's C++ that gc cannot break; autograd gives the unpacked tensor its history)
            name = owners.get(_key(t)) if owners else None
            if name is not None:
                return _Aliased(t.detach(), name)
            return t.detach() if outer_pack is None else outer_pack(t)

        def unpack(x):
            if isinstance(x, _Aliased):
                step = ref()
                if step is not None:
                    _ensure_gathered(step, x)
                return x.tensor
            return x if outer_unpack is None else outer_unpack(x)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self.hooks = hooks

    def pop(self) -> None:
        """Pop the hooks (the forward ended or raised); only if they are still the innermost ones."""
        hooks, self.hooks = self.hooks, None
        if hooks is None:
            return
        top = top_saved_tensors_default_hooks(False) if top_saved_tensors_default_hooks is not None else None
        if top is not None and top[0] is hooks.pack_hook:
            hooks.__exit__(None, None, None)


def _ensure_gathered(step: Step, saved: _Aliased) -> None:
    """Autograd unpacks a saved view of group ``saved.name``'s unsharded storage: gather the group first (its
    pre-backward: prefetch and the enclosing groups as from its output hook) if it is not gathered."""
    name = saved.name
    gb = step.groups[name]
    if gb.status is Status.GATHERED:
        return
    if step.failed is not None:
        raise RuntimeError(
            f"funcshard: the backward reads group {name!r}'s unsharded parameters, freed when this step failed "
            f"({step.failed}); run a new step (a new forward) after the failure ({step.api})")
    if current_graph_task_id() == -1:
        raise RuntimeError(
            f"funcshard: a tensor autograd saved in group {name!r}'s forward is a view of its unsharded parameters, "
            f"which are freed outside backward; read it inside backward (or keep the group gathered: "
            f"reshard_after_forward=False for it) ({step.api})")
    step.pre_backward(name)
    if gb.status is not Status.GATHERED:
        raise RuntimeError(
            f"funcshard: the backward reads group {name!r}'s unsharded parameters, but the group promised not to "
            f"(set_unshard_in_backward(False)); set it back to True for this model ({step.api})")
