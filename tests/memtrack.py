"""A dispatch-mode tracker of live tensor storage bytes, independent of funcshard's bookkeeping.

Like torch's MemTracker (which it follows: storages seen by any op under the mode, weakly referenced,
``UntypedStorage.resize_`` tracked) but without module/parameter hooks, which assume module parameters are
leaf tensors.  Counts storages created or touched under the mode; ``peak`` is the high-water mark.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class PeakBytes(TorchDispatchMode):
    def __init__(self, ignore=()):
        super().__init__()
        self.sizes = WeakIdKeyDictionary()
        self.ignore = WeakIdKeyDictionary({t.untyped_storage(): True for t in ignore})
        self.peak = 0

    def _update(self):
        self.peak = max(self.peak, sum(self.sizes.values()))

    def _see(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            if st not in self.ignore:
                self.sizes[st] = st.nbytes()

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            tracker._orig_resize(st, size)
            if st in tracker.sizes or size:
                tracker.sizes[st] = st.nbytes()
            tracker._update()

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._see(t)
        self._update()
        return out
