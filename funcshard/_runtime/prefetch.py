"""Which groups to gather early, and the order the groups' forwards actually ran in.

Forward: the plan's prefetch (``Plan.prefetch_after``: the next groups in the plan's order, or explicit lists).
Backward: the groups this forward ran, in reverse of the order their forwards finished in (FSDP2's reverse
post-forward order: a parent group, whose pass closes after the groups nested in it, comes before them), unless
the plan has an explicit backward list for the group. Each group's enclosing groups (those whose pass was open when
its own opened) are recorded for ``Step.pre_backward``, which runs theirs before its own. Groups the forward
prefetch gathered but the forward never used (skipped blocks, another order) are freed when the forward ends, not
at the end of backward.
"""

from __future__ import annotations

from funcshard._plan import ROOT
from funcshard._runtime.buffers import Status
from funcshard._runtime.part import Part


class Prefetcher(Part):
    def __init__(self, step):
        super().__init__(step)
        self.order: list[str] = []  # the non-root groups in the order their forward first ran
        self.prefetched: set[str] = set()  # groups gathered early by the forward prefetch, not used yet
        self.finished: list[str] = []  # the non-root groups in the order their forward pass first closed
        self.enclosing: dict[str, tuple[str, ...]] = {}  # group -> the non-root groups open when its pass opened

    def opened(self, name: str, open_now: list[str]) -> None:
        """The group's forward pass opens while those of ``open_now`` are open (the first time in this step)."""
        if name != ROOT and name not in self.enclosing:
            rank = {n: i for i, n in enumerate(self.order)}
            self.enclosing[name] = tuple(sorted((n for n in open_now if n not in (ROOT, name) and n in rank),
                                                key=rank.__getitem__))

    def closed(self, name: str) -> None:
        """The group's forward pass closes (its post-forward)."""
        if name != ROOT and name not in self.finished:
            self.finished.append(name)

    def used(self, name: str) -> None:
        """The group's forward gathers it now."""
        if name != ROOT and name not in self.order:
            self.order.append(name)
        self.prefetched.discard(name)

    def after(self, name: str, *, backward: bool) -> None:
        """Issue the all-gathers of the groups to prefetch when group ``name`` starts."""
        step = self.step
        ran = tuple(self.finished) if backward and self.finished else None  # (backward: the order forward finished in)
        others = step.plan.prefetch_after(name, backward=backward, ran=ran)
        for other in others:
            if not backward and step.groups[other].status is Status.SHARDED:
                self.prefetched.add(other)
            step.runs[other].unshard()

    def unused(self) -> list[str]:
        """At the end of forward: the groups prefetched but never used (the caller frees them)."""
        out = list(self.prefetched)
        self.prefetched.clear()
        return out
