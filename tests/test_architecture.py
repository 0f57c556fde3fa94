"""docs/architecture.md held to the code: the import graph of ``funcshard/`` (read from the sources with ``ast``,
function-level imports included, ``if TYPE_CHECKING:`` blocks aside) has no cycle and follows the layering the
document states; every ``module.symbol`` it names exists; no class of ``funcshard/`` is over 300 lines."""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "funcshard"
DOC = ROOT / "docs" / "architecture.md"
MAX_CLASS_LINES = 300  # (issue 30: a class that outgrows this holds more than one job)


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name without the ``funcshard.`` prefix (the package itself: "")."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


@functools.cache
def _trees() -> dict[str, ast.Module]:
    """Every module's syntax tree, parsed once."""
    return {name: ast.parse(path.read_text()) for name, path in _modules().items()}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            for b in n.body:
                skip.update(id(x) for x in ast.walk(b))
    return skip


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported funcshard module: line}; an imported name that is a module counts as that module."""
    mods = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        tree = _trees()[name]
        skip = _type_checking_nodes(tree)
        deps: dict[str, int] = {}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}:{node.lineno}: relative import"
                if node.module is None:
                    continue
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}"[10:] in mods else node.module
                           for a in node.names]
            for t in targets:
                if t == "funcshard" or t.startswith("funcshard."):
                    dep = t[len("funcshard."):] if t != "funcshard" else ""
                    if dep != name:
                        deps.setdefault(dep, node.lineno)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in graph.get(v, {}):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)) is not None:
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in graph:
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def documented_layers() -> dict[str, int]:
    """The ```layers block of docs/architecture.md: ``L<n> <role>: module, module, ...`` per line."""
    text = DOC.read_text()
    m = re.search(r"```layers\n(.*?)```", text, re.S)
    assert m, "docs/architecture.md has no ```layers block"
    layers: dict[str, int] = {}
    for line in m.group(1).splitlines():
        if not line.strip():
            continue
        head, _, mods = line.partition(":")
        level = int(re.match(r"\s*L(\d+)", head).group(1))
        for mod in mods.split(","):
            mod = mod.strip()
            mod = "" if mod == "funcshard" else mod.removeprefix("funcshard.")
            assert mod not in layers, f"{mod!r} is in two layers of docs/architecture.md"
            layers[mod] = level
    return layers


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(c or "funcshard" for c in cycle)


def test_imports_follow_the_documented_layering():
    graph, layers = import_graph(), documented_layers()
    missing = sorted(set(graph) - set(layers))
    unknown = sorted(set(layers) - set(graph))
    assert not missing and not unknown, f"docs/architecture.md's layers: missing {missing}, not modules {unknown}"
    bad = [f"{m or 'funcshard'} (L{layers[m]}) imports {d or 'funcshard'} (L{layers[d]}) at line {line}"
           for m, deps in graph.items() for d, line in deps.items() if layers[d] >= layers[m]]
    assert not bad, "imports the documented layering rules out:\n" + "\n".join(bad)


def _symbol_owners() -> tuple[dict[str, str], dict[str, list[str]]]:
    """Module names as the document may write them (``_runtime.step``, ``_runtime/step.py``, ``fsdp/_api``,
    ``step``-less short forms only when unique and private or public submodules) and class names -> modules."""
    mods = _modules()
    names: dict[str, str] = {}
    short: dict[str, list[str]] = {}
    for name in mods:
        if not name:
            continue
        names[name] = name
        names[name.replace(".", "/")] = name
        short.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    for s, full in short.items():
        if len(full) == 1 and s not in names:
            names[s] = full[0]
    classes: dict[str, list[str]] = {}
    for name in mods:
        for n in _trees()[name].body:
            if isinstance(n, ast.ClassDef):
                classes.setdefault(n.name, []).append(name)
    return names, classes


def _instance_attributes() -> dict[str, set[str]]:
    """Per class name: the attributes its methods assign on ``self`` (``Step.runs``, ``GroupRun.buffers``)."""
    out: dict[str, set[str]] = {}
    for tree in _trees().values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = out.setdefault(cls.name, set())
            for n in ast.walk(cls):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
                for t in targets:
                    for x in ast.walk(t):
                        if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                            names.add(x.attr)
    return out


_INSTANCE: dict[str, set[str]] = {}


def _resolve(obj, attrs: list[str]) -> bool:
    for a in attrs:
        if not hasattr(obj, a):
            if not _INSTANCE:
                _INSTANCE.update(_instance_attributes())
            # an instance attribute of a class, last in the chain (its type is not known statically)
            return isinstance(obj, type) and a == attrs[-1] and a in _INSTANCE.get(obj.__name__, ())
        obj = getattr(obj, a)
    return True


def named_symbols() -> list[str]:
    """Every backticked ``a.b`` of docs/architecture.md whose head is a funcshard module or class (calls and
    argument lists cut off: ``PendingReduce.finish(divide)`` is ``PendingReduce.finish``)."""
    out = []
    for span in re.findall(r"`([^`\n]+)`", DOC.read_text()):
        m = re.match(r"(?:funcshard\.)?([A-Za-z_][\w/]*(?:\.py)?(?:\.[A-Za-z_]\w*)+)", span.strip())
        if m:
            out.append(m.group(1))
    return out


def test_every_symbol_the_architecture_names_exists():
    names, classes = _symbol_owners()
    checked, bad = 0, []
    for ref in named_symbols():
        ref = ref.replace(".py.", ".")
        if ref.endswith(".py"):
            continue  # a file (checked as a module below when written without .py)
        parts = ref.split(".")
        # the longest dotted prefix that is a module, else a class head
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in names:
                mod = importlib.import_module("funcshard." + names[head] if names[head] else "funcshard")
                checked += 1
                if not _resolve(mod, parts[cut:]):
                    bad.append(ref)
                break
        else:
            owners = classes.get(parts[0])
            if owners:
                checked += 1
                objs = [getattr(importlib.import_module("funcshard." + o if o else "funcshard"), parts[0])
                        for o in owners]
                if not any(_resolve(o, parts[1:]) for o in objs):
                    bad.append(ref)
    assert checked > 50, f"only {checked} symbols found: the document's spelling changed?"
    assert not bad, "docs/architecture.md names symbols that do not exist: " + ", ".join(sorted(set(bad)))


def test_the_symbol_check_can_fail():
    names, classes = _symbol_owners()
    assert "_collectives" in names and "Step" in classes
    mod = importlib.import_module("funcshard._collectives")
    assert _resolve(mod, ["wait_work"]) and not _resolve(mod, ["no_such_symbol"])
    step = importlib.import_module("funcshard._runtime.step").Step
    assert _resolve(step, ["runs"]) and not _resolve(step, ["no_such_attribute"])
    assert _cycle({"a": {"b": 1}, "b": {"a": 2}}) == ["a", "b", "a"]


def test_no_class_over_300_lines():
    big = []
    for name, tree in _trees().items():
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{name}.{n.name}: {n.end_lineno - n.lineno + 1} lines")
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"


@pytest.mark.parametrize("api", ["funcshard.apply", "funcshard.gather", "fully_shard"])
def test_device_error_names_the_api(api):
    import types

    import torch

    from funcshard._mesh import device_of

    if torch.cuda.is_available():
        pytest.skip("this process has a CUDA device")
    fake = types.SimpleNamespace(device_type="cuda")  # (device_of reads the mesh's device type only)
    with pytest.raises(ValueError, match=rf"^{re.escape(api)} got a mesh of device type 'cuda', and this process has "
                                         r"no cuda device"):
        device_of(fake, api)
