"""The long randomized run of tests/test_random.py (issue 21): more examples, a fresh seed each run.

    python benchmarks/random_long.py                       # 50 examples per mesh (W = 1, 2, 3, 4 and 2x2), new seed
    python benchmarks/random_long.py --examples 200 --seed 1234 --mesh 3 2x2

The default suite runs a few derandomized examples per mesh (the same ones every run); this runs
``test_random_cases_match_the_reference`` with ``FUNCSHARD_RANDOM_EXAMPLES`` and ``FUNCSHARD_RANDOM_SEED`` set, so each
run draws new cases. A failure prints hypothesis's shrunk falsifying ``Case`` (paste it into ``check(Case(...))`` to
replay it) and the seed that found it; exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=50, help="examples per mesh (2x2: half)")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: a new one, printed)")
    ap.add_argument("--mesh", nargs="*", default=[], help="only these meshes (ids: 1 2 3 4 2x2)")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else random.randrange(2**32)
    env = dict(os.environ, FUNCSHARD_RANDOM_EXAMPLES=str(a.examples), FUNCSHARD_RANDOM_SEED=str(seed))
    select = "random_cases" + (" and (" + " or ".join(f"[{m}]" for m in a.mesh) + ")" if a.mesh else "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_random.py", "-k", select]
    print(f"seed {seed}, {a.examples} examples per mesh: {' '.join(cmd)}", flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    print(f"seed {seed}: {'passed' if rc == 0 else f'FAILED (pytest exit {rc})'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
