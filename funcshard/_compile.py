"""Where ``torch.compile`` stops: the runtime's entry points that dynamo does not trace.

The runtime (gathers, frees, placeholders, module and autograd hooks) is Python that mutates state, talks to process
groups and reads private torch state: nothing dynamo should put in a graph. Each function marked here is a
deliberate graph break: dynamo compiles the user's code up to the call, runs the runtime eagerly, and compiles again
from its return (the module's forward between ``apply``'s entry and exit, each group's forward between its hooks,
the loss, ``value_and_grad``'s function). FSDP2 does the same with its hooks (``torch._dynamo.config.skip_fsdp_hooks``).
The fully traced mode (``funcshard._traced``) is the other way: no runtime, the collectives in the graph.

Eager cost: about 0.7 us per marked call (dynamo's disable wrapper), a few calls per group and step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

# What dynamo prints at each of these breaks, and, under ``torch.compile(..., fullgraph=True)``, in the error it
# raises (torch's own hint there, "remove the torch.compiler.disable call", is not the way out): it names the fully
# traced mode.
REASON = (
    "funcshard's runtime (gathers, frees, hooks) runs eagerly: a deliberate graph break; torch.compile traces the code "
    "between its calls. For one graph (torch.compile(..., fullgraph=True)) call funcshard.traced_apply(plan, state, "
    "...) in place of funcshard.apply, the fully traced mode (e.g. funcshard.value_and_grad(torch.compile(loss_fn, "
    "fullgraph=True)) with loss_fn calling traced_apply); fully_shard breaks at its hooks as FSDP2 does: compile each "
    "block, or the model without fullgraph"
)


def runtime_boundary(fn: F) -> F:
    """``fn`` runs eagerly under ``torch.compile``, with nothing it calls traced: one graph break per call."""
    return torch.compiler.disable(fn, recursive=True, reason=REASON)
