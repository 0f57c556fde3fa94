"""The base of a step's parts (and of its groups' runs): each holds its step weakly; ``failing``.

A strong reference back would make every step a reference cycle, which outlives its process group until the
garbage collector runs (gloo aborts at exit then); the autograd graph and the caller keep a step alive.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

from funcshard._collectives import CollectiveError

if TYPE_CHECKING:
    from funcshard._runtime.step import Step


class Part:
    def __init__(self, step: Step):
        self._step = weakref.ref(step)

    @property
    def step(self) -> Step:
        return self._step()


def failing(method):
    """A method of the step or of one of its parts that may raise a ``CollectiveError``: the step fails first
    (``Step.fail``: the module's own parameters back, nothing in flight freed), then the error propagates."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except CollectiveError as e:
            (self.step if isinstance(self, Part) else self).fail(e)
            raise

    return wrapper
