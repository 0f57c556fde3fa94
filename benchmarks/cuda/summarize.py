"""run.sh's last step: one summary of every stage, and the few files that go back from the device machine.

    python benchmarks/cuda/summarize.py WORKDIR OUT

Reads WORKDIR (run.sh's stage logs, ``check/*.json``, ``bench_*/results.{md,json}``, the pytest JUnit XML files) and
writes to OUT: ``summary.md`` (stages, every check, pytest failures, the benchmark's targets and CUDA rows, cost
and trace readings), ``bench.md`` (the benchmark runs' full reports), ``checks.json`` (every check stage's JSON),
``logs.txt`` (every stage's log, each cut to its last 300 KB) and the two profiler traces (``*.json.gz``).
"""

from __future__ import annotations

import json
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LOG_TAIL = 300_000
MAX_FILE = 15_000_000


def _junit(path: Path) -> tuple[str, list[str]]:
    if not path.exists():
        return "no JUnit file (the stage did not run, was skipped or was killed: see Stages)", []
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    bad = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or el.text or "").strip().replace("\n", " ")[:400]
                bad.append(f"{case.get('classname')}::{case.get('name')}: {tag}: {msg}")
    return (f"{n['tests']} tests, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped", bad)


def _section(md: str, title: str) -> str:
    """The Markdown section starting at the line ``title`` up to the next ``## ``."""
    lines, out, on = md.splitlines(), [], False
    for ln in lines:
        if ln.startswith("## "):
            on = ln.strip() == title
        if on:
            out.append(ln)
    return "\n".join(out)


def main(work: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    s = ["# funcshard on CUDA: run.sh summary", ""]
    checks = {}
    for p in sorted((work / "check").glob("*.json")):
        try:
            checks[p.stem] = json.loads(p.read_text())
        except ValueError as e:
            checks[p.stem] = {"error": f"unreadable: {e}"}
    env = checks.get("env", {}).get("data", {})
    s.append(f"- device: {env.get('device_name', '?')} ({env.get('memory_GiB', 0):.0f} GiB, capability "
             f"{env.get('capability')}), CUDA {env.get('cuda')}, NCCL {env.get('nccl')}")
    s.append(f"- python {env.get('python')}, torch {env.get('torch')}, optree {env.get('optree')}, "
             f"typing_extensions {env.get('typing_extensions')}")
    s += ["", "## Stages", "", (work / "stages.md").read_text() if (work / "stages.md").exists() else "(none)", ""]
    s += ["## Checks (PASS / FAIL / INFO)", ""]
    for stage, body in checks.items():
        s.append(f"### {stage}" + (f": ERROR {body['error'].splitlines()[0]}" if body.get("error") else ""))
        for name, ok, detail in body.get("checks", []):
            s.append(f"- **{'INFO' if ok is None else 'PASS' if ok else 'FAIL'}** {name}: {detail}")
        s.append("")
    for label, xml in (("pytest -m cuda (tests/test_cuda.py)", "pytest_cuda.xml"),
                       ("torch 2.11 on the CPU suites (precision, offload, comm)", "pytest_cpu.xml")):
        head, bad = _junit(work / xml)
        s += [f"## {label}", "", head] + [f"- {b}" for b in bad] + [""]
    bench = []
    for d in sorted(p for p in work.glob("bench_*") if p.is_dir()):
        md = d / "results.md"
        if not md.exists():
            s += [f"## {d.name}: no results.md (see its log)", ""]
            continue
        text = md.read_text()
        bench += [f"# {d.name}", "", text, ""]
        s += [f"## {d.name}: targets", "", _section(text, "## Targets"), ""]
        runs = [_section(text, t) for t in dict.fromkeys(ln.strip() for ln in text.splitlines()
                                                         if ln.startswith("## W="))]
        s += runs + [""]
        guard = _section(text, "## Correctness guard")
        if guard:
            s += [guard, ""]
    if bench:
        (out / "bench.md").write_text("\n".join(bench))
    (out / "checks.json").write_text(json.dumps(checks, indent=1, default=str))
    logs = []
    for p in sorted(work.glob("*.log")):
        text = p.read_text(errors="replace")
        cut = len(text) > LOG_TAIL
        logs.append(f"===== {p.name}" + (f" (last {LOG_TAIL} of {len(text)} chars)" if cut else "") + "\n"
                    + text[-LOG_TAIL:])
    (out / "logs.txt").write_text("\n".join(logs))
    for p in sorted((work / "check").glob("trace_profiler_*.json.gz")):
        if p.stat().st_size <= MAX_FILE:
            shutil.copy(p, out / p.name)
        else:
            s.append(f"- {p.name}: {p.stat().st_size} bytes, too large to send back (in no file)")
    (out / "summary.md").write_text("\n".join(s) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
