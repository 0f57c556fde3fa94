"""The safetensors file format, written and read a piece at a time (``funcshard.checkpoint.export_full`` /
``import_full``).

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte offsets into
the data; ``__metadata__``) padded with spaces to 8 bytes, then the tensors' bytes, contiguous. The header depends only
on names, dtypes and shapes, which a plan knows, so a writer can put it first and stream the tensors after it one by
one (``safetensors.torch.save_file`` needs every tensor in memory at once); a reader needs only the header and the
byte runs of the rows it wants. Plain Python: the ``safetensors`` package is not needed (the tests check that it reads
these files and that these functions read its files).
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Iterable

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
NAMES = {v: k for k, v in DTYPES.items()}


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def check_dtypes(entries: Iterable[tuple[str, tuple, torch.dtype]]) -> None:
    """Raise a TypeError naming every entry [(name, shape, dtype)] whose dtype safetensors has no name for."""
    bad = [f"{name}: {dtype}" for name, _, dtype in entries if dtype not in DTYPES]
    if bad:
        raise TypeError(f"safetensors has no name for the dtypes of {', '.join(bad)} (it has "
                        f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)}); convert them first, or pass "
                        f"a callable to receive the tensors instead of a path")


class Writer:
    """Writes the header for ``entries`` [(name, shape, dtype)] at once; then ``write(name, tensor)`` in that order;
    ``finish()`` checks all were written and closes (``close()`` only closes: safe while an exception unwinds)."""

    def __init__(self, path: str, entries: Iterable[tuple[str, tuple, torch.dtype]], metadata: dict | None = None):
        entries = list(entries)
        check_dtypes(entries)
        header, offset, self.order = {}, 0, []
        for name, shape, dtype in entries:
            n = _nbytes(shape, dtype)
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            self.order.append((name, tuple(shape), dtype))
        if metadata:
            header["__metadata__"] = metadata
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self.order[self.next]
        if (name, tuple(tensor.shape), tensor.dtype) != want:
            raise ValueError(f"safetensors writer: expected {want}, got {(name, tuple(tensor.shape), tensor.dtype)}")
        t = tensor.detach().cpu().contiguous().reshape(-1)
        self.file.write(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
        self.next += 1

    def finish(self) -> None:
        if self.next != len(self.order):
            raise ValueError(f"safetensors writer: finished after {self.next} of {len(self.order)} tensors")
        self.file.close()

    def close(self) -> None:
        self.file.close()


class Reader:
    """The header of a safetensors file, and ``read_rows``: a box of one tensor, read as byte runs."""

    def __init__(self, path: str):
        self.file = open(path, "rb")
        (n,) = struct.unpack("<Q", self.file.read(8))
        self.header = json.loads(self.file.read(n))
        self.header.pop("__metadata__", None)
        self.base = 8 + n

    def shape_dtype(self, name: str) -> tuple[tuple, torch.dtype | None]:
        e = self.header[name]
        return tuple(e["shape"]), NAMES.get(e["dtype"])

    def read_box(self, name: str, offsets: tuple, sizes: tuple, out: torch.Tensor) -> None:
        """Copy the box ``offsets``/``sizes`` of tensor ``name`` into ``out`` (its shape: ``sizes``), reading only
        its bytes: one run per index of the dims before the first partial one."""
        shape, dtype = self.shape_dtype(name)
        item = torch.empty((), dtype=dtype).element_size()
        start = self.header[name]["data_offsets"][0]
        k = len(shape) - 1
        while k > 0 and sizes[k] == shape[k]:  # the box is contiguous from dim k on (full extents after it)
            k -= 1
        run = math.prod(sizes[max(k, 0):])
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        first = sum(o * st for o, st in zip(offsets[max(k, 0):], strides[max(k, 0):]))
        target = out if out.is_contiguous() else torch.empty(sizes, dtype=dtype)
        flat_out = target.view(-1)
        buf = bytearray(run * item)
        leads = itertools.product(*[range(o, o + n) for o, n in zip(offsets[:max(k, 0)], sizes[:max(k, 0)])])
        for j, idx in enumerate(leads):
            pos = first + sum(i * st for i, st in zip(idx, strides))
            self.file.seek(self.base + start + pos * item)
            self.file.readinto(buf)
            if run:
                flat_out[j * run:(j + 1) * run].copy_(torch.frombuffer(buf, dtype=dtype))
        if target is not out:
            out.copy_(target)

    def close(self) -> None:
        self.file.close()
