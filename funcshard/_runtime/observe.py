"""The runtime's events, for observers (``funcshard.trace``): off unless a listener is registered.

The runtime calls ``emit(event, group, obj)`` behind one ``if LISTENERS:`` at each point a group's buffers or a
reduce-scatter change state, so that with no listener the cost is that one test:

    "all-gather issued"        GroupBuffers       the group's all-gather is in flight (its buffers allocated)
    "all-gather wait"          GroupBuffers       the runtime starts waiting for it (and copying out)
    "gathered"                 GroupBuffers       the unsharded parameters are ready
    "freed"                    GroupBuffers       the unsharded parameters' storage is released
    "reduce-scatter issued"    PendingReduce      the group's gradients are copied in and the collective issued
    "reduce-scatter wait"      PendingReduce      the runtime starts waiting for it
    "reduce-scatter done"      PendingReduce      the gradient shards are ready, its input freed
"""

from __future__ import annotations

from typing import Any, Callable

LISTENERS: list[Callable[[str, str, Any], None]] = []


def emit(event: str, group: str, obj: Any) -> None:
    for listener in LISTENERS:
        listener(event, group, obj)
