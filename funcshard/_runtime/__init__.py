"""Executes a Plan for one forward/backward: just-in-time all-gather, free, prefetch, reduce-scatter.

One :class:`Step` per ``apply`` call (and per iteration of a ``fully_shard`` model); ``step.py`` lists its parts
and the job each owns. It owns the unsharded (padded) parameter tensors as raw buffers, so that freeing them
(``untyped_storage().resize_(0)``) and refilling them before backward works under ``torch.func`` transforms too,
where autograd only ever sees wrapped views of them.
"""

from funcshard._runtime.buffers import Status
from funcshard._runtime.group import GroupRun
from funcshard._runtime.step import Step

_Status = Status  # (the name tests and tools have used)

__all__ = ["GroupRun", "Status", "Step"]
