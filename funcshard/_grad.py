"""value_and_grad: JAX's first-order gradient transform, on plain autograd.

``torch.func.grad`` differentiates with ``create_graph=True`` so that transforms can nest, and wraps every op of
the model for its grad level. A training step needs neither: this runs the same function under plain autograd
(detached ``requires_grad`` copies of the differentiated arguments, ``torch.autograd.grad``), which frees each
saved activation as soon as backward has used it and skips the per-op wrapping. Inside a ``torch.func``
transform it is ``torch.func.grad_and_value`` over the same flattened leaves (funcshard's pytrees, the same leaf
checks and errors), so it composes (``vmap(value_and_grad(loss))``: per-example values and gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcshard._compat import TransformType, get_interpreter_stack
from funcshard._compile import runtime_boundary
from funcshard._primitives import transform_stack
from funcshard._tree import tree_flatten_with_path, tree_map_only, tree_unflatten


def value_and_grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """``fn(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``) becomes ``(*args) -> (value, grads)``, as in
    JAX: ``grads`` has the pytree structure of ``args[argnums]`` (a tuple of them when ``argnums`` is a
    sequence); with ``has_aux`` the value is ``(scalar, aux)``. The value, aux and gradients are detached.

    First-order only: the gradients carry no graph. Every tensor leaf of the differentiated arguments must be
    floating point or complex (as for ``torch.func.grad``); a leaf the value does not depend on gets zeros.

    Under ``torch.func`` transforms it is one more level of them (``torch.func.grad_and_value`` of the flattened
    leaves): ``vmap(value_and_grad(loss), in_dims=(None, 0))(state, examples)`` gives per-example values and
    gradients (shards with a leading example dim over sharded state), and the value and gradients are detached from
    this level only (an outer ``grad``/``jvp`` differentiates them, as ``torch.func.grad_and_value``'s). Under
    ``vmap`` an ``aux`` leaf that is not a tensor is refused (``NotImplementedError`` naming the transform stack:
    vmap returns tensors only).

    Args:
        fn: ``fn(*args, **kwargs) -> scalar tensor`` (or ``(scalar, aux)`` with ``has_aux``).
        argnums: which positional argument(s) to differentiate: an int, or a sequence of distinct ints.
        has_aux: ``fn`` returns ``(scalar, aux)``; ``aux`` is returned with the value, detached.
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(n, int) for n in nums) or len(set(nums)) != len(nums):
        raise TypeError(f"value_and_grad: argnums must be an int or a non-empty sequence of distinct ints, got "
                        f"{argnums!r}")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any):
        args, inputs, specs, composed = _prepare(fn, nums, argnums, args)
        if composed:  # inside a torch.func transform: one more level of them
            return _compose(fn, nums, argnums, has_aux, args, kwargs, inputs, specs)
        with torch.enable_grad():
            out = fn(*args, **kwargs)
        return _differentiate(fn, argnums, has_aux, out, inputs, specs)

    return wrapped


def _compose(fn: Callable, nums: tuple[int, ...], argnums: int | Sequence[int], has_aux: bool, args: tuple,
             kwargs: dict, inputs: list, specs: list):
    """``torch.func.grad_and_value`` of ``fn`` as a function of the differentiated arguments' leaves (funcshard's
    pytrees, as the eager path's), with value_and_grad's checks and results."""
    kept: dict[str, Any] = {}

    def flat(*leaves: list):
        a = list(args)
        for n, spec, ls in zip(nums, specs, leaves):
            a[n] = tree_unflatten(spec, ls)
        value, aux = _value_of(fn, has_aux, fn(*a, **kwargs))
        if not has_aux:
            return value, []
        paths, aux_leaves, kept["spec"] = tree_flatten_with_path(aux)
        others = [(p, x) for p, x in zip(paths, aux_leaves) if not isinstance(x, torch.Tensor)]
        if others and any(i.key() == TransformType.Vmap for i in get_interpreter_stack() or ()):
            path, x = others[0]
            raise NotImplementedError(
                f"value_and_grad(has_aux=True) under {transform_stack()}: {fn.__name__}'s aux at "
                f"{'.'.join(map(str, path)) or '<root>'} is of type {type(x).__name__!r}, and vmap returns tensors "
                f"only; return it as a tensor, or compute it outside vmap")
        kept["aux"] = aux_leaves
        return value, [x for x in aux_leaves if isinstance(x, torch.Tensor)]

    grads, (value, tensors) = torch.func.grad_and_value(flat, argnums=tuple(range(len(nums))), has_aux=True)(*inputs)
    out_grads = [tree_unflatten(spec, list(g)) for spec, g in zip(specs, grads)]
    if has_aux:
        it = iter(tensors)
        aux = tree_unflatten(kept["spec"], [next(it) if isinstance(x, torch.Tensor) else x for x in kept["aux"]])
        value = (value, aux)
    return value, (out_grads[0] if isinstance(argnums, int) else tuple(out_grads))


# Under torch.compile, ``wrapped`` is traced with ``fn`` in it; these two run eagerly (graph breaks: the pytree walks
# and torch.autograd.grad are no graph's business; the compiled ``fn`` records its own backward for autograd.grad).
@runtime_boundary
def _prepare(fn: Callable, nums: tuple[int, ...], argnums: int | Sequence[int], args: tuple
             ) -> tuple[tuple, list, list, bool]:
    """The arguments with detached ``requires_grad`` leaves in place of the differentiated ones, the leaves, the
    trees' specs, and False; inside a torch.func transform: the arguments, their leaves as they are, the specs and
    True."""
    for n in nums:
        if not -len(args) <= n < len(args):
            raise TypeError(f"value_and_grad: argnums={argnums!r} but {fn.__name__} got {len(args)} "
                            f"positional argument(s); pass the differentiated arguments positionally")
    composed = bool(get_interpreter_stack())
    args = list(args)
    inputs, specs = [], []
    for n in nums:
        paths, leaves, spec = tree_flatten_with_path(args[n])
        for path, leaf in zip(paths, leaves):
            if not isinstance(leaf, torch.Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
                what = type(leaf).__name__ if not isinstance(leaf, torch.Tensor) else f"a {leaf.dtype} tensor"
                raise TypeError(
                    f"value_and_grad: argument {n} at {'.'.join(map(str, path)) or '<root>'} is {what}; every "
                    f"leaf of a differentiated argument must be a floating point tensor (pass the rest as "
                    f"another, non-differentiated argument)")
        if not composed:  # (an inference tensor, e.g. made under torch.inference_mode, cannot take a gradient: copy it)
            leaves = [(leaf.clone() if leaf.is_inference() else leaf.detach()).requires_grad_() for leaf in leaves]
            args[n] = tree_unflatten(spec, leaves)
        inputs.append(leaves)
        specs.append(spec)
    return tuple(args), inputs, specs, composed


@runtime_boundary
def _differentiate(fn: Callable, argnums: int | Sequence[int], has_aux: bool, out: Any, inputs: list, specs: list):
    value, aux = _value_of(fn, has_aux, out)
    flat = [leaf for leaves in inputs for leaf in leaves]
    if flat and value.requires_grad:
        grads = torch.autograd.grad(value, flat, allow_unused=True, materialize_grads=True)
    else:  # the value does not depend on the arguments (as torch.func.grad: zeros)
        grads = tuple(torch.zeros_like(leaf) for leaf in flat)
    out_grads, k = [], 0
    for leaves, spec in zip(inputs, specs):
        out_grads.append(tree_unflatten(spec, list(grads[k : k + len(leaves)])))
        k += len(leaves)
    value = value.detach()
    if has_aux:
        value = (value, tree_map_only(torch.Tensor, lambda t: t.detach(), aux))
    return value, (out_grads[0] if isinstance(argnums, int) else tuple(out_grads))


def _value_of(fn: Callable, has_aux: bool, out: Any) -> tuple[torch.Tensor, Any]:
    """``(value, aux)`` of ``fn``'s result, the value checked to be a scalar tensor (per example under vmap)."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"value_and_grad(has_aux=True): {fn.__name__} must return (scalar, aux), got "
                            f"{type(out).__name__}")
        value, aux = out
    else:
        value, aux = out, None
    if not isinstance(value, torch.Tensor) or value.dim() != 0:  # as torch.func.grad and JAX: shape ()
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"value_and_grad: {fn.__name__} must return a scalar tensor (shape ()), got "
                         f"{shape}; reduce it (e.g. .mean(), or .squeeze() for one element) or use "
                         f"torch.func.vjp for vector outputs")
    return value, aux
