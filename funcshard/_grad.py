"""value_and_grad: JAX's first-order gradient transform, on plain autograd.

``torch.func.grad`` differentiates with ``create_graph=True`` so that transforms can nest, and wraps every op of
the model for its grad level. A training step needs neither: this runs the same function under plain autograd
(detached ``requires_grad`` copies of the differentiated arguments, ``torch.autograd.grad``), which frees each
saved activation as soon as backward has used it and skips the per-op wrapping. Inside a ``torch.func``
transform it defers to ``torch.func.grad_and_value``, so it still composes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcshard._compat import get_interpreter_stack
from funcshard._compile import runtime_boundary
from funcshard._tree import tree_flatten_with_path, tree_map_only, tree_unflatten


def value_and_grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """``fn(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``) becomes ``(*args) -> (value, grads)``, as in
    JAX: ``grads`` has the pytree structure of ``args[argnums]`` (a tuple of them when ``argnums`` is a
    sequence); with ``has_aux`` the value is ``(scalar, aux)``. The value, aux and gradients are detached.

    First-order only: the gradients carry no graph. Every tensor leaf of the differentiated arguments must be
    floating point or complex (as for ``torch.func.grad``); a leaf the value does not depend on gets zeros.

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
        args, inputs, specs = _prepare(fn, nums, argnums, args)
        if inputs is None:  # inside a torch.func transform: compose with it
            grads, value = torch.func.grad_and_value(fn, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
            return value, grads
        with torch.enable_grad():
            out = fn(*args, **kwargs)
        return _differentiate(fn, argnums, has_aux, out, inputs, specs)

    return wrapped


# Under torch.compile, ``wrapped`` is traced with ``fn`` in it; these two run eagerly (graph breaks: the pytree walks
# and torch.autograd.grad are no graph's business; the compiled ``fn`` records its own backward for autograd.grad).
@runtime_boundary
def _prepare(fn: Callable, nums: tuple[int, ...], argnums: int | Sequence[int], args: tuple
             ) -> tuple[tuple, list | None, list]:
    """The arguments with detached ``requires_grad`` leaves in place of the differentiated ones, the leaves and the
    trees' specs; ``(args, None, [])`` inside a torch.func transform."""
    for n in nums:
        if not -len(args) <= n < len(args):
            raise TypeError(f"value_and_grad: argnums={argnums!r} but {fn.__name__} got {len(args)} "
                            f"positional argument(s); pass the differentiated arguments positionally")
    if get_interpreter_stack():
        return args, None, []
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
        # (an inference tensor, e.g. made under torch.inference_mode, cannot take a gradient: copy it)
        leaves = [(leaf.clone() if leaf.is_inference() else leaf.detach()).requires_grad_() for leaf in leaves]
        args[n] = tree_unflatten(spec, leaves)
        inputs.append(leaves)
        specs.append(spec)
    return tuple(args), inputs, specs


@runtime_boundary
def _differentiate(fn: Callable, argnums: int | Sequence[int], has_aux: bool, out: Any, inputs: list, specs: list):
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
