"""Differentiable collectives, and the bucketed per-group all-gather / reduce-scatter the runtime uses.

all_gather and reduce_scatter are each other's transpose: the backward of all_gather is a reduce-scatter
with a *sum* (the mathematical transpose), and vice versa; all_reduce (sum) is its own transpose. None of
them averages: data-parallel averaging is one explicit divide, applied by the runtime after the gradient
reduce-scatter (``Plan.divide_factor``), never inside these functions.

Asynchrony: every collective is issued with ``async_op=True`` and its work handle is waited before the
result is read. On CUDA with NCCL the collective runs on the process group's own communication stream and
``Work.wait()`` makes the consuming stream wait on it (an event fence, the CPU does not block); on CPU with
gloo, the collective runs on gloo's threads while Python continues, and ``wait()`` blocks.

Bounded waits: every wait of the runtime goes through ``wait_work`` (the one owner). On a process group whose waits
block the CPU (gloo) it waits at most the plan's timeout (``Work.wait(timeout=...)``, c10d's own mechanism; gloo's
reduce-scatter ignores that timeout, so its wait runs in a helper thread, ``_Waiter``), then raises a
``CollectiveTimeout`` naming the collective, its group and the step's phase; a collective that fails (a peer that
died: gloo's "Connection reset by peer") raises a ``CollectiveError``. Either way the process group is marked broken
(``broken``): a collective of it may still be pending in gloo's threads, tags no longer pair up, so every later wait
on it raises at once (no second timeout) and nothing frees a buffer such a collective may still write. On NCCL
``wait()`` is a stream fence (the CPU does not wait; a bounded wait would block it), so there the bound is the process
group's own timeout, enforced by NCCL's watchdog (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from funcshard import _comm
from funcshard._comm import CommHook
from funcshard._compat import (
    DisableFuncTorch,
    TransformType,
    all_gather_name,
    chunk_cat,
    dispatch_keys,
    foreach_copy_,
    get_interpreter_stack,
    get_unwrapped,
    is_functorch_wrapped_tensor,
    reduce_scatter_name,
    unflatten_dense_tensors,
)
from funcshard._mesh import shard_group
from funcshard._policy import compute_dtype, divide_factors, reduce_dtype_of
from funcshard._schedule import bucket_sizes
from funcshard._spec import ShardingError, ShardSpec

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "CollectiveError", "CollectiveTimeout", "DivergenceError"]

# torch 2.13 renamed the tensor collectives; keep working on older releases (the names: _compat). Looked up on
# every call, so that tools which wrap torch.distributed's functions (collective counters, tracers) see ours.
_AG_NAME = all_gather_name
_RS_NAME = reduce_scatter_name


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    return getattr(dist, _AG_NAME)(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    return getattr(dist, _RS_NAME)(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


# ---- bounded waits: the one owner of every wait of the runtime ---------------------------------


class CollectiveError(ShardingError, RuntimeError):
    """A collective of a step failed (a peer died) or timed out (``CollectiveTimeout``), or the ranks were found to
    disagree (``DivergenceError``). The message names the collective, the group, the phase of the step and the fix;
    after one, the process group is broken: ``funcshard`` refuses further collectives on it."""

    def __init__(self, message: str, *, repeat: bool = False):
        super().__init__(message)
        self.repeat = repeat  # raised again for a process group an earlier failure broke (cleanup may ignore it)


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the plan's ``timeout`` (a rank died, stalled, or ran another
    collective: a forward that skipped a group, another number of microbatches)."""


class DivergenceError(CollectiveError):
    """The ranks disagree on what the step does (which parameters take gradients; in check mode, the sequence of
    collectives): found before the mismatched collective runs, raised on every rank."""


DEFAULT_TIMEOUT = 300.0  # s: torchtitan's bound for the first steps (compilation, warm-up), 1/6 of gloo's 30 min
TIMEOUT_ENV = "FUNCSHARD_TIMEOUT"  # seconds; overrides the default (0 or "none": unbounded, the group's own)


def resolve_timeout(timeout: float | None) -> float | None:
    """A plan's ``timeout`` in seconds (None: the ``FUNCSHARD_TIMEOUT`` environment variable, else
    ``DEFAULT_TIMEOUT``); None: unbounded (0, inf, or the variable set to 0 or "none")."""
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV, "").strip().lower()
        if not env:
            return DEFAULT_TIMEOUT
        if env in ("none", "inf", "0", "0.0"):
            return None
        try:
            timeout = float(env)
        except ValueError:
            raise ShardingError(f"{TIMEOUT_ENV}={env!r} is not a number of seconds; set it to e.g. 120, or to "
                                f"none for no bound") from None
    return None if timeout == 0 or timeout == float("inf") else float(timeout)


def check_timeout(timeout: Any, where: str) -> None:
    """A ``timeout`` given to ``plan`` or ``fully_shard``: None or seconds > 0 (0 or inf: unbounded)."""
    if timeout is None:
        return
    if isinstance(timeout, timedelta):
        raise ShardingError(f"{where}: timeout={timeout!r}; give seconds as a number, e.g. "
                            f"timeout={timeout.total_seconds():g}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0 or timeout != timeout:
        raise ShardingError(f"{where}: timeout={timeout!r} is not a number of seconds >= 0; pass e.g. timeout=120 "
                            f"(0 or float('inf'): no bound of funcshard's own, the process group's timeout applies)")


class Bound:
    """A step's bound on its waits over one process group: the timeout (None: unbounded, or a stream fence on NCCL)
    and the plan's description for messages."""

    __slots__ = ("pg", "timeout", "seconds", "plan")

    def __init__(self, pg, seconds: float | None, plan: str):
        self.pg, self.seconds, self.plan = pg, seconds, plan
        host = pg is not None and _host_waits(pg)
        self.timeout = timedelta(seconds=seconds) if seconds is not None and host else None


class Where(NamedTuple):
    """What a wait is for: the collective's kind, the plan's group, the step's phase, and the bound."""
    kind: str
    group: str
    phase: str
    bound: Bound
    pg: Any = None  # (None: the bound's process group)


# Per process group, weakly (a destroyed group's gloo threads and sockets go with its last reference):
_HOST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> whether its waits block the CPU
_BROKEN: dict[Any, str] = {}  # process group -> what broke it; strongly: a wrapper nobody holds would vanish from a
# weak map and its group be trusted again (pybind returns the same wrapper while one lives); ``forget`` drops it


def _host_waits(pg) -> bool:
    """Whether ``Work.wait()`` blocks the CPU on this process group (gloo), not a stream fence (NCCL), and there are
    peers to wait for (not the fake group: its works never complete, its waits return at once)."""
    hit = _HOST.get(pg)
    if hit is None:
        try:
            name = dist.get_backend(pg)
        except (RuntimeError, ValueError):
            name = "gloo"
        hit = _HOST[pg] = str(name) not in ("nccl", "xccl", "fake")
    return hit


def broken(pg) -> str | None:
    """What broke the process group (a collective of it failed or timed out), or None."""
    return None if pg is None else _BROKEN.get(pg)


def pg_desc(pg) -> str:
    """The process group as messages name it: its name and ranks."""
    try:
        ranks = dist.get_process_group_ranks(pg)
    except (RuntimeError, ValueError):
        ranks = "?"
    return f"process group {getattr(pg, 'group_name', '?')!r} (ranks {ranks})"


def describe(where: Where) -> str:
    if where.group is None:  # (a public collective: funcshard.all_gather / reduce_scatter / all_reduce)
        return f"the {where.kind} of {where.phase}"
    return f"the {where.kind} of group {_comm.group_label(where.group)} ({where.phase})"


def public_where(kind: str, what: str, group, timeout: float | None = None) -> Where:
    """Where a collective outside a step (``what``, e.g. ``funcshard.all_gather``) waits: bounded by ``timeout``
    (a plan's; None: as a plan without one, ``FUNCSHARD_TIMEOUT``, else ``DEFAULT_TIMEOUT``); on a group broken by an
    earlier failure it is refused before it is issued."""
    if (cause := broken(group)) is not None:
        raise CollectiveError(f"funcshard: {what} was not issued: {pg_desc(group)} is broken by an earlier failure "
                              f"({cause}). " + _FIX.format(why=cause), repeat=True)
    seconds = resolve_timeout(timeout)
    bound = "unbounded" if seconds is None else f"{seconds:g} s"
    source = f"timeout={timeout:g}" if timeout is not None else TIMEOUT_ENV
    return Where(kind, None, what, Bound(group, seconds, f"none; {what} is bounded by {source} ({bound})"))


def bounded_all_reduce(t: torch.Tensor, group, what: str, op=dist.ReduceOp.SUM, timeout: float | None = None) -> None:
    """``dist.all_reduce`` of ``t`` in place, its wait bounded as ``public_where`` says (``what`` names it)."""
    where = public_where("all-reduce", what, group, timeout)
    wait_work(dist.all_reduce(t, op=op, group=group, async_op=True), where)


_FIX = ("Make every rank run the same groups in the same order (no data-dependent skipping of a group, the same "
        "number of microbatches and forwards), and find the rank that failed first in its own log. The process group "
        "can no longer be trusted ({why}): end the job and restart it (torchrun restarts it from the last checkpoint), "
        "or destroy it and make a new one with a new mesh, plan and state. Raise the bound with plan(..., timeout=s), "
        "model.set_timeout(s) (fully_shard) or FUNCSHARD_TIMEOUT=s if a rank is legitimately that slow.")


def wait_work(work, where: Where | None) -> None:
    """Wait for ``work`` (the one place the runtime waits), bounded by ``where.bound``; a failure or timeout raises
    a CollectiveError naming ``where`` and marks the process group broken."""
    if work is None:
        return
    if where is None:
        work.wait()
        return
    pg = where.pg if where.pg is not None else where.bound.pg
    if (cause := broken(pg)) is not None:
        raise CollectiveError(f"funcshard: {describe(where)} was not waited for: {pg_desc(pg)} is broken by an "
                              f"earlier failure ({cause})", repeat=True)
    bound = where.bound
    try:
        if bound.timeout is None or pg is not bound.pg and not _host_waits(pg) or work.is_completed():
            work.wait()
        elif where.kind == "reduce-scatter":  # gloo's reduce-scatter work ignores wait's timeout
            if not _Waiter.wait(work, bound.seconds):
                raise collective_failed(where, pg, None, True)
        else:
            work.wait(timeout=bound.timeout)
    except RuntimeError as e:
        if isinstance(e, CollectiveError):
            raise
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        raise collective_failed(where, pg, e, timed_out) from e


class _Waiter:
    """A thread that waits for works whose own ``wait(timeout)`` ignores the timeout (gloo's reduce-scatter runs
    inside its ``wait``); the caller waits for the thread, bounded. A thread left waiting for a collective that timed
    out is retired (it ends when gloo gives up) and a new one serves later waits."""

    current: _Waiter | None = None

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.retired = False
        threading.Thread(target=self._run, name="funcshard-wait", daemon=True).start()

    def _run(self) -> None:
        while not self.retired:
            work, done, box = self.queue.get()
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 (handed to the waiting caller)
                box.append(e)
            work = None  # (not held while the thread waits for the next: a work keeps its tensors alive)
            done.set()

    @classmethod
    def wait(cls, work, seconds: float) -> bool:
        """Wait for ``work`` at most ``seconds``; False if it did not complete (its exception, if any, raised)."""
        me = cls.current
        if me is None:
            me = cls.current = _Waiter()
        done, box = threading.Event(), []
        me.queue.put((work, done, box))
        if not done.wait(seconds):
            me.retired, cls.current = True, None
            return False
        if box:
            raise box[0]
        return True


def collective_failed(where: Where, pg, error: BaseException | None, timed_out: bool,
                      detail: str = "") -> CollectiveError:
    """The error for a collective that failed or timed out; marks its process group broken."""
    what = describe(where)
    if timed_out:
        head = (f"funcshard: {what} did not complete within {where.bound.seconds:g} s on {pg_desc(pg)} (plan: "
                f"{where.bound.plan}){detail}: a rank died, stalled, or is waiting in another collective (a forward "
                f"that skipped a group on some ranks, another number of microbatches or forwards, a rank that "
                f"raised).")
        why = "its collective is still pending in the backend"
    else:
        head = (f"funcshard: {what} failed on {pg_desc(pg)} (plan: {where.bound.plan}){detail}: "
                f"{str(error).strip().splitlines()[-1] if error is not None else 'unknown'}. A peer rank died or "
                f"ran a different collective.")
        why = "a collective of it failed"
    _BROKEN[pg] = f"{what} {'timed out' if timed_out else 'failed'}"
    cls = CollectiveTimeout if timed_out else CollectiveError
    return cls(head + " " + _FIX.format(why=why))


def mark_broken(pg, cause: str) -> None:
    _BROKEN[pg] = cause


def forget(pg) -> None:
    """Drop a destroyed process group (``dist.destroy_process_group``) from the broken ones, so that nothing of
    funcshard keeps it (its gloo threads and sockets): ``tests/multirank`` after each job."""
    _BROKEN.pop(pg, None)


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any functorch wrappers (itself if none)."""
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def raw(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any functorch wrappers, detached (shares storage)."""
    return unwrapped(t).detach()


def raw_grads(grads: list) -> None:
    """In place: each gradient as a plain tensor (``raw``); one that is already plain and has no autograd
    history (the usual case) is kept as it is. In place, so that no loop variable is left holding one."""
    grads[:] = [g if g is None or not (g.requires_grad or is_functorch_wrapped_tensor(g)) else raw(g)
                for g in grads]


def no_grad():
    """``torch.no_grad()``, or nothing where grad is already off (most calls on the hot path: the runtime turned
    it off; ``torch.no_grad()`` costs ~2.5 us a use, ~7 uses a group a step)."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


def no_functorch():
    """In-place and communication work inside a backward under a functorch transform runs with functorch off."""
    return DisableFuncTorch()


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


def check_batched_grads(what: str, grads) -> None:
    """Plain autograd's batched backward (torch.autograd.grad(..., is_grads_batched=True)) hands the sharded
    gather batched gradients (a dispatch key, not a torch.func level): refuse them as vmap's."""
    g = next((g for g in grads if g is not None), None)
    if g is not None and "Batched" in repr(dispatch_keys(g)):  # (the key is not in Python's enum)
        raise NotImplementedError(
            f"the backward of {what} got batched gradients (torch.autograd.grad(..., is_grads_batched=True)): "
            f"batched cotangents through the sharded gather are not built yet; call torch.autograd.grad once per "
            f"cotangent (retain_graph=True)")


def _group_of(where) -> dist.ProcessGroup:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(where, DeviceMesh):
        return shard_group(where)
    return where if where is not None else dist.group.WORLD


# ---- differentiable collectives (dim 0; under autograd and torch.func) --------------------------


def _ag(x: torch.Tensor, group, what: str = "funcshard.all_gather") -> torch.Tensor:
    w = dist.get_world_size(group)
    where = public_where("all-gather", what, group)
    x = x.contiguous()
    out = x.new_empty((w * x.shape[0], *x.shape[1:]))
    wait_work(all_gather_into(out, x, group), where)
    return out


def _rs(x: torch.Tensor, group, what: str = "funcshard.reduce_scatter") -> torch.Tensor:
    w = dist.get_world_size(group)
    if x.shape[0] % w:
        raise ValueError(
            f"reduce_scatter needs dim 0 divisible by the group size {w}, got shape {tuple(x.shape)}; pad it"
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


def _batched(fn, x, bdim, group):
    """vmap rule: move the batch dim to 1 so dim 0 stays the collective's dim."""
    if bdim is None:
        return fn(x, group), None
    x = x.movedim(bdim, 1) if x.dim() > 1 else x.movedim(bdim, 0).unsqueeze(0)
    return fn(x, group), 1


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        with no_functorch():
            return _ag(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        with no_functorch():
            return _rs(g, ctx.group, "the backward of funcshard.all_gather"), None

    @staticmethod
    def jvp(ctx, t, _):
        return _AllGather.apply(t, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _batched(_AllGather.apply, x, in_dims[0], group)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        with no_functorch():
            return _rs(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        with no_functorch():
            return _ag(g, ctx.group, "the backward of funcshard.reduce_scatter"), None

    @staticmethod
    def jvp(ctx, t, _):
        return _ReduceScatter.apply(t, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _batched(_ReduceScatter.apply, x, in_dims[0], group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        with no_functorch():
            return _ar(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        with no_functorch():
            return _ar(g, ctx.group, "the backward of funcshard.all_reduce"), None

    @staticmethod
    def jvp(ctx, t, _):
        return _AllReduce.apply(t, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _AllReduce.apply(x, group), in_dims[0]


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0. Backward: reduce-scatter (sum). ``group``: a
    ProcessGroup, a DeviceMesh (its shard axis, ``_mesh.dp_axes``) or None (the default group).

    Like the three public collectives (and their backward), it waits at most ``FUNCSHARD_TIMEOUT`` seconds (else 300)
    on gloo, then raises ``CollectiveTimeout`` naming it, and the group is refused afterwards (a rank that never
    joins: dead, or running something else); on NCCL the bound is NCCL's own watchdog."""
    return _AllGather.apply(x, _group_of(group))


def reduce_scatter(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks and give each rank its dim-0 slice. Backward: all-gather."""
    return _ReduceScatter.apply(x, _group_of(group))


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks. Backward: all-reduce (sum) of the cotangent."""
    return _AllReduce.apply(x, _group_of(group))


# ---- bucketed per-group collectives (one collective per group and dtype) ------------------------


def free_buffers(buffers) -> None:
    """Release communication buffers whose collective has completed."""
    for b in buffers:
        b.untyped_storage().resize_(0)


class Buckets:
    """The layout of one group's shards: one flat bucket per dtype, parameters at fixed offsets.

    Per-parameter layout: a bucket is the concatenation of the parameters' (equal-size) local shards; its
    all-gather output ``(world, n)`` is copied out into each parameter's padded tensor ("targets").
    Flat layout: a bucket is the group's flat buffer; the all-gather output is the parameters themselves.
    """

    def __init__(self, specs: Sequence[ShardSpec], only: Sequence[int] | None = None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None):
        self.specs = tuple(specs)
        self.world = specs[0].world if specs else 1
        self.flat = bool(specs) and specs[0].flat is not None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self._subsets: dict[tuple[int, ...], Buckets] = {}
        keep = None if only is None else set(only)
        # each parameter's compute dtype: what it is all-gathered and used in (its own, or param_dtype)
        self.compute = tuple(compute_dtype(s.dtype, param_dtype) for s in self.specs)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in range(len(self.specs)):
            if keep is None or i in keep:
                by_dtype.setdefault(self.compute[i], []).append(i)
        self.buckets = tuple((dt, tuple(ix)) for dt, ix in by_dtype.items())  # keyed by compute dtype
        self.numels = {dt: [self.specs[i].local_numel for i in ix] for dt, ix in self.buckets}
        self.dim0 = {dt: not self.flat and all(self.specs[i].dim == 0 for i in ix) for dt, ix in self.buckets}
        # elements per rank of each bucket's collective, and whether padding is among them (the schedule's sizes)
        sizes = bucket_sizes([self.specs[i] for _, ix in self.buckets for i in ix], param_dtype)
        self.chunk = {dt: n for dt, (n, _) in sizes.items()}
        self.has_padding = {dt: pad for dt, (_, pad) in sizes.items()}
        # the gradient's reduce-scatter dtype, and the shards' dtype it is cast back to (None: they differ within
        # the bucket, e.g. fp32 and bf16 parameters both computing in bf16: cast piece by piece)
        self.reduce = {dt: reduce_dtype_of(dt, reduce_dtype) for dt, _ in self.buckets}
        origs = {dt: {self.specs[i].dtype for i in ix} for dt, ix in self.buckets}
        self.shard_dtype = {dt: next(iter(o)) if len(o) == 1 else None for dt, o in origs.items()}
        # this rank's gradient shards, consecutive in the reduce-scatter output (flat layout: the parameters'
        # pieces of this rank's slice), as meta tensors for one-call views of it (torch's unflatten_dense_tensors;
        # a Python loop of views costs ~3 us a parameter)
        meta = torch.device("meta")
        self.shard_templates = {dt: [torch.empty(self.specs[i].local_shape, dtype=self.shard_dtype[dt] or
                                                 self.reduce[dt], device=meta) for i in ix]
                                for dt, ix in self.buckets}
        # a 0-dim parameter's gradient is viewed as (1,) for torch._chunk_cat
        self.scalar = {dt: any(not self.specs[i].shape for i in ix) for dt, ix in self.buckets}

    def only(self, index: tuple[int, ...]) -> Buckets:
        """The layout of the parameters at ``index`` alone (the rest are left out of its buckets; results are
        still indexed by position in ``specs``): a group's reduce-scatter covers only the parameters that take
        a gradient, as FSDP2's does, so a frozen parameter costs no traffic and no buffer. The flat layout keeps
        every parameter at its fixed offset: itself."""
        if self.flat or len(index) == len(self.specs):
            return self
        hit = self._subsets.get(index)
        if hit is None:
            hit = self._subsets[index] = Buckets(self.specs, only=index, param_dtype=self.param_dtype,
                                                 reduce_dtype=self.reduce_dtype)
        return hit

    def new_buffers(self, device) -> list[torch.Tensor]:
        """The raw unsharded storage: per-parameter padded tensors, or one flat buffer per dtype.

        Per-parameter layout: one storage per parameter, not one per group, so that an in-place edit of one
        unsharded parameter (e.g. a frozen one under no_grad in forward) leaves the version counters, and so
        the autograd views, of the group's other parameters alone."""
        if self.flat:
            return [torch.empty(self.world * self.chunk[dt], dtype=dt, device=device) for dt, _ in self.buckets]
        return [torch.empty(s.padded_shape, dtype=dt, device=device) for s, dt in zip(self.specs, self.compute)]

    def flat_shards(self, shards: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per bucket, the local shards as 1-D views: the copy-in's inputs (a caller gathering the same shards
        twice makes them once). Plain tensors (``unwrapped``), under no_grad: the views have no history."""
        return [[shards[i].reshape(-1) for i in ix] for _, ix in self.buckets]

    def copy_targets(self, padded: Sequence[torch.Tensor]) -> list[list[torch.Tensor] | None]:
        """Per bucket, where the copy-out writes: each padded parameter as ``(world, local numel)`` (every shard
        on dim 0) or ``(world, *local_shape)`` (``ShardSpec.split_view``); None in the flat layout (no
        copy-out). Made once per set of buffers: views stay valid when the storage is freed and refilled."""
        if self.flat:
            return [None] * len(self.buckets)
        return [[padded[i].view(self.world, -1) for i in ix] if self.dim0[dt]
                else [self.specs[i].split_view(padded[i]) for i in ix] for dt, ix in self.buckets]

    def views(self, buffers: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The unsharded parameters as views of the raw buffers."""
        if not self.flat:
            return tuple(s.unpad(t) for s, t in zip(self.specs, buffers))
        out: list[torch.Tensor | None] = [None] * len(self.specs)
        for (dt, ix), buf in zip(self.buckets, buffers):
            for i in ix:
                s = self.specs[i]
                out[i] = buf[s.flat.offset : s.flat.offset + s.numel].view(s.shape)
        return tuple(out)  # type: ignore[arg-type]


class PendingGather:
    """All-gathers in flight for one group; ``finish(targets)`` waits and copies out into the padded tensors
    (``Buckets.copy_targets``; allocated by the caller only then, so a prefetched group holds just its
    all-gather buffer). In the flat layout the all-gather output is already the parameters: nothing to copy."""

    comm_owned = False  # the buffers are an FSDP2 comm's (its ``allocate``): dropped, never resized (it may reuse them)

    def __init__(self, layout: Buckets, outs, works, where: Where | None = None):
        self.layout, self.outs, self.works, self.where = layout, outs, works, where

    def finish(self, targets: Sequence[Sequence[torch.Tensor] | None] | None) -> None:
        lay = self.layout
        if lay.flat:
            for work in self.works:
                wait_work(work, self.where)
            self.outs = self.works = None
            return
        dsts, srcs = [], []
        for (dt, ix), out, work, dst in zip(lay.buckets, self.outs, self.works, targets):
            wait_work(work, self.where)
            if lay.dim0[dt]:  # every shard along dim 0: a padded tensor is (world, local numel) rank-major
                with no_grad():
                    torch.split_with_sizes_copy(out.view(lay.world, -1), lay.numels[dt], dim=1, out=dst)
                continue
            chunks = out.view(lay.world, -1).split(lay.numels[dt], dim=1)
            for i, c, d in zip(ix, chunks, dst):
                dsts.append(d)
                srcs.append(c.view(lay.world, *lay.specs[i].local_shape))
        if dsts:
            with no_grad():
                foreach_copy_(dsts, srcs)
        if not self.comm_owned:
            free_buffers(self.outs)  # now, not when the process group's work objects let go of them
        self.outs = self.works = None


def start_gather(
    layout: Buckets, flat_shards: Sequence[Sequence[torch.Tensor]], group, rank: int,
    outs: Sequence[torch.Tensor] | None = None, where: Where | None = None, comm: CommHook | None = None,
) -> PendingGather:
    """Copy the group's local shards (``Buckets.flat_shards``) into one flat buffer per dtype (one copy each)
    and issue the all-gathers (async). ``outs``: the flat layout's unsharded buffers to gather into. ``where``: what
    ``finish`` names and bounds its waits by (``wait_work``). ``comm``: the group's hook (``_comm``; its FSDP2 comm
    allocates the output)."""
    works, bufs = [], []
    hooked = comm is not None and comm.all_gather is not None and layout.world > 1
    with no_grad():
        for k, (dt, ix) in enumerate(layout.buckets):
            n = layout.chunk[dt]
            flat = flat_shards[k]
            out = outs[k] if outs is not None else _comm.allocate(comm if hooked else None, _comm.ALL_GATHER,
                                                                   layout.world * n, dt, flat[0].device)
            inp = out.narrow(0, rank * n, n)
            valid = sum(layout.numels[dt])
            torch.cat(flat, out=inp.narrow(0, 0, valid) if valid < n else inp)
            if valid < n:
                inp.narrow(0, valid, n - valid).zero_()
            if hooked:
                work, got = _comm.run(comm, _comm.ALL_GATHER, out, inp, group, where and where.group)
                if got is not out:  # a functional hook's result (the flat layout's buffers: copied in)
                    out = out.copy_(got) if outs is not None else got
            else:
                work = all_gather_into(out, inp, group) if layout.world > 1 else None  # (1 rank: no collective)
            bufs.append(out)
            works.append(work)
    pending = PendingGather(layout, bufs, works, where)
    pending.comm_owned = outs is None and hooked and _comm.allocates(comm, _comm.ALL_GATHER)
    return pending


def bucket_buffers(layout: Buckets, bases: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per bucket, the unsharded buffers it fills: its parameters' padded tensors, or the flat layout's buffer."""
    if layout.flat:
        return [[b] for b in bases]
    return [[bases[i] for i in ix] for _, ix in layout.buckets]


def post_forward_shards(layout: Buckets, bases: Sequence[torch.Tensor], rank: int, k: int) -> list[torch.Tensor]:
    """Per bucket, what a rank keeps after forward when its group is resharded to ``k`` ranks (int
    ``reshard_after_forward``): the ``rank``-th of ``k`` equal slices of each of its unsharded buffers (padding
    included: ``k`` divides the shard count), concatenated, a copy (FSDP2's post-forward shard)."""
    with no_grad():
        return [torch.cat([t.view(k, -1)[rank] for t in ts]) for ts in bucket_buffers(layout, bases)]


class PendingRegather:
    """All-gathers in flight over a block of ``k`` ranks, from the post-forward shards; ``finish(bases)`` waits and
    copies out into the unsharded buffers (each the ``k`` slices ``post_forward_shards`` cut, rank-major)."""

    comm_owned = False  # (as PendingGather's)

    def __init__(self, layout: Buckets, k: int, outs, works, where: Where | None = None):
        self.layout, self.k, self.outs, self.works, self.where = layout, k, outs, works, where

    def finish(self, bases: Sequence[torch.Tensor]) -> None:
        k = self.k
        for ts, out, work in zip(bucket_buffers(self.layout, bases), self.outs, self.works):
            wait_work(work, self.where)
            with no_grad():
                torch.split_with_sizes_copy(out.view(k, -1), [t.numel() // k for t in ts], dim=1,
                                            out=[t.view(k, -1) for t in ts])
        if not self.comm_owned:
            free_buffers(self.outs)
        self.outs = self.works = None


def start_regather(layout: Buckets, post: Sequence[torch.Tensor], group, rank: int, k: int,
                   where: Where | None = None, comm: CommHook | None = None) -> PendingRegather:
    """Issue the all-gathers (async) of a group's post-forward shards over its block of ``k`` ranks (with the group's
    all-gather hook, as FSDP2 runs its custom all-gather over the post-forward group too)."""
    outs, works = [], []
    hooked = comm is not None and comm.all_gather is not None
    with no_grad():
        for p in post:
            out = _comm.allocate(comm, _comm.ALL_GATHER, k * p.numel(), p.dtype, p.device)
            inp = out.narrow(0, rank * p.numel(), p.numel())
            inp.copy_(p)
            if hooked:
                work, out = _comm.run(comm, _comm.ALL_GATHER, out, inp, group, where and where.group)
            else:
                work = all_gather_into(out, inp, group)
            outs.append(out)
            works.append(work)
    pending = PendingRegather(layout, k, outs, works, where)
    pending.comm_owned = _comm.allocates(comm, _comm.ALL_GATHER)
    return pending


def gather_tangents(layout: Buckets, tangents: Sequence[torch.Tensor | None], group, rank: int,
                    where: Where | None = None):
    """All-gather a group's shard tangents (or shards) into new full tensors: the forward-mode rule. ``where``: what
    the wait names and is bounded by (``wait_work``; checkpoint.export_full's)."""
    with no_functorch(), no_grad():
        device = next(t.device for t in tangents if t is not None)
        shards = [torch.zeros(s.local_shape, dtype=s.dtype, device=device) if t is None else raw(t)
                  for s, t in zip(layout.specs, tangents)]
        bases = layout.new_buffers(device)
        start_gather(layout, layout.flat_shards(shards), group, rank,
                     outs=bases if layout.flat else None, where=where).finish(layout.copy_targets(bases))
    return layout.views(bases)


def jvp_of_gather(layout: Buckets, tangents: Sequence[torch.Tensor | None], group, rank: int):
    """The forward-mode rule of a gather: the gather of the tangents, None for an integer parameter (its output
    is not differentiable)."""
    out = gather_tangents(layout, tangents, group, rank)
    return tuple(o if s.dtype.is_floating_point or s.dtype.is_complex else None for o, s in zip(out, layout.specs))


def _per_param_grad_copies(spec: ShardSpec, dst: torch.Tensor, g: torch.Tensor, dsts: list, srcs: list) -> None:
    """Copies that lay a full gradient out as ``dst`` ``(world, *local_shape)``; padding stays zero."""
    g = g.reshape(spec.sharded_shape)
    full_rows = spec.size // spec.chunk if spec.chunk else 0
    d = spec.dim
    if full_rows:  # ranks whose shard is all real data
        shp = list(spec.sharded_shape)
        shp[d : d + 1] = [full_rows, spec.chunk]
        dsts.append(dst.narrow(0, 0, full_rows))
        srcs.append(g.narrow(d, 0, full_rows * spec.chunk).reshape(shp).movedim(d, 0))
    rem = spec.size - full_rows * spec.chunk
    if rem:  # the one rank whose shard is partly padding
        dsts.append(dst.select(0, full_rows).narrow(d, 0, rem))
        srcs.append(g.narrow(d, full_rows * spec.chunk, rem))


def reduce_scatter_grads(
    layout: Buckets, grads: list[torch.Tensor | None], group, divide: float, device: torch.device
) -> list[torch.Tensor]:
    """Reduce-scatter (sum) a group's full gradients, one collective per dtype, divide once by ``divide``,
    and return each parameter's local gradient shard (views into one flat buffer per dtype).

    Consumes ``grads``: its entries are dropped once copied into the reduce-scatter input, before the output
    is allocated (as FSDP2 does), so that a caller holding no other reference frees the full gradients first."""
    return start_reduce_scatter(layout, grads, group, device, divide).finish(divide)


class PendingReduce:
    """A group's reduce-scatters in flight; ``finish(divide)`` waits, frees the inputs, all-reduces over the replicate
    group (HSDP) and returns the local gradient shards."""

    comm_owned = False  # the inputs are an FSDP2 comm's: dropped, never resized

    def __init__(self, layout: Buckets, pending: list, replicate=None, where: Where | None = None):
        self.layout, self.pending, self.replicate, self.where = layout, pending, replicate, where

    def finish(self, divide: float, *, all_reduce: bool = True, partial: dict | None = None,
               hook=None) -> list[torch.Tensor] | None:
        """HSDP (a replicate group): each output is all-reduced (sum) over it before the divide. ``partial``: sums a
        finish without all-reduce left (by dtype; taken and added first). ``all_reduce=False``: keep the sums in
        ``partial`` instead (no all-reduce, divide or shards: FSDP2's ``set_requires_all_reduce(False)``); returns
        None. ``hook(output)``: FSDP2's all-reduce hook, on each output in the reduce dtype after the all-reduce, when
        it holds what FSDP2's holds there (after the divide for fp32 and bf16, which FSDP2 divides inside the
        collectives; before the rest of it for fp16)."""
        layout = self.layout
        result: list[torch.Tensor | None] = [None] * len(layout.specs)
        pending, self.pending = self.pending, []
        reduced = []
        with no_grad():
            for dt, ix, inp, out, work, before in pending:
                if work is not None:
                    wait_work(work, self.where)  # (raises: nothing freed, the backend may still read the input)
                if inp is not out and not self.comm_owned:
                    free_buffers([inp])
                if partial is not None and (acc := partial.pop(dt, None)) is not None:
                    out.add_(acc)
                if self.replicate is not None and not all_reduce:
                    partial[dt] = out
                    continue
                ar = None
                if self.replicate is not None:
                    ar = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.replicate, async_op=True)
                reduced.append((dt, ix, out, ar, before))
            if self.replicate is not None and not all_reduce:
                return None
            for dt, ix, out, ar, before in reduced:
                if ar is not None:
                    wait_work(ar, self.where and self.where._replace(kind="all-reduce (HSDP)", pg=self.replicate))
                after = divide / before  # (fp32, bf16: all of it; see _policy.divide_factors)
                if hook is not None and before != 1.0:
                    hook(out)
                if after != 1.0:
                    out.div_(after)  # in the reduce dtype, before the cast back (FSDP2's order)
                if hook is not None and before == 1.0:
                    hook(out)
                shard_dtype = layout.shard_dtype[dt]
                if shard_dtype is not None and out.dtype != shard_dtype:
                    out = out.to(shard_dtype)
                # the shards are consecutive in the output (flat layout: the pieces of this rank's slice)
                pieces = unflatten_dense_tensors(out, layout.shard_templates[dt])
                if shard_dtype is None:  # shards of several dtypes in one bucket: each cast on its own
                    pieces = [p.to(layout.specs[i].dtype) for i, p in zip(ix, pieces)]
                for i, piece in zip(ix, pieces):
                    result[i] = piece
        return result  # type: ignore[return-value]


def start_reduce_scatter(
    layout: Buckets, grads: list[torch.Tensor | None], group, device: torch.device, divide: float = 1.0,
    replicate=None, where: Where | None = None, comm: CommHook | None = None,
) -> PendingReduce:
    """Copy a group's full gradients into one reduce-scatter input per dtype (cast to the reduce dtype by the copy)
    and issue the reduce-scatters (async; none over a single rank); consumes ``grads`` (see
    ``reduce_scatter_grads``). ``divide``: the factor ``finish`` will divide by; for a reduce dtype that risks
    overflow part of it is applied here, before the sum (``_policy.divide_factors``). ``replicate``: the process group
    ``finish`` all-reduces the outputs over (HSDP). ``comm``: the group's hook (``_comm``; its FSDP2 comm allocates the
    input and the output, and is called with ``op=SUM``)."""
    pending = []
    world = layout.world
    hooked = comm is not None and comm.reduce_scatter is not None and world > 1
    with no_grad():
        for dt, ix in layout.buckets:
            if not (dt.is_floating_point or dt.is_complex):
                continue  # integer parameters have no gradient
            n = layout.chunk[dt]
            missing = False
            for i in ix:
                if grads[i] is None:
                    missing = True
                elif grads[i].layout is not torch.strided:
                    grads[i] = grads[i].to_dense()  # e.g. nn.Embedding(sparse=True): shards are dense slices
            # dim-0 shards: torch._chunk_cat writes the padded rank-major layout (padding included) in one op
            one_op = layout.dim0[dt] and not missing and all(grads[i].is_contiguous() and grads[i].numel()
                                                             for i in ix)
            alloc = torch.zeros if (layout.has_padding[dt] or missing) and not one_op else torch.empty
            rdt = layout.reduce[dt]
            inp = _comm.allocate(comm if hooked else None, _comm.REDUCE_SCATTER, world * n, rdt, device,
                                 zero=alloc is torch.zeros)
            dsts, srcs = [], []
            if one_op and len({grads[i].dtype for i in ix}) > 1:  # e.g. accumulated fp32 beside fresh bf16
                for i in ix:  # (torch._chunk_cat takes one dtype; the cast is exact or the copy's own)
                    grads[i] = grads[i].to(rdt)
            if one_op:
                gs = [grads[i] for i in ix]
                if layout.scalar[dt]:
                    gs = [g.view(layout.specs[i].sharded_shape) for i, g in zip(ix, gs)]
                chunk_cat(gs, dim=0, num_chunks=world, out=inp.view(world, n))
                gs = None
            elif layout.flat:
                for i in ix:
                    spec, g = layout.specs[i], grads[i]
                    if g is not None:
                        dsts.append(inp[spec.flat.offset : spec.flat.offset + spec.numel].view(spec.shape))
                        srcs.append(g)
            else:
                for i, c in zip(ix, inp.view(world, n).split(layout.numels[dt], dim=1)):
                    if grads[i] is not None:
                        spec = layout.specs[i]
                        _per_param_grad_copies(spec, c.view(world, *spec.local_shape), grads[i], dsts, srcs)
            if dsts:
                foreach_copy_(dsts, srcs)
            dsts = srcs = g = None  # (g: the flat branch's loop variable holds the last gradient)
            for i in ix:
                grads[i] = None
            before, _ = divide_factors(divide, rdt)
            if before != 1.0:
                inp.div_(before)
            if world == 1:  # the input is the output (FSDP2 issues no collective either)
                pending.append((dt, ix, inp, inp, None, before))
                continue
            if hooked:
                out = _comm.allocate(comm, _comm.REDUCE_SCATTER, n, rdt, device)
                work, out = _comm.run(comm, _comm.REDUCE_SCATTER, out, inp, group, where and where.group)
                pending.append((dt, ix, inp, out, work, before))
                continue
            out = torch.empty(n, dtype=rdt, device=device)
            pending.append((dt, ix, inp, out, reduce_scatter_into(out, inp, group), before))
    result = PendingReduce(layout, pending, replicate, where)
    result.comm_owned = hooked and _comm.allocates(comm, _comm.REDUCE_SCATTER)
    return result
