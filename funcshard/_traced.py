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
  back to the shard's dtype. Under torch.func transforms of the state (eagerly) the collectives are
  ``funcshard.all_gather`` / ``reduce_scatter`` instead, which compose (``traced_apply``'s docstring).

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

from funcshard._primitives import (
    Bucket,
    buckets,
    check_backward_transforms,
    check_batched_grads,
    divides,
    gather_bucket,
    refuse_series,
    scatter_mean,
    unflatten,
    untraced,
    watch_means,
)
from funcshard._compat import (c10d_functional, get_dynamic_layer_stack_depth, get_interpreter_stack,
                               is_functorch_wrapped_tensor)
from funcshard._plan import Plan
from funcshard._policy import cast_floating
from funcshard._schedule import label
from funcshard._shard import check_state


class _Layout(NamedTuple):
    buckets: tuple[Bucket, ...]
    cast_inputs: torch.dtype | None
    output_dtype: torch.dtype | None


def unsupported(plan: Plan) -> list[str]:
    """What of ``plan`` the traced mode does not run (empty: all of it)."""
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
    if hooked := [g.name for g in plan.groups if g.comm is not None]:
        problems.append(f"groups {hooked} have comm hooks (Group.comm), which the traced mode does not run (a plan "
                        f"without them)")
    return problems


def apply_unsupported(plan: Plan) -> list[str]:
    """What of ``plan`` ``funcshard.apply``'s traced path (nested transforms, a state made from a gradient, results
    differentiated below one torch.func level) does not run: ``unsupported``'s, and model-sharded parameters and
    offloaded groups (empty: all of it)."""
    problems = unsupported(plan)
    if model := [p for p, s in plan.specs.items() if s.model is not None]:
        problems.append(f"model-sharded (tensor-parallel DTensor) parameters {model}")
    if offloaded := [label(g.name) for g in plan.groups if g.offload_to_cpu]:
        problems.append(f"groups {offloaded} offload to the host (CPUOffloadPolicy)")
    return problems


def _check(plan: Plan) -> None:
    if problems := [p for p in unsupported(plan) if "comm hooks" not in p]:
        raise NotImplementedError(f"funcshard.traced_apply does not support {'; '.join(problems)}; "
                                  f"funcshard.apply does")


def _layout(plan: Plan) -> _Layout:
    _check(plan)
    pg, _ = plan.shard_group()
    rep = plan.replicate_group()
    _GROUPS.update((g.group_name, g) for g in (pg, rep) if g is not None)
    root = plan.groups[0]
    return _Layout(buckets(plan), root.param_dtype if root.cast_forward_inputs else None, root.output_dtype)


_GROUPS: dict = {}  # process group name -> group: the differentiable backward's (create_graph=True) collectives


def layout(plan: Plan) -> _Layout:
    """The plan's traced layout, made once per plan (eagerly, or while dynamo traces the first call: plain Python
    over the plan's frozen data, whose result dynamo keeps as constants)."""
    return plan.derived("traced", _layout)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return c10d_functional.wait_tensor(t)


class _Gather(torch.autograd.Function):
    """One bucket's all-gather: ``(*shards) -> (world * n,)`` rank-major, the shards cast to the compute dtype;
    backward: the reduce-scatter of the reduced parameters' gradients (see the module docstring).

    Not ``_primitives.all_gather`` (``_Collective``), which ``_composed`` uses under transforms of the state: this
    one is traced (``c10d_functional`` ops, which dynamo and inductor take into the step's graph, bucket, reorder and
    tag ``MUST_RECOMPUTE`` for the re-gather of resharded groups), while ``_Collective`` runs raw c10d calls on
    plain tensors and is never traced (``untraced``: a graph break). Its backward reduce-scatters only the shards
    being differentiated (frozen ones cost no traffic); under ``create_graph=True`` it reduce-scatters with the
    differentiable primitives and divides with ``_primitives.mean`` (exact at second order)."""

    @staticmethod
    def forward(b: Bucket, *shards: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([s.reshape(-1).to(b.compute) for s in shards])
        if b.world == 1:
            return flat
        return _wait(c10d_functional.all_gather_into_tensor(flat, b.world, b.shard_group))

    @staticmethod
    def setup_context(ctx, inputs, output):
        b = ctx.bucket = inputs[0]
        ctx._funcshard_node = "gather"  # (for _primitives.watch_means and refuse_series)
        ctx._funcshard_divides = divides(b)

    @staticmethod
    def vmap(info, in_dims, b: Bucket, *shards: torch.Tensor):
        """Under a vmap of the module's inputs alone (the state differentiated by plain autograd, or not at all):
        unbatched shards, one unbatched gather. (Batched shards are functorch-wrapped: ``_composed`` gathers them.)"""
        if any(d is not None for d in in_dims[1:]):
            raise NotImplementedError(f"{_WHAT}: the c10d gather of group {b.group!r} got batched shards under vmap "
                                      f"(an internal routing error: a transform of the state gathers through the "
                                      f"composable collectives); gather with funcshard.gather meanwhile")
        return _Gather.apply(b, *shards), None

    @staticmethod
    def backward(ctx, grad):
        b: Bucket = ctx.bucket
        compiling = torch.compiler.is_compiling()  # (dynamo traces this backward: no functorch levels to read)
        if not compiling:
            _check_backward(grad)
        # the shards differentiated (as apply asks the shards it is given): with the plan's frozen parameters left
        # out of the state differentiated, none of theirs
        reduced = [i for i in range(len(b.params)) if ctx.needs_input_grad[1 + i]]
        cols = grad.view(b.world, -1).split([p.numel for p in b.params], dim=1)
        inp = torch.cat([cols[i] for i in reduced], dim=1).to(b.reduce)  # (world, reduced elements)
        if not compiling and grad.requires_grad and torch.is_grad_enabled():
            # create_graph=True: the differentiable collectives and divide (_primitives.mean: exact at second order)
            out = scatter_mean(b, inp, _GROUPS[b.shard_group], _GROUPS.get(b.replicate_group))
        else:
            if b.before != 1.0:
                inp = inp / b.before
            out = inp.reshape(-1)
            with torch.no_grad():  # (torch 2.13 registers autograd for these ops with a Function that torch.func's
                if b.world > 1:    # transforms refuse; first order needs none)
                    out = _wait(c10d_functional.reduce_scatter_tensor(out, "sum", b.world, b.shard_group))
                if b.replicate_group is not None:
                    out = _wait(c10d_functional.all_reduce(out, "sum", b.replicate_group))
            if b.after != 1.0:
                out = out / b.after  # (in the reduce dtype, then the cast: FSDP2's order)
        grads: list[torch.Tensor | None] = [None] * len(b.params)
        for i, piece in zip(reduced, out.split([b.params[i].numel for i in reduced])):
            grads[i] = piece.to(b.params[i].dtype).view(b.params[i].local_shape)
        return None, *grads


_WHAT = "funcshard.traced_apply"


def _check_backward(grad: torch.Tensor) -> None:
    """The c10d gather's backward rules (its forward ran under no torch.func transform of the state): no batched
    cotangents (plain autograd's is_grads_batched, a vmap around a plain-autograd backward)."""
    check_backward_transforms(_WHAT)
    check_batched_grads(_WHAT, (grad,))


def _must_recompute(ctx, func, *args, **kwargs):
    return torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE


def _recompute_context():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_must_recompute)


def _gather_bucket(b: Bucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if any(s.requires_grad for s in shards):
        if divides(b):
            refuse_series(shards, _WHAT)  # (a leaf state, the first-order step's: nothing)
        full = _Gather.apply(b, *shards)
        watch_means(shards, full)  # (a leaf state, the first-order step's: nothing)
        return unflatten(b, full)
    # (nothing to differentiate, e.g. a frozen group: the all-gather alone; dynamo mis-passes the arguments of a
    # setup_context-style Function none of whose inputs requires grad inside a checkpoint)
    return unflatten(b, _Gather.forward(b, *shards))


def gathered(plan: Plan, state: Mapping[str, torch.Tensor], what: str = _WHAT) -> dict[str, torch.Tensor]:
    """The full parameters (every alias of a tied one), gathered with one traceable all-gather per group and compute
    dtype; differentiable: each trainable shard's gradient is the reduce-scatter of the full gradient, divided by
    the group's factor, in the shard's dtype. A group that reshards after forward is gathered inside a selective
    checkpoint whose every op (all-gather, copy-out) is ``MUST_RECOMPUTE``: the compiled backward gathers it again.
    Under a torch.func transform of the state: ``_composed``."""
    if torch.compiler.is_compiling():
        if get_dynamic_layer_stack_depth():  # (a transform that dynamo traces: run eagerly, see _composed)
            return _composed(plan, state, what)
    elif get_interpreter_stack() and any(is_functorch_wrapped_tensor(t) for t in state.values()):
        return _composed(plan, state, what)
    out: dict[str, torch.Tensor] = {}
    for b in layout(plan).buckets:
        shards = [state[p.path] for p in b.params]
        if b.recompute and torch.is_grad_enabled() and torch.compiler.is_compiling():  # (eagerly: no use)
            params = torch.utils.checkpoint.checkpoint(_gather_bucket, b, *shards, use_reentrant=False,
                                                       context_fn=_recompute_context)
        else:
            params = _gather_bucket(b, *shards)
        _named(out, b, params)
    return out


def _named(out: dict[str, torch.Tensor], b: Bucket, params) -> None:
    for p, param in zip(b.params, params):
        for alias in p.aliases:
            out[alias] = param


@untraced
def _composed(plan: Plan, state: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """``gathered`` under a torch.func transform of the state: each bucket by the primitives' gather
    (``gather_bucket``: every transform and nesting composes). Never traced
    (``untraced``): dynamo cannot break a transform's body, so under ``torch.compile`` this graph break makes it run
    the transform eagerly (before: the c10d functional gather on dynamo's GradTrackingTensors, a torch error; a
    compiled grad of grad would have dropped the second-order term, the compiled backward being first order), and
    ``fullgraph=True`` refuses it naming ``_primitives._UNTRACED``'s way out."""
    pg, rep = plan.shard_group()[0], plan.replicate_group()
    out: dict[str, torch.Tensor] = {}
    for b in layout(plan).buckets:
        _named(out, b, gather_bucket(b, [state[p.path] for p in b.params], pg, rep, what))
    return out


def traced_apply(plan: Plan, state: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """``plan.module(*args, **kwargs)`` on the full parameters gathered from ``state``, as traceable ops only: compile
    the step that calls it with ``torch.compile(step, fullgraph=True)`` and the whole step is one graph, its
    collectives included (see the module docstring for what the plan decides and what the compiler does).

    Same values and gradients as :func:`funcshard.apply` (gradients reduce-scattered and divided by the plan's
    factor, in the reduce dtype, returned in the shards' dtype; for the shards being differentiated), under
    ``funcshard.value_and_grad``, plain autograd or ``torch.func``; same restrictions on ``state``.

    Transforms compose (not compiled): under any ``torch.func`` transform of the state, and nestings of them
    (``jvp`` of the state, ``vmap(grad(...))`` per-sample gradients as shards with a leading batch dim, ``vmap`` over
    stacked states with one all-gather per group and compute dtype for all members, ``jvp(grad(...))``, ``jacrev``,
    ``jacfwd``, ``hessian``), each bucket is gathered by the differentiable collectives
    (``_primitives.gather_bucket``); a ``create_graph=True`` backward under plain autograd reduce-scatters with them
    (differentiable again). Any transform of the inputs alone is the unsharded module's. The plan's divide factor
    (and HSDP's replica sum) is applied once per reverse level on every derivative path through the gathered
    parameters (``_primitives._Mean``; docs/transforms.md), so two reverse levels (``grad(grad(...))``, MAML,
    ``jacrev(jacrev(...))``, a ``create_graph=True`` gradient differentiated again) are exact with any factor;
    refused (``NotImplementedError``): one inner gradient reaching the outer loss both through a gather and
    otherwise, or fed to a gather and differentiated twice more, with a factor other than 1 or over HSDP. Under
    ``torch.compile`` a transform of the state through it runs eagerly (the composable gather is a graph break inside
    it, so dynamo runs the transform eagerly: right, not compiled), and ``fullgraph=True`` refuses it naming the way
    out. Memory, not compiled: every group's unsharded parameters live
    from forward to backward (autograd saves them), for as long as the outermost transform needs them (a nested
    transform keeps them until it returns); the selective checkpoint that re-gathers resharded groups in backward
    is the compiled path's only.

    Args:
        plan: from :func:`funcshard.plan` (no comm hooks; see the refusals above).
        state: this rank's shards, keyed like ``plan.specs``.
        *args: the module's positional inputs (this rank's batch).
        **kwargs: the module's keyword inputs.
    """
    check_state(plan, state)  # (under torch.compile: traced once, the guards keep the shapes it saw)
    if hooked := [g.name for g in plan.groups if g.comm is not None]:
        raise NotImplementedError(f"traced_apply: groups {hooked} have comm hooks (Group.comm), which the traced mode "
                                  f"does not run; use funcshard.apply, or a plan without them")
    return run(plan, state, args, kwargs)


def run(plan: Plan, state: Mapping[str, torch.Tensor], args: tuple, kwargs: dict, what: str = _WHAT) -> Any:
    """traced_apply's body, for a checked state (``funcshard.apply`` under nested transforms runs it too: ``what``
    names the API the user called in refusals)."""
    lay = layout(plan)
    if lay.cast_inputs is not None:
        args, kwargs = cast_floating(lay.cast_inputs, (args, kwargs))
    out = torch.func.functional_call(plan.module, gathered(plan, state, what), args, kwargs, tie_weights=False)
    return out if lay.output_dtype is None else cast_floating(lay.output_dtype, out)
