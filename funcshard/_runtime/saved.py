"""Saved views of a group's unsharded parameters: gathered again when autograd unpacks them (``SavedViews``).

A group freed after forward is gathered again by the pre-backward hook on its outputs. A backward that reaches the
group's operations without passing through those outputs never fires it: a loss taken only from an activation inside
the group, or a forward run under ``torch.func.jvp`` and differentiated by ``.backward()`` (the hook sits on the
transform's wrapper, not on the tensor the backward runs through). Autograd would then read a view of the freed
storage (FSDP2: "setStorage ... out of bounds for storage of size 0"; funcshard: autograd's "modified inplace"
error, ``GroupBuffers.mark_freed``). So, while a step's forward runs (``apply``'s, where a group is freed after forward;
not under ``torch.compile``; not ``fully_shard``'s: it cannot tell whether dynamo traces its forward), saved-tensor
hooks are in effect: packing is the C ``detach`` (no Python per saved tensor in the forward),
and unpacking a tensor whose storage is a group's unsharded buffer (``_OWNERS``) runs the group's pre-backward first
when the group is not gathered (a no-op in an ordinary backward, where the output hook already ran: its schedule and
collectives are unchanged); read outside backward (``grad_fn._saved_*``) it raises, naming the group, and so does
its unpack once the group was refilled from parameters changed in place since (``GroupBuffers.stale``: an optimizer
step before a retained graph's second backward; autograd's version check, which would refuse it, skips hooked
tensors). The caller's
own saved-tensor hooks (e.g. ``save_on_cpu``) still pack every tensor. Inside
non-reentrant ``torch.utils.checkpoint`` (around ``apply``) they step aside: it saves nothing of that forward.

Under ``torch.func.grad`` / ``vjp`` torch refuses saved-tensor hooks: there a loss of an inner activation alone fails
as in FSDP2 (docs/reliability.md gives the ways out).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch

from funcshard._compat import (TransformType, checkpoint_saved_hooks, current_graph_task_id, get_interpreter_stack,
                               saved_tensors_hooks_enabled, storage_key, top_saved_tensors_default_hooks)
from funcshard._runtime.buffers import Status

if TYPE_CHECKING:
    from funcshard._runtime.step import Step


class _Outer:
    """A tensor packed by the caller's own saved-tensor hooks (``unpack`` is theirs)."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed, unpack):
        self.packed, self.unpack = packed, unpack


# what reading a tensor's storage raises where it has none (a subclass, sparse, ...)
_NO_STORAGE = (RuntimeError, NotImplementedError, TypeError, AttributeError)


def _key(t: torch.Tensor) -> int | None:
    try:
        return storage_key(t)
    except _NO_STORAGE:
        return None


def hooks_allowed() -> bool:
    """Saved-tensor hooks may be pushed here: the caller has not disabled them
    (``torch.autograd.graph.disable_saved_tensors_hooks``) and no functorch transform other than ``jvp`` is
    active."""
    if not saved_tensors_hooks_enabled():
        return False
    stack = get_interpreter_stack()
    return not stack or all(i.key() == TransformType.Jvp for i in stack)


# The unsharded storages of the live steps' groups (storage id -> (weak step, group name)), noted as their groups are
# gathered while the hooks are in effect: what ``_unpack`` looks a saved tensor up in.
_OWNERS: dict[int, tuple[Any, str]] = {}

# The pack hook where the caller has none: the C ``detach`` (no Python frame per saved tensor: the forward's cost is
# one alias each; detached, because a tensor saved by its own node, an output, would otherwise hold that node in a
# reference cycle through autograd's C++ that gc cannot break; autograd gives the unpacked tensor its history).
_pack = torch.Tensor.detach


def _pack_outer(outer: tuple, t):
    """The pack hook over the caller's hooks ``outer`` (bound into it: torch's hook stacks are per thread)."""
    return _Outer(outer[0](t), outer[1])


def _unpack(x):
    t = x.unpack(x.packed) if isinstance(x, _Outer) else x
    if not _OWNERS:
        return t
    try:
        k = storage_key(t)  # (not _key: one frame less for each tensor autograd unpacks)
    except _NO_STORAGE:
        return t
    owner = _OWNERS.get(k)
    if owner is not None:
        step = owner[0]()
        if step is not None and ((gb := step.groups[owner[1]]).status is not Status.GATHERED or gb.stale) and _owns(
                step, owner[1], k):
            _ensure_gathered(step, owner[1])
            if gb.stale:
                _refuse_stale(step, owner[1])
    return t


def _owns(step: Step, name: str, k: int) -> bool:
    """Group ``name``'s buffers still have storage ``k`` (not a stale id: its buffers were dropped, the storage freed
    and its address taken by another tensor's)."""
    gb = step.groups[name]
    return gb.bases is not None and any(_key(b) == k for b in gb.storages())


class SavedViews:
    """The step's saved-tensor hooks, pushed for its forward (``push`` / ``pop``) when a group can be freed after
    forward. ``owners``: this step's storage ids (in ``_OWNERS`` while it lives), noted as groups are gathered
    (``note``)."""

    def __init__(self, step: Step):
        self._step = weakref.ref(step)
        self.owners: dict[int, str] = {}
        self.noted: dict[str, Any] = {}  # group -> its first buffer when its storages were noted last (``note``)
        self.hooks = None  # the saved_tensors_hooks context while pushed (_NESTED: an enclosing step's are in effect)
        # apply under torch.compile: no hooks (dynamo would trace them into its graphs: other graphs); a backward that
        # bypasses a freed group's outputs then fails as in FSDP2
        self.off = False

    def __del__(self):
        ref = self._step
        for k in self.owners:
            if _OWNERS.get(k, (None,))[0] is ref:
                del _OWNERS[k]

    def note(self, name: str, gb) -> None:
        """Group ``name``'s storages (its buffers ``gb``'s) are this step's: noted once per set of buffers (a regather
        refills the same storages; an all-gather extension's may be new tensors each gather: noted each time)."""
        bases = gb.bases
        if gb.ext is None:
            if not bases or (noted := self.noted.get(name)) is not None and noted() is bases[0]:
                return
            self.noted[name] = weakref.ref(bases[0])  # (weak: buffers a failed gather dropped are not kept alive)
        for t in gb.storages():
            k = _key(t)
            if k is not None:
                self.owners[k] = name
                _OWNERS[k] = (self._step, name)

    def begin(self) -> None:
        """``apply``'s forward begins (not ``fully_shard``'s: it cannot tell whether dynamo traces its forward): push
        the hooks; none under a ``torch.func`` grad level (torch refuses saved-tensor hooks there; a gradient hook per
        parameter-owning module cost that path ~9 % of a tiny-33g step's CPU time, so it is not built)."""
        if not self.off and not self._step().fused_on:
            self.push()

    def push(self) -> None:
        step = self._step()
        if self.hooks is not None or top_saved_tensors_default_hooks is None or not hooks_allowed():
            return  # (a torch that cannot show the caller's hooks: none, rather than hide them)
        if not any(gb.shards and freed_after_forward(step, gb) for gb in step.groups.values()):
            return  # nothing is freed after forward: nothing to gather again (a group freed after backward only: a
            # saved view read after it raises autograd's error, GroupBuffers.mark_freed; hooks here cost Python per
            # saved tensor, ~8 % of a tiny-13g step's CPU time at W=4)
        top = top_saved_tensors_default_hooks(False)
        if checkpoint_saved_hooks(top):
            # apply inside torch.utils.checkpoint: it saves no tensor of this forward (it recomputes them in backward)
            # and checks that the recomputation saves the same tensors through its hooks: none of ours
            return
        for name, gb in step.groups.items():
            if gb.bases is not None:
                self.note(name, gb)
        if top is not None and top[1] is _unpack:  # a forward inside another's: its hooks look this step's up too
            self.hooks = _NESTED
            return
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack if top is None else functools.partial(_pack_outer, top),
                                                         _unpack)
        hooks.__enter__()
        self.hooks = hooks

    def pop(self) -> None:
        """Pop the hooks (the forward ended or raised); the context only if it is still the innermost one."""
        hooks, self.hooks = self.hooks, None
        if hooks is None or hooks is _NESTED:
            return
        top = top_saved_tensors_default_hooks(False)
        if top is not None and top[1] is _unpack:
            hooks.__exit__(None, None, None)


_NESTED = object()


def _ensure_gathered(step: Step, name: str) -> None:
    """Autograd unpacks a saved view of group ``name``'s unsharded storage: gather the group first (in a backward:
    a retained graph's second backward too); outside backward (``grad_fn._saved_*``) a freed group raises."""
    if current_graph_task_id() == -1 and step.groups[name].status is not Status.GATHERED:
        if step.done and freed_after_forward(step, step.groups[name]):
            when = ("freed after the step's backward (the group reshards after forward too, so it cannot be read "
                    "before the backward either): read it inside the backward, or keep the group gathered after the "
                    "backward (reshard_after_backward=False for it)")
        elif step.done:
            when = ("freed after the step's backward: read it before or inside the backward, or keep the group "
                    "gathered (reshard_after_backward=False for it)")
        else:
            when = ("freed after the group's forward: read it inside backward, or keep the group gathered "
                    "(reshard_after_forward=False for it)")
        raise RuntimeError(
            f"funcshard: a tensor autograd saved in the forward of group {name!r} is a view of the group's "
            f"unsharded parameters, {when}; or keep `.detach().clone()` of it inside the forward, or read the "
            f"parameters by funcshard.gather(plan, state) (reading it now would read freed memory) ({step.api})")
    regather(step, name)


def freed_after_forward(step: Step, gb) -> bool:
    """Group buffers ``gb``'s group is freed (or resharded to fewer ranks) after its forward."""
    return bool(gb.group.reshard_after_forward) or step.plan.post_forward_world(gb.group) is not None


def _refuse_stale(step: Step, name: str) -> None:
    """Autograd unpacks a saved view of group ``name``'s unsharded parameters, refilled from shards changed in place
    since (``GroupBuffers.stale``): it would compute with the new values (plain torch refuses the same)."""
    raise RuntimeError(
        f"funcshard: a tensor autograd saved in the forward of group {name!r} is a view of the group's unsharded "
        f"parameters, and the group's parameters were modified by an inplace operation since that forward (an "
        f"optimizer step, a no_grad edit): its backward would use the new values. Run a new forward after changing "
        f"the parameters, or run every backward of this graph before changing them ({step.api})")


def regather(step: Step, name: str) -> None:
    """A backward reaches group ``name``'s operations: if the group is not gathered, run its pre-backward (gather,
    prefetch, the enclosing groups first) as its output hook would have."""
    gb = step.groups[name]
    if gb.status is Status.GATHERED or current_graph_task_id() == -1:
        return
    if step.failed is not None:
        raise RuntimeError(
            f"funcshard: the backward reads group {name!r}'s unsharded parameters, freed when this step failed "
            f"({step.failed}); run a new step (a new forward) after the failure ({step.api})")
    step.pre_backward(name)
    if gb.status is not Status.GATHERED:
        raise RuntimeError(
            f"funcshard: the backward reads group {name!r}'s unsharded parameters, but the group promised not to "
            f"(set_unshard_in_backward(False)); set it back to True for this model ({step.api})")
