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
from typing import TYPE_CHECKING, NamedTuple

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
from funcshard._compat import (TransformType, assume_constant_result, current_graph_task_id, dispatch_keys,
                              allow_single_level_function, function_base_apply, get_interpreter_stack,
                              get_unwrapped, is_compiled_backward, is_functorch_wrapped_tensor, never_inlined,
                              single_level_function_allowed)
from funcshard._mesh import shard_group
from funcshard._policy import compute_dtype, divide_factors, reduce_dtype_of
from funcshard._spec import ShardSpec, from_split, unpad

__all__ = ["all_gather", "reduce_scatter", "all_reduce"]  # (and, internal: a bucket's composable gather)

if TYPE_CHECKING:
    from funcshard._plan import Plan


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


_THIRD = ("a gradient taken through a gather that divides by the plan's factor or sums over HSDP's replicas, fed to "
          "another gather (as in MAML), then differentiated twice more (three reverse levels) is not verified (two "
          "are exact; a gradient fed otherwise composes at any depth). Plan with grad_divide_factor=1.0 and a mesh "
          "without a replicate axis (gradients are then sums over ranks, exact at every order; divide the loss by the "
          "number of ranks to get the mean's), or use funcshard.gather")


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
        ctx._funcshard_node = "refused"  # (_toward_means stops here: a backward through it raises)

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


# ---- a gather's divide and replica sum, exact at second order -------------------------------------------------
#
# A gather's backward divides the reduce-scattered gradient by the plan's factor D (and sums it over HSDP's replicas):
# the gradient of the ranks' mean loss. The rule that makes two reverse levels exact: each reverse level divides (and
# sums over replicas) once on every derivative path through the gathered parameters, as the loss divided by D would.
# The inner level's gradient g = mean(RS(c)) (``_Mean``: the replica sum then the divide, a linear map of the
# cotangent) is a function of the state; the outer level differentiates it. On a path that reaches g from the outer
# loss through another gather's backward (MAML: g feeds the adapted state's gather), that gather already divided and
# summed over replicas, so the transpose of g's ``_Mean`` must not do it again: it is the identity there. On a path
# that reaches g otherwise (a gradient norm, a gradient penalty, grad(<g, v>): the outer value made from g by the
# caller's ops and collectives) it is ``_Mean``'s transpose, and the gather that g's graph leads back to divides.
# Which of the two a backward pass has is read from the graph: a gather whose input depends on a ``_Mean``'s output
# (``watch_means``) hooks the nodes between them, which record the cotangents the gathers send; at the ``_Mean`` the
# received cotangent equal to the recorded sum is the first kind, none recorded the second, and anything else (both
# at once) is refused.

_NODE = "_funcshard_node"  # on a gather's backward node: "gather"; on a gradient's _Mean node: "mean"; "refused"
_DIVIDES = "_funcshard_divides"  # on a gather's backward node: True where its backward divides or sums over replicas


_WATCH = "_funcshard_watch"  # in a watched node's ``metadata``: its token (``_Paths``' key for it)
_PATHS = "_funcshard_paths"  # in a watched ``_Mean`` node's ``metadata``: its ``_Paths``
_HOW = "_funcshard_how"  # in a watched ``_Mean`` node's ``metadata``: (graph task, what it received)


class _Token:
    """A watched node's key in ``_Paths`` (kept in the node's ``metadata``): ``_Paths`` and the hooks hold tokens and
    ``metadata`` dicts, never a node, so no reference cycle runs through autograd's C++ nodes (which Python's cycle
    collector cannot see: a cycle there kept a MAML step, its groups gathered, alive for good)."""

    __slots__ = ()


class _Paths:
    """The tokens of the nodes between gathers and the ``_Mean``s their inputs depend on (``watched``), and per
    backward pass (graph task) the cotangents the gathers sent through them (``rec``), what each received (``how``:
    "gathers", "other", "mixed", "batched") and those that a "mixed" one sent to (``mixed``)."""

    def __init__(self):
        self.watched: set = set()
        self.task, self.rec, self.how, self.mixed = None, {}, {}, set()

    def state(self) -> _Paths:
        task = current_graph_task_id()
        if task != self.task:
            self.task, self.rec, self.how, self.mixed = task, {}, {}, set()
        return self


def _token(node) -> _Token:
    """``node``'s token (made once, kept in its ``metadata``)."""
    return node.metadata.setdefault(_WATCH, _Token())


def _same(got: torch.Tensor, parts: list) -> bool:
    """Whether the cotangent ``got`` is exactly the sum of the recorded ``parts`` (autograd's order of accumulation)."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return got is not None and got.shape == total.shape and torch.equal(got, total)


def _classify(paths: _Paths, key: _Token, meta):
    """A pre-hook of the node whose token is ``key`` (``meta``: its ``metadata`` where it is a ``_Mean``'s, else
    None): what its received cotangents are (``_Paths.how``), for this backward pass."""
    def pre(grad_outputs):
        st = paths.state()
        got = st.rec.pop(key, None)
        how = "other" if got is None else "gathers"
        if key in st.mixed:  # (from a node that received both)
            how = "mixed"
        elif got is not None and any(i.key() == TransformType.Vmap for i in get_interpreter_stack() or ()):
            how = "batched"  # (batched cotangents: not compared)
        elif got is not None:
            for nr, g in enumerate(grad_outputs):
                parts = got.get(nr)
                if (parts is None and g is not None) or (parts is not None and not _same(g, parts)):
                    how = "mixed"
        st.how[key] = how
        if meta is not None:
            meta[_HOW] = (st.task, how)
    return pre


def _record(paths: _Paths, node, always: bool):
    """A hook of ``node``: record what it sends on to watched nodes where it received gathers' cotangents only
    (``always``: a gather's own node). The hook holds the token and the next nodes' ``metadata``, not the nodes."""
    key = None if always else _token(node)
    nexts = [None if nxt is None else (nxt.metadata, nr) for nxt, nr in node.next_functions]

    def post(grad_inputs, grad_outputs):
        st = paths.state()
        how = "gathers" if always else st.how.get(key)
        for nxt, g in zip(nexts, grad_inputs):
            if g is None or nxt is None or nxt[0].get(_WATCH) not in paths.watched:
                continue
            k = nxt[0][_WATCH]
            if how == "gathers":
                st.rec.setdefault(k, {}).setdefault(nxt[1], []).append(g)
            elif how == "mixed":
                st.mixed.add(k)
    return post


def _grad_fns(tensors) -> list:
    """The autograd nodes of ``tensors`` at every level under their torch.func wrappers (under ``vmap`` the graph is
    the unwrapped tensor's)."""
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        while True:
            if t.grad_fn is not None:
                out.append(t.grad_fn)
            if not is_functorch_wrapped_tensor(t):
                break
            t = get_unwrapped(t)
    return out


def _toward_means(tensors) -> dict:
    """The autograd nodes of ``tensors``' history, each with whether a gradient's ``_Mean`` is reached from it without
    crossing a gather's node (a ``_Mean`` maps to True; the walk stops at both)."""
    leads: dict = {}
    todo = [(n, False) for n in _grad_fns(tensors)]
    while todo:
        n, done = todo.pop()
        if done:
            leads[n] = any(leads.get(m, False) for m, _ in n.next_functions if m is not None)
        elif n not in leads:
            kind = getattr(n, _NODE, None)
            leads[n] = kind == "mean"
            if kind is None:
                todo.append((n, True))
                todo.extend((m, False) for m, _ in n.next_functions if m is not None and m not in leads)
    return leads


def depends_on_gradient(tensors) -> bool:
    """Whether ``tensors`` were made from a gradient taken through a gather that divides or sums over replicas (the
    adapted state of MAML): a gather of them must be one that ``watch_means`` hooks (``funcshard.apply`` then runs
    the traced path, not its runtime)."""
    return any(v and getattr(n, _NODE, None) == "mean" for n, v in _toward_means(tensors).items())


_SERIES = ("a gather whose gradient is divided by the plan's factor or summed over HSDP's replicas (traced_apply's, "
           "apply's) got a state made from the output of another such gather (the parameters or the module output of "
           "another traced_apply/apply call or of a funcshard.fully_shard module, through the caller's ops and "
           "collectives) within one reverse level: the gradient would be divided at each of the two gathers (off by "
           "the divide factor, silently). Plan one of the two calls with grad_divide_factor=1.0 and a mesh without a "
           "replicate axis (its gradients are then sums over ranks; a fully_shard module: "
           "set_gradient_divide_factor(1.0) on it), or gather that state with funcshard.gather (which sums)")
_SERIES_COMPILED = ("here the state was made by a torch.compile'd graph, and a dividing gather (traced_apply's, "
                    "apply's) was compiled in this process: what that graph gathers cannot be seen, so it is refused "
                    "as if it divides. Where the compiled graph holds no such gather, run it eagerly, make this "
                    "state in an eager function, or under torch.no_grad() where it needs no gradient (a compiled "
                    "optimizer step)")


_COMPILED = {"divides": False}  # whether a dividing gather was traced by torch.compile in this process


@assume_constant_result  # (dynamo runs it once, at trace time: the mutation is no side effect of the graph, which a
def _compiled_gather() -> bool:  # checkpoint HOP around the gather refuses under fullgraph=True)
    """Note that torch.compile traced a dividing gather (``_COMPILED``)."""
    _COMPILED["divides"] = True
    return True


def refuse_series(inputs, what: str) -> None:
    """``inputs``: the shards a gather that divides (or sums over replicas) is about to gather. Raise ``_SERIES``
    where one was made from the output of another dividing gather within this reverse level (``_toward_means``' walk,
    which stops at gradients' ``_Mean``s: the next reverse level's state, MAML's, is not this case), or from a
    torch.compile'd graph's output once a dividing gather was traced under torch.compile in this process (its
    gathers cannot be seen: refused conservatively). Nothing where no input has a history (a first-order step's
    leaves). Under torch.compile: notes the traced dividing gather (``_COMPILED``) and walks nothing."""
    if torch.compiler.is_compiling():
        if len(inputs):
            _compiled_gather()
        return
    if not _with_history(inputs):
        return
    for n in _toward_means(inputs):
        if getattr(n, _DIVIDES, False):
            raise NotImplementedError(f"{what}: {_SERIES}")
        if _COMPILED["divides"] and is_compiled_backward(n):
            raise NotImplementedError(f"{what}: {_SERIES}; {_SERIES_COMPILED}")


def _with_history(inputs) -> bool:
    """Whether a gather's ``inputs`` may depend on a gradient's ``_Mean`` (a history, or torch.func wrappers over
    one), outside torch.compile: else ``watch_means`` and ``refuse_unwatched`` walk nothing (a first-order step's
    leaves)."""
    return not torch.compiler.is_compiling() and (
        any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in inputs)
        or any(is_functorch_wrapped_tensor(t) for t in inputs))


def watch_means(inputs, out: torch.Tensor) -> None:
    """``out``: a gather's output made from ``inputs``. Where an input depends on a gradient's ``_Mean`` (not through
    another gather), hook the nodes between them (the section's comment). Nothing where none does (a first-order
    step: leaves), and nothing under torch.compile."""
    if not _with_history(inputs):
        return
    leads = _toward_means(inputs)
    means = [n for n, v in leads.items() if v and getattr(n, _NODE, None) == "mean"]
    if not means:
        return
    keys = [i.key() for i in get_interpreter_stack() or ()]
    if TransformType.Vmap in keys and TransformType.Grad in keys[keys.index(TransformType.Vmap):]:
        for m in means:  # (a grad inside vmap: its backward runs on batched cotangents, not compared: refused)
            m._funcshard_batched = True
    paths = next((p for p in (m.metadata.get(_PATHS) for m in means) if p is not None), None) or _Paths()
    for m in means:
        other = m.metadata.get(_PATHS)
        if other is not None and other is not paths:  # (two gathers' walks met: one record for both)
            paths.watched |= other.watched
            other.__dict__ = paths.__dict__
        m.metadata[_PATHS] = paths
    new = [n for n, v in leads.items() if v and _token(n) not in paths.watched]
    paths.watched.update(_token(n) for n in new)
    for n in new:
        mean_node = getattr(n, _NODE, None) == "mean"
        n.register_prehook(_classify(paths, _token(n), n.metadata if mean_node else None))
        if not mean_node:
            n.register_hook(_record(paths, n, False))
    for node in _grad_fns((out,)):
        node.register_hook(_record(paths, node, True))


def refuse_unwatched(inputs) -> None:
    """A gather that neither divides nor sums over replicas (a summing one: ``funcshard.gather``'s, a plan's with
    ``grad_divide_factor=1.0``, ``funcshard.all_gather``) is not watched: where one of ``inputs`` depends on a
    gradient's ``_Mean``, mark that ``_Mean``, whose backward then refuses rather than taking its transpose (which
    would divide a second time on that path). Nothing where no input has a history (a first-order step)."""
    if not _with_history(inputs):
        return
    for n, v in _toward_means(inputs).items():
        if v and getattr(n, _NODE, None) == "mean":
            n._funcshard_unwatched = True


def _again() -> bool:
    """Whether the running backward pass is itself differentiated (a third reverse level)."""
    grads = sum(i.key() == TransformType.Grad for i in get_interpreter_stack() or ())
    return grads >= 2 if grads else torch.is_grad_enabled()


_MIXED = ("the gradient taken through a gather of the state (divided by the plan's factor or summed over HSDP's "
          "replicas) reaches the outer loss both through another gather (as in MAML: the adapted state gathered "
          "again) and otherwise (a norm or product of the gradient itself): each path needs the divide once, and the "
          "two arrive summed. Plan with grad_divide_factor=1.0 and a mesh without a replicate axis (sums over ranks, "
          "exact at every order; divide the loss by the number of ranks for the mean's), or use funcshard.gather")


def _divide_context(ctx, inputs, output, kind: str) -> None:
    """``_Mean``'s and ``_Divided``'s context: ``(factor, group, keep)`` and the node's kind for ``watch_means``."""
    ctx.factor, ctx.group, ctx.keep, ctx.shard = inputs[1:]
    setattr(ctx, _NODE, kind)
    setattr(ctx, _DIVIDES, kind == "gather")  # (a _Divided exists where there is a divide or a replica sum)


_UNWATCHED = ("the gradient taken through a gather that divides by the plan's factor or sums over HSDP's replicas "
              "is gathered again by a gather that does neither (funcshard.gather, funcshard.all_gather, a plan with "
              "grad_divide_factor=1.0 and no replicate axis, or funcshard.apply's runtime under plain autograd): that "
              "second derivative is not checked. Gather the adapted state with the same kind of plan as the inner "
              "gradient's (traced_apply, or apply under torch.func), or plan both with grad_divide_factor=1.0 and a "
              "mesh without a replicate axis (sums over ranks, exact at every order)")


_BATCHED = ("a gradient taken through a gather that divides by the plan's factor or sums over HSDP's replicas, fed to "
            "another gather (as in MAML), differentiated again under vmap (an ensemble or a batch of MAML "
            "meta-gradients: vmap(grad(...)) over the meta-loss): which paths the batched cotangents took is not "
            "checked. vmap inside the outer grad (grad(vmap(...)), a meta-batch of tasks) composes; else plan with "
            "grad_divide_factor=1.0 and a mesh without a replicate axis, or use funcshard.gather")


class _Mean(torch.autograd.Function):
    """A gather's reduce-scattered gradient summed over ``group`` (HSDP's replicas; None: no sum) and divided by
    ``factor``: a linear map, whose backward is its transpose or the identity (the section's comment; ``keep``: the
    factor the identity multiplies by, the part of the divide that an earlier ``_Mean`` of the same gather applies);
    jvp: the same map of the tangent; vmap: elementwise (one collective for the batch)."""

    @staticmethod
    @untraced
    def forward(x, factor, group, keep, shard):
        with no_functorch():
            y = _ar(x, group, "a gather's gradient all-reduce over the replicate axis") if group is not None else x
            return y / factor if factor != 1.0 else y

    setup_context = staticmethod(functools.partial(_divide_context, kind="mean"))

    @staticmethod
    @untraced
    def backward(ctx, c):
        return _mean_cotangent(ctx, c), None, None, None, None

    @staticmethod
    @untraced
    def jvp(ctx, t, *_):
        return _Mean.apply(t, ctx.factor, ctx.group, ctx.keep, ctx.shard)

    @staticmethod
    @untraced
    def vmap(info, in_dims, x, factor, group, keep, shard):
        return _Mean.apply(x, factor, group, keep, shard), in_dims[0]


def _mean_cotangent(ctx, c: torch.Tensor) -> torch.Tensor:
    """A ``_Mean`` node's (or ``_GivenScatter``'s) cotangent for its input: the identity (times ``keep``) on a path
    through another gather, the transpose otherwise (the section's comment), or the refusals."""
    mark, paths = ctx.metadata.get(_HOW), ctx.metadata.get(_PATHS)
    how = mark[1] if mark is not None and mark[0] == current_graph_task_id() else "other"
    if getattr(ctx, "_funcshard_batched", False):
        how = "batched"
    elif how == "other" and paths is not None:
        how = "mixed"  # (a gather's input depends on it, yet none of that gather's cotangent was seen: refused)
    if how in ("gathers", "mixed") and paths is not None:
        how = _agreed(how, ctx, c)
    if how in ("other", "gathers") and getattr(ctx, "_funcshard_unwatched", False):
        raise NotImplementedError(f"funcshard, a backward under {transform_stack()}: {_UNWATCHED}")
    if how == "mixed":
        raise NotImplementedError(f"funcshard, a backward under {transform_stack()}: {_MIXED}")
    if how == "batched":
        raise NotImplementedError(f"funcshard, a backward under {transform_stack()}: {_BATCHED}")
    if how == "gathers":
        if _again():
            raise NotImplementedError(f"funcshard, a backward under {transform_stack()}: {_THIRD}")
        return c if ctx.keep == 1.0 else c * ctx.keep
    return _Mean.apply(c, ctx.factor, ctx.group, ctx.keep, ctx.shard)


def _agreed(how: str, ctx, c: torch.Tensor) -> str:
    """``how`` as every rank of the gather sees it: "mixed" where any rank's cotangents were. The comparison is of
    values, and a rank whose other path contributes exactly zero (a shard of padding alone: at W=4 the table's model
    has such ranks) sees the gathers' alone; alone, it would take the identity while the others raise, and the ranks'
    collectives part (gloo aborted). One all-reduce of a flag over the shard axis (``ctx.shard``) and one over the
    replicate axis, in the backward of a watched ``_Mean`` only (the second reverse level of MAML with a divide)."""
    flag = torch.tensor([float(how == "mixed")], device=c.device)
    with no_functorch():
        for g in (ctx.shard, ctx.group):
            if g is not None and dist.get_world_size(g) > 1:
                bounded_all_reduce(flag, g, "the ranks' agreement on a second-order gradient's paths (funcshard)")
    return "mixed" if flag.item() > 0 else how


def mean(g: torch.Tensor, factor: float, group=None, keep: float = 1.0, shard=None) -> torch.Tensor:
    """``g`` summed over ``group`` and divided by ``factor`` as ``_Mean`` (``g`` itself where there is nothing to
    do): a gather's differentiable gradient divide. ``shard``: the gather's shard-axis group (its ranks agree on
    what the backward takes: ``_agreed``)."""
    return g if factor == 1.0 and group is None else _Mean.apply(g, factor, group, keep, shard)


class _Divided(torch.autograd.Function):
    """The identity whose backward is ``mean`` of the cotangent (a gather's divide and replica sum, at every order);
    jvp: the tangent. Its node is a gather's for ``watch_means``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, factor, group, keep, shard):
        return x.clone()

    setup_context = staticmethod(functools.partial(_divide_context, kind="gather"))

    @staticmethod
    @untraced
    def backward(ctx, g):
        return mean(g, ctx.factor, ctx.group, ctx.keep, ctx.shard), None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return t.clone()


def divided(x: torch.Tensor, factor: float, group=None, keep: float = 1.0, shard=None) -> torch.Tensor:
    """``x``, whose gradient is summed over ``group`` and divided by ``factor`` (``_Divided``; ``x`` itself where
    there is nothing to do; ``shard``: ``mean``'s)."""
    if factor == 1.0 and group is None:
        return x
    out = _Divided.apply(x, factor, group, keep, shard)
    watch_means((x,), out)
    return out


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
    refuse_unwatched((x,))
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


def divides(b: Bucket) -> bool:
    """Whether the bucket's gather divides its gradient (by the plan's factor) or sums it over HSDP's replicas."""
    return b.before != 1.0 or b.after != 1.0 or b.replicate_group is not None


def bucket_param(s: ShardSpec) -> Param:
    """A planned parameter's ``Param``."""
    return Param(s.fqn, s.dtype, *geometry(s.shape, s.dim, s.world), s.shape, s.aliases)


def _buckets(plan: Plan) -> tuple[Bucket, ...]:
    pg, _ = plan.shard_group()
    rep = plan.replicate_group()
    out = []
    for g in plan.groups:
        by_dtype: dict[torch.dtype, list] = {}
        for p in g.params:
            s = plan.specs[p]
            by_dtype.setdefault(compute_dtype(s.dtype, g.param_dtype), []).append(s)
        for dt, specs in by_dtype.items():
            rdt = reduce_dtype_of(dt, g.reduce_dtype)
            before, after = divide_factors(plan.divide_factor_of(g), rdt)
            out.append(Bucket(
                g.name, dt, rdt, before, after, plan.world, pg.group_name, None if rep is None else rep.group_name,
                tuple(bucket_param(s) for s in specs),
                bool(g.reshard_after_forward)))
    return tuple(out)


def buckets(plan: Plan) -> tuple[Bucket, ...]:
    """The plan's buckets (each group's parameters by compute dtype, with the reduce dtype and the divide factors),
    made once per plan: ``traced_apply``'s gathers', and the buckets ``apply``'s runtime reduce-scatters by in a
    ``create_graph=True`` backward (``_runtime.strategies.second_order_grads``)."""
    return plan.derived("buckets", _buckets)


def unflatten(b: Bucket, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The bucket's parameters out of its all-gather output ``(world * n,)``, rank-major (padding dropped)."""
    full = full.view(b.world, -1)
    out, k = [], 0
    for p in b.params:
        out.append(column(b, p, full[:, k : k + p.numel]))
        k += p.numel
    return tuple(out)


def column(b: Bucket, p: Param, cols: torch.Tensor) -> torch.Tensor:
    """One parameter of the bucket out of its columns ``(world, p.numel)`` of the all-gather layout (every rank's
    shard; padding dropped): ``rows``' transpose."""
    piece = cols.reshape(b.world, *p.local_shape)  # (W, *local_shape): every rank's shard
    return unpad(from_split(piece, p.dim, p.padded_shape), p.dim, p.size, p.padding, p.shape)


def rows(b: Bucket, p: Param, g: torch.Tensor) -> torch.Tensor:
    """``unflatten``'s transpose for one of the bucket's parameters: its full gradient ``g`` (``p.shape``) as its
    columns of the all-gather layout, ``(world, p.numel)`` rank-major, zeros in the padding (torch ops only:
    differentiable at any order)."""
    d, shape = p.dim, list(p.padded_shape)
    shape[d] = p.size
    g = g.reshape(shape)
    if p.padding:
        shape[d] = p.padding
        g = torch.cat([g, g.new_zeros(shape)], d)
    split = list(p.padded_shape)
    split[d : d + 1] = [b.world, p.padded_shape[d] // b.world]
    return g.reshape(split).movedim(d, 0).reshape(b.world, p.numel)


def scatter_mean(b: Bucket, cols: torch.Tensor, group, replicate=None) -> torch.Tensor:
    """A gather's backward made of the differentiable primitives: the bucket's gradient columns ``cols``
    (``(world, n)`` rank-major, in ``b.reduce``) divided by ``b.before``, reduce-scattered (sum) over ``group``,
    summed over ``replicate`` (HSDP) and divided by ``b.after`` (``mean``: one divide per reverse level on every path,
    the section's comment). Returns this rank's ``(n,)``; its backward is the gather of the cotangent (again
    differentiable): a ``create_graph=True`` backward (``traced_apply``'s c10d gather, ``apply``'s runtime) gets
    exact derivatives of any order."""
    out = mean(cols, b.before, shard=group).reshape(-1)
    out = _Collective.apply(out, "reduce_scatter", group) if b.world > 1 else out
    return mean(out, b.after, replicate, b.before, group)


class _GivenScatter(torch.autograd.Function):
    """``scatter_mean`` of a bucket's full gradients for shard gradients computed already: ``given`` (this rank's, one
    per parameter ``ps``: apply's runtime's first-order reduce-scatter under one ``torch.func.grad`` level) returned
    as they are, as functions of ``grads`` (the full gradients, with the graph plain autograd recorded below the
    transform). Nothing is computed in forward (no collective, no copy: the runtime's schedule and speed stay);
    backward is ``scatter_mean``'s: the ``_Mean`` after the reduce-scatter (a ``_Mean`` node for ``watch_means`` where
    there is one: the identity on a path through another gather, else the transpose), the gather of the cotangent,
    the divide before it and ``rows``' transpose (``column``); ``ready()`` first (the runtime gathers the groups the
    graph below reads)."""

    @staticmethod
    def forward(meta, *tensors):
        return tuple(t.view_as(t) for t in tensors[: len(meta[0])])

    @staticmethod
    def setup_context(ctx, inputs, output):
        (ps, b, group, replicate, ready) = ctx.meta = inputs[0]
        ctx.divides = b.after != 1.0 or replicate is not None
        # (a _Mean where the divide after the reduce-scatter or the replica sum is one: scatter_mean has no _Mean
        # there, and watch_means walks on through it, as through the reduce-scatter)
        _divide_context(ctx, (None, b.after, replicate, b.before, group), output, "mean" if ctx.divides else None)
        ctx.dtypes = [None if t is None else t.dtype for t in inputs[1 + len(ps):]]  # (None: no gradient came)

    @staticmethod
    @untraced
    def backward(ctx, *us):
        ps, b, group, _, ready = ctx.meta
        if ready is not None:
            ready()
        device = next(g for g in us if g is not None).device  # (autograd calls it with one at least)
        u = torch.cat([(torch.zeros(p.local_shape, dtype=b.reduce, device=device) if g is None else g)
                       .reshape(-1).to(b.reduce) for p, g in zip(ps, us)])
        c = _mean_cotangent(ctx, u) if ctx.divides else u
        full = _Collective.apply(c, "all_gather", group) if b.world > 1 else c
        cols = mean(full, b.before, shard=group).view(b.world, -1)
        out, k = [], 0
        for p, dt in zip(ps, ctx.dtypes):
            out.append(None if dt is None else column(b, p, cols[:, k : k + p.numel]).to(dt))
            k += p.numel
        return (None, *[None] * len(ps), *out)


def given_scatter_mean(b: Bucket, ps: list, given: list, grads: list, group, replicate=None,
                       ready=None) -> tuple[torch.Tensor, ...]:
    """``scatter_mean`` of the bucket's parameters ``ps``' full gradients ``grads`` (by ``rows``; ``b.params``' or some
    of them, in their order, the same on every rank; None: none came, zeros), whose value is ``given`` (their shard
    gradients, computed already: ``_GivenScatter``);
    ``ready``: called first in backward. Under a torch.func level (its backward: the runtime's gradient hooks), on the
    plain tensors below it, with functorch off: Function.apply would hand them to functorch; the C++ apply records them
    in plain autograd."""
    return _plain_apply(_GivenScatter, (ps, b, group, replicate, ready), *given, *grads)


def _plain_apply(fn: type[torch.autograd.Function], *args):
    """``fn.apply(*args)`` by the C++ apply (plain autograd), also where torch.func transforms are active (with
    functorch disabled, on plain tensors)."""
    allowed = single_level_function_allowed()
    allow_single_level_function(True)
    try:
        return fn.apply(*args) if function_base_apply is None else function_base_apply.__get__(None, fn)(*args)
    finally:
        allow_single_level_function(allowed)


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
    if divides(b):
        refuse_series(shards, what)
    else:  # (a summing gather: not watched)
        refuse_unwatched(shards)
    flat = divided(flat, b.after, replicate, b.before, group)
    full = _Collective.apply(flat, "all_gather", group) if b.world > 1 else flat
    full = divided(full, b.before, shard=group).to(b.compute)
    return unflatten(b, full)
