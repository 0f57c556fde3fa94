"""The public differentiable collectives: ``funcshard.all_gather`` / ``reduce_scatter`` / ``all_reduce``, and the
rules of which torch.func transforms the sharded gather supports.

all_gather and reduce_scatter are each other's transpose: the backward of all_gather is a reduce-scatter
with a *sum* (the mathematical transpose), and vice versa; all_reduce (sum) is its own transpose. None of
them averages: data-parallel averaging is one explicit divide, applied by the runtime after the gradient
reduce-scatter (``_pipeline.PendingReduce.finish``), never inside these functions. The three are one
``autograd.Function`` (``_Collective``) parametrized by the collective and its transpose, with its jvp (the collective
of the tangent) and vmap (the batch dim moved off dim 0) rules. Their waits are ``_collectives.wait_work``'s.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

from funcshard._collectives import (
    all_gather_into,
    bounded_all_reduce,
    no_functorch,
    public_where,
    reduce_scatter_into,
    wait_work,
)
from funcshard._compat import (TransformType, assume_constant_result, dispatch_keys, get_interpreter_stack,
                              never_inlined)
from funcshard._mesh import shard_group
from funcshard._spec import ShardSpec, from_split, unpad

__all__ = ["all_gather", "reduce_scatter", "all_reduce"]  # (and, internal: a bucket's composable gather)


def transform_stack(stack=None) -> str:
    """The active torch.func transforms, outermost first, written as calls: ``vmap(grad(...))``."""
    stack = get_interpreter_stack() if stack is None else stack
    names = [str(i.key()).rsplit(".", 1)[-1].lower() for i in stack or ()]
    return "".join(f"{n}(" for n in names) + "..." + ")" * len(names)


_TRANSFORM_NAMES = {TransformType.Grad: "grad/vjp/grad_and_value", TransformType.Jvp: "jvp"}


def check_transforms(what: str, kinds=(TransformType.Grad, TransformType.Jvp), fix: str = "") -> None:
    """The sharded gather's rules are first-order: one torch.func level of ``kinds`` (grad/vjp or jvp), or none.

    Its backward reduce-scatters plain tensors, so an outer transform would see no dependence (nested grad:
    wrong second derivatives) or per-example gradients folded into one (vmap over grad). Refuse instead.
    """
    stack = get_interpreter_stack()
    if not stack:
        return
    found = [i.key() for i in stack]
    if len(found) == 1 and found[0] in kinds:
        return
    names = " inside ".join(str(k).rsplit(".", 1)[-1].lower() for k in reversed(found))
    raise NotImplementedError(
        f"{what} runs under a single torch.func {' or '.join(_TRANSFORM_NAMES[k] for k in kinds)} transform; it was "
        f"called under {names} ({transform_stack(stack)}). Nested transforms through the sharded gather (hessians, "
        f"vmap over grad, jacrev of grad) are not built yet: {fix}take first-order gradients with funcshard, or "
        f"gather the parameters (funcshard.gather) and apply the nested transform to the unsharded function"
    )


_DIVIDED = ("each gather's backward divides the reduce-scattered gradient by the plan's factor, so a derivative "
            "path through two gathers of the parameters (a gradient differentiated again: grad(grad(...)), MAML, "
            "jacrev(jacrev(...)), autograd.grad(create_graph=True) then backward) would be divided twice. Plan with "
            "grad_divide_factor=1.0 (gradients are then sums over ranks, exact at every order; divide the loss by the "
            "number of ranks to get the mean's), or use funcshard.gather (sums), or take a single reverse level "
            "(vmap(grad), jvp(grad), jacfwd(jacrev), hessian compose with the factor)")


_REPLICATED = ("the gradient's sum over HSDP's replicate axis (an all-reduce in each gather's backward) would be "
               "taken again on cotangents that are already the replicas' sum (a derivative path through two gathers: "
               "grad(grad(...)), MAML, a create_graph=True gradient differentiated again): measured, MAML's "
               "second-order term came out twice the reference's on 2 replicas. Use a mesh without a replicate axis "
               "(FSDP over every data-parallel rank) for second order, or a single reverse level (vmap(grad), "
               "jvp(grad), hessian compose)")


def check_reverse_levels(what: str, factor: float, replicated: bool = False) -> None:
    """A gradient divided by ``factor`` at each gather is only the derivative of the ranks' mean loss at one reverse
    level, and a sum over replicas at each gather only the replicas' at one: refuse two or more torch.func grad/vjp
    levels when ``factor != 1`` or ``replicated``."""
    stack = get_interpreter_stack()
    if (factor != 1.0 or replicated) and stack and sum(i.key() == TransformType.Grad for i in stack) >= 2:
        why = (f"with a gradient divide factor of {factor:g}: {_DIVIDED}" if factor != 1.0
               else f"over HSDP: {_REPLICATED}")
        raise NotImplementedError(f"{what} under {transform_stack(stack)} {why}")


def divided_twice(what: str, factor: float, replicated: bool = False) -> str:
    """The refusal of a create_graph=True gradient differentiated again through a gather that divides by ``factor``
    or sums over replicas."""
    why = f"with a gradient divide factor of {factor:g}: {_DIVIDED}" if factor != 1.0 else f"over HSDP: {_REPLICATED}"
    return (f"{what}: a gradient taken with create_graph=True was differentiated again (or a torch.func gradient "
            f"differentiated by autograd), {why}")


def check_backward_transforms(what: str) -> None:
    """The same rule for the backward: a vjp function called under vmap (torch.func.jacrev, vmap over
    vjp_fn) hands the sharded gather batched cotangents, which its reduce-scatter would fold together."""
    stack = get_interpreter_stack()
    if stack and any(i.key() == TransformType.Vmap for i in stack):
        raise NotImplementedError(
            f"the backward of {what} ran under vmap (torch.func.jacrev or jacfwd over it, or vmap over a vjp "
            f"function): batched cotangents through the sharded gather are not built yet. Call the vjp function "
            f"once per cotangent, or gather the parameters (funcshard.gather) and take the jacobian of the "
            f"unsharded function"
        )


def check_batched_grads(what: str, grads, *, vmapped: bool = True) -> None:
    """Plain autograd's batched backward (torch.autograd.grad(..., is_grads_batched=True)) hands the sharded
    gather batched gradients (a dispatch key, not a torch.func level): refuse them as vmap's. ``vmapped=False``:
    refuse only those (the public collectives' vmap rules take torch.func's batched gradients)."""
    g = next((g for g in grads if g is not None), None)
    keys = "" if g is None else repr(dispatch_keys(g))  # (the keys are not in Python's enum)
    if re.search(r"\bBatched\b" if not vmapped else "Batched", keys):
        raise NotImplementedError(
            f"the backward of {what} got batched gradients (torch.autograd.grad(..., is_grads_batched=True)): "
            f"batched cotangents through the sharded gather are not built yet; call torch.autograd.grad once per "
            f"cotangent (retain_graph=True), or use torch.func.vmap over torch.func.vjp's function")


def _group_of(where) -> dist.ProcessGroup:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(where, DeviceMesh):
        return shard_group(where)
    return where if where is not None else dist.group.WORLD


# ---- differentiable collectives (dim 0; under autograd and torch.func) --------------------------
#
# Complete torch.func primitives, as JAX's: forward runs the raw c10d call on plain tensors (functorch has unwrapped
# every level by then); backward is the transposed collective's own Function.apply (so it is differentiable again:
# derivatives of any order, torch.autograd.grad(create_graph=True)); jvp is the collective of the tangent (they are
# linear); vmap moves the batch dim off dim 0 (to dim 1) and issues one collective for the whole batch.


def _dim0(x: torch.Tensor, what: str) -> None:
    if x.dim() == 0:
        raise ValueError(f"{what} works on dim 0 and got a 0-dim tensor; reshape it to (1,) first")


def _ag(x: torch.Tensor, group, what: str = "funcshard.all_gather") -> torch.Tensor:
    _dim0(x, what)
    w = dist.get_world_size(group)
    where = public_where("all-gather", what, group)
    x = x.contiguous()
    out = x.new_empty((w * x.shape[0], *x.shape[1:]))
    wait_work(all_gather_into(out, x, group), where)
    return out


def _rs(x: torch.Tensor, group, what: str = "funcshard.reduce_scatter") -> torch.Tensor:
    _dim0(x, what)
    w = dist.get_world_size(group)
    if x.shape[0] % w:
        raise ValueError(
            f"{what} needs dim 0 divisible by the group size {w}, got shape {tuple(x.shape)}; pad it"
        )
    where = public_where("reduce-scatter", what, group)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // w, *x.shape[1:]))
    wait_work(reduce_scatter_into(out, x, group), where)
    return out


def _ar(x: torch.Tensor, group, what: str = "funcshard.all_reduce") -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    bounded_all_reduce(out, group, what)
    return out


def _batched(fn, x: torch.Tensor, bdim, group, what: str):
    """vmap rule of a dim-0 collective: the batch dim moved to 1, so dim 0 stays the collective's; one collective for
    the whole batch, its output batched on dim 1."""
    if bdim is None:
        return fn(x, group), None
    if x.dim() < 2:  # (a 0-dim tensor per example: the collective has no dim 0)
        _dim0(x.select(bdim, 0), what)
    return fn(x.movedim(bdim, 1), group), 1


def _raw_grads(what: str, g: torch.Tensor) -> None:
    check_batched_grads(what, (g,), vmapped=False)


_UNTRACED = ("funcshard's differentiable collectives (funcshard.all_gather / reduce_scatter / all_reduce, and "
             "traced_apply's or apply's gather under a torch.func transform) run eagerly: raw c10d calls on plain "
             "tensors. Under torch.compile, a torch.func transform through them runs eagerly (this graph break inside "
             "it), and torch.compile(..., fullgraph=True) refuses it. For one graph, compile the first-order step "
             "(funcshard.value_and_grad(torch.compile(loss_fn, fullgraph=True)) with loss_fn calling "
             "funcshard.traced_apply), or call the torch.func transform outside torch.compile")


def untraced(fn):
    """``fn``, never traced by dynamo: a call to it in traced code is a graph break naming ``_UNTRACED``
    (``never_inlined``), and it runs with dynamo off (``torch.compiler.disable(recursive=True)``, made at its first
    call once torch._dynamo is loaded: ``import funcshard`` loads no dynamo). Dynamo compiles every Python frame a
    compiled function runs, the frames of an eager torch.func transform it falls back to included (a collective's
    backward, jvp and vmap rules): each would trace as far as the raw c10d work, warn and fall back."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn, recursive=True, reason=_UNTRACED)
        return disabled(*args, **kwargs)

    return never_inlined(call, _UNTRACED)


# name -> (the raw collective on plain tensors, its transpose's name, whether vmap moves the batch dim off dim 0)
_COLLECTIVES = {
    "all_gather": (_ag, "reduce_scatter", True),
    "reduce_scatter": (_rs, "all_gather", True),
    "all_reduce": (_ar, "all_reduce", False),  # (elementwise over ranks: any batch dim stays where it is)
}


class _Collective(torch.autograd.Function):
    """One of the three dim-0 collectives (``op``: a key of ``_COLLECTIVES``) as a complete torch.func primitive:
    forward, the raw c10d call; backward, the transposed collective's own ``apply`` (differentiable again); jvp, the
    collective of the tangent; vmap, one collective for the whole batch."""

    @staticmethod
    @untraced
    def forward(x, op, group):
        with no_functorch():
            return _COLLECTIVES[op][0](x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op, ctx.group = inputs[1], inputs[2]

    @staticmethod
    @untraced
    def backward(ctx, g):
        _raw_grads(f"funcshard.{ctx.op}", g)
        return _Collective.apply(g, _COLLECTIVES[ctx.op][1], ctx.group), None, None

    @staticmethod
    @untraced
    def jvp(ctx, t, _op, _group):
        return _Collective.apply(t, ctx.op, ctx.group)

    @staticmethod
    @untraced
    def vmap(info, in_dims, x, op, group):
        if not _COLLECTIVES[op][2]:
            return _Collective.apply(x, op, group), in_dims[0]
        return _batched(lambda y, pg: _Collective.apply(y, op, pg), x, in_dims[0], group, f"funcshard.{op}")


class _CotangentMap(torch.autograd.Function):
    """The identity whose backward applies ``fn`` (a linear map made of differentiable ops: any order) to the
    cotangent; jvp: the tangent."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, fn):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.fn = inputs[1]

    @staticmethod
    @untraced
    def backward(ctx, g):
        return ctx.fn(g), None

    @staticmethod
    def jvp(ctx, t, _):
        return t.clone()


class _Refused(torch.autograd.Function):
    """The identity on gradients, depending on ``deps`` so that autograd reaches it exactly when those gradients are
    differentiated again, which raises ``refusal``. Forward-mode and vmap pass through (``jvp(grad)``, ``vmap(grad)``:
    one reverse level). The one owner of "these gradients are first order" (``refuse_again``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(refusal, n, *args):
        return tuple(g.view_as(g) for g in args[n:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.refusal, ctx.n = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.refusal)

    @staticmethod
    def jvp(ctx, _refusal, _n, *tangents):
        return tuple(None if t is None else t.view_as(t) for t in tangents[ctx.n:])


def refuse_again(refusal: str, deps, grads) -> list:
    """``grads`` (None entries kept) as their values, raising ``refusal`` if differentiated again; ``deps``: tensors
    they are made to depend on (the incoming cotangent, the state under a transform), so that the refusal is reached
    only through a second reverse level. Uses: a create_graph=True gradient through a gather that divides
    (``_traced``, the runtime), a torch.func gradient differentiated by autograd (``gather_bucket``, the runtime)."""
    grads, deps = list(grads), list(deps)
    at = [i for i, g in enumerate(grads) if g is not None]
    if at:
        for i, g in zip(at, _Refused.apply(refusal, len(deps), *deps, *(grads[i] for i in at))):
            grads[i] = g
    return grads


def _not_again(refusal: str, g: torch.Tensor) -> torch.Tensor:
    """A gather's shard gradient, divided by the plan's factor or summed over replicas: reached where no transform
    stack shows the two reverse levels to ``check_reverse_levels`` (plain autograd over a torch.func gradient: MAML's
    meta-gradient by ``loss.backward()`` or ``funcshard.value_and_grad`` over an inner ``torch.func.grad``)."""
    return refuse_again(refusal, (), (g,))[0] if torch.is_grad_enabled() else g


def replica_sum(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` (the same on every rank of ``group``), whose gradient is summed over ``group`` (HSDP's replicas)."""
    return _CotangentMap.apply(x, lambda g: _Collective.apply(g, "all_reduce", group))


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x``, whose gradient is divided by ``factor`` (at every order)."""
    return x if factor == 1.0 else _CotangentMap.apply(x, lambda g: g / factor)


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0. Backward: reduce-scatter (sum). ``group``: a
    ProcessGroup, a DeviceMesh (its shard axis, ``_mesh.dp_axes``) or None (the default group).

    A complete ``torch.func`` primitive, as the other two: its backward is the differentiable transposed collective
    (derivatives of any order, ``torch.autograd.grad(create_graph=True)``), its jvp the collective of the tangent, and
    under ``vmap`` one collective for the whole batch (the batch dim kept off dim 0). Not under
    ``torch.autograd.grad(..., is_grads_batched=True)`` (refused: use ``torch.func.vmap`` over a vjp function).

    Like the three public collectives (and their backward), it waits at most ``FUNCSHARD_TIMEOUT`` seconds (else 300)
    on gloo, then raises ``CollectiveTimeout`` naming it, and the group is refused afterwards (a rank that never
    joins: dead, or running something else); on NCCL the bound is NCCL's own watchdog.

    Args:
        x: this rank's piece (at least 1-D); every rank's has the same shape.
        group: a ProcessGroup, a DeviceMesh (its shard axis) or None (the default group).

    Returns:
        Every rank's ``x`` concatenated along dim 0 (``world * x.shape[0]`` rows), in rank order.
    """
    return _Collective.apply(x, "all_gather", _group_of(group))


def reduce_scatter(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks and give each rank its dim-0 slice. Backward: all-gather. A complete ``torch.func``
    primitive with :func:`all_gather`'s rules and bound.

    Args:
        x: this rank's full-size input; dim 0 divisible by the group's size.
        group: a ProcessGroup, a DeviceMesh (its shard axis) or None (the default group).

    Returns:
        This rank's ``x.shape[0] // world`` rows of the sum over ranks (a sum: nothing is averaged).
    """
    return _Collective.apply(x, "reduce_scatter", _group_of(group))


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks. Backward: all-reduce (sum) of the cotangent. A complete ``torch.func`` primitive with
    :func:`all_gather`'s rules and bound.

    Args:
        x: this rank's tensor; every rank's has the same shape.
        group: a ProcessGroup, a DeviceMesh (its shard axis) or None (the default group).

    Returns:
        The sum of every rank's ``x`` (a new tensor; ``x`` is not modified).
    """
    return _Collective.apply(x, "all_reduce", _group_of(group))


# ---- a bucket of parameters gathered by these primitives (composes under every transform) ----------------------


class Param(NamedTuple):
    """One parameter's place in its bucket (plain data: what traced code reads as constants)."""

    path: str
    dtype: torch.dtype  # the shard's
    numel: int  # local
    local_shape: tuple[int, ...]
    dim: int
    padded_shape: tuple[int, ...]
    size: int  # global size of the shard dim (the unpadded rows)
    padding: int
    shape: tuple[int, ...]
    aliases: tuple[str, ...]


class Bucket(NamedTuple):
    """One all-gather (and the reduce-scatter of its backward): a group's parameters of one compute dtype."""

    group: str
    compute: torch.dtype
    reduce: torch.dtype
    before: float  # the divide factor's part applied before the reduce-scatter (fp16), and after it
    after: float
    world: int
    shard_group: str  # process group names (functional collectives take names)
    replicate_group: str | None
    params: tuple[Param, ...]
    recompute: bool  # gather again in backward (reshard_after_forward), under torch.compile


@assume_constant_result  # (dynamo runs it at trace time: py3.11's functools.cached_property takes a
def geometry(shape: tuple[int, ...], dim: int, world: int) -> tuple:  # lock, which dynamo does not trace)
    """``(local numel, local shape, dim, padded shape, size, padding)`` of a parameter of ``shape`` sharded on ``dim``
    over ``world`` ranks: ``ShardSpec``'s, from plain arguments (a frozen dataclass argument is one torch 2.11's
    dynamo cannot pass)."""
    s = ShardSpec("", shape, torch.float32, dim, 0, world)
    return s.local_numel, s.local_shape, s.dim, s.padded_shape, s.size, s.padding


def bucket_param(s: ShardSpec) -> Param:
    """A planned parameter's ``Param``."""
    return Param(s.fqn, s.dtype, *geometry(s.shape, s.dim, s.world), s.shape, s.aliases)


def unflatten(b: Bucket, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The bucket's parameters out of its all-gather output ``(world * n,)``, rank-major (padding dropped)."""
    full = full.view(b.world, -1)
    out, k = [], 0
    for p in b.params:
        piece = full[:, k : k + p.numel].reshape(b.world, *p.local_shape)  # (W, *local_shape): every rank's shard
        k += p.numel
        out.append(unpad(from_split(piece, p.dim, p.padded_shape), p.dim, p.size, p.padding, p.shape))
    return tuple(out)


def gather_bucket(b: Bucket, shards, group, replicate=None, what: str = "funcshard.gather") -> tuple[torch.Tensor, ...]:
    """The bucket's parameters (cast to ``b.compute``) from this rank's ``shards``, made of the primitives above and
    plain torch ops only, so that every torch.func transform and nesting composes (grad of grad, vmap over stacked
    shards: one all-gather for the whole batch, per-sample gradients: one reduce-scatter). Gradients: the
    reduce-scatter (sum) over ``group`` of the full gradients in ``b.reduce``, divided by ``b.before`` before and
    ``b.after`` after it (``_policy.divide_factors``), all-reduced (sum) over ``replicate`` (HSDP), in the shards'
    dtypes. Gathers in ``b.reduce`` where it is not the compute dtype (exact when the shards are in that dtype: the
    cast commutes with the gather), so that the backward reduces in it; other shard dtypes are refused."""
    gd = b.compute
    if b.reduce != b.compute:
        if any(s.dtype != b.reduce for s in shards):
            raise NotImplementedError(
                f"{what} under a torch.func transform: group {b.group!r} computes in {b.compute} and reduces in "
                f"{b.reduce}, with shards in {sorted({str(s.dtype) for s in shards})}; the composable gather reduces "
                f"in the dtype it gathers in, exact only for shards in the reduce dtype. Keep the shards in "
                f"{b.reduce}, or a reduce_dtype equal to the param_dtype")
        gd = b.reduce
    flat = torch.cat([s.reshape(-1).to(gd) for s in shards])
    if b.before * b.after != 1.0 or replicate is not None:  # (a gradient of these shards is first order: _not_again)
        flat = _CotangentMap.apply(flat, functools.partial(
            _not_again, divided_twice(what, b.before * b.after, replicate is not None)))
    flat = scale_grad(flat, b.after)
    if replicate is not None:
        flat = replica_sum(flat, replicate)
    full = _Collective.apply(flat, "all_gather", group) if b.world > 1 else flat
    full = scale_grad(full, b.before).to(b.compute)
    return unflatten(b, full)
