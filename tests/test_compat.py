"""Every private torch API funcshard uses goes through ``funcshard/_compat.py``, so that a torch release that
moves or drops one breaks one file, with a clear error there (issue 13). This checks the rest of the package
statically (AST): no private torch name is imported or reached outside ``_compat.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parent.parent / "funcshard"
EXEMPT = {"_compat.py"}

# Attribute names private to torch's objects (modules, tensors, DTensors), wherever they are reached: a receiver
# like ``mod`` or ``grad`` cannot be traced to torch statically.
PRIVATE_ATTRS = {
    "_parameters", "_buffers", "_modules", "_local_tensor", "_spec", "_post_accumulate_grad_hooks",
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_version", "_base", "_cdata", "_grad_fn", "_schema",
}
OWN_PREFIX = "_funcshard"  # attributes funcshard sets on torch objects itself (``_funcshard_owner``)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and not name.startswith(
        OWN_PREFIX)


def _torch_module(module: str | None) -> bool:
    return module is not None and (module == "torch" or module.startswith("torch."))


def _root(node: ast.AST) -> ast.AST:
    """The start of an attribute chain (through calls and subscripts: ``torch.f(x)._y``, ``a.b[0]._c``)."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return node


def private_torch_uses(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, what) for every private torch name ``source`` imports or reaches."""
    tree = ast.parse(source, filename)
    torch_names = {"torch"}  # names bound to torch modules or objects by imports (torch, dist, nn, DTensor, ...)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _torch_module(a.name):
                    torch_names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _torch_module(node.module):
            torch_names.update(a.asname or a.name for a in node.names)
    parent = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def chain(node: ast.AST) -> str:  # the whole dotted name the private part is in: torch._C._functorch.f
        while isinstance(up := parent.get(id(node)), ast.Attribute) and up.value is node:
            node = up
        return ast.unparse(node)

    found, inner = [], set()
    for node in ast.walk(tree):  # (outer nodes first: a chain is reported once, by its outermost private name)
        if id(node) in inner:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if _torch_module(a.name) and any(map(_private, a.name.split("."))):
                    found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _torch_module(node.module):
            names = [a.name for a in node.names]
            if any(map(_private, node.module.split("."))) or any(map(_private, names)):
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node.value)
            if node.attr in PRIVATE_ATTRS or (isinstance(root, ast.Name) and root.id in torch_names):
                found.append((node.lineno, chain(node)))
                sub = node.value
                while isinstance(sub, (ast.Attribute, ast.Call, ast.Subscript)):
                    inner.add(id(sub))
                    sub = sub.func if isinstance(sub, ast.Call) else sub.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            # getattr(torch.X, "_name", ...), hasattr(...), setattr(...), and importlib's string imports
            name = node.args[1]
            if (node.func.id in {"getattr", "hasattr", "setattr", "delattr"} and isinstance(name, ast.Constant)
                    and isinstance(name.value, str) and _private(name.value)):
                root = _root(node.args[0])
                if name.value in PRIVATE_ATTRS or (isinstance(root, ast.Name) and root.id in torch_names):
                    found.append((node.lineno, ast.unparse(node)))
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str) and _torch_module(node.args[0].value)
                and ast.unparse(node.func) in {"importlib.import_module", "import_module", "__import__"}
                and any(map(_private, node.args[0].value.split(".")))):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_checker_finds_private_torch_names():
    """The check itself: each pattern it must catch, and what it must let through."""
    bad = """\
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
import torch.utils._pytree as pytree
from torch._C._functorch import get_unwrapped
from torch.utils import _pytree
torch._C._current_graph_task_id()
torch._foreach_add_(a, b)
torch.Tensor._make_subclass(cls, t)
torch.autograd.Variable._execution_engine.queue_callback(f)
dist._something(x)
nn.Module._apply
DTensor._op_dispatcher
mod._parameters[k] = v
grad._local_tensor.add_(o)
param._spec
p._post_accumulate_grad_hooks
getattr(torch._C._autograd, "_top", None)
getattr(torch.Tensor, "_dtensor__new__", None)
hasattr(m, "_buffers")
torch.empty(1)._version
importlib.import_module("torch._C")
"""
    found = private_torch_uses(bad)
    assert sorted({line for line, _ in found}) == list(range(5, 24)), found
    ok = """
import torch
import torch.distributed as dist
from funcshard._compat import current_graph_task_id
from funcshard import _compat
torch.Tensor.__new__
torch.autograd.Function.apply
dist.all_reduce(x)
self._groups
step._inputs_done(name)
t._funcshard_where = 1
super()._release_frozen(name)
_compat.param_slots(mod)
getattr(torch, kind, None)
setattr(p, _OWNER, unit)
getattr(obj, "_private_of_ours", None)
"""
    assert private_torch_uses(ok) == []


def test_optree_only_in_tree():
    """funcshard's pytrees go through funcshard/_tree.py (optree, namespace "funcshard"; torch's pytree for
    modules' inputs and outputs), so that every pytree has the same node types."""
    problems = []
    for p in sorted(PACKAGE.rglob("*.py")):
        if p.name == "_tree.py":
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "optree" or n.startswith("optree.") for n in names):
                problems.append(f"{p.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not problems, "optree used outside funcshard/_tree.py: " + ", ".join(problems)


def test_private_torch_apis_only_in_compat():
    files = sorted(p for p in PACKAGE.rglob("*.py") if p.name not in EXEMPT)
    assert len(files) > 5
    problems = [f"{p.relative_to(PACKAGE.parent)}:{line}: {what}"
                for p in files for line, what in private_torch_uses(p.read_text(), str(p))]
    assert not problems, ("private torch APIs outside funcshard/_compat.py (add a name there, with a fallback or a "
                          "clear error per torch version, and use it):\n" + "\n".join(problems))


def test_compat_names_resolve():
    """Every _compat name is bound (a missing API fails at import with a clear error, or has its fallback)."""
    from funcshard import _compat

    for name in _compat.__all__:
        assert hasattr(_compat, name), name
    assert callable(_compat.current_graph_task_id) and _compat.current_graph_task_id() == -1
    m = torch.nn.Linear(2, 3)
    assert _compat.param_slots(m) is m._parameters and _compat.buffer_slots(m) is m._buffers
    with pytest.raises(ImportError, match="torch.nope_not_there"):
        _compat.require("torch.nope_not_there")
