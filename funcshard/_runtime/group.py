"""One group's life in one step: ``GroupRun``.

A step makes one ``GroupRun`` per group of its plan. It owns the group's lifecycle within the step: gather (issue,
wait), the module's view of it (swap in / out), its entry into autograd (through the step's gather strategy), its
outputs' pre-backward hooks, the free after forward (or the post-forward shards of an int ``reshard_after_forward``)
and after backward, and its gradients' reduce-scatter. Every gather and free of a group goes through its run
(``unshard`` / ``issue`` / ``wait`` / ``reshard``). It holds the group's state in the step: ``buffers``
(``GroupBuffers``: the shards, the raw unsharded buffers, the status), ``slots`` (its parameters' module slots),
``node`` (its ``_GroupGather`` node, for ``Nodes``), ``fused`` (its part of the whole-step gather, for ``Fused``),
``counts`` (frozen-parameter release, for ``FrozenRelease``) and ``hook`` (the pre-backward hook on its outputs): the
parts act on these and keep no per-group state of their own. What spans groups stays with the ``Step``: the order
and prefetch, the reduce queue, the divergence checks, the routing of autograd hooks (of module hooks: ``hooks``).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch

from funcshard._collectives import Where, no_functorch, raw_grads
from funcshard._compat import TransformType, current_graph_task_id, get_interpreter_stack, maybe_current_level
from funcshard._compile import runtime_boundary
from funcshard._runtime.backward import Counts, grad_inputs
from funcshard._runtime.binding import Slots
from funcshard._runtime.buffers import GroupBuffers, Status
from funcshard._runtime.observe import LISTENERS, emit
from funcshard._runtime.part import Part, failing
from funcshard._runtime.strategies import (FusedState, NodeState, differentiated_below, graph_backward,
                                           regather_below, take_grads_hook)

if TYPE_CHECKING:
    from funcshard._runtime.step import Step

_functorch_level = maybe_current_level
_graph_task_id = current_graph_task_id


class GroupRun(Part):
    """Group ``buffers.group.name``'s life in ``step`` (see the module docstring)."""

    def __init__(self, step: Step, buffers: GroupBuffers, slots: Slots):
        super().__init__(step)
        self.name = buffers.group.name
        self.buffers = buffers  # the shards, the raw unsharded buffers, the status
        self.slots = slots  # its parameters' slots in the module, and the views they get
        self.node = NodeState(take_grads_hook(step, self.name))  # its _GroupGather node (Nodes)
        self.fused = FusedState()  # its part of the whole-step gather (Fused)
        self.counts = Counts()  # when it may be freed in backward with frozen parameters (FrozenRelease)
        self.hook = pre_backward_hook(step, self.name)  # the pre-backward hook on its outputs (the usual one)

    # ---- gather and free (every gather and free of the group goes through these) ------------------------------
    def unshard(self) -> None:
        """Issue the group's all-gather (async) unless it is gathered or in flight, or it is backward and the group
        promised its backward reads no parameters (``set_unshard_in_backward(False)``)."""
        if self.step.backward_started and not self.buffers.group.unshard_in_backward:
            return
        self.issue()

    @failing
    def issue(self) -> None:
        """Issue the group's all-gather (async) unless it is gathered or in flight (whatever unshard_in_backward
        says). HSDP: a reduce-scatter in flight is taken first. Check mode: the ranks agree on it first."""
        step, gb = self.step, self.buffers
        if gb.status is not Status.SHARDED:
            return
        if gb.shards:
            step.reduce_queue.before_gather()
        if gb.shards and step.checks.sequence:
            kind = "re-gather" if gb.post is not None else "all-gather"
            step.checks.collective(f"{kind} of group {self.name!r} ({step.phase()})")
        gb.issue(step.pg, step.rank, self.where("all-gather"))

    def gather_and_prefetch(self, *, backward: bool) -> None:
        """The group's use (forward) or its pre-backward: gather it, then issue the all-gathers of the groups the plan
        prefetches after it (``Prefetcher.after``)."""
        self.unshard()
        self.wait()
        self.step.prefetcher.after(self.name, backward=backward)

    @failing
    def wait(self) -> None:
        if self.buffers.status is Status.SHARDED:
            self.unshard()
        self.buffers.wait()
        saved = self.step.saved
        if saved is not None and saved.hooks is not None:  # (its storage, for the forward's saved-tensor hooks)
            saved.note(self.name, self.buffers)

    @failing
    def reshard(self) -> None:
        """Free the group's unsharded parameters (the module never keeps views of freed storage)."""
        self.slots.swap_out()
        self.buffers.free()

    @failing
    def reshard_after_forward(self) -> None:
        """Free the group after forward if its plan says so, or keep it sharded over fewer ranks (an int
        ``reshard_after_forward``: its next gather runs within that block)."""
        step, group = self.step, self.buffers.group
        k = step.plan.post_forward_world(group)
        if k is None:
            if group.reshard_after_forward:
                self.reshard()
            return
        self.slots.swap_out()
        self.buffers.reshard_to(step.plan, k)

    def free_after_backward(self) -> None:
        """Free the group after its backward if its plan says so; never in a step whose backward ran with
        ``create_graph=True`` (``Step.second_order``): the graph that backward made reads the unsharded parameters when
        it is differentiated (views of these buffers, which a free would empty), so they stay until the step goes with
        its graph."""
        if self.buffers.group.reshard_after_backward and not self.step.second_order:
            self.reshard()

    def release(self) -> None:
        """Free the group and put the module's own parameters back (outside forward and backward)."""
        self.reshard()  # (it swaps the module's own parameters back in)
        self.step.nodes.loosen(self.name)

    def drop(self) -> None:
        """The step failed: put the module's own parameters back, free what is gathered, drop a gather in flight
        without waiting (its buffers stay with the backend's work)."""
        step, gb = self.step, self.buffers
        self.slots.swap_out()
        if gb.status is Status.GATHERING:
            gb.drop()
        else:
            gb.free()
        gb.post = None
        step.nodes.loosen(self.name)

    def take_over(self, old: GroupRun) -> None:
        """Take the group as the last step ``old`` left it gathered (no second all-gather)."""
        swapped = old.slots.swapped
        old.swap_out()
        self.buffers.take_from(old.buffers)
        old.slots.views = None
        if swapped:
            self.register_unsharded()

    # ---- the module's view of the group ------------------------------------------------------------------------
    def swap_in(self) -> None:
        b = self.slots
        if not b.swapped and b.views is None and self.step.nodes.saved_views(self.name) is None:
            return
        b.swap_in()

    def swap_out(self) -> None:
        self.slots.swap_out()

    def register_unsharded(self) -> None:
        """Put the gathered (unpadded) parameters on the module, outside autograd (``unshard()``)."""
        gb = self.buffers
        if gb.status is Status.GATHERED and not self.slots.swapped:
            ns = self.node
            self.slots.views, ns.node = gb.views(), None
            ns.views_grad = False  # (no autograd history: a use with grad gathers through a node again)
            self.swap_in()

    # ---- forward -----------------------------------------------------------------------------------------------
    def gather_for_forward(self) -> None:
        """Gather the group for a forward use and give the module its parameters through the step's strategy."""
        step, gb, name = self.step, self.buffers, self.name
        self.swap_out()  # (parameters registered by unshard() make way for autograd-visible ones)
        step.prefetcher.used(name)
        self.gather_and_prefetch(backward=False)
        ns = self.node
        grad = torch.is_grad_enabled()
        if not step.fused_on and ns.views_grad and not grad and gb.shards:
            # used again under no_grad after a use with grad: keep the views with autograd history (refilled in
            # place), which activation checkpointing recomputes with in backward
            return
        ns.views_grad, ns.node = grad, None
        if not gb.shards:
            self.slots.views = ()
        elif step.fused_on:
            self.slots.views = step.fused.views(name)
        elif _functorch_level() is not None:  # torch.func.jvp: the new-style Function (it has the jvp rule)
            step.nodes.gather_jvp(name)
        else:
            relayed = step.relay.on and gb.trainable and grad  # (a no-grad use needs no relay)
            step.nodes.gather(name, step.relay.tokens_for(name) if relayed else None)

    def post_forward(self, output: Any) -> Any:
        """The group's forward pass closed: swap out, free (or keep post-forward shards), hook the outputs."""
        self.step.prefetcher.closed(self.name)
        self.swap_out()
        self.step.nodes.loosen(self.name)
        self.reshard_after_forward()
        return self.wrap_for_backward(output)

    def wrap_for_backward(self, output: Any, keeper: list | None = None) -> Any:
        """Hook the group's outputs so the group is gathered again before its backward runs: a gradient hook on
        the outputs fires once the first output gradient is ready, before any backward op of the group. The hooks
        of a fused forward hold its ``keeper`` (``Fused.end_forward``: the graph's views live as long as they do)."""
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor):  # (the usual case, without a pytree walk)
            tensors = [output] if output.requires_grad else []
        else:
            tensors = grad_inputs(output)
        if not tensors:
            return output
        step = self.step
        if step.below and single_grad_level() and differentiated_below(step):
            regather_below(step, self.name, tensors)
        # A group without trainable parameters has no gather node in the graph to keep the step alive until its
        # backward: its hooks hold the step themselves (made per call, not kept by the step: no reference cycle).
        strong = not self.buffers.trainable
        keeper = step.fused.keeper if keeper is None else keeper
        if len(tensors) > 1 and single_grad_level():
            # one hook per tensor (a multi-grad hook cannot replace gradients); pre_backward once per call
            hook = pre_backward_hook(step, self.name, once=True, strong=strong, keeper=keeper)
            for t in tensors:
                t.register_hook(hook)
            return output
        if strong or keeper is not None:
            hook = pre_backward_hook(step, self.name, strong=strong, keeper=keeper)
        else:
            hook = self.hook
        if len(tensors) == 1:
            tensors[0].register_hook(hook)
        else:
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        return output

    # ---- backward ----------------------------------------------------------------------------------------------
    def pre_backward(self) -> None:
        """The gradient reached the group's outputs (or a nested group's): gather it, prefetch the next groups of
        backward, swap it in for a recomputation."""
        step, gb, name = self.step, self.buffers, self.name
        step.pre_backward_ran.add(name)
        graph_backward(step)  # (apply, create_graph=True: keep what that backward's graph reads)
        self.gather_and_prefetch(backward=True)
        if ((self.slots.views is None or not self.node.views_grad) and gb.trainable
                and not step.fused_on and gb.status is Status.GATHERED and step.nodes.saved_views(name) is None):
            # The module holds no views with autograd history: no recorded op used the group's parameters (reentrant
            # checkpointing inside the group's forward ran them under no_grad), or the group stayed gathered after
            # forward with its parameters registered without history (reshard_after_forward=False). A recomputation
            # that runs no hook of ours (torch.utils.checkpoint inside the unit: checkpoint_wrapper) reads these: with
            # grad, as in the forward (or it saves fewer tensors: CheckpointError); a reentrant one's backward reaches
            # their node (the group's post-backward).
            self.swap_out()  # (the registered views make way)
            with torch.enable_grad():
                step.nodes.gather(name, None, count=False)  # (the forward's node was counted)
        if gb.status is Status.SHARDED:  # not gathered (unshard_in_backward=False): no views
            self.swap_out()
        else:
            self.swap_in()  # activation-checkpoint recomputation reads the module's attributes

    def divide_factor(self) -> float:
        """The factor the group's summed gradients are divided by (``Plan.divide_factor_of``), given once to its
        reduce-scatter."""
        return self.step.plan.divide_factor_of(self.buffers.group)

    def where(self, kind: str) -> Where:
        """What a collective of the group's waits names and is bounded by."""
        return self.step.where(kind, self.name)

    @failing
    def post_backward(self, grads: list) -> list:
        """The group's gradients are complete: free it, then reduce-scatter them (consumes ``grads``; FSDP2's order,
        so the unsharded parameters are gone before the reduce-scatter's buffers are allocated). Returns the
        shards, or (with a sink) Nones: the shards go to the sink."""
        step = self.step
        if step.sink is not None:
            n = len(grads)
            self.reduce_later(grads, step.sink)
            return [None] * n
        raw_grads(grads)
        pending = step.reduce_queue.start(self.name, grads)
        if LISTENERS:
            emit("reduce-scatter wait", self.name, pending)
        with no_functorch():
            shards = pending.finish()
        if LISTENERS:
            emit("reduce-scatter done", self.name, pending)
        return shards

    @failing
    def reduce_later(self, grads: list, sink: Any) -> None:
        """``post_backward`` whose reduce-scatter is taken later: in the next group's post-backward or at the end of
        backward, so it runs while that group's backward computes; its shards go to ``sink``."""
        step = self.step
        raw_grads(grads)
        grads, extra = sink.collect(self.name, grads)
        if grads is None:  # the sink keeps them (accumulation without sync): no reduce-scatter now
            step.frozen.grads_done(self.name)
            return
        pending = step.reduce_queue.start(self.name, grads)
        step.reduce_queue.defer(self.name, pending, sink, extra)

    def end_backward(self) -> None:
        """The step's backward ended: free (``reshard_after_backward``), swap out, let go of the graph, reset the
        counts for a retained graph's next backward."""
        step = self.step
        self.free_after_backward()
        self.swap_out()
        step.nodes.loosen(self.name)
        step.frozen.backward_ended(self.name)
        step.fused.end_backward(self.name)


def single_grad_level() -> bool:
    stack = get_interpreter_stack()
    return stack is not None and len(stack) == 1 and stack[0].key() == TransformType.Grad


def pre_backward_hook(step: Step, name: str, once: bool = False, strong: bool = False, keeper: list | None = None):
    """The hook on a group's outputs that runs its pre-backward (``Step.pre_backward``: the step routes it, as the
    enclosing groups' run first)."""
    # Weakly held: the step keeps its hooks. The autograd graph keeps the step alive through its gather nodes while
    # a backward can come; ``strong``: a hook the step does not keep holds it (for a group without such a node);
    # ``keeper``: a fused forward's views (Fused.end_forward), held by the hook for as long as the graph holds it.
    ref = (lambda: step) if strong else weakref.ref(step)
    # (a partial of one marked function: marking a closure per group and step cost ~35 us each)
    wrapped = functools.partial(_pre_backward, ref, name, once, [None])
    wrapped.keeper = keeper  # (held for as long as autograd holds the hook)
    return wrapped


@runtime_boundary
def _pre_backward(ref, name: str, once: bool, fired: list, grad):
    """``pre_backward_hook``'s hook; ``fired``: the backward (graph task) in which a once-per-call hook last fired."""
    step = ref()
    if step is None:
        return None
    task = _graph_task_id()
    if not once or fired[0] != task:
        fired[0] = task
        step.pre_backward(name)
    if single_grad_level() and not (step.below and differentiated_below(step)):
        # torch.func.grad differentiates with create_graph=True (so transforms can nest); with a single grad
        # level nothing differentiates the gradients again (but plain autograd below it: strategies.below), and the
        # graph that made them would keep every finished group's saved activations and full gradients alive until
        # backward ends.
        return grad.detach()
    return None  # the gradient passes unchanged
