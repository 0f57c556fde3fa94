"""Prototypes of runtime changes suggested in NOTES.md, as monkeypatches active only while one variant's step
runs (funcshard itself is not modified). ``profile_cpu.py`` times each one against ``fs_apply`` as it is,
interleaved, and prints the step-1/2 losses so a prototype that changes the numbers shows.

They wrap the runtime's functions rather than copy them, so they keep working while the runtime changes:

* ``proto_spec_cache``: memoize ShardSpec's derived properties (``size``, ``chunk``, ``local_shape``, ...),
  which copy-out and the reduce-scatter input build recompute thousands of times per step.
* ``proto_nocheck``: skip ``check_state`` on every ``apply`` call (what the per-call checks cost).
* ``proto_defer_rs``: under torch.func (grad / vjp) hand back the reduce-scatter's output views at once and
  wait for the collective (then divide) when the next group's reduce-scatter is issued or at the end of
  backward, so each reduce-scatter overlaps the backward compute of the group before it. (Under plain
  autograd, AccumulateGrad reads the gradient at once: left synchronous.)
* ``proto_sync``: issue the collectives synchronously (what FSDP2 does on CPU): does async issue cost more
  on an oversubscribed CPU?
* ``proto_cut_graph``: under a single torch.func grad level, detach the incoming gradient at each group's
  pre-backward hook (torch.func.grad differentiates with create_graph=True, which keeps every finished
  group's activations and full gradients alive until the end of backward).
* ``proto_chunk_cat``: build the reduce-scatter input with one ``torch._chunk_cat`` (as FSDP2 does) instead
  of a Python loop of narrow/reshape/movedim views and a ``_foreach_copy_``.
* ``proto_best``: spec cache + no per-call check + cut graph + chunk_cat, together.
"""

from __future__ import annotations

import contextlib
import functools

import torch

# ---- the patches ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _patched(*triples):
    saved = []
    for obj, attr, val in triples:
        saved.append((obj, attr, obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)))
        setattr(obj, attr, val)
    try:
        yield
    finally:
        for obj, attr, val in reversed(saved):
            setattr(obj, attr, val)


def _spec_cache_patches():
    from funcshard import _spec

    triples = []
    for name, prop in list(vars(_spec.ShardSpec).items()):
        if isinstance(prop, property) and prop.fset is None:
            cp = functools.cached_property(prop.fget)
            cp.__set_name__(_spec.ShardSpec, name)
            triples.append((_spec.ShardSpec, name, cp))
    return triples


def _nocheck_patches():
    from funcshard import _apply

    return [(_apply, "check_state", lambda *a, **k: None)]


class _DoneWork:
    def wait(self, *a, **k):
        return True


_PENDING: list = []  # (work, out, inp, divide) of the reduce-scatters in flight
_BATCH: list = []  # filled by reduce_scatter_into during one reduce_scatter_grads call


def _drain() -> None:
    from funcshard import _collectives

    with torch._C._DisableFuncTorch(), torch.no_grad():
        while _PENDING:
            work, out, inp, divide = _PENDING.pop(0)
            work.wait()
            _collectives._free([inp])
            if divide != 1.0:
                out.div_(divide)


def _defer_patches():
    from funcshard import _collectives, _runtime

    orig_rs = _runtime.reduce_scatter_grads
    orig_into = _collectives.reduce_scatter_into
    orig_free = _collectives._free
    orig_end = _runtime.Step.end_of_backward
    level = torch._C._functorch.maybe_current_level
    deferring = [False]

    def reduce_scatter_into(out, inp, group, async_op=True):
        work = orig_into(out, inp, group)
        if not deferring[0]:
            return work
        _BATCH.append((work, out, inp))
        return _DoneWork()

    def _free(tensors):
        if deferring[0]:
            return  # the inputs of deferred reduce-scatters are freed by _drain
        return orig_free(tensors)

    def reduce_scatter_grads(layout, grads, group, divide, *rest):
        if level() is None:
            return orig_rs(layout, grads, group, divide, *rest)
        _drain()  # at most one group's reduce-scatter in flight (FSDP2 also holds one input)
        deferring[0] = True
        try:
            result = orig_rs(layout, grads, group, 1.0, *rest)  # divided in _drain, once the data is there
        finally:
            deferring[0] = False
        _PENDING.extend((w, o, i, divide) for w, o, i in _BATCH)
        _BATCH.clear()
        return result

    def end_of_backward(self):
        _drain()
        return orig_end(self)

    return [(_collectives, "reduce_scatter_into", reduce_scatter_into), (_collectives, "_free", _free),
            (_runtime, "reduce_scatter_grads", reduce_scatter_grads), (_runtime.Step, "end_of_backward", end_of_backward)]


def _sync_patches():
    import torch.distributed as dist

    from funcshard import _collectives

    def all_gather_into(out, inp, group, async_op=True):
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=group)
        return _DoneWork()

    def reduce_scatter_into(out, inp, group, async_op=True):
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            out, inp, op=dist.ReduceOp.SUM, group=group)
        return _DoneWork()

    return [(_collectives, "all_gather_into", all_gather_into),
            (_collectives, "reduce_scatter_into", reduce_scatter_into)]


def _cut_graph_patches():
    """Under one torch.func grad level, the pre-backward hook hands the group the incoming gradient detached.

    torch.func.grad runs autograd with create_graph=True (for nesting), so every gradient carries the graph
    that computed it, and the live activation gradient keeps every finished group's saved tensors and full
    parameter gradients alive until backward ends. Detaching the gradient at each group boundary frees them
    as plain autograd does. Only valid when nothing differentiates the gradients again (one grad level)."""
    from funcshard import _runtime

    level = torch._C._functorch.maybe_current_level

    def _pre_backward_hook(step, name):
        def hook(grad):
            step.pre_backward(name)
            if level() is not None:
                return grad.detach()
            return None

        return hook

    return [(_runtime, "_pre_backward_hook", _pre_backward_hook)]


def _chunk_cat_patches():
    """Build a group's reduce-scatter input with one ``torch._chunk_cat`` (FSDP2's copy-in for gradients): for
    dim-0 shards, funcshard's padded layout (chunk = ceil(size / W), padding at the end) is exactly what
    _chunk_cat writes, zero padding included. Other layouts fall back to the runtime's function."""
    from funcshard import _collectives, _runtime

    orig = _runtime.reduce_scatter_grads

    def reduce_scatter_grads(layout, grads, group, divide, device, *rest):
        if layout.flat or any(s.dim != 0 for s in layout.specs) or any(g is None for g in grads):
            return orig(layout, grads, group, divide, device, *rest)
        result = [None] * len(layout.specs)
        world, pending = layout.world, []
        with torch.no_grad():
            for dt, ix in layout.buckets:
                if not (dt.is_floating_point or dt.is_complex):
                    continue
                n = layout.chunk[dt]
                inp = torch.empty(world * n, dtype=dt, device=device)
                torch._chunk_cat([grads[i].reshape(layout.specs[i].sharded_shape) for i in ix], dim=0,
                                 num_chunks=world, out=inp.view(world, n))
                out = torch.empty(n, dtype=dt, device=device)
                pending.append((ix, dt, inp, out, _collectives.reduce_scatter_into(out, inp, group)))
            for ix, dt, inp, out, work in pending:
                work.wait()
                _collectives._free([inp])
                if divide != 1.0:
                    out.div_(divide)
                for i, piece in zip(ix, out.split(layout.numels[dt])):
                    result[i] = piece.view(layout.specs[i].local_shape)
        return result

    return [(_runtime, "reduce_scatter_grads", PHASE_WRAP(reduce_scatter_grads))]


PHASE_WRAP = lambda fn: fn


PATCHES = {
    "proto_spec_cache": _spec_cache_patches,
    "proto_nocheck": _nocheck_patches,
    "proto_defer_rs": _defer_patches,
    "proto_sync": _sync_patches,
    "proto_cut_graph": _cut_graph_patches,
    "proto_chunk_cat": _chunk_cat_patches,
    "proto_best": lambda: _spec_cache_patches() + _nocheck_patches() + _cut_graph_patches() + _chunk_cat_patches(),
}


def _variant(patches):
    def make(sysobj, ph, optim_phase):
        def step():
            with _patched(*patches()):
                loss, grads = sysobj.step_fn(sysobj.state, sysobj.x, sysobj.y)
            with ph.phase(optim_phase):
                sysobj.update(grads)
            return loss.detach()

        return step

    return make


VARIANTS = {name: _variant(p) for name, p in PATCHES.items()}
