"""Measuring instruments shared by every system in the benchmark (the same instrument for all of them).

* :class:`CollectiveCounter` wraps the ``torch.distributed`` collective functions (in ``torch.distributed``,
  ``distributed_c10d`` and every loaded module that holds an alias of one, e.g. ``funcshard._collectives``)
  and counts calls and payload bytes per kind. Nested calls (one deprecated name forwarding to another) are
  counted once.
* :func:`profiled_collectives` counts the collectives that reached the c10d dispatcher (``c10d::*`` ops in
  ``torch.profiler``), whoever issued them: an independent check that the wrapper saw every call.
* :class:`LiveBytes` is a ``TorchDispatchMode`` tracker of live tensor bytes (MemTracker's method without its
  module bookkeeping): the storages reachable from the system at entry, plus every storage an op returns,
  ``UntypedStorage.resize_`` tracked, frees seen through weak references. Its ``peak`` is the high-water
  mark of live bytes over one iteration.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)

# ---- collectives ------------------------------------------------------------------------------------------

# name -> (kind, how to read the payload bytes from the arguments)
_OUT0 = "out0"  # first argument is the full output (all-gather into a tensor)
_IN1 = "in1"  # second argument is the full input (reduce-scatter from a tensor)
_T0 = "t0"  # first argument is the tensor (all-reduce, broadcast)
_LIST0 = "list0"  # first argument is a list of outputs (list all-gather)
_LIST1 = "list1"  # second argument is a list of inputs (list reduce-scatter)
COLLECTIVES = {
    "all_gather_single": ("all_gather", _OUT0),
    "all_gather_into_tensor": ("all_gather", _OUT0),
    "_all_gather_base": ("all_gather", _OUT0),
    "all_gather": ("all_gather", _LIST0),
    "all_gather_coalesced": ("all_gather", _LIST0),
    "reduce_scatter_single": ("reduce_scatter", _IN1),
    "reduce_scatter_tensor": ("reduce_scatter", _IN1),
    "_reduce_scatter_base": ("reduce_scatter", _IN1),
    "reduce_scatter": ("reduce_scatter", _LIST1),
    "all_reduce": ("all_reduce", _T0),
    "all_reduce_coalesced": ("all_reduce", _LIST0),
    "broadcast": ("broadcast", _T0),
    "all_to_all_single": ("all_to_all", _IN1),
    "barrier": ("barrier", None),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CollectiveCounter:
    """Context manager: counts ``torch.distributed`` collectives and their payload bytes (per rank).

    Payload: an all-gather counts its full output, a reduce-scatter its full input, an all-reduce its tensor
    (what a rank hands to or gets from the collective, independent of the algorithm on the wire).
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.by_name: Counter[str] = Counter()
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []

    def _wrap(self, name: str, fn):
        kind, where = COLLECTIVES[name]
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if depth == 0:
                counter.calls[kind] += 1
                counter.by_name[name] += 1
                if where == _OUT0 or where == _T0 or where == _LIST0:
                    arg = args[0] if args else next(iter(kwargs.values()), None)
                else:
                    arg = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_list"))
                counter.bytes[kind] += _nbytes(arg)
            counter._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._local.depth = depth

        wrapper.__wrapped__ = fn
        wrapper._counting = True
        return wrapper

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed.distributed_c10d as c10d

        originals = {}
        for name in COLLECTIVES:
            fn = getattr(c10d, name, None)
            if fn is not None and not getattr(fn, "_counting", False):
                originals[id(fn)] = (name, fn, self._wrap(name, fn))
        # every loaded module that holds one of these functions (by any name) gets the wrapper
        for mod in list(sys.modules.values()):
            if mod is None or not isinstance(mod, types.ModuleType):
                continue
            try:
                items = list(vars(mod).items())
            except TypeError:
                continue
            for attr, val in items:
                hit = originals.get(id(val))
                if hit is not None and val is hit[1]:
                    setattr(mod, attr, hit[2])
                    self._patched.append((mod, attr, val))
        return self

    def __exit__(self, *exc) -> None:
        for mod, attr, val in reversed(self._patched):
            setattr(mod, attr, val)
        self._patched.clear()

    def summary(self, steps: int = 1) -> dict[str, Any]:
        return {
            "calls": {k: v / steps for k, v in sorted(self.calls.items())},
            "bytes": {k: v / steps for k, v in sorted(self.bytes.items())},
            "functions": dict(sorted(self.by_name.items())),
        }


def profiled_collectives(fn, steps: int = 1) -> dict[str, float]:
    """Run ``fn`` ``steps`` times under torch.profiler and count the c10d ops that were dispatched
    (``c10d::_allgather_base_``, ``c10d::allreduce_``, ...): every collective, whoever issued it
    (Python wrappers, FSDP2, DDP's C++ reducer)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    counts: Counter[str] = Counter()
    for e in prof.events():
        if e.name.startswith("c10d::") and "wait" not in e.name:
            counts[e.name] += 1
    return {k: v / steps for k, v in sorted(counts.items())}


# ---- memory -------------------------------------------------------------------------------------------------


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    out, todo = [], [t]
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            attrs, _ = x.__tensor_flatten__()
            todo.extend(a for a in (getattr(x, n) for n in attrs) if isinstance(a, torch.Tensor))
            continue
        try:
            if x.device.type == "meta":
                continue
            out.append(x.untyped_storage())
        except (RuntimeError, NotImplementedError):  # sparse, mkldnn, ... (none in these models)
            pass
    return out


_SKIP = (type, types.ModuleType, types.BuiltinFunctionType, types.CodeType, str, bytes, int, float, bool,
         complex, type(None), weakref.ReferenceType, torch.device, torch.dtype)


def reachable_tensors(roots: Iterable[Any]) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots`` through Python objects (dicts, lists, instance attributes,
    bound methods, closures, ``.grad``), without crossing into modules, classes or functions' globals.

    This finds what a system keeps alive between steps, wherever it keeps it: parameters and their shards,
    gradients, optimizer state, and internals such as FSDP2's unsharded parameters or DDP's gradient
    buckets (seen through ``param.grad`` with ``gradient_as_bucket_view=True``)."""
    from torch.distributed.device_mesh import DeviceMesh

    seen: set[int] = set()
    stack = list(roots)
    found = []
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SKIP):
            continue
        seen.add(id(o))
        if isinstance(o, (dist.ProcessGroup, DeviceMesh)):
            continue
        if isinstance(o, torch.Tensor):
            found.append(o)
            if o.is_leaf and o.grad is not None:  # (.grad of a non-leaf warns)
                stack.append(o.grad)
            d = getattr(o, "__dict__", None)
            if d:
                stack.extend(d.values())
            continue
        if isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in (o.__closure__ or ()) if _cell_ok(c))
            stack.extend(o.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(o))
    return found


def _cell_ok(c) -> bool:
    try:
        _ = c.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


class LiveBytes(TorchDispatchMode):
    """Peak live tensor bytes over one iteration (one tracker per iteration).

    ``with LiveBytes(roots=[system]) as lb: step()`` then ``lb.peak`` (bytes), ``lb.baseline`` (bytes live at
    entry, i.e. reachable from the roots). DTensor ops are let through to their local-tensor ops (as
    MemTracker does) so that each allocation is seen once."""

    def __init__(self, roots: Iterable[Any] = (), where: bool = False) -> None:
        super().__init__()
        self.sizes: dict[int, list] = {}
        self.total = 0
        self.peak = 0
        self.where = where  # record the op and the Python stack at each new peak (for profiling)
        self.peak_at: tuple[str, list[str]] | None = None
        self._op = "?"
        for t in reachable_tensors(roots):
            for st in _storages(t):
                self._see(st)
        self.baseline = self.total
        self._orig_resize = None

    def _see(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        ent = self.sizes.get(key)
        n = st.nbytes()
        if ent is None:
            sizes = self.sizes

            self_ref = weakref.ref(self)

            def freed(_ref, key=key, self_ref=self_ref):
                me = self_ref()
                e = sizes.pop(key, None)
                if me is not None and e is not None:
                    me.total -= e[1]

            self.sizes[key] = [weakref.ref(st, freed), n]
            self.total += n
        elif ent[1] != n:
            self.total += n - ent[1]
            ent[1] = n
        if self.total > self.peak:
            self.peak = self.total
            if self.where:
                import traceback

                frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-2]
                          if ("funcshard" in f.filename or "fsdp" in f.filename or "benchmarks" in f.filename
                              or "optim" in f.filename)]
                self.peak_at = (self._op, frames[-8:])

    def __enter__(self):
        self._orig_resize = orig = torch.UntypedStorage.resize_
        me = self

        def resize_(st, size):
            r = orig(st, size)
            me._see(st)
            return r

        torch.UntypedStorage.resize_ = resize_
        self.peak = self.total
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types_):
            return NotImplemented
        self._op = str(func)
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._see(st)
        # in-place ops on inputs (resize_, set_) can change their storages too
        if func._schema.is_mutable:
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    for st in _storages(t):
                        if id(st) in self.sizes:
                            self._see(st)
        return out
