"""shard / gather: full parameters <-> a plain dict of local shards, and the checks on a state."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from funcshard._collectives import no_functorch, raw
from funcshard._pipeline import Buckets, gather_tangents, jvp_of_gather, reduce_scatter_grads
from funcshard._primitives import (Bucket, bucket_param, check_backward_transforms, check_transforms, gather_bucket,
                                   refuse_unwatched)
from funcshard._checkpoint_dcp import mark
from funcshard._compat import dtensor_local, get_interpreter_stack
from funcshard._compile import runtime_boundary
from funcshard._layout import expected_shards, full_layouts
from funcshard._mesh import check_mesh, device_of, mesh_str
from funcshard._offload import host_keys, place_state
from funcshard._plan import Plan, module_params
from funcshard._spec import ShardingError


def _fail(plan: Plan, what: str, problems: list[str], fix: str) -> ShardingError:
    shown = problems[:20] + ([f"  ... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    return ShardingError(f"{what} (mesh {mesh_str(plan.mesh)}):\n" + "\n".join(shown) + f"\n{fix}")


def check_state(plan: Plan, state: Mapping[str, torch.Tensor], *, what: str = "state", on_host=()) -> None:
    """Raise a :class:`ShardingError` naming every key of ``state`` that does not fit ``plan``. ``on_host``: keys
    expected on the host besides the offloaded groups' (``optim.offload``'s state).

    Args:
        plan: from :func:`funcshard.plan`.
        state: the dict to check: the keys, local shapes, dtypes and devices ``shard(plan)`` gives.
        what: how the message names it (e.g. ``"grads"``).
        on_host: keys expected on the host besides the offloaded groups' (``optim.offload``'s state).
    """
    if not isinstance(state, Mapping):
        raise ShardingError(
            f"{what} must be a dict of local shards (what funcshard.shard returns), got {type(state).__name__}"
        )
    # The fast path (every call of apply): one pass comparing each shard with the plan's expectation.
    expect = expected_shards(plan)
    if len(state) == len(expect) and not isinstance(next(iter(state.values()), None), DTensor):
        device_type, tensor, host = plan.mesh.device_type, torch.Tensor, host_keys(plan)
        if on_host:
            host = {**host, **dict.fromkeys(on_host)}
        for k, v in state.items():
            e = expect.get(k)
            if (e is None or not isinstance(v, tensor) or v.shape != e[0] or v.dtype is not e[1]
                    or v.device.type != ("cpu" if k in host else device_type)):
                break
        else:
            return
    problems = []
    specs, host = plan.specs, {**host_keys(plan), **dict.fromkeys(on_host)}
    for k, v in state.items():
        spec = specs.get(k)
        if spec is None:
            problems.append(f"  {k}: not a parameter of this plan (extra key)")
        elif not isinstance(v, torch.Tensor):
            problems.append(f"  {k}: a {type(v).__name__}, not a tensor")
        elif isinstance(v, DTensor):
            problems.append(
                f"  {k}: a DTensor (global {tuple(v.shape)}, {tuple(v.placements)}), not this rank's local shard: a "
                f"fully_shard model's parameters are its own state (call the model itself); for {what} make plain "
                f"shards with funcshard.shard(plan) (or funcshard.shard(plan, {{k: p.full_tensor()}}))")
        elif k in host and v.device.type != "cpu":
            problems.append(f"  {k}: on {v.device}, its group offloads to the host (CPUOffloadPolicy); make the state "
                            f"with funcshard.shard(plan), which places it there")
        elif k not in host and v.device.type != plan.mesh.device_type:
            problems.append(
                f"  {k}: on {v.device}, the mesh is on {plan.mesh.device_type}; move the state with "
                f"{{k: v.to(device) for k, v in state.items()}} (or shard parameters that live there)"
            )
        elif tuple(v.shape) != spec.local_shape or v.dtype != spec.dtype:
            problems.append(
                f"  {k}: local shard {tuple(v.shape)} {v.dtype}, the plan expects {spec.local_shape} {spec.dtype} "
                f"(global {spec.shape} sharded on dim {spec.dim} over {spec.world} ranks)"
            )
    problems += [f"  {k}: missing" for k in specs if k not in state]
    if problems:
        raise _fail(
            plan,
            f"{what} does not match the plan",
            problems,
            "Make the state with funcshard.shard(plan, ...) using this same plan; a state made by another plan "
            "(other mesh size, shard dims or model) does not fit.",
        )


def shard(plan: Plan, params: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """This rank's shards of the full parameters, as a plain ``dict[str, Tensor]`` keyed like ``plan.specs``.

    Args:
        plan: from :func:`funcshard.plan`.
        params: full (unsharded) tensors by canonical path, the same on every rank. Default: the planned
            module's current parameters. Never mutated; the shards are new tensors (about 1/W of the bytes,
            plus padding), detached, on the tensors' device.
    """
    check_mesh(plan.mesh)
    if params is None:
        params = module_params(plan)
    if not isinstance(params, Mapping):
        raise ShardingError(f"params must be a dict of full tensors by path, got {type(params).__name__}")
    problems = []
    for k, v in params.items():
        spec = plan.specs.get(k)
        if spec is None:
            problems.append(f"  {k}: not a parameter of this plan (extra key; tied parameters use their first path)")
        elif not isinstance(v, torch.Tensor):
            problems.append(f"  {k}: a {type(v).__name__}, not a tensor")
        elif v.is_meta:
            problems.append(f"  {k}: on the meta device, it has no data; materialize it (to_empty + init) first")
        elif spec.model is not None and (why := _not_model(spec, v)):
            problems.append(f"  {k}: {why}")
        elif spec.model is None and tuple(v.shape) != spec.shape:
            problems.append(f"  {k}: shape {tuple(v.shape)}, the plan expects {spec.shape}")
        elif v.dtype != spec.dtype:  # (cast silently before; FSDP2 shards a parameter in its own dtype)
            problems.append(f"  {k}: dtype {v.dtype}, the plan's is {spec.dtype} (the planned module's parameter)")
    problems += [f"  {k}: missing" for k in plan.specs if k not in params]
    if problems:
        raise _fail(plan, "cannot shard these parameters", problems,
                    "Pass one full tensor per parameter of the planned module (see plan.specs), in its dtype: cast "
                    "them (v.to(plan.specs[k].dtype)), or plan a module of their dtype (e.g. module.double()) to "
                    "train in it.")
    rank = plan.mesh.get_local_rank(plan.shard_axis)
    with torch.no_grad():
        out = {k: spec.local_shard(_local(spec, raw(params[k])).to(spec.dtype), rank) for k, spec in plan.specs.items()}
    out = place_state(plan, out)  # (offloaded groups: on the host)
    mark(plan.specs.values(), out.values())  # so that plain DCP refuses them (funcshard.checkpoint presents them)
    return out


def _not_model(spec, v: torch.Tensor) -> str | None:
    """Why ``v`` is not the model-sharded parameter ``spec`` describes (a DTensor of its mesh, placements and global
    shape), or None."""
    m = spec.model
    if not isinstance(v, DTensor):
        return (f"a plain {tuple(v.shape)} tensor; the plan expects the model's DTensor ({m.shape} on mesh "
                f"{mesh_str(m.mesh)}, placements {list(m.placements)}): pass the module's parameter")
    if v.device_mesh != m.mesh or tuple(v.placements) != m.placements or tuple(v.shape) != m.shape:
        return (f"a DTensor {tuple(v.shape)} on mesh {mesh_str(v.device_mesh)} with placements {list(v.placements)}; "
                f"the plan expects {m.shape} on mesh {mesh_str(m.mesh)} with {list(m.placements)}")
    return None


def _local(spec, v: torch.Tensor) -> torch.Tensor:
    """What is sharded of a full parameter: itself, or a model-sharded one's local tensor."""
    return v if spec.model is None else dtensor_local(v)


class _Gather(torch.autograd.Function):
    """One group's shards -> full parameters, through the group's bucketed pipeline (the plain-autograd path, and a
    flat layout's single transform level). Backward: reduce-scatter (sum), the exact transpose; with
    ``create_graph=True`` a differentiable one (``_ScatterGrads``: derivatives of any order).

    Not ``_primitives.all_gather`` (``_Collective``) per bucket, which every transform and nesting takes instead
    (``gather_bucket``): this is the first-order path, one autograd node for the whole group whose outputs are the
    parameters (``_Collective`` would add a concatenation, the collective and a split with a view node per
    parameter), gathered into and reduce-scattered from the pipeline's communication buffers (``gather_tangents``,
    ``reduce_scatter_grads``: the buffers ``apply``'s runtime uses, and a ``layout="flat"`` plan, whose shards are
    pieces of one buffer, not a parameter's rows, which ``gather_bucket`` does not take)."""

    @staticmethod
    def forward(layout: Buckets, pg, rank: int, *shards: torch.Tensor):
        return gather_tangents(layout, shards, pg, rank)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout, ctx.pg, ctx.rank = inputs[0], inputs[1], inputs[2]
        ctx.device = inputs[3].device

    @staticmethod
    def backward(ctx, *grads):
        check_backward_transforms("funcshard.gather")
        if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):  # create_graph=True
            return (None, None, None, *_ScatterGrads.apply(ctx.layout, ctx.pg, ctx.rank, ctx.device, *grads))
        with no_functorch():
            out = reduce_scatter_grads(ctx.layout, [None if g is None else raw(g) for g in grads], ctx.pg, 1.0,
                                       ctx.device)
        return (None, None, None, *out)

    @staticmethod
    def jvp(ctx, _layout, _pg, _rank, *tangents):
        return jvp_of_gather(ctx.layout, tangents, ctx.pg, ctx.rank)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise NotImplementedError(
            "funcshard.gather of a layout='flat' plan under torch.func.vmap is not supported: plan with "
            "layout='per_param' (its gather composes with every transform), or gather outside vmap")


class _ScatterGrads(torch.autograd.Function):
    """``_Gather``'s backward under ``create_graph=True``: the reduce-scatter of the full gradients, whose own
    backward is the gather of the cotangents (``_Gather`` again), so a double backward (MAML, a Hessian-vector
    product) gets every term through the gather."""

    @staticmethod
    def forward(layout: Buckets, pg, rank: int, device, *grads):
        with no_functorch():
            return tuple(reduce_scatter_grads(layout, [None if g is None else raw(g) for g in grads], pg, 1.0, device))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout, ctx.pg, ctx.rank = inputs[0], inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, *grads):
        check_backward_transforms("funcshard.gather")
        return (None, None, None, None, *_Gather.apply(ctx.layout, ctx.pg, ctx.rank, *grads))


def _buckets(plan: Plan) -> tuple[Bucket, ...]:
    """One bucket per group and shard dtype (gather casts nothing, divides nothing, all-reduces over no replicas)."""
    name = plan.mesh.get_group(plan.shard_axis).group_name
    out = []
    for g in plan.groups:
        by_dtype: dict[torch.dtype, list] = {}
        for p in g.params:
            by_dtype.setdefault(plan.specs[p].dtype, []).append(bucket_param(plan.specs[p]))
        out += [Bucket(g.name, dt, dt, 1.0, 1.0, plan.world, name, None, tuple(ps), False)
                for dt, ps in by_dtype.items()]
    return tuple(out)


@runtime_boundary  # (under torch.compile: a graph break; traced_apply's gather is the traceable one)
def gather(plan: Plan, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full parameters from the local shards, bit-identical to what was sharded.

    Differentiable (autograd and torch.func): the gradient of a shard is the reduce-scatter (sum over
    ranks) of the full gradient, the transpose of the all-gather; nothing is averaged here. One all-gather
    per group and dtype (and, in backward, one reduce-scatter).

    Composes: under any ``torch.func`` transform and nesting of them (``grad``, ``vjp``, ``jvp``, ``vmap``,
    ``jacrev``, ``jacfwd``, ``hessian``: ``grad(grad(...))``, ``vmap(grad(...))`` per-sample gradients, which come
    back as shards with a leading batch dim, ``jvp(grad(...))``), and with ``torch.autograd.grad(create_graph=True)``
    (a double backward). Under a transform it gathers with the differentiable collectives (``funcshard.all_gather``:
    backward the differentiable reduce-scatter, jvp the gather of the tangent); under ``vmap`` over stacked states
    (every shard with a leading member dim: an ensemble) it issues one all-gather per group and dtype for all the
    members. A ``layout="flat"`` plan composes with one grad/vjp or jvp level only (refused otherwise, naming the
    transform stack). Memory: what autograd saves, as for any function of the parameters; a nested transform keeps
    what its outer levels need (the full parameters, for a double backward) until it returns.

    Args:
        plan: from :func:`funcshard.plan`.
        state: this rank's shards.
    """
    check_state(plan, state)
    check_mesh(plan.mesh)
    pg = plan.mesh.get_group(plan.shard_axis)
    if get_interpreter_stack():
        if plan.layout == "per_param":
            return _composed(plan, state, pg)
        check_transforms("funcshard.gather", fix="plan with layout='per_param' (its gather composes); otherwise ")
    lay = full_layouts(plan)  # (the shards' dtypes: mixed precision casts for compute, not for gather)
    rank = plan.mesh.get_local_rank(plan.shard_axis)
    out: dict[str, torch.Tensor] = {}
    for g in plan.groups:
        if not g.params:
            continue
        shards = _on_device(plan, g, state)
        refuse_unwatched(shards)  # (a summing gather of a state made from a dividing gather's gradient: refused)
        full = _Gather.apply(lay[g.name], pg, rank, *shards)
        out.update((p, plan.specs[p].present(t)) for p, t in zip(g.params, full))
    return out


def _on_device(plan: Plan, g, state: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    shards = [state[p] for p in g.params]
    if g.offload_to_cpu:  # (host shards: gathered on the mesh's device; differentiable copies)
        shards = [s.to(device_of(plan.mesh, "funcshard.gather")) for s in shards]
    return shards


def _composed(plan: Plan, state: Mapping[str, torch.Tensor], pg) -> dict[str, torch.Tensor]:
    """gather under a torch.func transform: each bucket through ``_primitives.gather_bucket``."""
    groups = {g.name: g for g in plan.groups}
    out: dict[str, torch.Tensor] = {}
    for b in plan.derived("gather_buckets", _buckets):
        g = groups[b.group]
        on_device = dict(zip(g.params, _on_device(plan, g, state)))
        full = gather_bucket(b, [on_device[p.path] for p in b.params], pg)
        out.update((p.path, plan.specs[p.path].present(t)) for p, t in zip(b.params, full))
    return out
