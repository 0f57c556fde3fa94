"""apply: run the planned module on sharded state, with FSDP's memory behaviour."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from funcshard._primitives import check_transforms, depends_on_gradient, divides, refuse_series, transform_stack
from funcshard._compile import runtime_boundary
from funcshard._mesh import check_mesh
from funcshard._plan import Plan
from funcshard._runtime import Step
from funcshard._runtime.step import buffer_update_error
from funcshard._runtime.strategies import below, tangents_below
from funcshard._shard import check_state
from funcshard._traced import apply_unsupported, buckets, run as traced_run
from funcshard._compat import TransformType, get_interpreter_stack


def apply(plan: Plan, state: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """Run ``plan.module(*args, **kwargs)`` with the parameters in ``state`` (local shards).

    Each group is all-gathered just before its first module runs (the next ``plan.forward_prefetch``
    groups' all-gathers are issued then, to overlap), freed after its forward when the plan says so, gathered
    again before its backward, and its gradient reduce-scattered as soon as it is complete.

    Differentiable with respect to ``state`` under ``torch.func.grad`` / ``grad_and_value`` / ``vjp`` / ``jvp`` and
    plain autograd (``loss.backward()`` with ``requires_grad`` shards), by the runtime; other and nested transforms
    (``vmap`` included) run the traced body (below). Under one ``torch.func.grad`` level over shards or inputs that
    require grad (with grad mode on), its gradients are differentiable again by plain autograd below the transform
    (MAML's meta-gradient by ``loss.backward()`` over an inner ``torch.func.grad``): the runtime runs as at first
    order, and that second backward gathers the groups again (except where a group's reduce-scatter cannot be
    transposed: layout="flat", a comm hook, CPU offload, FSDP2's all-gather extension, model-sharded parameters; there
    it raises ``NotImplementedError`` naming the group). Gradients have the keys and local
    shapes of ``state`` and are divided once by ``plan.divide_factor`` (default: the number of data-parallel
    ranks), so each rank computing the mean loss of its local batch yields the gradient of the global mean
    loss. ``state`` and the module's parameters are not modified.

    Buffers are not part of ``state``: they stay the module's own (not sharded, not synced across ranks, not saved
    by ``funcshard.checkpoint``), and a forward that updates them in place (BatchNorm's running statistics in train
    mode) updates the module's buffers, as the module would on its own, under plain autograd and
    ``funcshard.value_and_grad``; ``torch.func`` transforms refuse such updates (a RuntimeError that says so and names
    the buffers): use eval mode or ``track_running_stats=False`` there.

    Under nested ``torch.func`` transforms (anything but one grad/vjp or jvp level: ``vmap(grad(...))`` per-sample
    gradients, ``vmap`` over stacked states, ``jvp(grad(...))``, ``jacfwd``, ``hessian``, a vmap over the inputs,
    ``grad(grad(...))`` with ``grad_divide_factor=1.0``) it runs :func:`funcshard.traced_apply`'s body, which composes
    and gives the plan's numbers (same gathers, divide factor, dtypes); its parameters stay gathered for the nested
    transform's life (no reshard after forward, no prefetch schedule), and what it refuses it refuses naming the
    transform stack. Plans the traced mode does not run (layout="flat", comm hooks, a non-root group's own casts;
    and here model-sharded parameters, offloaded groups) refuse nested transforms as before. A vjp function of
    apply called under vmap (``jacrev`` of apply) is refused.

    Under plain autograd with ``create_graph=True`` (``torch.autograd.grad`` or ``loss.backward``) the runtime's
    gradients are differentiable again (a gradient penalty, a Hessian-vector product by ``grad(<g, v>)``, MAML's
    inner step; exact as ``traced_apply``, the divide taken once per reverse level): that backward reduce-scatters
    each group by the differentiable collectives (one synchronous reduce-scatter per group and compute dtype), and
    from then on the step frees no group, so that its graph can read the unsharded parameters again: about the
    model's full parameter bytes per rank, until the loss and the gradients are dropped. A backward without
    ``create_graph`` is unchanged. Differentiating again through a group whose reduce-scatter cannot be made
    differentiable (layout="flat", a comm hook, CPU offload, FSDP2's all-gather extension, model-sharded parameters)
    raises ``NotImplementedError`` naming the group: use ``traced_apply`` or ``gather`` there.

    Under ``torch.compile`` the module's forward is traced (each group's modules between its hooks) and the
    runtime is not: a graph break on entry, one at each group's hooks, one on exit (``funcshard._compile``). So
    ``torch.compile(..., fullgraph=True)`` cannot trace it (dynamo's error carries the way out):
    :func:`funcshard.traced_apply` is the fully traced mode, with the same arguments.

    Args:
        plan: from :func:`funcshard.plan`.
        state: this rank's shards, keyed like ``plan.specs`` (:func:`funcshard.shard`'s result, or what an optimizer
            made of it).
        *args: the module's positional inputs (this rank's batch).
        **kwargs: the module's keyword inputs.
    """
    # (a transform stack apply's runtime does not take: the traced path, which composes. Not asked while dynamo
    # traces: reading the transform stack is a graph break of its own, and dynamo runs a torch.func transform that
    # reaches the runtime's boundary eagerly, where this is asked)
    compiling = torch.compiler.is_compiling()
    nested = False if compiling else _nested(plan)
    if nested is None:  # (one jvp level: nested where plain autograd records its tangents below it)
        nested = (isinstance(state, Mapping) and bool(tangents_below(state, (args, kwargs)))
                  and not apply_unsupported(plan))
    if nested:
        check_state(plan, state)
        check_mesh(plan.mesh)
        return traced_run(plan, state, args, kwargs, "funcshard.apply")
    step, args, kwargs = _enter(plan, state, args, kwargs, compiling)
    if step is None:  # (one grad/jvp level over a state made from a gradient through the gathers: _adapted)
        return traced_run(plan, state, args, kwargs, "funcshard.apply")
    try:
        out = plan.module(*args, **kwargs)
    except BaseException as e:
        explained = _failed(step, e)
        if explained is not None:
            raise explained from e
        raise
    return _exit(step, out)


def _nested(plan: Plan) -> bool | None:
    """Whether a torch.func transform stack other than the runtime's own is active, and the traced mode runs the plan
    (else apply's ``check_transforms`` refuses it). The runtime's own: none, one grad/vjp level, or one jvp level
    whose tangents plain autograd does not record below it (None: one jvp level, the caller asks
    ``strategies.tangents_below``: then the tangents' gather is the traced path's, differentiable). Takes no tensors:
    dynamo skips such a frame met inside a torch.func transform silently (one with tensors it tries and refuses, one
    more "Unsupported functorch tracing attempt": test_compile's pinned breaks)."""
    stack = get_interpreter_stack()
    if not stack:
        return False
    if len(stack) == 1:
        key = stack[0].key()
        if key == TransformType.Grad:
            return False
        if key == TransformType.Jvp:
            return None
    return not apply_unsupported(plan)


def _adapted(plan: Plan, state: Mapping[str, torch.Tensor]) -> bool:
    """Under one torch.func level or none (plain autograd), whether ``state`` was made from a gradient taken through
    the gathers (MAML's adapted state): its second derivative needs the traced path's gather
    (``_primitives.watch_means``; the runtime's would divide again), so apply runs that path; refused where the traced
    mode does not run the plan. A leaf state (a first-order step) is not walked."""
    stack = get_interpreter_stack()
    if stack and len(stack) != 1:
        return False
    made = bool(stack) and stack[0].key() == TransformType.Jvp  # (no stack: plain autograd over such a state)
    for t in state.values():
        made = made or (isinstance(t, torch.Tensor) and t.grad_fn is not None)
    if not made:
        return False
    # (a dividing group's state made from another dividing gather's output within this level: refused)
    refuse_series([state[p.path] for b in buckets(plan) if divides(b) for p in b.params], "funcshard.apply")
    if not depends_on_gradient(state.values()):
        return False
    if apply_unsupported(plan):
        raise NotImplementedError(
            f"funcshard.apply under {transform_stack(stack) if stack else 'plain autograd'} of a state made from a "
            f"gradient taken through a gather "
            f"(MAML's adapted state): its second derivative needs the traced path, which does not run this plan "
            f"({'; '.join(apply_unsupported(plan))}); call "
            f"funcshard.gather + torch.func.functional_call there, or use a plan funcshard.traced_apply runs")
    return True


_TANGENTS = (
    "funcshard.apply under {stack}: a tangent requires grad (plain autograd records it below the transform: a backward "
    "through jvp's outputs would differentiate it). apply runs its traced path for that, which does not run this plan "
    "({why}), and the runtime's gather of the tangents is outside autograd, so the terms through it would be missing. "
    "Pass tangents that do not require grad (detach them) if nothing differentiates them, or use funcshard.gather + "
    "torch.func.functional_call, or a plan funcshard.traced_apply runs")


def _tangents_refusal(plan: Plan) -> str:
    """``_TANGENTS`` for ``plan``, naming why apply's traced path does not run it."""
    return _TANGENTS.format(stack=transform_stack(get_interpreter_stack()), why="; ".join(apply_unsupported(plan)))


@runtime_boundary
def _enter(plan: Plan, state: Mapping[str, torch.Tensor], args: tuple, kwargs: dict,
           compiled: bool = False) -> tuple[Step | None, tuple, dict]:
    check_state(plan, state)
    check_mesh(plan.mesh)
    if _adapted(plan, state):  # (no Step: apply runs the traced path)
        return None, args, kwargs
    check_transforms("funcshard.apply")
    stack = get_interpreter_stack()
    if stack and stack[0].key() == TransformType.Jvp and apply_unsupported(plan) and tangents_below(state, (args,
                                                                                                        kwargs)):
        raise NotImplementedError(_tangents_refusal(plan))  # (a plan the traced path does not run: _nested)
    step = Step(plan, dict(state))
    step.below = below(state, (args, kwargs))  # (one grad level: what plain autograd records below it)
    step.saved.off = compiled  # (dynamo traces the module's forward: no saved-tensor hooks in it)
    return step, *step.open_forward(args, kwargs)


@runtime_boundary
def _failed(step: Step, error: BaseException) -> RuntimeError | None:
    step.forward_failed()
    return buffer_update_error(step.plan, error)


@runtime_boundary
def _exit(step: Step, out: Any) -> Any:
    return step.close_forward(out)
