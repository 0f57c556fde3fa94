"""Executes a Plan for one forward/backward: just-in-time all-gather, free, prefetch, reduce-scatter.

One :class:`Step` per ``apply`` call (and per iteration of a ``fully_shard`` model); ``step.py`` lists its parts
and the job each owns. It owns the unsharded (padded) parameter tensors as raw buffers, so that freeing them
(``untyped_storage().resize_(0)``) and refilling them before backward works under ``torch.func`` transforms too,
where autograd only ever sees wrapped views of them.
"""

__all__ = ["GroupRun", "Status", "Step"]

_WHERE = {"Status": "buffers", "_Status": "buffers", "GroupRun": "group", "Step": "step"}


def __getattr__(name: str):
    """The package's names, imported when first read: ``funcshard.cost`` reads ``_runtime.buffers.Status`` alone,
    and the group runs' and step's modules import torch._dynamo (their ``runtime_boundary``), which ``import
    funcshard`` and planning leave out (issue 36's start-up)."""
    import importlib

    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), "Status" if name == "_Status" else name)
    globals()[name] = value
    return value
