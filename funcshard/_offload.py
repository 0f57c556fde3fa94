"""CPU offload: where offloaded shards, gradients and optimizer state live, and the copies between host and device.

FSDP2's ``CPUOffloadPolicy`` semantics (torch 2.13, ``_fsdp_param.py`` / ``_fsdp_collectives.py``): an offloaded
group's sharded parameters live on the host (pinned when ``pin_memory``), are copied to the device before the
all-gather's copy-in, and its reduce-scattered gradient shards are copied back to the host; the optimizer steps on
the host. On a CPU mesh the host is the device: nothing is copied, only the pinning is asked for.

One owner each:
- ``offload_fields``: a policy object -> the Group fields (``offload_to_cpu``, ``pin_memory``); bad input raises.
- ``pin``: the one place funcshard pins host memory (``can_pin`` says whether this process can: torch's pinned
  allocator needs an accelerator; FSDP2 calls ``Tensor.pin_memory()`` at ``fully_shard`` and raises there on a
  machine without one, funcshard raises before touching the module, naming the fix).
- ``to_host`` (shards and optimizer state onto the host), ``to_device`` (host -> device before the all-gather, on a
  copy stream of its own on CUDA), ``HostReduce`` (device -> host after the reduce-scatter).
- ``host_keys(plan)``: which state keys an offloaded group holds (``shard`` places them, ``check_state`` expects them
  on the host).
"""

from __future__ import annotations

from typing import Any

import torch

from funcshard._compat import current_graph_task_id, queue_callback

HOST = torch.device("cpu")

__all__ = ["HOST", "HostReduce", "can_pin", "check_pin", "drain", "host_keys", "host_reduce", "offload_fields", "pin",
           "place_state", "start_to_device", "start_to_host", "to_device", "to_host"]


def _is_policy(obj: Any, name: str) -> bool:
    return any(c.__name__ == name for c in type(obj).__mro__)


def offload_fields(policy: Any, where: str) -> dict[str, bool]:
    """``{"offload_to_cpu": ..., "pin_memory": ...}`` for an ``OffloadPolicy`` (funcshard's or torch's; None: no
    offload). Raises TypeError for another object, RuntimeError for ``pin_memory=True`` where nothing can pin."""
    if policy is None or (_is_policy(policy, "OffloadPolicy") and not _is_policy(policy, "CPUOffloadPolicy")):
        return {"offload_to_cpu": False, "pin_memory": False}
    if not _is_policy(policy, "CPUOffloadPolicy") or not hasattr(policy, "pin_memory"):
        raise TypeError(f"{where}: offload_policy must be an OffloadPolicy or a CPUOffloadPolicy (funcshard's or "
                        f"torch.distributed.fsdp's), got {type(policy).__name__}; e.g. "
                        f"CPUOffloadPolicy(pin_memory=True)")
    return {"offload_to_cpu": True, "pin_memory": check_pin(bool(policy.pin_memory), where, "CPUOffloadPolicy(")}


def check_pin(pinned: bool, where: str, call: str) -> bool:
    """``pinned``, or a RuntimeError where this process cannot pin (``call``: how the user asked, for the fix)."""
    if pinned and not can_pin():
        raise RuntimeError(f"{where}: {call}pin_memory=True) needs pinned host memory, which needs an accelerator, and "
                           f"this process has none (torch.accelerator.is_available() is False; FSDP2 fails in "
                           f"Tensor.pin_memory() here). Pass {call}pin_memory=False): on a CPU mesh the host is the "
                           f"device, nothing is copied")
    return pinned


def can_pin() -> bool:
    """Whether this process can allocate pinned host memory (torch's pinned allocator belongs to an accelerator)."""
    acc = getattr(torch, "accelerator", None)
    return bool(acc.is_available()) if acc is not None else torch.cuda.is_available()


def pin(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a host tensor) in pinned memory: the one place funcshard pins."""
    return t.pin_memory()


def to_host(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """``t`` on the host, pinned if asked: ``t`` itself when it already is; otherwise a copy (blocking)."""
    if t.device.type == "cpu":
        return pin(t) if pinned and not t.is_pinned() else t
    with torch.no_grad():
        out = torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=pinned)
        out.copy_(t)
    return out


_STREAMS: dict[torch.device, Any] = {}


def _copy_stream(device: torch.device):
    """The side stream host<->device copies run on (one per device, FSDP2's copy-in and D2H streams in one)."""
    s = _STREAMS.get(device)
    if s is None:
        s = _STREAMS[device] = torch.cuda.Stream(device)
    return s


def start_to_device(tensors: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], Any]:
    """Issue host -> device copies; returns the device tensors and ``ready()``, which makes the current stream wait
    for them (call it before the current stream reads them). ``tensors`` itself (and a no-op) when they are there
    already: a CPU mesh. On CUDA the copies run on the copy stream (async from pinned memory), so they overlap
    what the current stream computes until ``ready()``."""
    if not tensors or all(t.device == device or t.device.type == device.type == "cpu" for t in tensors):
        return tensors, _nothing
    if device.type != "cuda":
        return [t.to(device) for t in tensors], _nothing
    cur, side = torch.cuda.current_stream(device), _copy_stream(device)
    side.wait_stream(cur)  # (device memory the caching allocator hands out may still be read by queued kernels)
    with torch.cuda.stream(side):
        out = [t.to(device, non_blocking=True) for t in tensors]
    event = side.record_event()

    def ready() -> None:
        c = torch.cuda.current_stream(device)
        c.wait_event(event)
        for o in out:
            o.record_stream(c)  # allocated on the copy stream, used and freed on the current one

    return out, ready


def _nothing() -> None:
    pass


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host shards -> the device, before the all-gather's copy-in (FSDP2: ``.to(device, non_blocking=True)``):
    ``start_to_device`` and ``ready()`` at once (a prefetched group's copy still overlaps the compute queued
    before it)."""
    out, ready = start_to_device(tensors, device)
    ready()
    return out


def start_to_host(tensors: list, pinned: bool, into: list | None = None) -> tuple[list, Any]:
    """Issue device -> host copies of ``tensors`` (None entries stay None) into new host tensors (pinned if asked) or
    into ``into``'s; returns them and the CUDA event that marks them done (None: done already). On CUDA the copies
    run on the copy stream after what the current stream has queued; ``non_blocking`` when pinned."""
    dev = next((t.device for t in tensors if t is not None), HOST)
    if dev.type != "cuda":
        with torch.no_grad():
            if into is not None:
                for d, t in zip(into, tensors):
                    if t is not None and d is not t:
                        d.copy_(t)
                return into, None
            return [None if t is None else to_host(t, pinned) for t in tensors], None
    cur, side = torch.cuda.current_stream(dev), _copy_stream(dev)
    side.wait_stream(cur)
    out = []
    with torch.cuda.stream(side), torch.no_grad():
        for i, t in enumerate(tensors):
            if t is None:
                out.append(None)
                continue
            h = into[i] if into is not None else torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=pinned)
            h.copy_(t, non_blocking=pinned)
            t.record_stream(side)
            out.append(h)
    return out, side.record_event() if pinned else None


_EVENTS: list = []  # D2H copies in flight whose host tensors nobody may read yet (FSDP2's grad_offload_event)


def drain() -> None:
    """Block until every device -> host copy in flight is done (before the host reads the gradients)."""
    while _EVENTS:
        _EVENTS.pop().synchronize()


class HostReduce:
    """A group's reduce-scatter (``_pipeline.PendingReduce``) whose shards are copied to the host when taken
    (``start_to_host``, after the current stream, which waited for the reduce-scatter). Pinned, with ``defer``
    (``fully_shard``'s sink: nothing reads them inside backward unless it accumulates, see ``GradSink.deliver``), the
    CPU waits for the copies at the end of backward (``drain``, FSDP2's ``finalize_backward``), else at once."""

    __slots__ = ("inner", "pinned", "defer")

    def __init__(self, inner, pinned: bool, defer: bool):
        self.inner, self.pinned, self.defer = inner, pinned, defer

    def finish(self, *args, **kwargs):
        shards = self.inner.finish(*args, **kwargs)
        if shards is None:
            return None
        out, event = start_to_host(shards, self.pinned)
        if event is None:
            pass
        elif self.defer and current_graph_task_id() != -1:  # inside backward: wait at its end
            if not _EVENTS:
                queue_callback(drain)
            _EVENTS.append(event)
        else:
            event.synchronize()
        return out

    def __getattr__(self, name: str):  # (observers read the inner PendingReduce's fields)
        return getattr(self.inner, name)


def host_reduce(pending, group, device: torch.device, defer: bool):
    """``pending`` wrapped so that an offloaded group's shards come back on the host (itself when the device is the
    host, or the group is not offloaded)."""
    if not group.offload_to_cpu or device.type == "cpu":
        return pending
    return HostReduce(pending, group.pin_memory, defer)


def host_keys(plan) -> dict[str, bool]:
    """The state keys of the plan's offloaded groups -> whether they are pinned (computed once per plan)."""
    return plan.derived("offload_keys", lambda plan: {
        p: g.pin_memory for g in plan.groups if g.offload_to_cpu for p in g.params})


def place_state(plan, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the offloaded groups' shards on the host (pinned as asked); the others as they are."""
    keys = host_keys(plan)
    return {k: to_host(v, keys[k]) if k in keys else v for k, v in state.items()}
