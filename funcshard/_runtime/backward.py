"""Backward: the reduce-scatter queue, freeing groups with frozen parameters, and recomputation.

- ``ReduceQueue``: the reduce-scatters in flight, oldest first: one at a time by default. A group's post-backward
  frees the group first, then takes the reduce-scatter still in flight (so its buffers are gone before this one's are
  allocated), then issues its own; it is taken in the next group's post-backward, or at the end of backward, and its
  shards go to a sink (``deliver``), so that it runs while the next group's backward computes (FSDP2 does this on
  CUDA with its reduce-scatter stream). ``Plan.reduce_scatter_buffers`` = K keeps up to K in flight (FSDP2's
  ``set_reduce_scatter_max_input_buffers``): a post-backward takes the oldest only while K are.
- ``FrozenRelease``: a group with a frozen parameter may still be read by backward ops that do not reach its
  gather node (the gradient of its input through a frozen weight), so it is freed only once every use's input
  gradients are done and its post-backward ran for every gather that made autograd history.
- ``Recompute``: activation checkpointing runs a group's forward again inside backward; reentrant checkpointing
  (its first run had no grad) gathers the group through a new node, whose post-backward runs in the backward the
  checkpoint does on the recomputed graph.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from funcshard._collectives import CollectiveError, no_functorch
from funcshard._pipeline import start_reduce_scatter
from funcshard._compile import runtime_boundary
from funcshard._compat import is_functorch_wrapped_tensor, maybe_current_level
from funcshard._offload import host_reduce
from funcshard._runtime.observe import LISTENERS, emit
from funcshard._runtime.part import Part
from funcshard._schedule import reduce_scatter_depth
from funcshard._tree import module_io_leaves

if TYPE_CHECKING:
    from funcshard._runtime.step import Step


class ReduceQueue(Part):
    observed = True  # its takes are the runtime's events (observe.emit); the cost model's replay's are not

    def __init__(self, step: Step):
        super().__init__(step)
        self.items: deque[tuple] = deque()  # (group, PendingReduce, sink, extra), oldest first

    def start(self, name: str, grads: list):
        """Free the group (``grads_done``), take the oldest reduce-scatters in flight until fewer than the plan's
        depth are (``_schedule.reduce_scatter_depth``: one by default, so the one in flight is taken), then issue the
        group's (consumes ``grads``, plain tensors (``raw_grads``: the caller made them so once): each is dropped once
        copied into the reduce-scatter input)."""
        step = self.step
        step.frozen.grads_done(name)
        self.finish(keep=reduce_scatter_depth(step.plan) - 1)
        step.checks.collective(f"reduce-scatter of group {name!r} (backward)")
        return self.issue(name, grads)

    def issue(self, name: str, grads: list):
        """Issue the group's reduce-scatter (async); returns it pending (``PendingReduce``). (The cost model's replay
        runs this queue with an ``issue`` of its own: ``cost._Replay``.)"""
        step = self.step
        run = step.runs[name]
        gb = run.buffers
        with no_functorch():
            pending = start_reduce_scatter(gb.reduce_layout, grads, step.pg, gb.device, run.divide_factor(),
                                           step.replicate_pg, run.where("reduce-scatter"), gb.group.comm)
            pending = host_reduce(pending, gb.group, gb.device, defer=step.sink is not None)  # (CPU offload)
        if LISTENERS:
            emit("reduce-scatter issued", name, pending)
        return pending

    def before_gather(self) -> None:
        """An all-gather is about to be issued: the reduce-scatters in flight whose outputs are all-reduced over the
        replicate axis (HSDP) are taken first, so that their all-reduces come before the all-gather, in every path
        (the schedule's order and FSDP2's, which issues the all-reduce right after the reduce-scatter; on gloo the
        all-reduce can only start once the reduce-scatter is done). Their buffers are freed before the all-gather's
        are allocated. Without a replicate axis nothing is taken: the reduce-scatters keep running while the next
        group's backward computes."""
        while self.items and self.items[0][1].replicate is not None:
            self.finish(keep=len(self.items) - 1)

    def defer(self, name: str, pending, sink, extra: Any) -> None:
        self.items.append((name, pending, sink, extra))

    def _take(self) -> tuple | None:
        """The oldest reduce-scatter in flight, waited (None: none is)."""
        if not self.items:
            return None
        name, pending, sink, extra = self.items.popleft()
        if LISTENERS and self.observed:
            emit("reduce-scatter wait", name, pending)
        options = sink.reduce_options(name) if hasattr(sink, "reduce_options") else {}
        try:
            with no_functorch():
                shards = pending.finish(**options)
        except CollectiveError as e:
            self.step.fail(e)
            raise
        if LISTENERS and self.observed:
            emit("reduce-scatter done", name, pending)
        return name, shards, sink, extra

    def finish(self, keep: int = 0) -> None:
        """Wait for the reduce-scatters in flight, oldest first, until ``keep`` are left, and deliver their shards
        (none when the sink keeps its sums without an all-reduce: ``reduce_options``)."""
        while len(self.items) > keep:
            name, shards, sink, extra = self._take()
            if shards is not None:
                sink.deliver(name, shards, extra)

    def finish_if(self, name: str, extra: Any) -> None:
        """The group's shards are wanted now (its relay's backward): take its reduce-scatters in flight (a group used
        twice in forward may have two: its relay sums them), and the older ones first (they are delivered in the order
        they were issued)."""
        last = None
        for i, item in enumerate(self.items):
            if item[0] == name and item[3] == extra:
                last = i
        if last is not None:
            self.finish(keep=len(self.items) - last - 1)

    def drop(self) -> None:
        """Wait for the reduce-scatters in flight, if any, and drop their results (what an aborted backward left;
        those on a process group an earlier failure broke are dropped without waiting)."""
        try:
            while self.items:
                self._take()
        except CollectiveError as e:
            if not e.repeat:
                raise

    def clear(self) -> None:
        """Forget what is in flight without waiting (``Step.fail``: its buffers stay with the backend's work)."""
        self.items.clear()


class Counts:
    """A group's frozen-release counts in a step (``GroupRun.counts``)."""

    __slots__ = ("uses", "inputs_left", "nodes", "nodes_left", "unwatched", "counters")

    def __init__(self):
        self.uses = self.inputs_left = self.nodes = self.nodes_left = 0
        self.unwatched = False  # a use whose inputs could not be watched: only the end of backward frees it
        self.counters: list[list[int]] = []  # per watched use: [input gradients to go, inputs]


class FrozenRelease(Part):
    """When a group with frozen parameters may be freed in backward (its counts: ``GroupRun.counts``)."""

    def node_made(self, name: str) -> None:
        """A gather that made autograd history: one more post-backward to wait for."""
        c = self.step.runs[name].counts
        c.nodes += 1
        c.nodes_left += 1

    def watch_inputs(self, name: str, args: tuple) -> tuple | None:
        """For a group with frozen parameters: free it once the gradients of its forward inputs are complete.
        Returns new args (or None: unchanged): each input that requires grad is passed on as an alias whose
        gradient hook counts it, so the group is freed as soon as its own input gradients are done, before the
        previous group's pre-backward prefetches (FSDP2 puts a Function on the module's inputs for the same
        reason)."""
        if not self.step.groups[name].frozen or not torch.is_grad_enabled():
            return None
        c = self.step.runs[name].counts
        inputs = [a for a in grad_inputs(args) if _at_this_level(a)]
        if not inputs:  # e.g. inputs passed as keyword arguments: keep the group until the end of backward
            c.unwatched = True
            return None
        c.uses += 1
        c.inputs_left += 1
        top = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad and _at_this_level(a)]
        if len(top) != len(inputs) or any(args[i].layout is not torch.strided or args[i].is_nested for i in top):
            # inside containers (not rebuilt: the module may fill them) or not aliasable (nested, sparse)
            torch.autograd.graph.register_multi_grad_hook(
                inputs, runtime_boundary(lambda _g: self.inputs_done(name)), mode="all")
            return None
        left = [len(top), len(top)]  # (to go, total): reset at the end of backward for a retained graph
        c.counters.append(left)
        ref = weakref.ref(self)

        @runtime_boundary  # (autograd calls these hooks, under torch.compile too: see funcshard._compile)
        def done(_grad):
            left[0] -= 1
            if left[0] == 0 and (me := ref()) is not None:
                me.inputs_done(name)

        new = list(args)
        for i in top:
            new[i] = torch.ops.aten.alias(args[i])
            new[i].register_hook(done)
        return tuple(new)

    def inputs_done(self, name: str) -> None:
        """The gradients of one use's forward inputs are complete."""
        if self.step is None:  # (a hook that outlived its step: the step's buffers went with it)
            return
        self.step.runs[name].counts.inputs_left -= 1
        self.release(name)

    def grads_done(self, name: str) -> None:
        """The group's post-backward ran: free it, unless frozen parameters may still be read by backward ops that
        do not reach here (then once every use's inputs are done too)."""
        if not self.step.groups[name].frozen:
            self.step.runs[name].free_after_backward()
            return
        self.step.runs[name].counts.nodes_left -= 1
        self.release(name)

    def release(self, name: str) -> None:
        c = self.step.runs[name].counts
        if c.inputs_left <= 0 and not c.unwatched and (c.nodes_left <= 0 or not self.step.groups[name].trainable):
            self.step.runs[name].free_after_backward()

    def backward_ended(self, name: str) -> None:
        """Ready for another backward through a retained graph."""
        c = self.step.runs[name].counts
        c.inputs_left, c.nodes_left = c.uses, c.nodes
        for k in c.counters:
            k[0] = k[1]


class Recompute(Part):
    def __init__(self, step: Step):
        super().__init__(step)
        self.reentrant: set[str] = set()  # groups recomputed reentrantly (gathered anew by each backward)

    def run(self, name: str, args: tuple = ()) -> None:
        """The group's forward runs again inside backward (activation checkpointing), on ``args``."""
        step = self.step
        if torch.is_grad_enabled() and (name in self.reentrant or not step.runs[name].node.views_grad):
            self.gather(name)  # reentrant: the forward had no grad
            if not step.groups[name].trainable:  # no post-backward frees it: once its inputs' gradients are done
                inputs = grad_inputs(args)
                if inputs:
                    torch.autograd.graph.register_multi_grad_hook(
                        inputs, runtime_boundary(
                            lambda _g, s=weakref.ref(step): (st := s()) and st.runs[name].free_after_backward()))
        else:  # the group's pre-backward gathered it
            step.runs[name].wait()
            step.runs[name].swap_in()

    def gather(self, name: str) -> None:
        """Reentrant checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``): the group's parameters are
        about to be used with grad enabled inside backward, by a recomputation whose first run recorded no autograd
        history for them. Gather the group through a new node, so that the backward the checkpoint runs on the
        recomputed graph runs the group's post-backward (it reduce-scatters and frees the group), as FSDP2's
        unsharded parameters collect that backward's gradients."""
        step = self.step
        run = step.runs[name]
        step.begin_backward()
        run.issue()  # (the forward reads them, whatever unshard_in_backward says)
        run.wait()
        step.prefetcher.after(name, backward=True)
        run.swap_out()
        if run.buffers.shards:
            with torch.enable_grad():
                step.nodes.gather(name, None)
        run.node.views_grad = True
        self.reentrant.add(name)
        run.swap_in()


def _at_this_level(a: torch.Tensor) -> bool:
    """Whether ``a`` takes a gradient in the innermost level's backward: under a torch.func level, a tensor from below
    it (not wrapped: plain autograd's, an input requiring grad there) is a constant at that level (its alias would not
    require grad: measured, a RuntimeError registering the hook)."""
    return maybe_current_level() is None or is_functorch_wrapped_tensor(a)


def grad_inputs(args: Any) -> list[torch.Tensor]:
    """The tensors in ``args`` (any pytree) that require grad."""
    return [a for a in module_io_leaves(args) if isinstance(a, torch.Tensor) and a.requires_grad]
