"""One group's unsharded parameters as raw buffers, and their states: SHARDED -> GATHERING -> GATHERED -> SHARDED.

A group resharded to ``k`` ranks after forward (int ``reshard_after_forward``) is SHARDED holding its post-forward
shards (``post``): its next gather runs over its block of ``k`` ranks from them (``start_regather``).

The buffers (``Buckets.new_buffers``: one padded tensor per parameter, or the flat layout's one per dtype) are
allocated once per step and freed and refilled in place (``untyped_storage().resize_``), so that autograd's views
of them stay valid across a reshard, under ``torch.func`` too. Owned invariant: nothing is freed while a collective
may still write to it (``free`` waits for a gather in flight first; a gather whose collective failed or timed out is
dropped, never freed: the backend may still write to it).
"""

from __future__ import annotations

import contextlib
import enum

import torch

from funcshard._collectives import CollectiveError, free_buffers, no_functorch, no_grad, unwrapped, Where
from funcshard._pipeline import Buckets, post_forward_shards, regather_targets, start_gather, start_regather
from funcshard._extension import extension_of
from funcshard._compat import set_version_counters, unsafe_preserve_version_counter, version_counters
from funcshard._offload import to_device
from funcshard._plan import Group
from funcshard._spec import reduced
from funcshard._runtime.observe import LISTENERS, emit


class Status(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class GroupBuffers:
    """One group's shards (as given), unsharded buffers, and gather state within a step."""

    __slots__ = ("group", "layout", "reduce_layout", "shards", "flat_shards", "bases", "copy_to", "status",
                 "pending", "versions", "frozen", "trainable", "post", "regather", "grad_mask", "ext", "compute_device",
                 "freed_versions", "stale", "watch")

    def __init__(self, group: Group, layout: Buckets, state: dict[str, torch.Tensor], plan=None,
                 compute_device: torch.device | None = None):
        self.group = group
        self.compute_device = compute_device  # (an offloaded group's shards are on the host: gathered here)
        self.layout = layout
        self.shards = [state[p] for p in group.params]  # (as given: the gathers read them under no_grad)
        # shards whose class defines FSDP2's all-gather extension (fsdp_pre_all_gather / fsdp_post_all_gather)
        self.ext = None if plan is None else extension_of(group, layout, list(map(unwrapped, self.shards)), plan)
        if self.ext is not None and group.offload_to_cpu:
            raise NotImplementedError(
                f"group {group.name!r}: CPU offload together with the tensor-subclass all-gather extension "
                f"(fsdp_pre_all_gather / fsdp_post_all_gather) is not built yet; offload another group, or use plain "
                f"tensors in this one")
        # (under torch.func.jvp a shard's wrapper does not require grad where the tensor under it does: plain autograd
        # below the transform differentiates it, through this group's backward)
        grad = [t.requires_grad or unwrapped(t).requires_grad for t in self.shards]
        # A group with a shard that takes no gradient: backward ops may read its unsharded parameters after the
        # group's reduce-scatter, so it is freed only once its inputs' gradients are complete too (FrozenRelease).
        self.frozen = not all(grad)
        self.trainable = any(grad)
        self.grad_mask = tuple(grad)  # (the ranks check that they agree on it: _runtime.check)
        # the reduce-scatter's layout: the parameters it covers (_spec.reduced, decided by the shards, as every rank
        # sees them; a trainable parameter without a gradient on this rank is sent as zeros, so the ranks agree)
        self.reduce_layout = layout.only(reduced(layout.flat, grad, [s.dtype for s in layout.specs]))
        self.flat_shards: list | None = None  # the copy-in's views of the shards (Buckets.flat_shards), made once
        self.bases: list[torch.Tensor] | None = None  # the raw unsharded buffers
        self.copy_to: list | None = None  # the copy-out's views of them (Buckets.copy_targets)
        self.status = Status.SHARDED
        self.pending = None  # PendingGather (PendingExtension: the extension's) while GATHERING
        self.versions = None  # flat layout: autograd's version counters held while the collective writes
        self.post: tuple | None = None  # (post-forward shards, process group, rank in it, k) while resharded to k
        self.regather = 0  # k while a gather from the post-forward shards is in flight
        # while the storage is freed: (the buffers, autograd's versions of them before the free, the shards' versions
        # then) (``mark_freed``); the buffers' put back when it is refilled from unchanged shards (``wait``)
        self.freed_versions = None
        # refilled from shards changed in place since the free (an optimizer step, a no_grad edit): what autograd
        # saved of the buffers before holds other values (``_runtime.saved`` refuses it; autograd does, unhooked)
        self.stale = False
        # the tensors an in-place change of the parameters moves autograd's version of (``shard_versions``): the
        # shards under any functorch wrappers (inference tensors have none); fully_shard's DTensor parameters (its
        # shards are detached aliases: an optimizer step on the DTensor moves only the DTensor's version on)
        self.watch = [u for u in map(unwrapped, self.shards) if not u.is_inference()]

    @property
    def device(self) -> torch.device:
        """Where the group is gathered and computes: its shards' device, the mesh's for an offloaded group."""
        if self.group.offload_to_cpu and self.compute_device is not None:
            return self.compute_device
        return self.shards[0].device

    def issue(self, pg, rank: int, where: Where | None = None) -> None:
        """Issue the group's all-gather (async) unless it is gathered or in flight. ``where``: what its wait names
        and is bounded by (``_collectives.wait_work``)."""
        if self.status is not Status.SHARDED:
            return
        if not self.shards:  # e.g. a root group when every parameter is in a child group
            self.bases, self.status = [], Status.GATHERED
            return
        if self.post is not None:  # resharded to k ranks after forward: gather from them, over them
            (post, group, rank, k), self.post = self.post, None
            with no_functorch():
                self.pending = start_regather(self.layout, post, group, rank, k,
                                              where and where._replace(kind="re-gather", pg=group), self.group.comm)
            self.regather = k
            self.status = Status.GATHERING
            if LISTENERS:
                emit("all-gather issued", self.group.name, self)
            return
        if self.ext is not None:  # the extension's inputs, one all-gather of them all
            with no_functorch(), no_grad():
                self.pending = self.ext.start(self.shards, pg, rank, self.group.comm, where)
            self.status = Status.GATHERING
            if LISTENERS:
                emit("all-gather issued", self.group.name, self)
            return
        with no_functorch(), no_grad():
            flat = self.flat_shards
            if flat is None:
                plain = list(map(unwrapped, self.shards))
                moved = to_device(plain, self.device) if self.group.offload_to_cpu else plain  # (host shards)
                flat = self.layout.flat_shards(moved)
                if moved is plain and all(t.is_contiguous() for t in plain):  # views, kept for the step (a copy
                    # would be stale later)
                    self.flat_shards = flat
            if self.layout.flat:  # the all-gather writes straight into the parameters' storage
                self.allocate()
                # Autograd may have saved views of these buffers: hide the refill from its version check. The
                # collective may bump the version from its own thread until waited: restored in wait().
                self.versions = preserve_versions(self.bases)
                self.pending = start_gather(self.layout, flat, pg, rank, outs=self.bases, where=where,
                                            comm=self.group.comm)
            else:
                self.pending = start_gather(self.layout, flat, pg, rank, where=where, comm=self.group.comm)
        self.status = Status.GATHERING
        if LISTENERS:
            emit("all-gather issued", self.group.name, self)

    def allocate(self) -> None:
        if self.bases is None:
            self.bases = self.layout.new_buffers(self.device)
            self.copy_to = self.layout.copy_targets(self.bases)
        else:  # storage freed by a reshard: allocate it again (autograd's views stay valid)
            for t in self.storages():  # (never shrinking: an extension's tensors may be views of one storage)
                need = (t.storage_offset() + t.numel()) * t.element_size()
                if t.untyped_storage().nbytes() < need:
                    t.untyped_storage().resize_(need)

    def storages(self) -> list[torch.Tensor]:
        """The tensors whose storage is freed and refilled with the group (with an all-gather extension: the plain
        parameters' buffers and the tensors ``fsdp_post_all_gather`` returned)."""
        return self.bases if self.ext is None else self.ext.storages(self.bases)

    def wait(self) -> None:
        """GATHERING -> GATHERED: wait for the all-gather and copy out into the buffers."""
        if self.status is not Status.GATHERING:
            return
        if LISTENERS:
            emit("all-gather wait", self.group.name, self)
        with no_functorch(), no_grad():
            fresh = self.bases is None  # new buffers: nothing can have saved them yet
            if not self.layout.flat or self.regather:
                self.allocate()
            if self.regather:
                targets = regather_targets(self.layout, self.bases, self.regather)
            else:
                targets = self.bases if self.ext is not None else self.copy_to
            try:
                if fresh:
                    self.pending.finish(targets)
                else:  # refilling tensors autograd saved for backward: their version must not change
                    with preserve_versions(self.versioned()):
                        self.pending.finish(targets)
            except CollectiveError:
                self.drop()
                raise
            if self.versions is not None:
                self.versions.__exit__(None, None, None)
                self.versions = None
            if self.freed_versions is not None:  # refilled
                self.unmark_freed()
        self.pending, self.regather = None, 0
        self.status = Status.GATHERED
        if LISTENERS:
            emit("gathered", self.group.name, self)

    def drop(self) -> None:
        """The gather failed or timed out: forget it without waiting or freeing. Its collective may still write into
        its buffers (the flat layout's are the unsharded buffers: dropped too, left to the work holding them)."""
        if self.versions is not None:
            self.versions.__exit__(None, None, None)
            self.versions = None
        if self.pending is not None and self.pending.in_place:
            self.bases = self.copy_to = self.freed_versions = None  # (versions left moved on: not refilled)
        elif self.bases is not None:
            self.mark_freed()
            free_buffers(self.storages())  # (per-parameter layout: the collective writes into its own buffers)
        self.pending, self.regather, self.status = None, 0, Status.SHARDED

    def free(self) -> None:
        """Free the unsharded buffers' storage (autograd's references stay valid); waits for a gather in flight. Drops
        post-forward shards. A gather on a process group an earlier failure broke is dropped (``drop``)."""
        self.post = None
        if self.status is Status.SHARDED:
            return
        try:
            self.wait()  # never free memory a collective still writes to
        except CollectiveError as e:
            if not e.repeat:
                raise
            return  # (dropped)
        self.mark_freed()
        with no_functorch():
            free_buffers(self.storages())
        self.status = Status.SHARDED
        if LISTENERS:
            emit("freed", self.group.name, self)

    def mark_freed(self) -> None:
        """The buffers' storage is about to be freed: move autograd's version of each on by one (its views share it),
        so that autograd refuses to unpack a tensor it saved of them without saved-tensor hooks (its "modified by an
        inplace operation" error, where it would read freed memory: a saved view read by ``grad_fn._saved_*``, or a
        backward that reaches the group without gathering it); ``wait`` puts the versions back once refilled from
        unchanged parameters (``unmark_freed``). Per group: a C call and a version read per buffer and per
        parameter, nothing per saved tensor (the saved-tensor hooks of ``_runtime.saved`` cost Python per saved
        tensor: they run where they can name the group). Autograd checks versions only of tensors saved without
        saved-tensor hooks: under the caller's own (identity) hooks a read is not guarded (docs/reliability.md)."""
        if self.freed_versions is not None or not self.bases or not self.group.unshard_in_backward:
            return  # (freed already, not refilled since; a group whose backward is promised to read no parameter
            # values is not gathered for it: its ops may still unpack what they saved, for its sizes, torch.gather)
        tensors = tuple(self.versioned())
        if not tensors or any(t.is_inference() for t in tensors):
            return  # (inference tensors have no versions)
        versions = version_counters(tensors)
        self.freed_versions = (tensors, versions, self.shard_versions())
        set_version_counters(tensors, [v + 1 for v in versions])

    def unmark_freed(self) -> None:
        """Refilled: put autograd's versions of the buffers back (it may read what it saved of them again) if the
        shards are unchanged since the free; else leave them moved on (autograd refuses the old values, as plain
        torch refuses a tensor changed in place since it was saved) and mark the buffers ``stale``."""
        tensors, versions, shards = self.freed_versions
        self.freed_versions = None
        if self.shard_versions() == shards:
            set_version_counters(tensors, versions)
        else:
            self.stale = True

    def shard_versions(self) -> list[int]:
        """Autograd's versions of the parameters the group's gathers read (``watch``): an in-place change of one (an
        optimizer step, a no_grad edit) moves it on."""
        return version_counters(self.watch)

    def reshard_to(self, plan, k: int) -> None:
        """Keep this rank's post-forward shards (a ``k``-th of the unsharded buffers, ``post_forward_shards``), free
        the buffers; the next gather runs over the block of ``k`` ranks (``plan.post_forward_group(k)``)."""
        if self.status is Status.SHARDED:
            return
        group, rank = plan.post_forward_group(k)
        self.wait()
        with no_functorch():
            post = post_forward_shards(self.layout, self.bases, rank, k)
        self.free()
        self.post = (post, group, rank, k)

    def versioned(self) -> list[torch.Tensor]:
        """The buffers whose autograd versions a refill must not bump (plain tensors only)."""
        if self.ext is None:
            return self.bases
        return list({id(t): t for t in (*self.bases, *self.storages()) if _plain(t)}.values())

    def views(self) -> tuple[torch.Tensor, ...]:
        """The unsharded parameters as views of the buffers (no autograd history)."""
        with no_grad():
            return self.layout.views(self.bases)

    def storageless_views(self) -> tuple[torch.Tensor, ...]:
        """The unsharded parameters as views of buffers made now and freed at once (storage comes with the group's
        gathers): the whole-step gather's outputs under torch.func."""
        if self.ext is not None:
            raise NotImplementedError(
                f"group {self.group.name!r}: a parameter with an all-gather extension (fsdp_pre_all_gather) under a "
                f"torch.func grad transform is not built (its fsdp_post_all_gather makes the unsharded parameter at "
                f"each gather, after the transform's whole-step gather has made its outputs); use "
                f"funcshard.value_and_grad or plain autograd")
        with no_functorch(), no_grad():
            self.bases = self.layout.new_buffers(self.device)
            self.copy_to = self.layout.copy_targets(self.bases)
            views = self.layout.views(self.bases)
            free_buffers(self.bases)
        return views

    def take_from(self, other: GroupBuffers) -> None:
        """Take over another step's gathered buffers (no second all-gather); ``other`` becomes SHARDED."""
        other.wait()
        self.bases, self.copy_to, self.status = other.bases, other.copy_to, Status.GATHERED
        if self.ext is not None and other.ext is not None:  # (the parameters fsdp_post_all_gather made)
            self.ext.inner, other.ext.inner = other.ext.inner, [None] * len(other.ext.inner)
            self.ext.outs, other.ext.outs = other.ext.outs, [None] * len(other.ext.outs)
        other.bases, other.copy_to, other.status = None, None, Status.SHARDED


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def preserve_versions(tensors):
    """Hide in-place refills from autograd's version check (inference tensors have no versions)."""
    if any(t.is_inference() for t in tensors):
        return contextlib.nullcontext()
    return unsafe_preserve_version_counter(tuple(tensors))
