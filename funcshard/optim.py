"""Optax-style optimizers over pytrees of (sharded) tensors.

An optimizer is a :class:`GradientTransformation`: a pair of pure functions

* ``init(params) -> opt_state``
* ``update(updates, opt_state, params=None) -> (updates, opt_state)``

working on any pytree of tensors (flattened with :mod:`optree`, namespace
``"funcshard"``, ``none_is_leaf=False``); the usual case is a flat
``dict[str, Tensor]`` holding the *local shards* of the parameters. Every
per-parameter piece of optimizer state (Adam moments, momentum buffers) has the
same structure, keys, shapes and dtypes as the params given to ``init``: the
optimizer state is sharded exactly like the parameters, and the element-wise
math needs no communication. The only collective is the one ``all_reduce`` of a
scalar in :func:`clip_by_global_norm`.

Training step::

    import torch
    from funcshard import optim

    tx = optim.chain(
        optim.clip_by_global_norm(1.0, mesh=mesh),   # global norm across ranks
        optim.adamw(lr=3e-4, weight_decay=0.1),       # == torch.optim.AdamW
    )
    opt_state = tx.init(state)                       # state: dict[str, Tensor]

    def train_step(state, opt_state, batch):
        grads = torch.func.grad(loss_fn)(state, batch)
        updates, opt_state = tx.update(grads, opt_state, state)
        state = optim.apply_updates(state, updates)
        return state, opt_state

Conventions (as in optax):

* ``update`` returns the deltas to *add* to the params (``-lr * direction``);
  :func:`apply_updates` adds them. Nothing is mutated: ``update`` returns new
  update and state tensors and leaves its inputs (grads, state, params) alone,
  and :func:`apply_updates` returns new parameter tensors.
* ``update`` accepts and ignores extra keyword arguments (``**extra``) for
  forward compatibility, except ``donate=True``: JAX-style buffer donation, the
  caller gives up ``updates`` and ``opt_state``, which are then reused in place
  (moments, momentum, the returned updates), so a step allocates no second copy
  of the optimizer state; ``apply_updates(params, updates, donate=True)``
  likewise updates ``params`` in place. Same numbers as the pure form. Check
  first, then donate: a donating :func:`chain` (and :func:`step`) runs the input
  checks of every transform in it before any tensor is changed in place, so a
  call that raises leaves updates, state and params as they were (a transform
  of your own in a chain takes part if its update function has a
  ``check(updates, state, params)`` attribute; without one it is not checked
  beforehand).
* ``lr`` is a float or a schedule ``schedule(count: int) -> float`` where
  ``count`` is the number of updates already applied: ``0`` for the first
  update. This matches both optax (``scale_by_schedule``) and torch's
  ``LambdaLR`` (``lr_lambda(0)`` is used by the first ``optimizer.step()``).
  Torch's own step counter (``state["step"]``, used for Adam's bias correction)
  is 1 in the first step; ``ScaleByAdamState.count`` is that counter after the
  update, i.e. ``1`` after the first update, exactly like ``state["step"]``.
* ``count`` fields of the state NamedTuples are plain Python ``int``.
* Updates run under ``torch.no_grad()`` with ``torch._foreach_*`` kernels over
  the flat list of leaves; no per-parameter math loops in Python.
* Bad input (an ``updates`` tree whose keys/structure or shapes differ from the
  optimizer state or params) raises ``ValueError``/``TypeError`` naming the key
  path, the shapes, and the fix.

:func:`sgd` and :func:`adamw` reproduce ``torch.optim.SGD`` and
``torch.optim.AdamW`` (same defaults, same math, including the coupled L2
weight decay and first-gradient momentum initialisation of SGD and the
decoupled weight decay ``p *= 1 - lr * wd`` of AdamW applied to the param value
before the Adam step). ``amsgrad``, ``maximize``, ``foreach``, ``fused``,
``capturable`` and ``differentiable`` are not supported.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Union

import torch
import torch.distributed as dist

from funcshard._checkpoint_dcp import refuse_container
from funcshard._collectives import bounded_all_reduce
from funcshard._compat import (
    DCP_WRITE_ITEMS,
    foreach_add,
    foreach_add_,
    foreach_addcdiv,
    foreach_addcdiv_,
    foreach_addcmul_,
    foreach_copy_,
    foreach_div,
    foreach_div_,
    foreach_lerp,
    foreach_lerp_,
    foreach_mul,
    foreach_mul_,
    foreach_norm,
    foreach_sqrt,
    get_interpreter_stack,
    is_functorch_wrapped_tensor,
)
from funcshard._offload import check_pin, start_to_device, start_to_host, to_host
from funcshard._spec import shard_like
from funcshard._tree import TreeSpec, tree_flatten, tree_flatten_with_path, tree_unflatten

__all__ = [
    "GradientTransformation",
    "TorchOptimizer",
    "Schedule",
    "ScalarOrSchedule",
    "EmptyState",
    "ScaleState",
    "ScaleByScheduleState",
    "ScaleByAdamState",
    "AddDecayedWeightsState",
    "TraceState",
    "ClipByGlobalNormState",
    "identity",
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "scale_by_adam",
    "add_decayed_weights",
    "trace",
    "clip_by_global_norm",
    "chain",
    "sgd",
    "adamw",
    "apply_updates",
    "step",
    "offload",
    "OffloadState",
]

PyTree = Any
Schedule = Callable[[int], Union[float, torch.Tensor]]
"""A learning-rate schedule: ``count -> value``, called with the number of updates so far (0 first)."""
ScalarOrSchedule = Union[float, Schedule]
"""A constant (float) or a :data:`Schedule`."""


class GradientTransformation(NamedTuple):
    """An optimizer as a pair of pure functions (optax convention).

    ``init(params) -> opt_state``;
    ``update(updates, opt_state, params=None, **extra) -> (updates, opt_state)``.

    Attributes:
        init: ``params -> opt_state``: the state for a pytree of parameters (sharded like them).
        update: ``(updates, opt_state, params=None, **extra) -> (updates, opt_state)``: transform the gradients (or
            updates) into updates; ``extra`` may carry ``donate=True``.
    """

    init: Callable[[PyTree], Any]
    update: Callable[..., tuple[PyTree, Any]]


class TorchOptimizer(GradientTransformation):
    """A :class:`GradientTransformation` that is one of ``torch.optim``'s optimizers (:func:`adamw`, :func:`sgd`, or a
    :func:`chain` ending in one): besides ``init``/``update`` it has

    * ``exact(grads, opt_state, params, donate=False) -> (params, opt_state)``: the new parameters computed with
      torch's multi-tensor (``foreach``) op order, bit for bit (what :func:`step` runs);
    * ``torch_param_group(count) -> dict``: torch's ``param_groups`` entry for it after ``count`` updates (what a
      torch optimizer's state dict holds; ``funcshard.checkpoint`` writes it).

    Attributes:
        init: as :class:`GradientTransformation`'s.
        update: as :class:`GradientTransformation`'s.
    """

    # (instances carry the two attributes above: a NamedTuple subclass without __slots__ has a __dict__)


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


class ScaleState(NamedTuple):
    """State of :func:`scale` (empty)."""


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`.

    Attributes:
        count: updates applied so far (0 before the first).
    """

    count: int


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`.

    Attributes:
        count: steps taken (torch's ``state['step']``).
        mu: first moments (torch's ``exp_avg``), a pytree like the params.
        nu: second moments (torch's ``exp_avg_sq``), a pytree like the params.
    """

    count: int
    mu: PyTree
    nu: PyTree


class AddDecayedWeightsState(NamedTuple):
    """State of :func:`add_decayed_weights` (empty)."""


class TraceState(NamedTuple):
    """State of :func:`trace`.

    Attributes:
        count: steps taken.
        trace: the momentum buffers (torch's ``momentum_buffer``), a pytree like the params.
    """

    count: int
    trace: PyTree


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm` (empty)."""


_STATES = [EmptyState, ScaleState, ScaleByScheduleState, ScaleByAdamState, AddDecayedWeightsState, TraceState,
           ClipByGlobalNormState]
_CHAINS: dict[int, type] = {}


def chain_state_class(n: int) -> type:
    """The state class of a chain of ``n`` transformations: a namedtuple ``ChainState<n>(s0, ..., s<n-1>)`` (a
    tuple, indexed and unpacked as optax's plain tuple; a pytree node for optree and torch's pytree alike). Not a
    plain tuple so that it can answer ``torch.distributed.checkpoint`` (see :func:`refuse_container`). Made on first
    use; it pickles as ``_chain_state(n, states)``, one safe global for ``torch.load(weights_only=True)``."""
    cls = _CHAINS.get(n)
    if cls is None:
        cls = collections.namedtuple(f"ChainState{n}", [f"s{i}" for i in range(n)], module=__name__)
        cls.__doc__ = f"State of a :func:`chain` of {n} transformations: their states in order."
        cls.__reduce__ = lambda self: (_chain_state, (len(self), tuple(self)))
        _CHAINS[n] = cls
        _serve(cls)
    return cls


def _chain_state(n: int, states: tuple) -> tuple:
    """A pickled ``ChainState<n>`` (see :func:`chain_state_class`)."""
    return chain_state_class(n)(*states)


def is_chain_state(state: Any) -> bool:
    """Whether ``state`` is a chain's state (a ``ChainState<n>``, or a plain tuple of states as optax keeps)."""
    return type(state) is tuple or (isinstance(state, tuple) and _CHAINS.get(len(state)) is type(state))


def _serve(cls: type) -> None:
    # plain DCP of an optimizer state holding shards of a multi-rank plan: a clear error, not one rank's copy
    setattr(cls, DCP_WRITE_ITEMS, refuse_container)


# torch.load's default (weights_only=True) unpickles only allowlisted classes: the states are plain data
torch.serialization.add_safe_globals([*_STATES, _chain_state])
for _cls in _STATES:
    _serve(_cls)


# --------------------------------------------------------------------------
# pytree helpers and input validation
# --------------------------------------------------------------------------


def _keystr(path: tuple[Any, ...]) -> str:
    if not path:
        return "<root>"
    return "".join(f"[{k!r}]" for k in path)


def _paths(tree: PyTree) -> list[tuple[Any, ...]]:
    paths, _, _ = tree_flatten_with_path(tree)
    return paths


def _fmt_keys(paths: Sequence[tuple[Any, ...]], limit: int = 8) -> str:
    shown = [_keystr(p) for p in paths[:limit]]
    more = f" ... (+{len(paths) - limit} more)" if len(paths) > limit else ""
    return ", ".join(shown) + more


def _check_tensor_leaves(where: str, what: str, tree: PyTree, leaves: Sequence[Any]) -> None:
    for path, leaf in zip(_paths(tree), leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{where}: {what} leaf at {_keystr(path)} is a {type(leaf).__name__}, "
                f"not a torch.Tensor. Fix: pass a pytree whose leaves are all tensors "
                f"(e.g. dict[str, Tensor]); use None (not a number) for absent entries."
            )


def _check_match(
    where: str,
    what: str,
    tree: PyTree,
    leaves: list[Any],
    spec: TreeSpec,
    ref_what: str,
    ref_tree: PyTree,
    ref_leaves: list[Any],
    ref_spec: TreeSpec,
    fix: str,
) -> None:
    """Raise a helpful error unless ``tree`` has ``ref_tree``'s structure and shapes.

    The fast path is one treespec comparison and one comparison of shape lists.
    """
    if spec != ref_spec:
        paths, ref_paths = _paths(tree), _paths(ref_tree)
        ref_set, path_set = set(ref_paths), set(paths)
        missing = [p for p in ref_paths if p not in path_set]
        extra = [p for p in paths if p not in ref_set]
        parts = []
        if missing:
            parts.append(f"missing keys {_fmt_keys(missing)} (in {ref_what}, not in {what})")
        if extra:
            parts.append(f"unexpected keys {_fmt_keys(extra)} (in {what}, not in {ref_what})")
        if not parts:
            parts.append(f"same keys but different container types: {what} is {spec}, {ref_what} is {ref_spec}")
        raise ValueError(f"{where}: {what} do not match the {ref_what}: " + "; ".join(parts) + f". Fix: {fix}")
    try:
        shapes = [x.shape for x in leaves]
    except AttributeError:
        _check_tensor_leaves(where, what, tree, leaves)
        raise
    try:
        ref_shapes = [x.shape for x in ref_leaves]
    except AttributeError:
        _check_tensor_leaves(where, ref_what, ref_tree, ref_leaves)
        raise
    if shapes != ref_shapes:
        for path, s, r in zip(_paths(tree), shapes, ref_shapes):
            if s != r:
                raise ValueError(
                    f"{where}: shape mismatch at {_keystr(path)}: {what} has shape {tuple(s)} "
                    f"but the {ref_what} has shape {tuple(r)}. Fix: {fix}"
                )


_FIX_STATE = (
    "pass updates (grads) with exactly the structure and local shard shapes of the params "
    "given to init(); if the parameters or their sharding changed, re-create the state "
    "with tx.init(params)."
)
_FIX_PARAMS = (
    "pass the current params (same keys and local shard shapes as the updates) as the "
    "third argument: tx.update(grads, opt_state, params)."
)


def _check_state(where: str, state: Any, state_type: type) -> None:
    if not isinstance(state, state_type):
        raise TypeError(
            f"{where}: expected opt_state of type {state_type.__name__}, got {type(state).__name__}. "
            f"Fix: pass the state returned by this transformation's init() (or by its previous update())."
        )


def _require_params(where: str, params: PyTree) -> None:
    if params is None:
        raise ValueError(f"{where}: params are required but got None. Fix: {_FIX_PARAMS}")


def _zeros_like_tree(where: str, params: PyTree) -> PyTree:
    leaves, spec = tree_flatten(params)
    _check_tensor_leaves(where, "params", params, leaves)
    with torch.no_grad():
        out = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
    shard_like(leaves, out)  # sharded like the params (funcshard.checkpoint: plain DCP refuses shards)
    return tree_unflatten(spec, out)


def _check_nonneg(name: str, value: float, where: str) -> None:
    if not (isinstance(value, (int, float)) and value >= 0.0):
        raise ValueError(f"{where}: invalid {name} {value!r}; expected a number >= 0.")


def _check_lr(where: str, lr: Any) -> None:
    if callable(lr):
        return
    if isinstance(lr, torch.Tensor):
        raise TypeError(
            f"{where}: lr must be a float or a callable schedule(count) -> float, got a Tensor. "
            f"Fix: pass float(lr), or a schedule returning it."
        )
    _check_nonneg("learning rate", lr, where)


def _checked(update_fn: Callable, check: Callable) -> Callable:
    """``update_fn`` with its input check attached (``update_fn.check(updates, state, params)``, raising what
    ``update_fn`` would raise for bad input): a donating chain or step runs every check before anything changes.
    It refuses tensors of a torch.func transform first (``_untransformed``)."""
    where = f"optim.{update_fn.__qualname__.split('.')[0]}"

    @functools.wraps(update_fn)
    def update(updates, state, *rest, **extra):
        _untransformed(where, updates, rest[0] if rest else extra.get("params"))
        return update_fn(updates, state, *rest, **extra)

    update.check = check
    return update


def _untransformed(where: str, *trees: PyTree) -> None:
    """Refuse tensors of an active torch.func transform: the optimizers run under ``torch.no_grad`` with foreach
    kernels, so under ``grad``/``jvp`` their step would be a constant (an optimizer step inside ``torch.func.grad``,
    as in MAML: measured, the second-order term silently 0) and under ``vmap`` the kernels have no batching rules."""
    if not get_interpreter_stack():
        return
    for tree in trees:
        paths, leaves, _ = tree_flatten_with_path(tree)
        for path, t in zip(paths, leaves):
            if isinstance(t, torch.Tensor) and is_functorch_wrapped_tensor(t):
                from funcshard._primitives import transform_stack

                raise NotImplementedError(
                    f"{where} got {_keystr(path)}, a tensor of the torch.func transform {transform_stack()}: the "
                    f"optimizers run under torch.no_grad with foreach kernels, so their step would not be "
                    f"differentiated (grad/jvp) nor batched (vmap). Take the step outside the transform "
                    f"(grads = torch.func.vmap(torch.func.grad(loss))(...), then tx.update); through an inner step "
                    f"(MAML) write it with torch ops ({{k: p - lr * g}}); for an ensemble call tx.update on the "
                    f"stacked trees outside vmap (elementwise optimizers act per member; clip_by_global_norm would "
                    f"take one norm over all the members)")


def _precheck(tx: Any, updates: PyTree, state: Any, params: PyTree) -> None:
    check = getattr(getattr(tx, "update", None), "check", None)
    if check is not None:
        check(updates, state, params)


# --------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------


def identity() -> GradientTransformation:
    """Pass updates through unchanged (state :class:`EmptyState`)."""

    def init_fn(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        return updates, state

    return GradientTransformation(init_fn, update_fn)


def _scale_leaves(updates: PyTree, factor: float | torch.Tensor, donate: bool = False) -> PyTree:
    leaves, spec = tree_flatten(updates)
    if not leaves:
        return updates
    with torch.no_grad():
        if donate:
            foreach_mul_(leaves, factor)
            return updates
        return tree_unflatten(spec, foreach_mul(leaves, factor))


def scale(step_size: float) -> GradientTransformation:
    """Multiply updates by a constant ``step_size`` (state :class:`ScaleState`).

    Args:
        step_size: the constant factor.
    """

    def init_fn(params: PyTree) -> ScaleState:
        del params
        return ScaleState()

    def update_fn(updates, state, params=None, **extra):
        del params
        _untransformed("optim.scale", updates)
        return _scale_leaves(updates, step_size, extra.get("donate", False)), state

    return GradientTransformation(init_fn, update_fn)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply updates by ``step_size_fn(count)``; ``count`` = updates so far (0 first).

    State :class:`ScaleByScheduleState`.

    Args:
        step_size_fn: ``count -> factor``, a float or a 0-dim tensor.
    """
    if not callable(step_size_fn):
        raise TypeError(f"scale_by_schedule: step_size_fn must be callable, got {type(step_size_fn).__name__}.")

    def init_fn(params: PyTree) -> ScaleByScheduleState:
        del params
        return ScaleByScheduleState(count=0)

    def check(updates, state, params=None):
        _check_state("scale_by_schedule", state, ScaleByScheduleState)

    def update_fn(updates, state, params=None, **extra):
        check(updates, state)
        factor = step_size_fn(state.count)
        return _scale_leaves(updates, factor, extra.get("donate", False)), ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init_fn, _checked(update_fn, check))


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply updates by ``-lr`` (``+lr`` if ``flip_sign=False``).

    A float gives :func:`scale` (state :class:`ScaleState`); a callable
    ``schedule(count)`` gives :func:`scale_by_schedule` (state
    :class:`ScaleByScheduleState`), called with 0 for the first update.

    Args:
        learning_rate: a float, or a schedule ``count -> lr``.
        flip_sign: multiply by ``-lr`` (True, a descent step) or ``+lr``.
    """
    _check_lr("scale_by_learning_rate", learning_rate)
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * float(learning_rate))


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam direction ``m_hat / (sqrt(v_hat) + eps)``, computed exactly as torch does.

    ``m <- lerp(m, g, 1 - b1)``; ``v <- b2 * v + (1 - b2) * g * g``;
    ``out = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`` with ``bc_i = 1 - b_i ** count``
    and ``count`` the step number (1 on the first update), as in
    ``torch.optim.Adam``. State :class:`ScaleByAdamState`; ``mu``/``nu`` have the
    params' structure, shapes and dtypes.

    Args:
        b1: the first moment's decay (torch's ``betas[0]``).
        b2: the second moment's decay (torch's ``betas[1]``).
        eps: added to ``sqrt(v_hat)`` in the denominator.
    """
    where = "scale_by_adam"
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"{where}: invalid beta1 {b1!r}; expected 0 <= beta1 < 1.")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"{where}: invalid beta2 {b2!r}; expected 0 <= beta2 < 1.")
    _check_nonneg("eps", eps, where)

    def init_fn(params: PyTree) -> ScaleByAdamState:
        mu = _zeros_like_tree(where, params)
        nu = _zeros_like_tree(where, params)
        return ScaleByAdamState(count=0, mu=mu, nu=nu)

    def check(updates, state, params=None):
        _check_state(where, state, ScaleByAdamState)
        return _check_moments(where, "updates", updates, state)

    def update_fn(updates, state, params=None, **extra):
        donate = extra.get("donate", False)
        g, spec, mu, nu, mu_spec = check(updates, state)
        state_leaves = mu + nu
        count = state.count + 1
        if not g:
            return updates, ScaleByAdamState(count=count, mu=state.mu, nu=state.nu)
        with torch.no_grad():
            # (donate: the moments and the incoming updates are reused in place)
            mu, nu, denom = _adam_moments(mu, nu, g, b1, b2, (1.0 - b2**count) ** 0.5, eps, donate)
            bias_correction1 = 1.0 - b1**count
            if donate:
                foreach_copy_(g, mu)
                foreach_div_(g, denom)
                out = g
            else:
                out = foreach_div(mu, denom)
            del denom
            foreach_div_(out, bias_correction1)
        if not donate:
            shard_like(state_leaves, mu + nu)
        return tree_unflatten(spec, out), ScaleByAdamState(
            count=count, mu=tree_unflatten(mu_spec, mu), nu=tree_unflatten(mu_spec, nu)
        )

    return GradientTransformation(init_fn, _checked(update_fn, check))


def _adam_moments(mu: list, nu: list, g: list, b1: float, b2: float, bias_correction2_sqrt, eps: float,
                  donate: bool) -> tuple[list, list, list]:
    """Adam's moments and denominator, torch's ``_multi_tensor_adam`` op for op (the one copy: ``scale_by_adam`` and
    ``adamw``'s torch-exact step): ``mu <- lerp(mu, g, 1 - b1)``, ``nu <- b2 * nu + (1 - b2) * g * g`` (in place when
    ``donate``, else new tensors), ``denom = sqrt(nu) / bias_correction2_sqrt + eps``. Returns ``(mu, nu, denom)``."""
    if donate:
        foreach_lerp_(mu, g, 1.0 - b1)
        foreach_mul_(nu, b2)
    else:
        mu, nu = foreach_lerp(mu, g, 1.0 - b1), foreach_mul(nu, b2)
    foreach_addcmul_(nu, g, g, 1.0 - b2)
    denom = foreach_sqrt(nu)
    foreach_div_(denom, bias_correction2_sqrt)
    foreach_add_(denom, eps)
    return mu, nu, denom


def _check_moments(where: str, what: str, updates: PyTree, state: ScaleByAdamState):
    """``updates`` against Adam's moments (both): ``(g, spec, mu, nu, mu_spec)`` flattened."""
    g, spec = tree_flatten(updates)
    mu, mu_spec = tree_flatten(state.mu)
    nu, nu_spec = tree_flatten(state.nu)
    _check_match(where, what, updates, g, spec, "optimizer state", state.mu, mu, mu_spec, _FIX_STATE)
    _check_match(where, what, updates, g, spec, "optimizer state", state.nu, nu, nu_spec, _FIX_STATE)
    if any(x.dtype != m.dtype for x, m in zip(g, mu)):  # (the moments' lerp_ / addcmul_ need the same dtype)
        path, x, m = next((p, x, m) for p, x, m in zip(_paths(updates), g, mu) if x.dtype != m.dtype)
        raise ValueError(
            f"{where}: dtype mismatch at {_keystr(path)}: {what} are {x.dtype} but the optimizer state (made "
            f"from the params by init) is {m.dtype}. Fix: give the {what} the params' dtype (e.g. "
            f"{{k: g.to(params[k].dtype) for k, g in grads.items()}}; funcshard's gradients come in the shards' "
            f"dtype, whatever the reduce_dtype), or init the state from params of the {what}' dtype")
    return g, spec, mu, nu, mu_spec


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """``updates + weight_decay * params`` (needs ``params``; state :class:`AddDecayedWeightsState`).

    Placed before the Adam/momentum statistics this is torch's coupled L2
    penalty (``g += wd * p``); placed after the direction and before
    :func:`scale_by_learning_rate` it is AdamW's decoupled decay
    (``p -= lr * wd * p``).

    Args:
        weight_decay: the factor of ``params`` added to the updates (0: nothing added).
    """
    where = "add_decayed_weights"
    _check_nonneg("weight_decay", weight_decay, where)

    def init_fn(params: PyTree) -> AddDecayedWeightsState:
        del params
        return AddDecayedWeightsState()

    def check(updates, state, params=None):
        if weight_decay == 0.0:
            return None
        _require_params(where, params)
        u, spec = tree_flatten(updates)
        p, p_spec = tree_flatten(params)
        _check_match(where, "updates", updates, u, spec, "params", params, p, p_spec, _FIX_PARAMS)
        return u, spec, p

    def update_fn(updates, state, params=None, **extra):
        if weight_decay == 0.0:
            return updates, state
        u, spec, p = check(updates, state, params)
        if not u:
            return updates, state
        with torch.no_grad():
            if extra.get("donate", False):
                foreach_add_(u, p, alpha=weight_decay)
                return updates, state
            out = foreach_add(u, p, alpha=weight_decay)
        return tree_unflatten(spec, out), state

    return GradientTransformation(init_fn, _checked(update_fn, check))


def trace(decay: float, dampening: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """Torch-style momentum (``torch.optim.SGD``'s buffer; not optax's ``trace``).

    First step: ``buf = g`` (torch initialises the buffer to the first
    gradient, undamped); later ``buf = decay * buf + (1 - dampening) * g``.
    Output ``g + decay * buf`` if ``nesterov`` else ``buf``. State
    :class:`TraceState`; ``trace`` has the params' structure and shapes.

    Args:
        decay: the momentum (torch's ``momentum``).
        dampening: torch's ``dampening``: ``(1 - dampening) * g`` enters the buffer after the first step.
        nesterov: Nesterov momentum: the output is ``g + decay * buf``.
    """
    where = "trace"
    _check_nonneg("momentum", decay, where)
    _check_nonneg("dampening", dampening, where)
    if nesterov and (decay <= 0 or dampening != 0):
        raise ValueError(f"{where}: nesterov momentum requires a momentum > 0 and zero dampening.")

    def init_fn(params: PyTree) -> TraceState:
        return TraceState(count=0, trace=_zeros_like_tree(where, params))

    def check(updates, state, params=None):
        _check_state(where, state, TraceState)
        g, spec = tree_flatten(updates)
        buf, buf_spec = tree_flatten(state.trace)
        _check_match(where, "updates", updates, g, spec, "optimizer state", state.trace, buf, buf_spec, _FIX_STATE)
        return g, spec, buf, buf_spec

    def update_fn(updates, state, params=None, **extra):
        donate = extra.get("donate", False)
        g, spec, buf, buf_spec = check(updates, state)
        if not g:
            return updates, TraceState(count=state.count + 1, trace=state.trace)
        with torch.no_grad():
            if state.count == 0:
                buf = [t.clone() for t in g]  # like torch's grad.detach().clone()
            elif donate:
                foreach_mul_(buf, decay)
                foreach_add_(buf, g, alpha=1.0 - dampening)
            else:
                buf = foreach_mul(buf, decay)
                foreach_add_(buf, g, alpha=1.0 - dampening)
            if donate:  # the returned updates reuse g, never the state (later transforms scale them in place)
                if nesterov:
                    foreach_add_(g, buf, alpha=decay)
                else:
                    foreach_copy_(g, buf)
                out = g
            else:
                out = foreach_add(g, buf, alpha=decay) if nesterov else buf
        shard_like(tree_flatten(state.trace)[0], buf)  # (init's zeros are marked like the params)
        new_state = TraceState(count=state.count + 1, trace=tree_unflatten(buf_spec, buf))
        return tree_unflatten(spec, out), new_state

    return GradientTransformation(init_fn, _checked(update_fn, check))


def _resolve_group(mesh: Any) -> Any:
    """ProcessGroup to reduce over, or ``None`` for no reduction."""
    if mesh is None:
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None
    if hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):  # DeviceMesh: its shard axis (replicas hold the same)
        from funcshard._mesh import shard_group
        return shard_group(mesh)
    return mesh  # a ProcessGroup


def clip_by_global_norm(max_norm: float, *, mesh: Any = None) -> GradientTransformation:
    """Scale updates by ``min(1, max_norm / (global_norm + 1e-6))``, as ``clip_grad_norm_``.

    ``global_norm`` is the L2 norm over all leaves of the *full* (unsharded)
    updates: the local sum of squares (one ``torch._foreach_norm`` call,
    accumulated in float32, or float64 if any leaf is float64) is summed over
    ranks with ONE ``torch.distributed.all_reduce`` of a scalar, then square-
    rooted. Correct because shards are disjoint pieces of the full tensors and
    padding entries are zero. No host-device synchronisation. The all-reduce waits
    at most ``FUNCSHARD_TIMEOUT`` s (else 300) on gloo, as ``funcshard.all_reduce``
    does (``CollectiveTimeout``; the group is refused afterwards).

    ``mesh``: a ``DeviceMesh`` (reduce over its last axis, the shard axis), a
    ``ProcessGroup``, or ``None``: the default group when
    ``torch.distributed.is_initialized()`` (checked at update time), else no
    reduction. State :class:`ClipByGlobalNormState` (empty).

    Args:
        max_norm: the largest global L2 norm the updates keep (>= 0).
        mesh: what the sum of squares is all-reduced over: a ``DeviceMesh`` (its last axis), a ``ProcessGroup``, or None
            (the default group when one is initialised, else no reduction).
    """
    where = "clip_by_global_norm"
    _check_nonneg("max_norm", max_norm, where)

    def init_fn(params: PyTree) -> ClipByGlobalNormState:
        del params
        return ClipByGlobalNormState()

    def check(updates, state, params=None):
        leaves, spec = tree_flatten(updates)
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            _check_tensor_leaves(where, "updates", updates, leaves)
        return leaves, spec

    def update_fn(updates, state, params=None, **extra):
        leaves, spec = check(updates, state)
        if not leaves:
            return updates, state
        devices = {t.device for t in leaves}
        acc = torch.float64 if any(t.dtype == torch.float64 for t in leaves) else torch.float32
        with torch.no_grad():
            norms = foreach_norm(leaves, 2, dtype=acc)
            device = leaves[0].device
            if len(devices) > 1:
                norms = [n.to(device) for n in norms]
            sq = _summed(torch.stack(norms).square().sum(), mesh, "optim.clip_by_global_norm")
            clip_coef = _clip_factor(max_norm, sq)
            if len(devices) > 1:
                out = [u * clip_coef.to(u.device) for u in leaves]
            elif extra.get("donate", False):
                foreach_mul_(leaves, clip_coef)
                return updates, state
            else:
                out = foreach_mul(leaves, clip_coef)
        return tree_unflatten(spec, out), state

    update_fn = _checked(update_fn, check)
    update_fn.reads_all_params = True  # (offload() steps one group at a time: it refuses this inside)
    return GradientTransformation(init_fn, update_fn)


def _summed(sq: torch.Tensor, mesh: Any, what: str) -> torch.Tensor:
    """Local sums of squares ``sq`` summed over ``mesh`` (``_resolve_group``), on ``sq``'s device."""
    group = _resolve_group(mesh)
    if group is None:
        return sq
    device = sq.device
    if sq.device.type == "cpu" and "nccl" in str(dist.get_backend(group)):  # (CPU-offloaded grads)
        sq = sq.to(torch.device("cuda", torch.cuda.current_device()))
    bounded_all_reduce(sq, group, what)
    return sq.to(device)


def _clip_factor(max_norm: float, sq: torch.Tensor) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` of the squared norms ``sq`` (``clip_grad_norm_``'s and Opacus's)."""
    return torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)


def per_example_global_norm_clip(grads: PyTree, max_norm: float, *, mesh: Any = None
                                 ) -> tuple[PyTree, torch.Tensor]:
    """DP-SGD's per-example clipping (optax's ``per_example_global_norm_clip``, Opacus's clip factor) of per-example
    gradients, sharded or not: each example's gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``, ``norm``
    its global L2 norm over the full (unsharded) parameters, and the scaled gradients are summed over the examples.

    ``grads`` has a leading example dim on every leaf, e.g. ``torch.func.vmap(torch.func.grad(loss), in_dims=(None,
    0))(state, examples)`` over sharded state. Each example's local sum of squares (accumulated in float32, float64
    if a leaf is float64) is summed over ranks with ONE all-reduce of the ``(examples,)`` vector over ``mesh``, as
    :func:`clip_by_global_norm` reduces its scalar; the rest is local. Not under a torch.func transform (refused:
    take it outside, on vmap's result).

    Args:
        grads: a pytree of tensors, each ``(examples, *shard shape)``, the same number of examples in every leaf.
        max_norm: the largest per-example global L2 norm kept (>= 0).
        mesh: what the sums of squares are all-reduced over: a ``DeviceMesh`` (its last axis, the shard axis), a
            ``ProcessGroup``, or None (the default group when one is initialised, else no reduction).

    Returns:
        ``(clipped, num_clipped)``: the sum over examples of the clipped gradients (a pytree like ``grads`` without
        the example dim, in each leaf's dtype) and the number of examples whose norm exceeded ``max_norm`` (a 0-dim
        int64 tensor).
    """
    where = "optim.per_example_global_norm_clip"
    _check_nonneg("max_norm", max_norm, where)
    _untransformed(where, grads)
    paths, leaves, spec = tree_flatten_with_path(grads)
    _check_tensor_leaves(where, "grads", grads, leaves)
    sizes = {tuple(t.shape[:1]) for t in leaves}
    if not leaves or len(sizes) != 1 or sizes == {()} or not next(iter(sizes))[0]:
        shapes = ", ".join(f"{_keystr(p)}: {tuple(t.shape)}" for p, t in zip(paths, leaves)) or "no leaves"
        raise ValueError(f"{where}: every leaf of grads needs the same leading example dim (at least one example), "
                         f"got {shapes}; pass per-example gradients, e.g. torch.func.vmap(torch.func.grad(loss), "
                         f"in_dims=(None, 0))(state, examples)")
    acc = torch.float64 if any(t.dtype == torch.float64 for t in leaves) else torch.float32
    with torch.no_grad():
        device = leaves[0].device
        sq = sum(t.reshape(t.shape[0], -1).to(device, acc).square().sum(1) for t in leaves)
        sq = _summed(sq, mesh, where)
        factor = _clip_factor(max_norm, sq)
        clipped = [torch.einsum("i,i...->...", factor.to(t.device, t.dtype), t) for t in leaves]
        num_clipped = (sq.sqrt() > max_norm).sum()
    return tree_unflatten(spec, clipped), num_clipped


__all__ += ["per_example_global_norm_clip"]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations left to right; state is a tuple of their states.

    Args:
        *transforms: the :class:`GradientTransformation`s, applied left to right.
    """
    for i, t in enumerate(transforms):
        if not (hasattr(t, "init") and hasattr(t, "update")):
            raise TypeError(f"chain: argument {i} is a {type(t).__name__}, not a GradientTransformation.")

    state_class = chain_state_class(len(transforms))

    def init_fn(params: PyTree) -> tuple[Any, ...]:
        return state_class(*(t.init(params) for t in transforms))

    def check(state):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = f"a tuple of {len(state)}" if isinstance(state, tuple) else type(state).__name__
            raise ValueError(
                f"chain: expected opt_state as a tuple of {len(transforms)} inner states, got {got}. "
                f"Fix: pass the state returned by this chain's init() (or by its previous update())."
            )

    def check_all(updates, state, params=None):
        check(state)
        for t, s in zip(transforms, state):  # (each transform keeps the updates' structure and shapes)
            _precheck(t, updates, s, params)

    def update_fn(updates, state, params=None, **extra):
        if extra.get("donate", False):
            check_all(updates, state, params)  # check first, then donate
        else:
            check(state)
        new_states = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params, **extra)
            new_states.append(s)
        return updates, state_class(*new_states)

    update_fn = _checked(update_fn, check_all)
    update_fn.reads_all_params = any(getattr(t.update, "reads_all_params", False) for t in transforms)
    last = transforms[-1] if transforms else None
    if not isinstance(last, TorchOptimizer):
        return _chain_owners(GradientTransformation(init_fn, update_fn), transforms)

    def check_exact(grads, state, params):
        check(state)
        for t, s in zip(transforms[:-1], state[:-1]):
            _precheck(t, grads, s, params)
        last.exact.check(grads, state[-1], params)

    def exact(grads, state, params, donate=False):  # the transforms before the optimizer, then its exact step
        if donate:
            check_exact(grads, state, params)
        else:
            check(state)
        new_states = []
        for t, s in zip(transforms[:-1], state[:-1]):
            grads, s = t.update(grads, s, params, donate=donate)
            new_states.append(s)
        params, s = last.exact(grads, state[-1], params, donate=donate)
        return params, state_class(*new_states, s)

    return _chain_owners(_torch_optimizer(GradientTransformation(init_fn, update_fn), _checked(exact, check_exact),
                                          last.torch_param_group), transforms)


# --------------------------------------------------------------------------
# named optimizers
# --------------------------------------------------------------------------


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> GradientTransformation:
    """``torch.optim.SGD``: ``chain(add_decayed_weights(wd), trace(...), scale_by_learning_rate(lr))``.

    Coupled L2 decay ``g += wd * p`` (needs ``params`` in ``update`` when
    ``weight_decay != 0``), torch-style momentum buffer (first step ``buf = g``),
    ``dampening``, ``nesterov``. Without momentum no buffer is kept (the chain
    has two states instead of three).

    Args:
        lr: the learning rate, a float or a schedule ``count -> lr``.
        momentum: torch's ``momentum`` (0: no buffer).
        dampening: torch's ``dampening``.
        weight_decay: coupled L2 decay ``g += wd * p`` (needs ``params`` in ``update``).
        nesterov: Nesterov momentum (needs ``momentum > 0``).
    """
    _check_lr("sgd", lr)
    parts = [add_decayed_weights(weight_decay)]
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("sgd: nesterov momentum requires a momentum > 0 and zero dampening.")
    if momentum != 0.0:
        parts.append(trace(momentum, dampening, nesterov))
    else:
        _check_nonneg("momentum", momentum, "sgd")
    parts.append(scale_by_learning_rate(lr))
    tx = chain(*parts)
    tx_check = _chain_check("sgd", len(parts))

    def check(grads, state, params):
        tx_check(state)
        _check_state("sgd", state[-1], ScaleByScheduleState if callable(lr) else ScaleState)
        g, p, spec = _step_inputs("sgd", grads, params)
        if momentum != 0:
            tr = state[1]
            _check_state("sgd", tr, TraceState)
            buf, buf_spec = tree_flatten(tr.trace)
            _check_match("sgd", "grads", grads, g, spec, "optimizer state", tr.trace, buf, buf_spec, _FIX_STATE)
        return g, p, spec

    def exact(grads, state, params, donate=False):
        """``torch.optim.SGD``'s ``_multi_tensor_sgd``, op for op."""
        g, p, spec = check(grads, state, params)  # everything checked before anything changes
        sched = state[-1]
        lr_t = lr(sched.count) if callable(lr) else lr
        new_states = [state[0]]
        with torch.no_grad():
            if weight_decay != 0:
                g = foreach_add(g, p, alpha=weight_decay)
            owned = donate or weight_decay != 0  # g may be changed in place
            if momentum != 0:
                tr = state[1]
                buf, buf_spec = tree_flatten(tr.trace)
                if tr.count == 0:
                    buf = [t.clone() for t in g]
                    shard_like(p, buf)
                else:
                    if not donate:
                        old, buf = buf, [t.clone() for t in buf]
                        shard_like(old, buf)
                    foreach_mul_(buf, momentum)
                    foreach_add_(buf, g, alpha=1 - dampening)
                if nesterov and owned:
                    foreach_add_(g, buf, alpha=momentum)
                elif nesterov:
                    g = foreach_add(g, buf, alpha=momentum)
                else:
                    g = buf
                new_states.append(TraceState(count=tr.count + 1, trace=tree_unflatten(buf_spec, buf)))
            new = p if donate else [t.clone() for t in p]
            foreach_add_(new, g, alpha=-lr_t)
        if not donate:
            shard_like(p, new)
        new_states.append(ScaleByScheduleState(count=sched.count + 1) if callable(lr) else sched)
        return tree_unflatten(spec, new), chain_state_class(len(new_states))(*new_states)

    def param_group(count):
        return dict(lr=lr(count) if callable(lr) else lr, momentum=momentum, dampening=dampening,
                    weight_decay=weight_decay, nesterov=nesterov, maximize=False, foreach=None,
                    differentiable=False, fused=None)

    return _torch_optimizer(tx, _checked(exact, check), param_group)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> GradientTransformation:
    """``torch.optim.AdamW`` (same defaults and math).

    ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(wd), scale_by_learning_rate(lr))``:
    the delta is ``-lr * (adam_direction + wd * p)``, i.e. torch's
    ``p *= 1 - lr * wd`` on the pre-step param value followed by the Adam step
    with the same ``lr``. Needs ``params`` in ``update`` when
    ``weight_decay != 0``. ``amsgrad`` is not supported.

    Args:
        lr: the learning rate, a float or a schedule ``count -> lr``.
        betas: ``(b1, b2)``: the moments' decays.
        eps: added to ``sqrt(v_hat)``.
        weight_decay: decoupled decay: ``p *= 1 - lr * weight_decay`` (needs ``params`` in ``update``).
    """
    _check_lr("adamw", lr)
    b1, b2 = betas
    tx = chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )
    tx_check = _chain_check("adamw", 3)

    def check(grads, state, params):
        tx_check(state)
        _check_state("adamw", state[0], ScaleByAdamState)
        _check_state("adamw", state[-1], ScaleByScheduleState if callable(lr) else ScaleState)
        g, p, spec = _step_inputs("adamw", grads, params)
        return (p, *_check_moments("adamw", "grads", grads, state[0]))

    def exact(grads, state, params, donate=False):
        """``torch.optim.AdamW``'s ``_multi_tensor_adam`` (decoupled weight decay), op for op."""
        p, g, spec, mu, nu, mu_spec = check(grads, state, params)  # everything checked before anything changes
        adam, sched = state[0], state[-1]
        lr_t = lr(sched.count) if callable(lr) else lr
        count = adam.count + 1
        with torch.no_grad():
            new = p if donate else [t.clone() for t in p]
            if weight_decay != 0:
                foreach_mul_(new, 1 - lr_t * weight_decay)
            old = mu + nu
            bias_correction2 = 1 - b2 ** float(count)  # torch: beta ** step.item(), step a float tensor
            mu, nu, denom = _adam_moments(mu, nu, g, b1, b2, bias_correction2**0.5, eps, donate)
            if not donate:
                shard_like(old, mu + nu)
            bias_correction1 = 1 - b1 ** float(count)
            step_size = (lr_t / bias_correction1) * -1
            foreach_addcdiv_(new, mu, denom, [step_size] * len(new))
        if not donate:
            shard_like(p, new)
        new_sched = ScaleByScheduleState(count=sched.count + 1) if callable(lr) else sched
        adam = ScaleByAdamState(count=count, mu=tree_unflatten(mu_spec, mu), nu=tree_unflatten(mu_spec, nu))
        return tree_unflatten(spec, new), chain_state_class(3)(adam, state[1], new_sched)

    def param_group(count):
        return dict(lr=lr(count) if callable(lr) else lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                    amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                    decoupled_weight_decay=True)

    return _torch_optimizer(tx, _checked(exact, check), param_group)


def _chain_check(where: str, n: int) -> Callable[[Any], None]:
    def check(state):
        if not isinstance(state, tuple) or len(state) != n:
            raise ValueError(f"{where}: expected opt_state as a tuple of {n} inner states, got "
                             f"{type(state).__name__}. Fix: pass the state returned by this optimizer's init() "
                             f"(or by its previous update() or step()).")
    return check


def _torch_optimizer(tx: GradientTransformation, exact: Callable, param_group: Callable) -> TorchOptimizer:
    out = TorchOptimizer(tx.init, tx.update)
    out.exact, out.torch_param_group = exact, param_group
    return out


def _step_inputs(where: str, grads: PyTree, params: PyTree):
    """Flattened grads and params of :func:`step` (checked against each other)."""
    g, spec = tree_flatten(grads)
    _check_tensor_leaves(where, "grads", grads, g)
    _require_params(where, params)
    p, p_spec = tree_flatten(params)
    _check_match(where, "grads", grads, g, spec, "params", params, p, p_spec, _FIX_PARAMS)
    return g, p, spec


def step(tx: GradientTransformation, grads: PyTree, opt_state: Any, params: PyTree, *,
         donate: bool = False) -> tuple[PyTree, Any]:
    """One optimizer step: ``(new_params, new_opt_state)``.

    For a :class:`TorchOptimizer` (:func:`adamw`, :func:`sgd`, a :func:`chain` ending in one) this is torch's
    ``optimizer.step()`` bit for bit (its multi-tensor op order: torch updates the parameters with fused ops such as
    ``addcdiv(p, m, denom, -lr / bc1)`` that no additive ``updates`` tree reproduces exactly), so a run moves between
    ``torch.optim`` and ``funcshard.optim`` without a difference. Otherwise
    ``apply_updates(params, tx.update(grads, opt_state, params)[0])``. ``donate=True``: ``params``, ``opt_state``
    and ``grads`` are reused in place.

    Args:
        tx: the optimizer.
        grads: the gradients, a pytree like ``params``.
        opt_state: ``tx``'s state.
        params: the parameters.
        donate: reuse ``params``, ``opt_state`` and ``grads`` in place.
    """
    exact = getattr(tx, "exact", None)
    if exact is not None:
        return exact(grads, opt_state, params, donate=donate)
    if donate:  # check first (the update's inputs, and the params apply_updates adds to), then donate
        _precheck(tx, grads, opt_state, params)
        _step_inputs("step", grads, params)
    updates, opt_state = tx.update(grads, opt_state, params, donate=donate)
    return apply_updates(params, updates, donate=donate), opt_state


def apply_updates(params: PyTree, updates: PyTree, *, donate: bool = False) -> PyTree:
    """Return new params ``p + u`` (one ``torch._foreach_add``); inputs are not mutated.

    Updates are cast to each param's dtype. Runs under ``torch.no_grad()``: the
    results do not require grad. ``donate=True`` (JAX's buffer donation): the
    caller gives up ``params``, which are updated in place and returned.

    Args:
        params: the parameters (a pytree of tensors, e.g. the sharded ``state``).
        updates: a pytree of the same structure and shapes (what ``update`` returned).
        donate: update ``params`` in place and return them (the caller gives them up).
    """
    where = "apply_updates"
    _untransformed(f"optim.{where}", params, updates)
    p, spec = tree_flatten(params)
    u, u_spec = tree_flatten(updates)
    _check_match(
        where,
        "updates",
        updates,
        u,
        u_spec,
        "params",
        params,
        p,
        spec,
        "pass the updates returned by tx.update(grads, opt_state, params) for these same params.",
    )
    if not p:
        return params
    with torch.no_grad():
        if any(a.dtype != b.dtype for a, b in zip(p, u)):
            u = [b.to(a.dtype) for a, b in zip(p, u)]
        if donate:
            foreach_add_(p, u)
            return params
        new = foreach_add(p, u)
    shard_like(p, new)
    return tree_unflatten(spec, new)


# --------------------------------------------------------------------------
# optimizer state on the host, stepped on the device
# --------------------------------------------------------------------------


class OffloadState(NamedTuple):
    """:func:`offload`'s state: the inner optimizer's state of each group of parameters, on the host (``pinned``: in
    pinned memory, which ``funcshard.checkpoint.load`` keeps).

    Attributes:
        groups: group name -> the inner optimizer's state of that group's parameters, on the host.
        pinned: whether that state is in pinned host memory.
    """

    groups: dict
    pinned: bool = False

    def group_nbytes(self) -> dict[str, int]:
        """Bytes of each group's state: what an update copies to the device and back (``funcshard.cost`` counts
        them)."""
        return {name: sum(t.numel() * t.element_size() for t in tree_flatten(s)[0] if isinstance(t, torch.Tensor))
                for name, s in self.groups.items()}


torch.serialization.add_safe_globals([OffloadState])
_serve(OffloadState)  # (plain DCP of it: the clear error, as for the other states)


def offload(tx: GradientTransformation, groups: Any, *, pin_memory: bool = True) -> GradientTransformation:
    """``tx`` with its state on the host, stepped on the device one group at a time (what verl and prime-rl add to
    FSDP2, whose ``CPUOffloadPolicy`` steps on the host): each group's state is copied to the gradients' device, ``tx``
    steps it there, and the new state is copied back; the device holds one group's state at a time (on CUDA: two, the
    next group's copy-in overlapping this group's step on a copy stream, the copy-out too).

    ``groups``: a :class:`funcshard.Plan` (its groups' parameters) or a sequence of sequences of keys of the params
    dict; every parameter in exactly one. ``tx`` must work parameter by parameter (``sgd``, ``adamw``, chains of
    them; not ``clip_by_global_norm``, which needs every gradient: chain it before, ``chain(clip, offload(adamw(),
    plan))``). Host state pinned when ``pin_memory`` (needs an accelerator, as for ``CPUOffloadPolicy``). Same numbers
    as ``tx`` bit for bit (element-wise ops, grouped or not); :func:`step` stays torch's step bit for bit. On a CPU
    mesh the host is the device: nothing is copied. ``funcshard.checkpoint`` saves this state as it saves ``tx``'s
    (the same keys: the checkpoints load into either) and loads it back on the host, pinned as it was.

    Args:
        tx: the optimizer to run on the device, parameter by parameter (``sgd``, ``adamw``, chains of them).
        groups: a :class:`funcshard.Plan` (its groups' parameters), or a sequence of sequences of keys of the params
            dict; every parameter in exactly one.
        pin_memory: keep the host state in pinned memory (needs an accelerator).
    """
    where = "optim.offload"
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"{where}: tx must be a GradientTransformation, got {type(tx).__name__}")
    if getattr(tx.update, "reads_all_params", False):
        raise ValueError(f"{where}: tx reads every parameter's gradient at once (clip_by_global_norm), and offload "
                         f"steps one group at a time; chain the clip before it: chain(clip_by_global_norm(...), "
                         f"offload(adamw(...), groups))")

    pinned = check_pin(bool(pin_memory), where, "offload(..., ")
    plan_groups = getattr(groups, "groups", None)
    if plan_groups is not None:
        named = [(g.name, tuple(g.params)) for g in plan_groups if g.params]
    else:
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
            raise TypeError(f"{where}: groups must be a Plan or a sequence of sequences of parameter keys, got "
                            f"{type(groups).__name__}")
        named = [(str(i), tuple(g)) for i, g in enumerate(groups) if len(g)]
    owner: dict[str, str] = {}
    for name, keys in named:
        for k in keys:
            if k in owner:
                raise ValueError(f"{where}: parameter {k!r} is in two groups ({owner[k]} and {name}); put it in one")
            owner[k] = name

    def split(where_: str, what: str, tree: Any) -> dict:
        if not isinstance(tree, dict):
            raise TypeError(f"{where_}: {what} must be a dict of tensors keyed like the groups, got "
                            f"{type(tree).__name__}")
        extra, missing = sorted(set(tree) - set(owner)), sorted(set(owner) - set(tree))
        if extra or missing:
            raise ValueError(f"{where_}: {what} keys differ from the groups': "
                             + "; ".join(x for x in (f"in no group: {extra[:8]}" if extra else "",
                                                     f"missing: {missing[:8]}" if missing else "") if x)
                             + ". Fix: pass the same params dict as to init, and groups that cover it")
        return {name: {k: tree[k] for k in keys} for name, keys in named}

    def host_tree(tree: Any) -> Any:
        leaves, spec = tree_flatten(tree)
        return tree_unflatten(spec, [to_host(t, pinned) if isinstance(t, torch.Tensor) else t for t in leaves])

    def init_fn(params: PyTree) -> OffloadState:
        return OffloadState({name: host_tree(tx.init(sub)) for name, sub in split(where, "params", params).items()},
                            pinned)

    def check(updates, state, params=None):
        if not isinstance(state, OffloadState) or set(state.groups) != {n for n, _ in named}:
            raise ValueError(f"{where}: expected the OffloadState this optimizer's init() returned (groups "
                             f"{[n for n, _ in named][:8]}), got {type(state).__name__}")
        ups = split(where, "updates", updates)
        pars = split(where, "params", params) if params is not None else {n: None for n, _ in named}
        for name, _ in named:
            _precheck(tx, ups[name], state.groups[name], pars[name])
        return ups, pars

    def run(step_group, updates, state, params, donate):
        """``step_group(updates, state, params) -> (out, new_state)`` per group, the state copied in and out."""
        ups, pars = check(updates, state, params)
        device = next((t.device for u in ups.values() for t in u.values()), None)
        outs, new_states, events = {}, {}, []

        def copy_in(name):
            leaves, spec = tree_flatten(state.groups[name])
            idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
            moved, ready = start_to_device([leaves[i] for i in idx], device)
            for i, t in zip(idx, moved):
                leaves[i] = t
            return leaves, spec, idx, ready

        pending = copy_in(named[0][0]) if named else None
        for j, (name, _) in enumerate(named):
            leaves, spec, idx, ready = pending
            pending = copy_in(named[j + 1][0]) if j + 1 < len(named) else None  # (overlaps this group's step)
            ready()
            out, new = step_group(ups[name], tree_unflatten(spec, leaves), pars[name])
            host_leaves, _ = tree_flatten(state.groups[name])
            new_leaves, new_spec = tree_flatten(new)
            tidx = [i for i, t in enumerate(new_leaves) if isinstance(t, torch.Tensor)]
            into = [host_leaves[i] for i in tidx] if donate else None
            copied, event = start_to_host([new_leaves[i] for i in tidx], pinned, into)
            if event is not None:
                events.append(event)
            for i, t in zip(tidx, copied):
                new_leaves[i] = t
            outs[name], new_states[name] = out, tree_unflatten(new_spec, new_leaves)
        for e in events:  # the host state is complete when update returns
            e.synchronize()
        merged = {k: v for name, _ in named for k, v in outs[name].items()}
        order = updates if isinstance(updates, dict) else merged
        return {k: merged[k] for k in order}, OffloadState(new_states, pinned)

    def update_fn(updates, state, params=None, **extra):
        return run(lambda u, s, p: tx.update(u, s, p, **extra), updates, state, params, extra.get("donate", False))

    update_fn = _checked(update_fn, check)
    out = GradientTransformation(init_fn, update_fn)
    if not isinstance(tx, TorchOptimizer):
        return out

    def exact(grads, state, params, donate=False):
        return run(lambda g, s, p: tx.exact(g, s, p, donate=donate), grads, state, params, donate)

    return _torch_optimizer(out, _checked(exact, check), tx.torch_param_group)


# --------------------------------------------------------------------------
# whole-matrix updates over sharded parameters: owner ranks (Muon, Shampoo-like), and routing by label
# --------------------------------------------------------------------------

import math  # noqa: E402

from funcshard import _muon  # noqa: E402
from funcshard._muon import Muon  # noqa: E402
from funcshard._owner import Exchange, Owned, OwnerCollective, Owners, OwnerStep, assign_owners, ns_flops  # noqa: E402
from funcshard._spec import ShardingError  # noqa: E402

__all__ += ["Muon", "MultiTransformState", "OwnerCollective", "OwnerComputeState", "OwnerStep", "Owned", "Owners",
            "multi_transform", "muon", "owner_compute"]


class OwnerComputeState(NamedTuple):
    """State of :func:`owner_compute`. Not sharded like the parameters: each matrix's state lives on its owner only.
    ``funcshard.checkpoint`` saves each matrix's state (tensors) whole under its path, so a load at another world size
    gives each matrix's new owner its state.

    Attributes:
        count: updates so far.
        owned: path -> the whole-matrix state of each matrix this rank owns (``init_state``'s), None without
            ``init_state``.
    """

    count: int
    owned: Any = None


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`.

    Attributes:
        inner_states: label -> the state of that label's transformation (over the parameters with that label).
    """

    inner_states: dict


torch.serialization.add_safe_globals([OwnerComputeState, MultiTransformState])
for _cls in (OwnerComputeState, MultiTransformState):
    _serve(_cls)


class _Owning:
    """A plan's owners and exchanges for the sets of parameters a whole-matrix transformation is given (computed
    once per set of paths: every rank the same table, from the plan's specs in the plan's order)."""

    def __init__(self, plan: Any, where: str, cost: Callable[[tuple[int, ...]], int], matrices: bool):
        if not (hasattr(plan, "specs") and hasattr(plan, "shard_group")):
            raise TypeError(f"{where}: plan= must be a funcshard.Plan (funcshard.plan(model, mesh, ...)), got "
                            f"{type(plan).__name__}")
        self.plan, self.where, self.cost, self.matrices = plan, where, cost, matrices
        self._cache: dict[tuple[str, ...], tuple[Owners, Exchange]] = {}
        self._pos = {k: i for i, k in enumerate(plan.specs)}

    def check(self, tree: Any, what: str) -> dict:
        if not isinstance(tree, dict):
            raise TypeError(f"{self.where}: {what} must be a dict[str, Tensor] keyed by the plan's parameter paths "
                            f"(funcshard.shard(plan)), got {type(tree).__name__}")
        specs = self.plan.specs
        bad = [k for k in tree if k not in specs]
        if bad:
            raise ShardingError(f"{self.where}: {what} keys {bad[:8]} are not parameters of the plan (its parameters: "
                                f"{list(specs)[:8]}...); pass this plan's state (funcshard.shard(plan)) or a subset")
        for k in tree:
            s = specs[k]
            if s.model is not None:
                raise ShardingError(
                    f"{self.where}: parameter {k!r} is model-sharded ({s.describe()}): its whole matrix spans the "
                    f"tensor-parallel ranks too, which this transformation does not assemble. Fix: route it to "
                    f"another optimizer with optim.multi_transform, or plan the model without tensor parallelism")
            if self.matrices and len(s.shape) != 2:
                raise ShardingError(
                    f"{self.where}: parameter {k!r} has shape {tuple(s.shape)}; Muon updates 2-D matrices only. Fix: "
                    f"route embeddings, norms and biases to another optimizer: optim.multi_transform({{'muon': "
                    f"optim.muon(...), 'adamw': optim.adamw(...)}}, labels)")
            t = tree[k]
            if isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(s.local_shape):
                raise ShardingError(f"{self.where}: {what}[{k!r}] has shape {tuple(t.shape)}, not this rank's shard "
                                    f"shape {tuple(s.local_shape)} of {tuple(s.shape)}; pass local shards "
                                    f"(funcshard.shard(plan))")
        return tree

    def get(self, keys: Sequence[str]) -> tuple[Owners, Exchange]:
        """The owners and exchange of ``keys``, taken in the plan's order (the same on every rank), not the order a
        rank's dicts come in: equal-cost matrices get their owners by position, and every rank must agree."""
        pos = self._pos
        keys = tuple(sorted(keys, key=pos.__getitem__))
        hit = self._cache.get(keys)
        if hit is None:
            plan = self.plan
            specs = {k: plan.specs[k] for k in keys}
            owners = assign_owners([(k, s.shape, self.cost(s.shape)) for k, s in specs.items()], plan.world)
            group, rank = plan.shard_group() if plan.world > 1 else (None, 0)
            hit = self._cache[keys] = (owners, Exchange(specs, owners, group, rank, timeout=plan.timeout,
                                                        what=self.where))
        return hit

    def owners(self, params: Any) -> Owners:
        keys = list(params)
        self.check({k: None for k in keys}, "params")
        return self.get(keys)[0]


def owner_compute(fn: Callable[[str, torch.Tensor, Any], tuple[torch.Tensor, Any]], *, plan: Any,
                  init_state: Callable[[str, Any], Any] | None = None,
                  cost: Callable[[tuple[int, ...]], int] | None = None) -> GradientTransformation:
    """A transformation that needs each whole matrix (Shampoo, SOAP, a whole-matrix normalisation): every parameter
    gets an owner rank of the plan's shard axis (longest processing time first over ``cost(shape)``, default ``m *
    n * min(m, n)``), its update (gradient) shards go there (one all-to-all per dtype), ``fn`` runs there on the whole
    matrix, and its result comes back as shards (a second all-to-all). No communication code of your own.

    Args:
        fn: ``fn(path, grad, state) -> (update, new_state)``: ``grad`` the whole matrix (the parameter's global
            shape, the updates' dtype), ``state`` this matrix's state (``init_state``'s; None without it); the update
            must have ``grad``'s shape and dtype (else the owner raises and the other ranks time out).
        plan: the :class:`funcshard.Plan` whose shards the updates are.
        init_state: ``init_state(path, spec) -> state`` for each matrix, held by its owner only
            (:class:`OwnerComputeState`: tensors, in dicts, lists or tuples, for ``funcshard.checkpoint`` to save
            and load it at any world size).
        cost: ``cost(shape) -> FLOPs`` used to balance the owners.

    Returns:
        A :class:`GradientTransformation` with ``owners(params) -> Owners`` (printable: who owns what).
    """
    where = "optim.owner_compute"
    owning = _Owning(plan, where, cost or (lambda s: math.prod(s) * min(s) if s else 1), matrices=False)

    def init_fn(params: PyTree) -> OwnerComputeState:
        owning.check(params, "params")
        if init_state is None:
            return OwnerComputeState(0, None)
        owners, ex = owning.get(list(params))
        return OwnerComputeState(0, {k: init_state(k, plan.specs[k]) for k in owners.owned_by(ex.rank)})

    def check(updates, state, params=None):
        _check_state(where, state, OwnerComputeState)
        owning.check(updates, "updates")

    def update_fn(updates, state, params=None, **extra):
        check(updates, state, params)
        owners, ex = owning.get(list(updates))
        if (state.owned is None) != (init_state is None) or (
                state.owned is not None and set(state.owned) != set(owners.owned_by(ex.rank))):
            raise ValueError(f"{where}: opt_state does not hold this rank's matrices' states; pass the state "
                             f"tx.init(params) returned for these same parameters")
        owned = {}

        def one(k, g):
            u, owned[k] = fn(k, g, state.owned[k] if state.owned is not None else None)
            return u

        with torch.no_grad():
            new = ex.map(updates, one)
        return new, OwnerComputeState(state.count + 1, owned if init_state is not None else None)

    out = GradientTransformation(init_fn, _checked(update_fn, check))
    return _with_owners(out, owning.owners)


class _OwnersTransformation(GradientTransformation):
    """A GradientTransformation with ``owners(params) -> Owners`` (instances carry it, as TorchOptimizer's do)."""


class _OwnersOptimizer(TorchOptimizer):
    """A TorchOptimizer with ``owners(params) -> Owners``."""


def _with_owners(tx: GradientTransformation, owners: Callable, wire_dtype: torch.dtype | None = None,
                 transforms: dict | None = None) -> GradientTransformation:
    """``tx`` with ``owners(params)``; ``wire_dtype``: the dtype its exchange sends (None: the updates'), and, for
    :func:`multi_transform`, ``transforms`` (label -> transformation): what ``funcshard.cost`` reads."""
    out = (_OwnersOptimizer if isinstance(tx, TorchOptimizer) else _OwnersTransformation)(tx.init, tx.update)
    if isinstance(tx, TorchOptimizer):
        out.exact, out.torch_param_group = tx.exact, tx.torch_param_group
    out.owners, out.wire_dtype, out.transforms = owners, wire_dtype, transforms
    return out


def _chain_owners(tx: GradientTransformation, transforms: Sequence[GradientTransformation]) -> GradientTransformation:
    """A :func:`chain`'s ``tx`` with the ``owners`` of the whole-matrix transformation in it (what the plan's printout
    and ``funcshard.cost`` read), and its last transformation's torch ``param_groups`` (:func:`multi_transform`'s);
    ``tx`` itself when none has owners. Two with owners: ``owners`` raises, naming them."""
    last = transforms[-1] if transforms else None
    if getattr(last, "torch_param_groups", None) is not None:
        tx.torch_param_groups = last.torch_param_groups
    owning = [i for i, t in enumerate(transforms) if getattr(t, "owners", None) is not None]
    if not owning:
        return tx
    if len(owning) > 1:
        def owners(params):
            raise ValueError(f"chain: transformations {owning} each have owner ranks; their tables are each one's: "
                             f"call owners() (or Plan.with_optimizer, cost.owner_costs) on each of them")
        return _with_owners(tx, owners)
    t = transforms[owning[0]]
    out = _with_owners(tx, t.owners, t.wire_dtype, t.transforms)
    if getattr(tx, "torch_param_groups", None) is not None:
        out.torch_param_groups = tx.torch_param_groups
    return out


def muon(
    lr: ScalarOrSchedule = 1e-3,
    *,
    plan: Any,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = _muon.DEFAULT_NS_COEFFICIENTS,
    eps: float = _muon.EPS,
    ns_steps: int = _muon.NS_STEPS,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """``torch.optim.Muon`` (torch 2.13: same arguments, defaults and op order) over sharded 2-D parameters.

    The momentum buffer (torch's ``momentum_buffer``, state :class:`TraceState`: ``count`` steps taken, ``trace``
    the buffers) is sharded like the parameters, and the momentum and the parameter update run on the shards; only
    Newton-Schulz needs each whole matrix: its bfloat16 update goes to its owner rank (longest processing time over
    Newton-Schulz FLOPs; ``tx.owners(params)`` prints the table), which orthogonalizes it and sends the shards back
    (``owner_compute``'s exchange: two all-to-alls per step). :func:`step` is torch's ``Muon.step`` bit for bit
    (``p.mul_(1 - lr * wd)``, ``p.add_(O, alpha=-adjusted_lr)``) at any world size, given the same full gradients;
    ``update`` + :func:`apply_updates` gives ``-lr * wd * p - adjusted_lr * O`` (within rounding). ``adjusted_lr``
    reads the parameter's global shape. Non-2-D parameters raise naming the path: route them to another optimizer
    with :func:`multi_transform`. For a bfloat16 parameter with ``nesterov=False`` the buffer is not normalised in
    place as torch's is (see ``funcshard/_muon.py``).

    Args:
        lr: learning rate (a float, or a schedule ``schedule(count)``).
        plan: the :class:`funcshard.Plan` whose shards the params are.
        weight_decay: decoupled decay: ``p *= 1 - lr * weight_decay`` (needs ``params`` in ``update``).
        momentum: the momentum buffer's decay (``buf.lerp_(grad, 1 - momentum)``).
        nesterov: Nesterov momentum (orthogonalize ``grad.lerp(buf, momentum)`` rather than ``buf``).
        ns_coefficients: Newton-Schulz's ``(a, b, c)``.
        eps: the floor of the norm the update is divided by before Newton-Schulz.
        ns_steps: Newton-Schulz iterations (``0 <= ns_steps < 100``).
        adjust_lr_fn: the learning rate's scaling by the matrix's global shape ``(rows, cols)``: None or
            ``"original"``: ``sqrt(max(1, rows / cols))``; ``"match_rms_adamw"``: ``0.2 * sqrt(max(rows, cols))``.

    Returns:
        A :class:`TorchOptimizer` with ``owners(params) -> Owners``.
    """
    where = "optim.muon"
    _muon.check_hyper(where, lr, momentum, weight_decay, ns_coefficients, ns_steps, adjust_lr_fn)
    _check_lr(where, lr)
    owning = _Owning(plan, where, lambda s: ns_flops(s, ns_steps), matrices=True)

    def init_fn(params: PyTree) -> TraceState:
        owning.check(params, "params")
        return TraceState(count=0, trace=_zeros_like_tree(where, params))

    def check(updates, state, params=None, need_params=False):
        _check_state(where, state, TraceState)
        owning.check(updates, "updates")
        g, spec = tree_flatten(updates)
        buf, buf_spec = tree_flatten(state.trace)
        _check_match(where, "updates", updates, g, spec, "optimizer state", state.trace, buf, buf_spec, _FIX_STATE)
        keys = list(updates)  # (every rank's order; tree_flatten sorts a dict's keys)
        p = None
        if need_params or weight_decay != 0:
            _require_params(where, params)
            p, p_spec = tree_flatten(params)
            _check_match(where, "updates", updates, g, spec, "params", params, p, p_spec, _FIX_PARAMS)
            p = [params[k] for k in keys]
        return keys, [updates[k] for k in keys], [state.trace[k] for k in keys], p

    def core(keys, g, buf, donate):
        """The momentum (sharded) and Newton-Schulz (on the owners): the new buffers and the bfloat16 shards."""
        _, ex = owning.get(keys)
        if not donate:
            old, buf = buf, [t.clone() for t in buf]
            shard_like(old, buf)
        upd = _muon.momentum_update(g, buf, momentum, nesterov)
        ortho = _muon.orthogonalize(ex, dict(zip(keys, upd)), ns_coefficients, ns_steps, eps)
        return buf, [ortho[k] for k in keys], [plan.specs[k].shape for k in keys]

    def update_fn(updates, state, params=None, **extra):
        donate = extra.get("donate", False)
        keys, g, buf, p = check(updates, state, params)
        lr_t = lr(state.count) if callable(lr) else lr
        with torch.no_grad():
            buf, ortho, shapes = core(keys, g, buf, donate)
            out = []
            for i, (o, shape) in enumerate(zip(ortho, shapes)):
                u = g[i].copy_(o) if donate else o.to(g[i].dtype)
                u.mul_(-_muon.adjust_lr(lr_t, adjust_lr_fn, shape))
                if weight_decay != 0:
                    u.add_(p[i], alpha=-lr_t * weight_decay)
                out.append(u)
        return dict(zip(keys, out)), TraceState(count=state.count + 1, trace=dict(zip(keys, buf)))

    def exact(grads, state, params, donate=False):
        """``torch.optim.Muon.step`` op for op (its ``_single_tensor_muon``)."""
        keys, g, buf, p = check(grads, state, params, need_params=True)
        lr_t = lr(state.count) if callable(lr) else lr
        with torch.no_grad():
            buf, ortho, shapes = core(keys, g, buf, donate)
            new = p if donate else [t.clone() for t in p]
            _muon.apply_muon(new, ortho, shapes, lr_t, weight_decay, adjust_lr_fn)
        if not donate:
            shard_like(p, new)
        new = dict(zip(keys, new))
        return {k: new[k] for k in params}, TraceState(count=state.count + 1, trace=dict(zip(keys, buf)))

    def param_group(count):
        return dict(lr=lr(count) if callable(lr) else lr, weight_decay=weight_decay, momentum=momentum,
                    nesterov=nesterov, ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                    adjust_lr_fn=adjust_lr_fn)

    tx = GradientTransformation(init_fn, _checked(update_fn, lambda u, s, p=None: check(u, s, p)))
    return _with_owners(_torch_optimizer(tx, _checked(exact, lambda g, s, p: check(g, s, p, True)), param_group),
                        owning.owners, torch.bfloat16)


def multi_transform(transforms: dict[str, GradientTransformation], labels: Any, *,
                    plan: Any = None) -> GradientTransformation:
    """One optimizer from several, each parameter routed to one by its label (optax's ``multi_transform``), e.g.
    ``multi_transform({"muon": optim.muon(0.02, plan=plan), "adamw": optim.adamw(3e-4)}, labels)``.

    Args:
        transforms: label -> transformation. Each is given the params (grads, state) with its label only, as a dict.
        labels: a dict path -> label for every parameter, or ``labels(path, x) -> label`` where ``x`` is the
            parameter's :class:`ShardSpec` when ``plan`` is given (its global ``shape``: ``len(x.shape) == 2`` picks
            matrices in any layout), else the tensor (the params' at ``init``, the updates' at ``update``).
        plan: the :class:`funcshard.Plan`, for a callable ``labels``.

    Returns:
        A :class:`GradientTransformation` (state :class:`MultiTransformState`) over ``dict[str, Tensor]`` params; a
        :class:`TorchOptimizer` when every transformation is one (:func:`step` runs each one's exact step). When
        each transformation knows its torch hyperparameters (``optim.muon``, ``optim.adamw``, ``optim.sgd``), a
        checkpoint holds torch's ``param_groups`` of one torch optimizer per label (``torch_param_groups``), as
        ``get_optimizer_state_dict(model, [torch.optim.Muon(...), torch.optim.AdamW(...)])`` writes them, so FSDP2
        with those optimizers loads it (``set_optimizer_state_dict(model, [muon, adamw], ...)``: each label's
        learning rate and betas too). ``owners(params)`` gives each labelled whole-matrix transformation's
        :class:`Owners` (label -> Owners). Works in :func:`chain`, with ``donate=True`` (every transformation's
        inputs checked before any is donated) and with ``funcshard.checkpoint``.
    """
    where = "optim.multi_transform"
    if not isinstance(transforms, dict) or not transforms:
        raise TypeError(f"{where}: transforms must be a non-empty dict label -> GradientTransformation")
    for name, t in transforms.items():
        if not (hasattr(t, "init") and hasattr(t, "update")):
            raise TypeError(f"{where}: transforms[{name!r}] is a {type(t).__name__}, not a GradientTransformation")
    if not (isinstance(labels, dict) or callable(labels)):
        raise TypeError(f"{where}: labels must be a dict path -> label or a callable (path, spec_or_tensor) -> label, "
                        f"got {type(labels).__name__}")
    cache: dict[tuple[str, ...], dict[str, str]] = {}

    def label_of(tree: Any, what: str) -> dict[str, str]:
        if not isinstance(tree, dict):
            raise TypeError(f"{where}: {what} must be a dict[str, Tensor] (funcshard.shard(plan)), got "
                            f"{type(tree).__name__}")
        keys = tuple(tree)
        hit = cache.get(keys)
        if hit is not None:
            return hit
        out = {}
        for k in keys:
            if isinstance(labels, dict):
                if k not in labels:
                    raise ValueError(f"{where}: parameter {k!r} has no label; give every parameter one of "
                                     f"{list(transforms)} in labels")
                lab = labels[k]
            else:
                if plan is not None and k not in plan.specs:
                    raise ShardingError(f"{where}: {what} key {k!r} is not a parameter of the plan")
                lab = labels(k, plan.specs[k] if plan is not None else tree[k])
            try:
                known = lab in transforms
            except TypeError:  # (an unhashable label: a list, a dict)
                known = False
            if not known:
                raise ValueError(f"{where}: parameter {k!r} is labelled {lab!r}, which names no transformation; the "
                                 f"labels are {list(transforms)}. Fix: return one of them for it")
            out[k] = lab
        if len(cache) < 64:
            cache[keys] = out
        return out

    def split(tree: dict, labs: dict[str, str]) -> dict[str, dict]:
        parts: dict[str, dict] = {name: {} for name in transforms}
        for k, v in tree.items():
            parts[labs[k]][k] = v
        return parts

    def init_fn(params: PyTree) -> MultiTransformState:
        parts = split(params, label_of(params, "params"))
        return MultiTransformState({name: t.init(parts[name]) for name, t in transforms.items()})

    def check_state(state):
        if not isinstance(state, MultiTransformState) or set(state.inner_states) != set(transforms):
            raise ValueError(f"{where}: expected the MultiTransformState this optimizer's init() returned (labels "
                             f"{list(transforms)}), got {type(state).__name__}")

    def split_all(updates, state, params):
        check_state(state)
        labs = label_of(updates, "updates")
        ups = split(updates, labs)
        if params is not None:
            if not isinstance(params, dict) or set(params) != set(updates):
                raise ValueError(f"{where}: params must be a dict with the updates' keys; {_FIX_PARAMS}")
            pars = split(params, labs)
        else:
            pars = {name: None for name in transforms}
        return ups, pars

    def check_all(updates, state, params=None):
        ups, pars = split_all(updates, state, params)
        for name, t in transforms.items():
            _precheck(t, ups[name], state.inner_states[name], pars[name])

    def update_fn(updates, state, params=None, **extra):
        if extra.get("donate", False):
            check_all(updates, state, params)  # check first, then donate
        ups, pars = split_all(updates, state, params)
        outs, new = {}, {}
        for name, t in transforms.items():
            outs[name], new[name] = t.update(ups[name], state.inner_states[name], pars[name], **extra)
        labs = label_of(updates, "updates")
        return {k: outs[labs[k]][k] for k in updates}, MultiTransformState(new)

    def owners(params):
        if not isinstance(params, dict):
            if callable(labels) and plan is None:
                raise TypeError(f"{where}: owners() of a list of paths needs plan= (the callable labels are given "
                                f"each parameter's spec, or without a plan its tensor): pass the params dict "
                                f"(tx.owners(state)), or give multi_transform plan=")
            params = {k: None for k in params}
        labs = label_of(params, "params")
        return {name: t.owners([k for k in labs if labs[k] == name]) for name, t in transforms.items()
                if hasattr(t, "owners")}

    def torch_param_groups(count, params):
        """torch's ``param_groups`` of the labels' optimizers, one after another (``get_optimizer_state_dict(model,
        [opt_a, opt_b])``'s): each label's group(s) with its hyperparameters at ``count`` and its parameters among
        ``params`` (path -> shard, in their order; with a dict ``labels``, those it labels: a checkpoint's parameters
        without optimizer state are every parameter, frozen ones too); a label given none of them has no group."""
        if isinstance(labels, dict):
            params = {k: v for k, v in params.items() if k in labels}
        labs = label_of(params, "params")
        out = []
        for name, t in transforms.items():
            mine = {k: params[k] for k in params if labs[k] == name}
            if not mine:
                continue
            many = getattr(t, "torch_param_groups", None)
            out += many(count, mine) if many is not None else [{**t.torch_param_group(count), "params": list(mine)}]
        return out

    tx = _with_owners(GradientTransformation(init_fn, _checked(update_fn, check_all)), owners,
                      transforms=dict(transforms))
    if all(getattr(t, "torch_param_groups", None) is not None or getattr(t, "torch_param_group", None) is not None
           for t in transforms.values()):
        tx.torch_param_groups = torch_param_groups
    if not all(isinstance(t, TorchOptimizer) for t in transforms.values()):
        return tx

    def check_exact(grads, state, params):
        ups, pars = split_all(grads, state, params)
        _require_params(where, params)
        for name, t in transforms.items():
            t.exact.check(ups[name], state.inner_states[name], pars[name])
        return ups, pars

    def exact(grads, state, params, donate=False):
        ups, pars = check_exact(grads, state, params) if donate else split_all(grads, state, params)
        outs, new = {}, {}
        for name, t in transforms.items():
            outs[name], new[name] = t.exact(ups[name], state.inner_states[name], pars[name], donate=donate)
        labs = label_of(grads, "grads")
        return {k: outs[labs[k]][k] for k in params}, MultiTransformState(new)

    out = _with_owners(_torch_optimizer(tx, _checked(exact, check_exact), None), owners, transforms=dict(transforms))
    out.torch_param_groups = getattr(tx, "torch_param_groups", None)
    return out
