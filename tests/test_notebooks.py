"""The notebooks in notebooks/ are committed executed (outputs and plots, no errors), and they run in the default
suite: the four in one kernel, its namespace reset before each (``run.execute_in_one_kernel``: the imports once),
their ranks forked (``nbhelpers.spawn``); 46 s of CPU in all, the fourth 16 s of it (Opacus's import included). Each
notebook's plots check their own axes (labels with units, ``nbhelpers.check_axes``), so an unreadable plot fails the
execution. ``python notebooks/run.py`` re-executes them, each in a fresh kernel, and writes the outputs that are
committed."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["1_quickstart.ipynb", "2_migrating_from_fsdp2.ipynb", "3_exploring_schedules.ipynb", "4_beyond_fsdp2.ipynb"]


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebooks_are_executed_with_their_plots(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), f"{name}: run python notebooks/run.py {name}"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], name
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} has no plot"
    assert all("check_axes(fig)" in c.source for c in code if "plt.subplots" in c.source)


def test_notebooks_execute():
    sys.path.insert(0, str(NOTEBOOKS))
    try:
        from run import execute_in_one_kernel
    finally:
        sys.path.remove(str(NOTEBOOKS))
    nbs = execute_in_one_kernel([NOTEBOOKS / name for name in NAMES], timeout=300)  # (a cell's error raises)
    for name, nb in zip(NAMES, nbs):
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        assert not [o for o in outputs if o.output_type == "error"], name
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} drew no plot"
