"""funcshard.value_and_grad: JAX's value_and_grad on plain autograd (single process: its own semantics; the
sharded parity runs are in test_apply.py, mode "value_and_grad")."""

from __future__ import annotations

import pytest
import torch

import funcshard


def _f(p, x):
    return (torch.tanh(x @ p["w"]) + p["b"]).square().mean() + p["nested"][0].sum()


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g),
            "nested": [torch.randn(2, generator=g)]}


def test_matches_torch_func_grad_and_value():
    p, x = _params(), torch.randn(5, 3)
    value, grads = funcshard.value_and_grad(_f)(p, x)
    ref_grads, ref_value = torch.func.grad_and_value(_f)(p, x)
    torch.testing.assert_close(value, ref_value)
    torch.testing.assert_close(grads, ref_grads)
    assert not value.requires_grad and all(not g.requires_grad for g in (grads["w"], grads["b"]))
    assert all(not t.requires_grad and t.grad is None for t in (p["w"], p["b"]))  # the inputs are untouched


def test_argnums_has_aux_and_unused_leaves():
    p, x = _params(), torch.randn(5, 3)
    p["unused"] = torch.ones(2)

    def f(p, x):
        return _f(p, x), {"twice": 2 * x.sum()}

    (value, aux), (gp, gx) = funcshard.value_and_grad(f, argnums=(0, 1), has_aux=True)(p, x)
    ref = torch.func.grad_and_value(f, argnums=(0, 1), has_aux=True)(p, x)
    (rgp, rgx), (rvalue, raux) = ref
    torch.testing.assert_close((value, aux, gx), (rvalue, raux, rgx))
    torch.testing.assert_close({k: gp[k] for k in rgp}, rgp)
    assert torch.equal(gp["unused"], torch.zeros(2))  # no dependence: zeros, as torch.func.grad gives


def test_no_dependence_gives_zeros():
    p, x = _params(), torch.randn(5, 3)
    value, grads = funcshard.value_and_grad(lambda p, x: x.sum())(p, x)
    ref_grads, ref_value = torch.func.grad_and_value(lambda p, x: x.sum())(p, x)
    torch.testing.assert_close((value, grads), (ref_value, ref_grads))


def test_inference_tensors_as_arguments():
    """The differentiated arguments may be inference tensors (e.g. loaded under torch.inference_mode)."""
    x = torch.randn(5, 3)
    with torch.inference_mode():
        p = _params()
    _, grads = funcshard.value_and_grad(_f)(p, x)
    torch.testing.assert_close(grads, torch.func.grad(_f)(_params(), x))


def test_composes_inside_torch_func_transforms():
    """Under a transform it defers to torch.func.grad_and_value: per-example gradients with vmap."""
    p, xs = _params(), torch.randn(4, 5, 3)
    _, per_example = torch.func.vmap(lambda x: funcshard.value_and_grad(_f)(p, x), in_dims=0)(xs)
    for i in range(4):
        torch.testing.assert_close(per_example["w"][i], torch.func.grad(_f)(p, xs[i])["w"])


@pytest.mark.parametrize("case,match", [
    ("vector", r"must return a scalar tensor \(shape \(\)\), got \(5, 4\); reduce it"),
    ("one_element", r"must return a scalar tensor \(shape \(\)\), got \(1,\); reduce it \(e\.g\. \.mean\(\), or "
                    r"\.squeeze\(\) for one element\)"),
    ("int_leaf", r"argument 0 at steps is a torch\.int64 tensor; every leaf of a differentiated argument must be "
                 r"a floating point tensor"),
    ("argnums", r"argnums=2 but f got 2 positional argument\(s\)"),
    ("argnums_twice", r"argnums must be an int or a non-empty sequence of distinct ints, got \(0, 0\)"),
    ("aux", r"has_aux=True\): f must return \(scalar, aux\), got Tensor"),
])
def test_errors(case, match):
    p, x = _params(), torch.randn(5, 3)

    def f(p, x):
        if case == "one_element":  # torch.func.grad and JAX refuse it too
            return _f(p, x).reshape(1)
        return torch.tanh(x @ p["w"]) if case == "vector" else _f(p, x)

    if case == "int_leaf":
        p["steps"] = torch.tensor(3)
    with pytest.raises((TypeError, ValueError), match=match):
        argnums = {"argnums": 2, "argnums_twice": (0, 0)}.get(case, 0)
        funcshard.value_and_grad(f, argnums=argnums, has_aux=case == "aux")(p, x)
    assert p["w"].grad is None and not p["w"].requires_grad  # nothing was changed
