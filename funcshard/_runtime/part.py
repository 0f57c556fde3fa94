"""The base of a step's parts: each holds its step weakly.

A strong reference back would make every step a reference cycle, which outlives its process group until the
garbage collector runs (gloo aborts at exit then); the autograd graph and the caller keep a step alive.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from funcshard._runtime.step import Step


class Part:
    def __init__(self, step: Step):
        self._step = weakref.ref(step)

    @property
    def step(self) -> Step:
        return self._step()
