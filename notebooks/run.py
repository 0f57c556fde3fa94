"""Execute the notebooks and write their outputs in place (what is committed):

    python notebooks/run.py                 # all of them (about a minute on 2 cores)
    python notebooks/run.py 3_exploring_schedules.ipynb

``tests/test_notebooks.py`` executes them in the test suite (without writing), in one kernel
(``execute_in_one_kernel``: the imports once).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
NOTEBOOKS = sorted(HERE.glob("[0-9]*.ipynb"))


def execute(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """The notebook at ``path`` executed in a fresh kernel, in its own folder (raises on a cell's error)."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def execute_in_one_kernel(paths: list[Path], timeout: int = 600) -> list[nbformat.NotebookNode]:
    """The notebooks executed one after another in one kernel, its namespace reset (``%reset -f``) before each: every
    cell runs as in a fresh kernel but for the modules already imported (torch, funcshard, matplotlib: seconds of
    CPU per kernel, what the test suite saves). Raises on a cell's error."""
    nbs = [nbformat.read(p, as_version=4) for p in paths]
    client = NotebookClient(nbs[0], timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}})
    reset = nbformat.v4.new_code_cell('get_ipython().run_line_magic("reset", "-f")\n'
                                      'import matplotlib.pyplot\nmatplotlib.pyplot.close("all")')
    with client.setup_kernel():
        for k, nb in enumerate(nbs):
            client.nb = nb  # (the cells' outputs go to their notebook)
            client.reset_execution_trackers()
            if k:
                client.execute_cell(reset, 0)
            for i, cell in enumerate(nb.cells):
                client.execute_cell(cell, i)
    return nbs


def main(argv: list[str]) -> int:
    paths = [HERE / a for a in argv] or NOTEBOOKS
    for p in paths:
        t = time.perf_counter()
        nb = execute(p)
        nbformat.write(nb, p)
        print(f"{p.name}: executed in {time.perf_counter() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
