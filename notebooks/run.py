"""Execute the notebooks and write their outputs in place (what is committed):

    python notebooks/run.py                 # all of them (about a minute on 2 cores)
    python notebooks/run.py 3_exploring_schedules.ipynb

``tests/test_notebooks.py`` executes them the same way (without writing) in the test suite.
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
