"""The fully traced mode: ``traced_apply``, the whole step one graph (SimpleFSDP's approach, arXiv 2411.00284).

``apply`` runs a Python runtime around the module (hooks, buffers, async collectives, a schedule it keeps itself);
``torch.compile`` can only compile the code between its calls. ``traced_apply`` has no runtime at all: it is a pure
function of the shards made of traceable ops, so ``torch.compile(step, fullgraph=True)`` takes the whole step
(gathers, forward, loss, backward, reduce-scatters) into one graph:

- per group of the plan and compute dtype, one all-gather (``c10d_functional.all_gather_into_tensor``) of the group's
  shards cast to the compute dtype (``param_dtype`` under mixed precision) and concatenated, split back into the
  parameters (padding dropped);
- ``torch.func.functional_call`` of the module with those parameters;
- backward (``_Gather.backward``): per group and compute dtype, one reduce-scatter (sum) in the reduce dtype of the
  gradients of the shards being differentiated (as ``apply`` asks the shards it is given: a frozen parameter whose
  shard does not require grad, or is not among the arguments ``value_and_grad`` differentiates, costs no traffic; a
  group with none has no reduce-scatter), the plan's divide factor split before and after it as
  ``_policy.divide_factors`` splits it, an all-reduce over the replicate axis (HSDP), and each shard's gradient cast
  back to the shard's dtype. First order only (no gradient of the gradient).

Where the Plan decides and where the compiler takes over:

- the Plan decides which collectives exist (one all-gather and one reduce-scatter per group and compute dtype, in
  the dtypes of its precision policy, with its divide factors), their order in the program (the plan's group
  order; backward: autograd's reverse order), and what lives from forward to backward: a group whose
  ``reshard_after_forward`` is true (or an int ``k``) has its all-gather tagged ``MUST_RECOMPUTE``
  (``torch.utils.checkpoint``'s selective checkpointing around the gather, as SimpleFSDP does), so the compiled
  backward gathers it again instead of keeping the unsharded parameters from forward (an int ``k`` gathers again
  over the whole shard axis: no block of ``k`` ranks is kept); ``reshard_after_forward=False`` (the root's
  default) keeps them;
- the compiler decides when each collective runs, which ones are bucketed or reordered (inductor's passes) and when
  buffers are freed; the plan's ``forward_prefetch`` / ``backward_prefetch`` depths and lists and
  ``reshard_after_backward`` are not applied (no state outlives a call: every call gathers again).

The re-gather is the compiler's: it needs AOTAutograd's min-cut partitioner (``aot_eager`` and ``inductor`` use it)
and a forward graph apart from the backward graph (the loss compiled, the backward run by autograd:
``value_and_grad(torch.compile(loss_fn, fullgraph=True))`` or ``loss.backward()`` outside the compiled function).
With ``torch.autograd.grad`` traced into the same graph (``trace_autograd_ops``) there is no partition: one graph
whose buffers inductor frees after their last use, the backward's included (no re-gather). Not compiled (eagerly,
under ``torch.func`` too), it runs with blocking collectives and no overlap, a reference and not the fast path, and
every group's unsharded parameters live from forward to backward (autograd saves them where the module uses them).

Mixed precision: ``param_dtype`` / ``reduce_dtype`` of every group (parameters cast before the all-gather, gradients
reduced in ``reduce_dtype``, returned in the shards' dtype), ``cast_forward_inputs`` / ``output_dtype`` of the root
group (the module's inputs and output). A traced step has no module hooks, so a non-root group's own casts are not
applied: refused (``NotImplementedError`` naming the fix) where they would differ from the root's (another
``param_dtype``, an ``output_dtype``); with the root's ``param_dtype`` its inputs are not cast again, which changes
nothing where they come from the root's cast inputs and parameters (an fp32 tensor made inside the forward, e.g. from
an fp32 buffer, reaches the group's modules uncast, where ``apply`` casts it). Also refused: ``layout="flat"`` (its
shards are pieces of one flat buffer, not a parameter's rows: its gather would be a different program).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from funcshard._collectives import check_backward_transforms, check_batched_grads, check_transforms
from funcshard._compat import TransformType, c10d_functional, get_interpreter_stack, is_functorch_wrapped_tensor
from funcshard._plan import Plan
from funcshard._policy import cast_floating, compute_dtype, divide_factors, reduce_dtype_of
from funcshard._schedule import label
from funcshard._shard import check_state
from funcshard._spec import ShardSpec


class _Param(NamedTuple):
    """One parameter's place in its bucket (plain data: what the traced code reads as constants)."""

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


class _Bucket(NamedTuple):
    """One all-gather (and the reduce-scatter of its backward): a group's parameters of one compute dtype."""

    group: str
    compute: torch.dtype
    reduce: torch.dtype
    before: float  # the divide factor's part applied before the reduce-scatter (fp16), and after it
    after: float
    world: int
    shard_group: str  # process group names (functional collectives take names)
    replicate_group: str | None
    params: tuple[_Param, ...]
    recompute: bool  # gather again in backward (reshard_after_forward), under torch.compile


class _Layout(NamedTuple):
    buckets: tuple[_Bucket, ...]
    cast_inputs: torch.dtype | None
    output_dtype: torch.dtype | None


def _check(plan: Plan) -> None:
    problems = []
    if plan.layout != "per_param":
        problems.append(f"layout={plan.layout!r} (use layout='per_param': the flat layout's shards are pieces of "
                        f"one buffer, not a parameter's rows)")
    root = plan.groups[0]
    for g in plan.groups[1:]:
        if g.output_dtype is not None and g.output_dtype != root.output_dtype:
            problems.append(f"group {label(g.name)!r}: output_dtype={g.output_dtype} (cast in the module's own "
                            f"forward, or give every group the root's output_dtype)")
        if (g.param_dtype is not None and g.cast_forward_inputs
                and (g.param_dtype != root.param_dtype or not root.cast_forward_inputs)):
            problems.append(f"group {label(g.name)!r}: casts its inputs to {g.param_dtype}, the root group to "
                            f"{root.param_dtype if root.cast_forward_inputs else None} (give the root the same "
                            f"param_dtype, or cast_forward_inputs=False)")
    if problems:
        raise NotImplementedError(f"funcshard.traced_apply does not support {'; '.join(problems)}; "
                                  f"funcshard.apply does")


def _layout(plan: Plan) -> _Layout:
    _check(plan)
    pg, _ = plan.shard_group()
    rep = plan.replicate_group()
    buckets = []
    for g in plan.groups:
        by_dtype: dict[torch.dtype, list] = {}
        for p in g.params:
            s = plan.specs[p]
            by_dtype.setdefault(compute_dtype(s.dtype, g.param_dtype), []).append(s)
        for dt, specs in by_dtype.items():
            rdt = reduce_dtype_of(dt, g.reduce_dtype)
            before, after = divide_factors(plan.divide_factor_of(g), rdt)
            buckets.append(_Bucket(
                g.name, dt, rdt, before, after, plan.world, pg.group_name, None if rep is None else rep.group_name,
                tuple(_Param(s.fqn, s.dtype, *_geometry(s.shape, s.dim, s.world), s.shape, s.aliases) for s in specs),
                bool(g.reshard_after_forward)))
    root = plan.groups[0]
    return _Layout(tuple(buckets), root.param_dtype if root.cast_forward_inputs else None, root.output_dtype)


@torch.compiler.assume_constant_result  # (dynamo runs it at trace time: py3.11's functools.cached_property takes a
def _geometry(shape: tuple[int, ...], dim: int, world: int) -> tuple:  # lock, which dynamo does not trace)
    """``(local numel, local shape, dim, padded shape, size, padding)`` of a parameter of ``shape`` sharded on ``dim``
    over ``world`` ranks: ``ShardSpec``'s, from plain arguments (a frozen dataclass argument is one torch 2.11's
    dynamo cannot pass)."""
    s = ShardSpec("", shape, torch.float32, dim, 0, world)
    return s.local_numel, s.local_shape, s.dim, s.padded_shape, s.size, s.padding


def layout(plan: Plan) -> _Layout:
    """The plan's traced layout, made once per plan (eagerly, or while dynamo traces the first call: plain Python
    over the plan's frozen data, whose result dynamo keeps as constants)."""
    return plan.derived("traced", _layout)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return c10d_functional.wait_tensor(t)


class _Gather(torch.autograd.Function):
    """One bucket's all-gather: ``(*shards) -> (world * n,)`` rank-major, the shards cast to the compute dtype;
    backward: the reduce-scatter of the reduced parameters' gradients (see the module docstring)."""

    @staticmethod
    def forward(b: _Bucket, *shards: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([s.reshape(-1).to(b.compute) for s in shards])
        if b.world == 1:
            return flat
        return _wait(c10d_functional.all_gather_into_tensor(flat, b.world, b.shard_group))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.bucket = inputs[0]

    @staticmethod
    def backward(ctx, grad):
        b: _Bucket = ctx.bucket
        compiling = torch.compiler.is_compiling()  # (dynamo traces this backward: no functorch levels to read)
        if not compiling:
            _check_backward(grad)
        # the shards differentiated (as apply asks the shards it is given): with the plan's frozen parameters left
        # out of the state differentiated, none of theirs
        reduced = [i for i in range(len(b.params)) if ctx.needs_input_grad[1 + i]]
        cols = grad.view(b.world, -1).split([p.numel for p in b.params], dim=1)
        inp = torch.cat([cols[i] for i in reduced], dim=1).to(b.reduce)  # (world, reduced elements)
        if b.before != 1.0:
            inp = inp / b.before
        out = inp.reshape(-1)
        with torch.no_grad():  # first order only (and torch 2.13 registers autograd for these ops with a
            if b.world > 1:    # Function that torch.func's transforms refuse)
                out = _wait(c10d_functional.reduce_scatter_tensor(out, "sum", b.world, b.shard_group))
            if b.replicate_group is not None:
                out = _wait(c10d_functional.all_reduce(out, "sum", b.replicate_group))
        if b.after != 1.0:
            out = out / b.after  # (in the reduce dtype, then the cast: FSDP2's order)
        grads: list[torch.Tensor | None] = [None] * len(b.params)
        for i, piece in zip(reduced, out.split([b.params[i].numel for i in reduced])):
            grads[i] = piece.to(b.params[i].dtype).view(b.params[i].local_shape)
        if not compiling and grad.requires_grad and torch.is_grad_enabled() and not get_interpreter_stack():
            # create_graph=True (torch.func.grad's own backward has grad mode on too: one level, checked in forward)
            for i, g in zip(reduced, _FirstOrder.apply(grad, *(grads[i] for i in reduced))):
                grads[i] = g
        return None, *grads


_WHAT = "funcshard.traced_apply"


def _check_forward(state: Mapping[str, torch.Tensor]) -> None:
    """The transforms the traced gather gets right: any over the inputs alone (the shards are constants to them),
    and one grad/vjp level over the state. Its all-gather has no jvp or vmap rule (a jvp of the state got a zero
    tangent, a vmap over stacked states another rank's rows) and its backward is first order (a grad of a grad got
    zeros): apply's rule (``check_transforms``), jvp left out."""
    if get_interpreter_stack() and any(is_functorch_wrapped_tensor(t) for t in state.values()):
        check_transforms(_WHAT, kinds=(TransformType.Grad,),
                         fix="for a jvp of the state use funcshard.apply; otherwise ")


def _check_backward(grad: torch.Tensor) -> None:
    """apply's backward rules: no batched cotangents (vmap over a vjp function, jacrev)."""
    check_backward_transforms(_WHAT)
    check_batched_grads(_WHAT, (grad,))


class _FirstOrder(torch.autograd.Function):
    """The shard gradients of a backward with create_graph=True: their values, and a backward that raises. The
    reduce-scatter carries no graph, so a derivative of these gradients (a double backward: MAML, a Hessian-vector
    product) would miss every term through the gather. Depends on the incoming gradient only to be differentiated
    exactly when it could be: an incoming gradient that does not require grad depends on no parameter, and then the
    terms through the gather are zero (the values returned are right)."""

    @staticmethod
    def forward(ctx, dep, *pieces):
        return tuple(p.view_as(p) for p in pieces)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{_WHAT}: a gradient taken with create_graph=True (torch.autograd.grad(..., create_graph=True), or a "
            f"torch.func.vjp function) was differentiated again (a double backward); the traced gather's gradients "
            f"are first order, so this derivative would miss every term through the gather. Differentiate once, or "
            f"gather the parameters (funcshard.gather) and differentiate the unsharded function")


def _must_recompute(ctx, func, *args, **kwargs):
    return torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE


def _recompute_context():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_must_recompute)


def _unflatten(b: _Bucket, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The bucket's parameters out of its all-gather output ``(world * n,)``, rank-major (padding dropped)."""
    full = full.view(b.world, -1)
    out, k = [], 0
    for p in b.params:
        piece = full[:, k : k + p.numel].reshape(b.world, *p.local_shape)  # (W, *local_shape): every rank's shard
        k += p.numel
        param = piece.movedim(0, p.dim).reshape(p.padded_shape)
        if p.padding:
            param = param.narrow(p.dim, 0, p.size)
        out.append(param.view(p.shape))
    return tuple(out)


def _gather_bucket(b: _Bucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if any(s.requires_grad for s in shards):
        return _unflatten(b, _Gather.apply(b, *shards))
    # (nothing to differentiate, e.g. a frozen group: the all-gather alone; dynamo mis-passes the arguments of a
    # setup_context-style Function none of whose inputs requires grad inside a checkpoint)
    return _unflatten(b, _Gather.forward(b, *shards))


def gathered(plan: Plan, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full parameters (every alias of a tied one), gathered with one traceable all-gather per group and compute
    dtype; differentiable: each trainable shard's gradient is the reduce-scatter of the full gradient, divided by
    the group's factor, in the shard's dtype. A group that reshards after forward is gathered inside a selective
    checkpoint whose every op (all-gather, copy-out) is ``MUST_RECOMPUTE``: the compiled backward gathers it again."""
    out: dict[str, torch.Tensor] = {}
    for b in layout(plan).buckets:
        shards = [state[p.path] for p in b.params]
        if b.recompute and torch.is_grad_enabled() and torch.compiler.is_compiling():  # (eagerly: no use)
            params = torch.utils.checkpoint.checkpoint(_gather_bucket, b, *shards, use_reentrant=False,
                                                       context_fn=_recompute_context)
        else:
            params = _gather_bucket(b, *shards)
        for p, param in zip(b.params, params):
            for alias in p.aliases:
                out[alias] = param
    return out


def traced_apply(plan: Plan, state: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """``plan.module(*args, **kwargs)`` on the full parameters gathered from ``state``, as traceable ops only: compile
    the step that calls it with ``torch.compile(step, fullgraph=True)`` and the whole step is one graph, its
    collectives included (see the module docstring for what the plan decides and what the compiler does).

    Same values and gradients as :func:`funcshard.apply` (gradients reduce-scattered and divided by the plan's
    factor, in the reduce dtype, returned in the shards' dtype; for the shards being differentiated), under
    ``funcshard.value_and_grad``, ``torch.func.grad`` / ``grad_and_value`` / ``vjp`` (not compiled) or plain autograd;
    same restrictions on ``state``. Any ``torch.func`` transform of the inputs alone (the shards captured) is the
    unsharded module's. Refused, naming the transform stack (``NotImplementedError``): a transform of the state
    other than one grad/vjp level (a jvp of the state, a vmap over stacked states, nested ones: ``vmap(grad(...))``,
    ``grad(grad(...))``), a vjp function called under vmap (jacrev), and differentiating again a gradient taken
    with ``create_graph=True`` (a double backward: raised when it reaches the shard gradients), at every world
    size. Compiled, groups that reshard after forward are gathered again in backward; not
    compiled, without apply's memory bound.
    """
    check_state(plan, state)  # (under torch.compile: traced once, the guards keep the shapes it saw)
    if not torch.compiler.is_compiling():
        _check_forward(state)
    if hooked := [g.name for g in plan.groups if g.comm is not None]:
        raise NotImplementedError(f"traced_apply: groups {hooked} have comm hooks (Group.comm), which the traced mode "
                                  f"does not run; use funcshard.apply, or a plan without them")
    lay = layout(plan)
    if lay.cast_inputs is not None:
        args, kwargs = cast_floating(lay.cast_inputs, (args, kwargs))
    out = torch.func.functional_call(plan.module, gathered(plan, state), args, kwargs, tie_weights=False)
    return out if lay.output_dtype is None else cast_floating(lay.output_dtype, out)
