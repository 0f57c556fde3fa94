"""torch.func transforms that compose over sharded state (issue 32).

Every rank runs its local function; the reference is one process simulating every rank in float64 (``_sim``): a
rank's gradient of a shard is the derivative of the *sum* of every rank's function (the reduce-scatter sums), its jvp
the derivative of its own function along every rank's tangent together.
"""

from __future__ import annotations

import re
import warnings
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multirank import run_ranks

N, M = 3, 2  # each rank's x: (N, M)


def _data(W: int, B: int = 3):
    """Every rank's inputs, the same on every rank (so each can compute the whole reference)."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(X=r(W, N, M), T=r(W, N, M), Xb=r(B, W, N, M), ws=r(W, W * N, M), cs=r(W, N, M))


def _local(x, w, c):
    """One rank's function of the three collectives: a vector (N,)."""
    import funcshard

    y = funcshard.all_gather(x)  # (W N, M)
    z = torch.tanh(y * w)
    u = funcshard.reduce_scatter(z)  # (N, M)
    v = funcshard.all_reduce(u * x)
    return (torch.sin(v) * c).sum(1)


def _sim(X, ws, cs):
    """Every rank's ``_local`` at once, one process: (W, N)."""
    W = X.shape[0]
    y = X.reshape(W * N, M)
    us = torch.stack([torch.tanh(y * ws[r]) for r in range(W)]).view(W, W, N, M).sum(0)  # rank r: block r summed
    v = (us * X).sum(0)
    return torch.stack([(torch.sin(v) * cs[r]).sum(1) for r in range(W)])


def _primitive_rows():
    import torch.distributed as dist
    from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

    W, r = dist.get_world_size(), dist.get_rank()
    d = _data(W)
    X, T, Xb, w, c = d["X"], d["T"], d["Xb"], d["ws"][r], d["cs"][r]
    x, t, xb = X[r], T[r], Xb[:, r]
    vec = lambda x: _local(x, w, c)  # noqa: E731
    f = lambda x: vec(x).sum()  # noqa: E731
    sim = lambda X: _sim(X, d["ws"], d["cs"])  # noqa: E731
    F = lambda X: sim(X).sum()  # noqa: E731  (what every rank's gradient differentiates)
    mine = lambda X: sim(X)[r].sum()  # noqa: E731  (what this rank's value and jvp differentiate)
    gnorm = lambda g: lambda x: g(x).pow(2).sum()  # noqa: E731

    def autograd_double():
        xx = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(xx), xx, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), xx)[0]

    def maml():
        xx = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(xx), xx, create_graph=True)
        return torch.autograd.grad(f(xx - 0.3 * g), xx)[0]

    def maml_ref():
        XX = X.clone().requires_grad_()
        (G,) = torch.autograd.grad(F(XX), XX, create_graph=True)
        return torch.autograd.grad(F(XX - 0.3 * G), XX)[0][r]

    H = hessian(F)(X)  # (W, N, M, W, N, M)
    rows = {
        "value": (lambda: f(x), lambda: mine(X)),
        "grad": (lambda: grad(f)(x), lambda: grad(F)(X)[r]),
        "grad_grad": (lambda: grad(gnorm(grad(f)))(x), lambda: grad(gnorm(grad(F)))(X)[r]),
        "autograd_double": (autograd_double, lambda: grad(gnorm(grad(F)))(X)[r]),
        "maml": (maml, maml_ref),
        "jvp": (lambda: jvp(f, (x,), (t,)), lambda: jvp(mine, (X,), (T,))),
        "vmap": (lambda: vmap(f)(xb), lambda: vmap(mine)(Xb)),
        "vmap_grad": (lambda: vmap(grad(f))(xb), lambda: vmap(grad(F))(Xb)[:, r]),
        "jvp_grad": (lambda: jvp(grad(f), (x,), (t,)), lambda: tuple(o[r] for o in jvp(grad(F), (X,), (T,)))),
        "jacrev": (lambda: jacrev(vec)(x), lambda: jacrev(lambda X: sim(X).sum(0))(X)[:, r]),
        "jacfwd": (lambda: jacfwd(vec)(x), lambda: jacfwd(lambda X: sim(X)[r])(X).sum(1)),
        "hessian": (lambda: hessian(f)(x), lambda: H[r].sum(2)),
        "jacrev_jacrev": (lambda: jacrev(jacrev(f))(x), lambda: H.sum(0)[:, :, r]),
        "vmap_jvp_grad": (lambda: vmap(lambda xx, tt: jvp(grad(f), (xx,), (tt,))[1])(xb, xb.flip(0)),
                          lambda: vmap(lambda XX, TT: jvp(grad(F), (XX,), (TT,))[1][r])(Xb, Xb.flip(0))),
    }
    out = {}
    for name, (got, want) in rows.items():
        a, b = torch.utils._pytree.tree_leaves(got()), torch.utils._pytree.tree_leaves(want())
        out[name] = (len(a) == len(b) > 0 and all(p.shape == q.shape and torch.allclose(p, q, rtol=1e-10, atol=1e-10)
                                                  for p, q in zip(a, b)))
    return out


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_compose(world):
    """all_gather / reduce_scatter / all_reduce under every transform and nesting of them, against one process
    simulating every rank (float64, 1e-10): grad, grad(grad), autograd create_graph double backward, MAML's step, jvp,
    vmap, vmap(grad), jvp(grad), jacrev, jacfwd, hessian, jacrev(jacrev), vmap(jvp(grad))."""
    for res in run_ranks(world, _primitive_rows):
        assert res and all(res.values()), {k: v for k, v in res.items() if not v}


def _count_vmap(B):
    import torch.distributed as dist

    import funcshard
    import funcshard._primitives as P

    calls = []
    real = P.all_gather_into, P.reduce_scatter_into, P.bounded_all_reduce

    def counted(i):
        def fn(*a, **k):
            calls.append(i)
            return real[i](*a, **k)
        return fn

    P.all_gather_into, P.reduce_scatter_into, P.bounded_all_reduce = counted(0), counted(1), counted(2)
    try:
        W, r = dist.get_world_size(), dist.get_rank()
        d = _data(W, B)
        f = lambda x: _local(x, d["ws"][r], d["cs"][r]).sum()  # noqa: E731
        torch.func.vmap(torch.func.grad(f))(d["Xb"][:, r])
    finally:
        P.all_gather_into, P.reduce_scatter_into, P.bounded_all_reduce = real
    return sorted(calls)


def test_vmap_issues_one_collective_for_the_batch():
    """vmap(grad) of the three collectives: the same collectives for a batch of 1 as of 5 (forward: all-gather,
    reduce-scatter, all-reduce; backward: their transposes)."""
    one, five = run_ranks(2, _count_vmap, 1), run_ranks(2, _count_vmap, 5)
    assert one == five == [[0, 0, 1, 1, 2, 2]] * 2


def _zero_dim():
    import funcshard

    try:
        torch.func.vmap(funcshard.all_gather)(torch.ones(3))
    except ValueError as e:
        return str(e)


def test_zero_dim_is_refused():
    (msg,) = run_ranks(1, _zero_dim)
    assert msg and "0-dim tensor" in msg


# ---- gather + functional_call and traced_apply over a model's sharded state (the issue's table) ---------------

LR = 0.3


def _model():
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


class Kind(NamedTuple):
    """A plan of the table: its module, ``funcshard.plan``'s keywords, the parameters left frozen (not
    differentiated: passed as constants, ``requires_grad=False``) and the compute dtype of a mixed-precision policy."""

    module: torch.nn.Module
    kw: dict
    frozen: tuple[str, ...] = ()
    compute: torch.dtype | None = None


PLANS = ("root", "per_block", "nested", "tied", "frozen", "bf16")


def _plans(m, mesh):
    """name -> Kind: ``m`` with one root group and a group per block (Linear); a nested model with groups nested
    as FSDP2's ("2" takes what "2.0" leaves); a weight tied across two blocks (the root group takes it); two frozen
    parameters; a bf16 param_dtype with an fp32 reduce_dtype on every group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    nn = torch.nn
    torch.manual_seed(1)
    nested = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))
    tied = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 3))
    tied[4].weight = tied[2].weight
    frozen = _model()
    frozen[0].weight.requires_grad_(False)
    frozen[2].bias.requires_grad_(False)
    blocks = {"groups": (nn.Linear,)}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {"root": Kind(m, {}), "per_block": Kind(m, blocks), "nested": Kind(nested, {"groups": ["2", "2.0"]}),
            "tied": Kind(tied, blocks), "frozen": Kind(frozen, blocks, ("0.weight", "2.bias")),
            "bf16": Kind(m, {**blocks, "mp_policy": bf16}, compute=torch.bfloat16)}


def _paths(m, mesh, kw, compute=None):
    """path -> (plan, the module's output from sharded state, the factor c on every backward: the gather's
    reduce-scatter sums the W identical ranks' gradients, traced_apply's divides the sum by the plan's factor).
    ``compute``: gather's inputs cast to it (apply and traced_apply cast them as the root group's policy does)."""
    import torch.distributed as dist

    import funcshard

    W = float(dist.get_world_size())
    plan, summed = funcshard.plan(m, mesh, **kw), funcshard.plan(m, mesh, grad_divide_factor=1.0, **kw)
    cast = (lambda t: t) if compute is None else (lambda t: t.to(compute))  # noqa: E731

    def gathered(s, x):  # (gather returns the shards' dtype: the policy's casts are the caller's)
        return torch.func.functional_call(plan.module, {k: cast(t) for k, t in funcshard.gather(plan, s).items()},
                                          (cast(x),))
    return {
        "gather": (plan, gathered, float(plan.world)),  # (over the shard axis only: HSDP's replicas are not summed)
        "traced": (plan, lambda s, x: funcshard.traced_apply(plan, s, x), 1.0),
        "traced_sum": (summed, lambda s, x: funcshard.traced_apply(summed, s, x), W),
        "apply": (plan, lambda s, x: funcshard.apply(plan, s, x), 1.0),
        "apply_sum": (summed, lambda s, x: funcshard.apply(summed, s, x), W),
    }


# two reverse levels: exact on every path with the plan's factor and over HSDP (before: refused at W > 1 and on HSDP
# meshes; MAML's second-order term 1/W off, or the replicas' sum twice, silently, before the refusals), but where one
# inner gradient reaches the outer loss both through a gather and otherwise (maml_and_gnorm: MAML's step plus that
# same gradient's norm). (func_then_autograd_maml on apply: before, refused; its runtime's gradients are now exact
# below the transform, strategies.differentiated_below)
SECOND_REVERSE = ("grad_gnorm", "autograd_double", "hvp_grad", "maml", "autograd_maml", "func_then_autograd_maml",
                  "func_inputs_below", "func_then_autograd_gnorm", "func_value_and_gnorm", "maml_gnorm",
                  "maml_and_gnorm", "maml_tasks", "maml_two_calls")
MIXED = ("maml_and_gnorm",)
_BATCHED = r"differentiated again under vmap \(an ensemble or a batch of MAML meta-gradients.*grad_divide_factor=1\.0"
_THIRD = r"fed to another gather \(as in MAML\), then differentiated twice more .*grad_divide_factor=1\.0"
_MIXED = r"reaches the outer loss both through another gather \(as in MAML.*grad_divide_factor=1\.0"
_APPLY_JACREV = r"the backward of funcshard\.apply ran under vmap .*jacrev"


def _refused(path: str, row: str, world: int, hsdp: bool = False) -> str | None:
    """The refusal a row gets on a path (a regex of the NotImplementedError's text), None where it is right."""
    if path in ("apply", "apply_sum") and row == "jacrev":  # (the runtime's first-order vjp under vmap)
        return _APPLY_JACREV
    divides = path != "gather" and (hsdp or (world > 1 and path in ("traced", "apply")))  # (or sums over replicas)
    if row in MIXED and divides:
        return _MIXED
    if row in ("maml3", "func_then_autograd_maml3") and divides:
        return _THIRD
    if row == "ensemble_maml" and divides:
        return _BATCHED
    return None


def _table_rows(plan, out, c, frozen=(), compute=None):
    """The issue's rows: name -> (sharded result, unsharded reference) thunks. ``out(s, x)`` runs the module on the
    shards ``s``; every rank has the same inputs, so a rank's shard gradient is ``c`` times the reference's rows.
    ``frozen``: parameters passed as constants (not differentiated); ``compute``: the reference casts the
    parameters and inputs to it (a mixed-precision policy's casts), the losses are fp32."""
    import funcshard
    from torch.func import functional_call, grad, jacrev, jvp, vmap

    m = plan.module
    every = {k: v.detach().clone() for k, v in m.named_parameters()}
    full = {k: v for k, v in every.items() if k not in frozen}
    consts = {k: v for k, v in funcshard.shard(plan, every).items() if k in frozen}
    state = {k: v for k, v in funcshard.shard(plan, every).items() if k not in frozen}
    g = torch.Generator().manual_seed(1)
    x, vx, xs = (torch.randn(*s, generator=g) for s in ((5, 4), (5, 4), (6, 4)))
    V = {k: torch.randn(t.shape, generator=g) for k, t in full.items()}
    members = [{k: t * (1 + 0.5 * i) for k, t in full.items()} for i in range(3)]
    def sharded(s, xx):  # (the frozen shards as constants)
        return out({**s, **consts}, xx).float()

    def call(p, xx):  # the reference: the unsharded module (with the policy's casts)
        p = {**p, **{k: every[k] for k in frozen}}
        if compute is not None:
            p, xx = {k: t.to(compute) for k, t in p.items()}, xx.to(compute)
        return functional_call(m, p, (xx,)).float()

    def sh(grads):  # full gradients (of the differentiated parameters) -> this rank's shards
        return {k: t for k, t in funcshard.shard(plan, {**every, **grads}).items() if k in grads}

    Vs = sh(V)
    stacked = {k: torch.stack([sh(p)[k] for p in members]) for k in state}
    full_members = {k: torch.stack([p[k] for p in members]) for k in full}
    f = lambda s, xx=x: sharded(s, xx).pow(2).mean()  # noqa: E731
    ref = lambda p, xx=x: call(p, xx).pow(2).mean()  # noqa: E731
    one = lambda s, xi: sharded(s, xi[None]).pow(2).sum()  # noqa: E731  (one example)
    ref_one = lambda p, xi: call(p, xi[None]).pow(2).sum()  # noqa: E731

    def sh_batched(grads, n):  # full gradients with a leading batch dim -> shards with it
        each = [sh({k: t[i] for k, t in grads.items()}) for i in range(n)]
        return {k: torch.stack([e[k] for e in each]) for k in state}

    def scaled(d, k=c):
        return {n: k * t for n, t in d.items()}

    def gnorm(s):  # the global squared norm of the shard gradient: an all-reduce of the local sums
        return funcshard.all_reduce(sum(t.pow(2).sum() for t in grad(f)(s).values()), plan.mesh)

    ref_gnorm = lambda p: sum(t.pow(2).sum() for t in scaled(grad(ref)(p)).values())  # noqa: E731

    def maml(fn, gfn, lr):
        return lambda p: fn({k: p[k] - lr * gk for k, gk in gfn(p).items()})

    def leaves():
        return {k: t.detach().clone().requires_grad_() for k, t in state.items()}

    def autograd_double():
        s = leaves()
        gs = torch.autograd.grad(f(s), list(s.values()), create_graph=True)
        norm2 = funcshard.all_reduce(sum(t.pow(2).sum() for t in gs), plan.mesh)  # (over the shard axis)
        return dict(zip(s, torch.autograd.grad(norm2, list(s.values()))))

    def autograd_maml():
        s = leaves()
        gs = torch.autograd.grad(f(s), list(s.values()), create_graph=True)
        return dict(zip(s, torch.autograd.grad(f({k: t - LR * gk for (k, t), gk in zip(s.items(), gs)}),
                                               list(s.values()))))

    def autograd_hvp():  # grad of <g, v>, g taken with create_graph=True (reverse over reverse)
        s = leaves()
        gs = torch.autograd.grad(f(s), list(s.values()), create_graph=True)
        return dict(zip(s, torch.autograd.grad(dot(dict(zip(s, gs)), Vs, True), list(s.values()))))

    def autograd_penalty():  # WGAN-GP: the input gradient's squared norm (create_graph), differentiated by the state
        s, xx = leaves(), x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(f(s, xx), xx, create_graph=True)
        return dict(zip(s, torch.autograd.grad(gx.pow(2).sum(), list(s.values()))))

    def backward_gnorm():  # loss.backward(create_graph=True): the gradients' norm from .grad, differentiated
        s = leaves()
        with warnings.catch_warnings():  # (torch's advice to prefer autograd.grad: the .grad reference cycle)
            warnings.filterwarnings("ignore", r"Using backward\(\) with create_graph=True")
            f(s).backward(create_graph=True)
        norm2 = funcshard.all_reduce(sum(t.grad.pow(2).sum() for t in s.values()), plan.mesh)
        return dict(zip(s, torch.autograd.grad(norm2, list(s.values()))))

    def backward_maml():  # the inner step by autograd.grad(create_graph=True), the meta-gradient by .backward()
        s = leaves()
        gs = torch.autograd.grad(f(s), list(s.values()), create_graph=True)
        f({k: t - LR * gk for (k, t), gk in zip(s.items(), gs)}).backward()
        return {k: t.grad for k, t in s.items()}

    def func_then_autograd_maml():  # (the inner step by torch.func, the meta-gradient by plain autograd)
        s = leaves()
        maml(f, grad(f), LR)(s).backward()
        return {k: t.grad for k, t in s.items()}

    def func_inputs_below():  # torch.func.grad of the state; its norm differentiated by plain autograd w.r.t. the
        xx = x.clone().requires_grad_()  # inputs (recorded below the transform: the gradient is a function of them)
        norm2 = funcshard.all_reduce(sum(t.pow(2).sum() for t in grad(lambda s: f(s, xx))(state).values()), plan.mesh)
        return torch.autograd.grad(norm2, xx)

    def ref_inputs_below():  # (the inputs' whole gradient, on every rank)
        xx = x.clone().requires_grad_()
        return torch.autograd.grad(sum(t.pow(2).sum() for t in scaled(grad(lambda p: ref(p, xx))(full)).values()), xx)

    def func_then_autograd_gnorm():  # (a torch.func.grad's norm, differentiated by plain autograd w.r.t. the state)
        s = leaves()
        norm2 = funcshard.all_reduce(sum(t.pow(2).sum() for t in grad(f)(s).values()), plan.mesh)
        return dict(zip(s, torch.autograd.grad(norm2, list(s.values()))))

    def func_value_and_gnorm():  # (torch.func.grad_and_value: its value's gradient, then its gradient's norm's, by
        s = leaves()  # plain autograd: two backwards through one graph)
        gs, v = torch.func.grad_and_value(f)(s)
        norm2 = funcshard.all_reduce(sum(t.pow(2).sum() for t in gs.values()), plan.mesh)
        a = torch.autograd.grad(v, list(s.values()), retain_graph=True)
        return {k: ak + bk for k, ak, bk in zip(s, a, torch.autograd.grad(norm2, list(s.values())))}

    def ref_value_and_gnorm():
        a, b = grad(ref)(full), grad(ref_gnorm)(full)
        return sh(scaled({k: a[k] + b[k] for k in a}))

    def autograd_over_jvp():  # plain autograd through torch.func.jvp's tangent (reverse over forward)
        s = leaves()
        return dict(zip(s, torch.autograd.grad(jvp(f, (s,), (Vs,))[1], list(s.values()))))

    def func_then_autograd_maml3():  # (MAML by plain autograd over torch.func.grad, create_graph=True; its squared
        s = leaves()  # norm differentiated: three reverse levels, the inner gradient fed to a gather)
        meta = dict(zip(s, torch.autograd.grad(maml(f, grad(f), LR)(s), list(s.values()), create_graph=True)))
        return dict(zip(s, torch.autograd.grad(dot(meta, meta, True), list(s.values()))))

    def ref_maml(p):
        return maml(ref, lambda q: scaled(grad(ref)(q)), LR)(p)

    def dot(gs, vs, over):  # <g, v>: the local sums, all-reduced over the shard axis (``over``) or not
        d = sum((t * vs[k]).sum() for k, t in gs.items())
        return funcshard.all_reduce(d, plan.mesh) if over else d

    def maml_and_gnorm(fn, gfn, norm):  # MAML's outer loss plus the squared norm of the same inner gradient
        def outer(p):
            gs = gfn(p)
            return fn({k: p[k] - LR * gk for k, gk in gs.items()}) + norm(gs)
        return outer

    vec = lambda s: sharded(s, x).sum(0)  # noqa: E731
    ref_vec = lambda p: call(p, x).sum(0)  # noqa: E731
    return {
        "grad": (lambda: grad(f)(state), lambda: sh(scaled(grad(ref)(full)))),
        "jvp_state": (lambda: jvp(f, (state,), (Vs,)), lambda: jvp(ref, (full,), (V,))),
        "jvp_inputs": (lambda: jvp(lambda xx: f(state, xx), (x,), (vx,)),
                       lambda: jvp(lambda xx: ref(full, xx), (x,), (vx,))),
        "vmap_grad": (lambda: vmap(grad(one), in_dims=(None, 0))(state, xs),
                      lambda: sh_batched(scaled(vmap(grad(ref_one), in_dims=(None, 0))(full, xs)), len(xs))),
        "grad_gnorm": (lambda: grad(gnorm)(state), lambda: sh(scaled(grad(ref_gnorm)(full)))),
        "autograd_double": (autograd_double, lambda: sh(scaled(grad(ref_gnorm)(full)))),
        "backward_gnorm": (backward_gnorm, lambda: sh(scaled(grad(ref_gnorm)(full)))),
        "autograd_hvp": (autograd_hvp, lambda: sh(scaled(grad(lambda p: dot(scaled(grad(ref)(p)), V, False))(full)))),
        "autograd_penalty": (autograd_penalty,
                             lambda: sh(scaled(grad(lambda p: grad(lambda xx: ref(p, xx))(x).pow(2).sum())(full)))),
        "maml": (lambda: grad(maml(f, grad(f), LR))(state),
                 lambda: sh(scaled(grad(maml(ref, lambda p: scaled(grad(ref)(p)), LR))(full)))),
        "autograd_maml": (autograd_maml, lambda: sh(scaled(grad(maml(ref, lambda p: scaled(grad(ref)(p)), LR))(full)))),
        "backward_maml": (backward_maml, lambda: sh(scaled(grad(maml(ref, lambda p: scaled(grad(ref)(p)), LR))(full)))),
        "func_then_autograd_maml": (func_then_autograd_maml,
                                    lambda: sh(scaled(grad(maml(ref, lambda p: scaled(grad(ref)(p)), LR))(full)))),
        "func_inputs_below": (func_inputs_below, ref_inputs_below),
        "func_then_autograd_gnorm": (func_then_autograd_gnorm, lambda: sh(scaled(grad(ref_gnorm)(full)))),
        "func_value_and_gnorm": (func_value_and_gnorm, ref_value_and_gnorm),
        "autograd_over_jvp": (autograd_over_jvp, lambda: sh(scaled(grad(lambda p: jvp(ref, (p,), (V,))[1])(full)))),
        "hvp_grad": (lambda: grad(lambda s: dot(grad(f)(s), Vs, True))(state),  # (grad of <grad, v>)
                     lambda: sh(scaled(grad(lambda p: dot(scaled(grad(ref)(p)), V, False))(full)))),
        "maml_gnorm": (lambda: grad(lambda s: maml(f, grad(f), LR)(s) + gnorm(s))(state),  # (two inner gradients)
                       lambda: sh(scaled(grad(lambda p: ref_maml(p) + ref_gnorm(p))(full)))),
        "maml_and_gnorm": (lambda: grad(maml_and_gnorm(f, grad(f), lambda gs: dot(gs, gs, True)))(state),
                           lambda: sh(scaled(grad(maml_and_gnorm(ref, lambda q: scaled(grad(ref)(q)),
                                                                 lambda gs: dot(gs, gs, False)))(full)))),
        "maml_two_calls": (lambda: grad(maml(lambda q: f(q) + f(q, vx), grad(f), LR))(state),  # (the adapted state
                           lambda: sh(scaled(grad(maml(lambda q: ref(q) + ref(q, vx),  # gathered twice)
                                                       lambda p: scaled(grad(ref)(p)), LR))(full)))),
        "maml3": (lambda: grad(lambda s: dot(*[grad(maml(f, grad(f), LR))(s)] * 2, True))(state),  # (third level)
                  lambda: sh(scaled(grad(lambda p: dot(*[scaled(grad(ref_maml)(p))] * 2, False))(full)))),
        "func_then_autograd_maml3": (func_then_autograd_maml3, lambda: sh(scaled(grad(
            lambda p: dot(*[scaled(grad(ref_maml)(p))] * 2, False))(full)))),
        "maml_tasks": (lambda: grad(lambda s: vmap(lambda xi: maml(lambda q: f(q, xi), grad(lambda q: f(q, xi)),
                                                                   LR)(s))(xs.view(2, 3, 4)).sum())(state),
                       # (vmap between the levels: a meta-batch of two tasks)
                       lambda: sh(scaled(grad(lambda p: vmap(lambda xi: maml(
                           lambda q: ref(q, xi), lambda q: scaled(grad(lambda r: ref(r, xi))(q)), LR)(p))(
                           xs.view(2, 3, 4)).sum())(full)))),
        "ensemble_maml": (lambda: vmap(grad(maml(f, grad(f), LR)))(stacked),
                          lambda: sh_batched(scaled(vmap(grad(maml(ref, lambda p: scaled(grad(ref)(p)), LR)))(
                              full_members)), len(members))),
        "hvp": (lambda: jvp(grad(f), (state,), (Vs,)),
                lambda: tuple(sh(scaled(t)) for t in jvp(grad(ref), (full,), (V,)))),
        "ensemble": (lambda: vmap(f)(stacked), lambda: vmap(ref)(full_members)),
        "ensemble_grad": (lambda: vmap(grad(f))(stacked),
                          lambda: sh_batched(scaled(vmap(grad(ref))(full_members)), len(members))),
        "jacrev": (lambda: jacrev(vec)(state),
                   lambda: sh_batched(scaled(jacrev(ref_vec)(full)), 3)),
        # (a vmap of the inputs alone, the state differentiated by plain autograd: value_and_grad's eager path)
        "vmap_inputs": (lambda: funcshard.value_and_grad(lambda s: vmap(lambda xi: one(s, xi))(xs).sum())(state)[1],
                        lambda: sh(scaled(grad(lambda p: vmap(lambda xi: ref_one(p, xi))(xs).sum())(full)))),
    }


def _table(plans=("root", "per_block"), names=None, hsdp=False, paths=None, every=True):
    """``hsdp``: True, every rank a replica (shards of one rank: the replica sum alone); or a (replicas, shards)
    mesh shape. ``every``: with ``names`` None, also ``SECOND_ROWS``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    W = dist.get_world_size()
    shape = (W, 1) if hsdp is True else hsdp
    mesh = (init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (W,)))
    res = {}
    for pname, kind in _plans(_model(), mesh).items():
        if pname not in plans:
            continue
        for path, (plan, out, c) in _paths(kind.module, mesh, kind.kw, kind.compute).items():
            if paths is not None and path not in paths:
                continue
            for name, (got, want) in _table_rows(plan, out, c, kind.frozen, kind.compute).items():
                if (name not in names) if names else (name in ONLY_NAMED or (name in SECOND_ROWS and not every)
                                                      or (name in CREATE_GRAPH_ROWS and not every)):
                    continue
                key = f"{path}/{pname}/{name}"
                try:
                    a, b = torch.utils._pytree.tree_leaves(got()), torch.utils._pytree.tree_leaves(want())
                except Exception as e:  # (every exception: the test reads which one, and its text)
                    res[key] = f"{type(e).__name__}: {e}"
                    continue
                close = all(p.shape == q.shape and torch.allclose(p, q, rtol=1e-6, atol=1e-6) for p, q in zip(a, b))
                res[key] = (len(a) == len(b) > 0 and close) or [
                    (tuple(p.shape), tuple(q.shape), float((p - q).abs().max()) if p.shape == q.shape else None)
                    for p, q in zip(a, b)]
    return res


ROWS = 27  # (_table_rows, but ONLY_NAMED)
ONLY_NAMED = ("maml3", "func_then_autograd_maml3", "ensemble_maml")  # (test_third_reverse_level)
SECOND_ROWS = ("hvp_grad", "maml_gnorm", "maml_and_gnorm", "maml_tasks", "maml_two_calls",  # (test_second_order_rows;
               "func_inputs_below", "func_then_autograd_gnorm", "func_value_and_gnorm",  # test_table: slow)
               "autograd_over_jvp")
# plain autograd's create_graph=True differentiated again: apply's runtime composes (before: refused, and the WGAN-GP
# penalty a torch error); test_create_graph_rows (test_table: slow), autograd_double and autograd_maml in test_table
CREATE_GRAPH_ROWS = ("autograd_hvp", "autograd_penalty", "backward_gnorm", "backward_maml")


def _check_table(res, world, hsdp=False):
    import re

    assert res
    for key, got in res.items():
        path, _, row = key.split("/")
        want = _refused(path, row, world, hsdp)
        if want is None:
            assert got is True, (key, got)
        else:
            assert isinstance(got, str) and got.startswith("NotImplementedError: ") and re.search(want, got), (key, got)


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_table(world):
    """The issue's table on gather + functional_call, traced_apply and apply (the plan's divide factor, and
    grad_divide_factor=1.0: "_sum"), root-only and per-block plans (W=1: root only; W=2: also HSDP): jvp w.r.t. the
    state and the inputs, vmap(grad) per-sample gradients (shards with a leading batch dim), grad of a gradient norm
    (torch.func and autograd create_graph), MAML (torch.func, autograd create_graph, and autograd over an inner
    torch.func.grad), jvp(grad) HVP, vmap over stacked states (values and
    gradients), jacrev, a vmap of the inputs alone under plain autograd (before: a torch error, "vmap over _Gather");
    fp32 against the same transform of the unsharded module, 1e-6. Refused (``_refused``): two reverse levels
    through a divided gather (W > 1) or over HSDP, jacrev of apply."""
    plans = ("root",) if world == 1 else ("root", "per_block")
    every = world == 4  # (the default suite: SECOND_ROWS in test_second_order_rows)
    rows = ROWS - (0 if every else len(SECOND_ROWS) + len(CREATE_GRAPH_ROWS))
    for res in run_ranks(world, _table, plans, None, False, None, every):
        assert len(res) == len(plans) * 5 * rows, sorted(res)
        _check_table(res, world)
    if world == 2:  # HSDP, a (2, 1) mesh: the gradients' sum over the replicate axis (traced: _primitives.divided)
        for res in run_ranks(world, _table, ("root",), None, True, None, every):
            _check_table(res, world, hsdp=True)


@pytest.mark.parametrize("world,hsdp", [(2, False), pytest.param(2, True, marks=pytest.mark.slow),
                                        pytest.param(1, False, marks=pytest.mark.slow)])
def test_second_order_rows(world, hsdp):
    """The table's second-order rows added with the divide factor made exact (default suite: W=2, the root plan,
    traced_apply and apply with the plan's factor; slow: every path, both plans, HSDP (2, 1) and W=1; W=4 in
    test_table): grad of <grad, v> (an HVP by reverse over reverse), MAML plus the norm of another inner gradient,
    MAML over vmap of two tasks (vmap between the levels), MAML whose adapted state is gathered twice (two outer
    calls), and MAML plus the norm of its own inner gradient (refused with a divide factor or over HSDP: the two
    paths arrive summed); plain autograd below one torch.func level: a torch.func.grad's norm differentiated w.r.t.
    the inputs and w.r.t. the state, grad_and_value's value and gradient norm differentiated (apply: its runtime,
    exact; before, a torch error, the refusal, and a torch error), and a backward through torch.func.jvp's tangent
    (apply: its runtime, exact; before, no gradient)."""
    quick = world == 2 and not hsdp
    plans, paths = (("root",), ("traced", "apply")) if quick else (("root", "per_block"), None)
    for res in run_ranks(world, _table, plans, SECOND_ROWS, hsdp, paths):
        assert len(res) == len(plans) * len(paths or range(5)) * len(SECOND_ROWS), sorted(res)
        _check_table(res, world, hsdp)


OTHER_PLANS = ("nested", "tied", "frozen", "bf16")
# (the default suite's rows and paths)
QUICK_ROWS = ("grad", "vmap_grad", "maml", "func_then_autograd_maml", "hvp", "ensemble_grad")
QUICK_PATHS = ("gather", "traced_sum", "apply")


@pytest.mark.parametrize("world,quick", [pytest.param(1, False, marks=pytest.mark.slow), (2, True),
                                         pytest.param(2, False, marks=pytest.mark.slow),
                                         pytest.param(4, False, marks=pytest.mark.slow)])
def test_table_over_plans(world, quick):
    """The table on the other plans: nested groups, a weight tied across blocks, frozen parameters (constants, not
    differentiated), a bf16 param_dtype with an fp32 reduce_dtype (against the reference's own casts: parameters and
    inputs cast to bf16; the same 1e-6: the same bf16 arithmetic). Default suite: W=2, per-sample gradients, MAML,
    HVP and ensemble gradients on gather, traced_apply (factor 1) and apply; every row and path at W=1, 2, 4 under
    ``-m slow``."""
    names, paths = (QUICK_ROWS, QUICK_PATHS) if quick else (None, None)
    for res in run_ranks(world, _table, OTHER_PLANS, names, False, paths, timeout=600):
        cells = len(QUICK_ROWS) * len(QUICK_PATHS) if quick else 5 * ROWS
        assert len(res) == len(OTHER_PLANS) * cells, sorted(res)
        _check_table(res, world)


@pytest.mark.parametrize("paths", [("traced", "apply_sum"),
                                   pytest.param(("gather", "traced_sum", "apply"), marks=pytest.mark.slow)])
def test_third_reverse_level(paths):
    """MAML's meta-gradient differentiated again (grad of its squared norm: three reverse levels, the inner gradient
    fed to a gather; by torch.func, and by plain autograd with create_graph=True over an inner torch.func.grad), and
    MAML under vmap over stacked states (an ensemble): refused on a gather that divides (traced_apply, apply, W=2),
    exact with factor 1 (apply's runtime below the torch.func level included) and on gather (slow: third order)."""
    for res in run_ranks(2, _table, ("root",), ONLY_NAMED, False, paths):
        assert len(res) == len(paths) * len(ONLY_NAMED), sorted(res)
        _check_table(res, 2)


@pytest.mark.slow
def test_table_hsdp_2x2():
    """Two reverse levels (and the first-order rows they build on) over an HSDP (2, 2) mesh at W=4, every path, on
    the root and per-block plans: the replicas' sum and the plan's divide taken once per level."""
    rows = ("grad", "vmap_grad", "hvp", *SECOND_REVERSE, *CREATE_GRAPH_ROWS)
    for res in run_ranks(4, _table, ("root", "per_block"), rows, (2, 2), timeout=600):
        assert len(res) == 2 * 5 * len(rows), sorted(res)
        _check_table(res, 4, hsdp=True)


@pytest.mark.parametrize("world,hsdp,plans", [
    (2, False, ("root", "per_block")),
    pytest.param(1, False, ("root", "per_block"), marks=pytest.mark.slow),
    pytest.param(2, True, ("root", "per_block"), marks=pytest.mark.slow),
    pytest.param(2, False, OTHER_PLANS, marks=pytest.mark.slow)])
def test_create_graph_rows(world, hsdp, plans):
    """Plain autograd's ``create_graph=True`` gradients differentiated again, on every path (apply: its runtime), with
    the plan's divide factor and with factor 1, against the unsharded reference (fp32, 1e-6): grad of <g, v> (an HVP),
    the WGAN-GP penalty (the input gradient's squared norm differentiated by the state), ``loss.backward(
    create_graph=True)`` then the norm of ``.grad`` differentiated, MAML's meta-gradient by ``.backward()``
    (``autograd_double`` and ``autograd_maml``: test_table). Default: W=2, root and per-block plans; slow: W=1,
    HSDP (2, 1), the other plans (nested, tied, frozen, bf16); W=4 and HSDP (2, 2) in test_table and
    test_table_hsdp_2x2. Before, on apply: refused (``NotImplementedError``), the penalty a torch error on freed
    storage ("setStorage ... out of bounds")."""
    for res in run_ranks(world, _table, plans, CREATE_GRAPH_ROWS, hsdp, timeout=600):
        assert len(res) == len(plans) * 5 * len(CREATE_GRAPH_ROWS), sorted(res)
        _check_table(res, world, hsdp)


_APPLY_BELOW = (r"funcshard\.apply: a gradient taken by torch\.func\.grad .* differentiated again by plain autograd "
                r"below the transform .* through group '(?P<group>[^']*)', whose reduce-scatter apply's runtime cannot "
                r"transpose: (?P<why>.*)\. The first-order values are right.*funcshard\.gather")
_TANGENTS = (r"funcshard\.apply under jvp\(\.\.\.\): a tangent requires grad .* apply runs its traced path for that, "
             r"which does not run this plan \((?P<why>.*)\), and .*\(detach them\)")
_TRACED_WHY = {"flat": r"layout='flat'", "comm": r"groups \['2'\] have comm hooks",
               "offload": r"groups \[.*'0', '2', '4'\] offload to the host"}
_NOT_DIFFERENTIABLE = (r"funcshard\.apply: a gradient taken with create_graph=True was differentiated again through "
                       r"group '(?P<group>[^']*)', whose reduce-scatter apply's runtime cannot make differentiable: "
                       r"(?P<why>.*)\. The first-order values are right.*funcshard\.traced_apply or funcshard\.gather")


def _apply_create_graph():
    """apply's runtime under ``create_graph=True``: the collectives of a plain backward and of a create_graph one (one
    reduce-scatter per bucket, by the differentiable collectives); what a flat-layout plan and a comm hook's group
    raise when differentiated again (first-order values equal to a plain backward's); the WGAN-GP penalty on the flat
    plan (first order through the gather: exact)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch.distributed.fsdp import CPUOffloadPolicy

    import funcshard
    from funcshard._traced import buckets

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = _model()
    x = torch.randn(5, 4)
    full = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    xx = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(torch.func.functional_call(m, full, (xx,)).pow(2).sum(), xx, create_graph=True)
    ref_penalty = dict(zip(full, torch.autograd.grad(gx.pow(2).sum(), list(full.values()))))
    V = {k: torch.randn(v.shape) for k, v in full.items()}  # (reverse over jvp: the tangent's gradient)
    ref_jvp = dict(zip(full, torch.autograd.grad(torch.func.jvp(
        lambda p: torch.func.functional_call(m, p, (x,)).pow(2).sum(), (full,), (V,))[1], list(full.values()))))
    out = {}
    plans = {"per_block": funcshard.plan(m, mesh, groups=(torch.nn.Linear,)),
             "flat": funcshard.plan(m, mesh, groups=(torch.nn.Linear,), layout="flat"),
             "comm": funcshard.plan(m, mesh, groups=(torch.nn.Linear,)).with_group(
                 "2", comm=funcshard.bf16_reduce_scatter()),
             "offload": funcshard.plan(m, mesh, groups=(torch.nn.Linear,),
                                       offload_policy=CPUOffloadPolicy(pin_memory=False))}
    for name, plan in plans.items():
        leaves = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
        loss = lambda: funcshard.apply(plan, leaves, x).pow(2).sum()  # noqa: E731
        plain = []
        counts = {"plain": _counted(lambda: plain.extend(torch.autograd.grad(loss(), list(leaves.values()))))}
        gs = []
        counts["create_graph"] = _counted(lambda: gs.extend(torch.autograd.grad(loss(), list(leaves.values()),
                                                                                 create_graph=True)))
        out[name, "counts"] = counts, len(buckets(plan))
        out[name, "same"] = all(torch.equal(a, b) for a, b in zip(plain, gs))
        out[name, "again"] = _differentiated_again(gs, leaves)
        if name != "per_block":  # (a torch.func.grad's norm differentiated below it: the state's, the inputs')
            xx = x.clone().requires_grad_()
            for below, wrt in (("below", leaves), ("inputs below", {"x": xx})):
                g = torch.func.grad(lambda s: funcshard.apply(plan, s, xx).pow(2).sum())(leaves)
                try:
                    torch.autograd.grad(funcshard.all_reduce(sum(t.pow(2).sum() for t in g.values()), mesh),
                                        list(wrt.values()))
                    out[name, below] = "no error"
                except NotImplementedError as e:
                    out[name, below] = str(e)
            Vs = funcshard.shard(plan, V)  # (a jvp level over state tracked below it: the runtime, right)
            _, t = torch.func.jvp(lambda s: funcshard.apply(plan, s, x).pow(2).sum(), (leaves,), (Vs,))
            want = funcshard.shard(plan, ref_jvp)
            out[name, "jvp below"] = [float((a - want[k]).abs().max()) if a.numel() else 0.0
                                      for k, a in zip(leaves, torch.autograd.grad(t, list(leaves.values())))]
            try:  # (its tangents tracked below it: refused)
                torch.func.jvp(lambda s: funcshard.apply(plan, s, x).pow(2).sum(), (Vs,),
                               ({k: v.clone().requires_grad_() for k, v in Vs.items()},))
                out[name, "tangents below"] = "no error"
            except NotImplementedError as e:
                out[name, "tangents below"] = str(e)
        if name == "flat":
            xx = x.clone().requires_grad_()
            (gx,) = torch.autograd.grad(funcshard.apply(plan, leaves, xx).pow(2).sum(), xx, create_graph=True)
            got = torch.autograd.grad(gx.pow(2).sum(), list(leaves.values()))
            want = funcshard.shard(plan, ref_penalty)
            out[name, "penalty"] = all(torch.allclose(a, want[k], rtol=1e-6, atol=1e-6) for k, a in zip(leaves, got))
    out.update(_apply_create_graph_ext_tp(mesh))
    return out


def _apply_create_graph_ext_tp(mesh):
    """What differentiating apply's create_graph gradients again raises through a group whose parameters define
    FSDP2's all-gather extension (test_comm's int8 weights) and through model-sharded (tensor-parallel) parameters
    (test_tp's model on a (dp=1, tp=2) mesh); their first-order values equal a plain backward's."""
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard
    from models import Block
    from test_comm import _QBlock, _QMLP
    from test_tp import _model as tp_model

    torch.manual_seed(0)
    tp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, plan in (("ext", funcshard.plan(_QMLP(), mesh, groups=(_QBlock,))),
                       ("tp", funcshard.plan(tp_model(tp_mesh, "tp"), tp_mesh["dp"], groups=(Block,)))):
        leaves = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
        x = torch.randn(4, 7)
        loss = lambda: funcshard.apply(plan, leaves, x).pow(2).sum()  # noqa: E731
        plain = torch.autograd.grad(loss(), list(leaves.values()))
        gs = torch.autograd.grad(loss(), list(leaves.values()), create_graph=True)
        out[name, "same"] = all(torch.equal(a, b) for a, b in zip(plain, gs))
        out[name, "again"] = _differentiated_again(gs, leaves)
    return out


def _differentiated_again(gs, leaves) -> str:
    """create_graph gradients ``gs`` of ``leaves`` differentiated again (their squared norm): what it raises."""
    try:
        torch.autograd.grad(sum(g.pow(2).sum() for g in gs), list(leaves.values()))
        return "no error"
    except NotImplementedError as e:
        return str(e)


def test_apply_create_graph_collectives_and_refusals():
    """apply's runtime under ``torch.autograd.grad(create_graph=True)`` (W=2, a group per Linear): a plain backward
    issues the runtime's collectives (3 all-gathers in forward, 3 again in backward, 3 reduce-scatters), a
    create_graph one the same all-gathers and one reduce-scatter per bucket (3) by the differentiable collectives, with
    the same first-order values bit for bit.
    Still refused when differentiated again, naming the group and the case: a layout="flat" plan, a group with a
    comm hook (its reduce-scatter would be bypassed), a CPU-offloading plan, a group with FSDP2's all-gather
    extension and one with model-sharded (tensor-parallel) parameters; the WGAN-GP penalty on the flat plan
    is exact (its second backward is first order through the gather). On those plans, which apply's traced path does
    not run, a torch.func.jvp whose tangents require grad is refused naming why (elsewhere that path runs it); a
    torch.func.grad's norm differentiated by plain autograd w.r.t. the state or the inputs is refused naming the group
    (elsewhere exact: test_table, test_second_order_rows); a backward through a jvp's tangent to state that requires
    grad runs the runtime, exact (flat, offload; before: no gradient on a per-parameter plan)."""
    import re

    for out in run_ranks(2, _apply_create_graph):
        counts, n = out["per_block", "counts"]
        assert n == 3 and counts["plain"] == counts["create_graph"] == ["ag"] * 6 + ["rs"] * 3, out
        assert all(out[p, "same"] for p in ("per_block", "flat", "comm", "offload")), out
        assert out["per_block", "again"] == "no error", out
        for name, groups, why in (("flat", ("0", "2", "4"), r"layout='flat'"),
                                  ("comm", ("2",), r"it has a comm hook \(Group\.comm\)"),
                                  ("offload", ("0", "2", "4"), r"it offloads to the host \(CPUOffloadPolicy\)")):
            m = re.search(_NOT_DIFFERENTIABLE, out[name, "again"])
            assert m and m["group"] in groups and re.search(why, m["why"]), (name, out[name, "again"])
            for below in ("below", "inputs below"):
                m = re.search(_APPLY_BELOW, out[name, below])
                assert m and m["group"] in groups and re.search(why, m["why"]), (name, below, out[name, below])
            m = re.search(_TANGENTS, out[name, "tangents below"])
            assert m and re.search(_TRACED_WHY[name], m["why"]), (name, out[name, "tangents below"])
            if name != "comm":  # (its bf16 reduce-scatter)
                assert max(out[name, "jvp below"]) < 1e-5, (name, out[name, "jvp below"])
        assert out["flat", "penalty"] is True, out
        for name, groups, why in (("ext", ("blocks.0", "blocks.1"), r"its parameters define FSDP2's all-gather "
                                   r"extension \(fsdp_pre_all_gather / fsdp_post_all_gather\)"),
                                  ("tp", ("blocks.0", "blocks.1"), r"model-sharded \(tensor-parallel DTensor\) "
                                   r"parameters \['blocks\.\d\.l1\.weight'")):
            assert out[name, "same"], (name, out)
            m = re.search(_NOT_DIFFERENTIABLE, out[name, "again"])
            assert m and m["group"] in groups and re.search(why, m["why"]), (name, out[name, "again"])


def _counted(fn):
    """The tensor collectives ``fn()`` issues, by kind (torch.distributed's functions wrapped while it runs)."""
    import torch.distributed as dist

    from funcshard._compat import all_gather_name, reduce_scatter_name

    names = {all_gather_name: "ag", reduce_scatter_name: "rs", "all_reduce": "ar"}
    real = {n: getattr(dist, n) for n in names}
    calls = []

    def wrap(n):
        def counted(*a, **k):
            calls.append(names[n])
            return real[n](*a, **k)
        return counted

    try:
        for n in names:
            setattr(dist, n, wrap(n))
        fn()
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return sorted(calls)


def _counts():
    """Per path: the collectives of vmap(grad) over stacked states of 2 and of 4 members, and of one gradient
    (torch.func.grad, plain autograd)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard

    m = _model()
    plan = funcshard.plan(m, init_device_mesh("cpu", (dist.get_world_size(),)), groups=(torch.nn.Linear,))
    state = funcshard.shard(plan)
    x = torch.randn(5, 4)
    out = {}
    for path, fwd in (("gather", lambda s: torch.func.functional_call(m, funcshard.gather(plan, s), (x,))),
                      ("traced", lambda s: funcshard.traced_apply(plan, s, x))):
        f = lambda s: fwd(s).pow(2).sum()  # noqa: E731
        for n in (2, 4):
            stacked = {k: torch.stack([v * (1 + i) for i in range(n)]) for k, v in state.items()}
            out[path, "ensemble", n] = _counted(lambda: torch.func.vmap(torch.func.grad(f))(stacked))
        out[path, "grad"] = _counted(lambda: torch.func.grad(f)(state))
        leaves = {k: v.clone().requires_grad_() for k, v in state.items()}
        out[path, "autograd"] = _counted(lambda: f(leaves).backward())
    out["apply"] = _routed(plan, state, x)
    out["vjp below"] = _vjp_below(plan, state, x)
    out["plans"] = _plan_counts(plan.mesh, ("apply",), ())
    return out


def _vjp_below(plan, state, x):
    """torch.func.vjp's vjp_fn over apply with the state or an input requiring grad (grad mode on), called twice: the
    level's backward runs outside the transform, its gradients equal value_and_grad's (before: zeros, taken for a
    backward below the level); those gradients differentiated again by plain autograd (MAML's inner step by vjp): refused
    (before: the second-order term silently missing)."""
    import funcshard

    f = lambda s, xx: funcshard.apply(plan, s, xx).pow(2).sum()  # noqa: E731
    leaves = {k: v.clone().requires_grad_() for k, v in state.items()}
    _, want = funcshard.value_and_grad(lambda s: f(s, x))(leaves)
    errors = []
    for s, xx in ((leaves, x), (dict(state), x.clone().requires_grad_())):
        o, fn = torch.func.vjp(lambda q: f(q, xx), s)
        for _ in range(2):  # (vjp_fn called again: the level's backward again, after one done; before: 0.11 off)
            got = fn(torch.ones_like(o))[0]
            errors.append(max(float((got[k] - want[k]).abs().max()) for k in got))
    o, fn = torch.func.vjp(lambda q: f(q, x), leaves)
    g = fn(torch.ones_like(o))[0]
    try:
        f({k: leaves[k] - 0.1 * g[k] for k in leaves}, x).backward()
        refusal = "no error"
    except NotImplementedError as e:
        refusal = str(e)
    return errors, refusal


def _routed(plan, state, x):
    """Which of apply's paths first-order calls take (the runtime, or the traced path: counted), and their collectives:
    one torch.func grad/vjp or jvp level, value_and_grad, a grad or jvp level over leaves that plain autograd records
    below it (the runtime too), and (the traced path) a jvp level whose tangents it records."""
    import funcshard
    import funcshard._apply as applied

    f = lambda s: funcshard.apply(plan, s, x).pow(2).sum()  # noqa: E731
    leaves = {k: v.clone().requires_grad_() for k, v in state.items()}
    traced, run = [], applied.traced_run
    out = {}

    def counted(key, fn):
        n = len(traced)
        out[key] = _counted(fn), len(traced) - n

    applied.traced_run = lambda *a: traced.append(1) or run(*a)
    try:
        counted("grad", lambda: torch.func.grad(f)(state))  # (the shards require no grad)
        with torch.no_grad():  # (plain autograd records nothing below the transform)
            counted("grad, no_grad", lambda: torch.func.grad(f)(leaves))
        counted("vjp", lambda: torch.func.vjp(f, state)[1](torch.ones(())))
        counted("jvp", lambda: torch.func.jvp(f, (state,), (state,)))
        counted("value_and_grad", lambda: funcshard.value_and_grad(f)(leaves))
        counted("grad, below", lambda: torch.func.grad(f)(leaves))  # (differentiable below it: no collective more)
        counted("jvp, below", lambda: torch.func.jvp(f, (leaves,), (state,)))
        counted("jvp, tangents below", lambda: torch.func.jvp(f, (state,), (leaves,)))  # (the traced path)
    finally:
        applied.traced_run = run
    return out


def _plan_counts(mesh, paths=("gather", "apply"), members=(2, 4)):
    """On every plan of the table, per path: the collectives of vmap(grad) per-sample gradients over 2 and 5
    examples and of vmap(grad) over stacked states of ``members`` members (the frozen parameters as constants), and
    the number of buckets (one all-gather and one reduce-scatter each). ``mesh`` None: a 1-D mesh of every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard
    from funcshard._traced import layout

    mesh = init_device_mesh("cpu", (dist.get_world_size(),)) if mesh is None else mesh

    out = {}
    for pname, kind in _plans(_model(), mesh).items():
        plan = funcshard.plan(kind.module, mesh, **kind.kw)
        every = funcshard.shard(plan)
        consts = {k: v for k, v in every.items() if k in kind.frozen}
        state = {k: v for k, v in every.items() if k not in kind.frozen}
        cast = (lambda t: t) if kind.compute is None else (lambda t: t.to(kind.compute))  # noqa: E731
        fwds = {"gather": lambda s, x: torch.func.functional_call(
                    plan.module, {k: cast(t) for k, t in funcshard.gather(plan, s).items()}, (cast(x),)),
                "apply": lambda s, x: funcshard.apply(plan, s, x)}
        for path, fwd in ((p, fwds[p]) for p in paths):
            f = lambda s, x, fwd=fwd: fwd({**s, **consts}, x).float().pow(2).sum()  # noqa: E731
            got = {}
            for n in (2, 5):
                xs = torch.randn(n, 1, 4)
                got["per_sample", n] = _counted(lambda: torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(
                    state, xs))
            for n in members:
                stacked = {k: torch.stack([v * (1 + i) for i in range(n)]) for k, v in state.items()}
                got["ensemble", n] = _counted(lambda: torch.func.vmap(torch.func.grad(f), in_dims=(0, None))(
                    stacked, torch.randn(3, 4)))
            out[pname, path] = got, len(layout(plan).buckets)
    return out


def test_collective_counts():
    """vmap over stacked states: one all-gather per group (3) in forward and one reduce-scatter per group in
    backward, whatever the number of members; a single torch.func.grad issues what plain autograd does (gather).
    apply under one grad/vjp or jvp level and value_and_grad: its runtime (the groups gathered again in backward),
    also over leaves that require grad (with grad mode on or off); its traced path only for a jvp level whose tangents
    plain autograd records below it.
    On every plan of the table, apply (its traced path): per-sample gradients over 2 or 5 examples issue one
    all-gather and one reduce-scatter per bucket (group and compute dtype); gather, and ensembles, under slow.
    (traced_apply's plain-autograd path issues c10d functional collectives, which these counters do not see.)"""
    out = run_ranks(2, _counts)[0]
    per_group = ["ag"] * 3 + ["rs"] * 3
    for path in ("gather", "traced"):
        assert out[path, "ensemble", 2] == out[path, "ensemble", 4] == out[path, "grad"] == per_group, out
    assert out["gather", "autograd"] == per_group, out
    runtime = ["ag"] * 6 + ["rs"] * 3  # (the runtime's groups resharded after forward, gathered again)
    assert out["apply"] == {"grad": (runtime, 0), "grad, no_grad": (runtime, 0), "vjp": (runtime, 0),
                            "jvp": (["ag"] * 6, 0), "value_and_grad": (runtime, 0), "grad, below": (runtime, 0),
                            "jvp, below": (["ag"] * 6, 0), "jvp, tangents below": (["ag"] * 6, 1)}, out["apply"]
    errors, refusal = out["vjp below"]
    assert max(errors) < 1e-6, errors
    assert re.match(r"funcshard\.apply: the gradients of a torch\.func\.vjp's vjp_fn \(the level's backward, run "
                    r"outside the transform\)", refusal), refusal
    _check_plan_counts(out["plans"], 1, 2)


def _check_plan_counts(out, paths, runs):
    assert len(out) == paths * len(PLANS), out
    for key, (got, buckets) in out.items():  # (every plan: independent of the batch and ensemble size)
        assert len(got) == runs and all(c == ["ag"] * buckets + ["rs"] * buckets for c in got.values()), (key, got)


@pytest.mark.slow
def test_collective_counts_over_plans():
    """test_collective_counts' plans on gather and apply, per-sample gradients and ensembles of 2 and 4 members."""
    _check_plan_counts(run_ranks(2, _plan_counts, None)[0], 2, 4)


# ---- transform stacks up to depth 3 over the collectives ---------------------------------------------------------

SCALES = (1.0, -0.5)


def _stacked(stack: str, local, ref, t, T):
    """Apply ``stack`` (G: grad of sin(.).sum(), J: jvp along this rank's tangent, V: vmap over scaled copies of the
    input), innermost last, to a rank's ``local`` x -> y and to the one-process ``ref`` X -> (W, ...) of every
    rank's y."""
    from torch.func import grad, jvp, vmap

    sc = torch.tensor(SCALES, dtype=torch.float64)
    for k in reversed(stack):
        if k == "G":
            local = (lambda h: lambda x: grad(lambda x: torch.sin(h(x)).sum())(x))(local)
            ref = (lambda H: lambda X: grad(lambda X: torch.sin(H(X)).sum())(X))(ref)
        elif k == "J":
            local = (lambda h: lambda x: jvp(h, (x,), (t,))[1])(local)
            ref = (lambda H: lambda X: jvp(H, (X,), (T,))[1])(ref)
        else:
            local = (lambda h: lambda x: vmap(h)(x[None] * sc.view(-1, 1, 1)))(local)
            ref = (lambda H: lambda X: vmap(H)(X[None] * sc.view(-1, 1, 1, 1)).movedim(0, 1))(ref)
    return local, ref


def _stacks(stacks):
    import torch.distributed as dist

    W, r = dist.get_world_size(), dist.get_rank()
    d = _data(W)
    X, T = d["X"], d["T"]
    local = lambda x: _local(x, d["ws"][r], d["cs"][r])  # noqa: E731
    ref = lambda X: _sim(X, d["ws"], d["cs"])  # noqa: E731
    out = {}
    for stack in stacks:
        # (a fresh tangent: torch.func's jvp batches, under vmap, a tangent laid out unlike its primal (T[1], a view
        # at an offset) and not T[0]: the ranks would then issue different collectives; docs/transforms.md)
        f, F = _stacked(stack, local, ref, T[r].clone(), T)
        a, b = f(X[r]), F(X)[r]
        out[stack] = a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-9)
    return out


_DEPTH3 = ("GGG", "VGJ", "JGV", "GJV", "VJG", "GVG")


@pytest.mark.parametrize("world", [2])
def test_depth_three_stacks(world):
    """Six depth-3 stacks of grad / jvp / vmap over the three collectives, each against the same stack of the
    one-process simulation (float64, 1e-9)."""
    for res in run_ranks(world, _stacks, _DEPTH3):
        assert len(res) == len(_DEPTH3) and all(res.values()), res


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_stack_to_depth_three(world):
    """All 39 stacks of grad / jvp / vmap of depth 1 to 3."""
    import itertools

    stacks = ["".join(p) for n in (1, 2, 3) for p in itertools.product("GJV", repeat=n)]
    for res in run_ranks(world, _stacks, stacks):
        assert len(res) == 39 and all(res.values()), {k: v for k, v in res.items() if not v}


def _flat_and_bf16():
    """A layout="flat" gather (create_graph double backward right; nested torch.func refused) and a bf16 policy
    (param_dtype bf16, reduce_dtype fp32) on traced_apply: torch.func against plain autograd per example."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import funcshard

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    m = _model()
    out = {}
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))

    flat = funcshard.plan(m, mesh, layout="flat")
    per = funcshard.plan(m, mesh)
    for name, plan in (("flat", flat), ("per_param", per)):
        s = {k: v.detach().clone().requires_grad_() for k, v in funcshard.shard(plan).items()}
        p = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
        loss = torch.func.functional_call(m, funcshard.gather(plan, s), (x,)).pow(2).mean()
        gs = torch.autograd.grad(loss, list(s.values()), create_graph=True)
        got = torch.autograd.grad(funcshard.all_reduce(sum(g.pow(2).sum() for g in gs), plan.mesh), list(s.values()))
        rl = torch.func.functional_call(m, p, (x,)).pow(2).mean()
        rg = torch.autograd.grad(rl, list(p.values()), create_graph=True)
        want = torch.autograd.grad(sum((W * g).pow(2).sum() for g in rg), list(p.values()))
        want = funcshard.shard(plan, {k: W * t for k, t in zip(p, want)})
        out[name] = all(torch.allclose(a, want[k], rtol=1e-6, atol=1e-6) for a, k in zip(got, s))
    try:
        st = funcshard.shard(flat)
        torch.func.grad(lambda q: sum(t.sum() for t in torch.func.grad(
            lambda r: torch.func.functional_call(m, funcshard.gather(flat, r), (x,)).sum())(q).values()))(st)
        out["flat_nested"] = "no error"
    except NotImplementedError as e:
        out["flat_nested"] = str(e)

    bf = funcshard.plan(m, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    state = funcshard.shard(bf)
    one = lambda s, xi: funcshard.traced_apply(bf, s, xi[None]).float().pow(2).sum()  # noqa: E731
    per_sample = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(state, x)
    loop = []
    for xi in x:
        leaves = {k: v.detach().clone().requires_grad_() for k, v in state.items()}
        one(leaves, xi).backward()
        loop.append({k: v.grad for k, v in leaves.items()})
    composed = [torch.func.grad(one)(state, xi) for xi in x]  # (the primitives' gather, unbatched)
    out["bf16_grad"] = all(torch.equal(composed[i][k], loop[i][k]) for i in range(len(x)) for k in state)
    out["bf16_vmap_grad"] = max(float((per_sample[k][i] - loop[i][k]).abs().max() / loop[i][k].abs().max())
                                for i in range(len(x)) for k in state)
    return out


def test_flat_layout_and_bf16_policy():
    """gather on a layout="flat" plan: a create_graph double backward is right (its bucketed gather's differentiable
    backward), nested torch.func is refused naming layout='per_param'; traced_apply under a bf16 policy (reduce in
    fp32): torch.func.grad (the primitives' gather) equals plain autograd (the c10d gather) per example bit for bit,
    and vmap(grad) per-sample gradients are within bf16 rounding of them."""
    for out in run_ranks(2, _flat_and_bf16):
        assert out["flat"] is True and out["per_param"] is True, out
        assert "layout='per_param'" in out["flat_nested"] and "grad inside grad" in out["flat_nested"], out
        assert out["bf16_grad"] is True, out
        assert out["bf16_vmap_grad"] < 3e-2, out  # (batched bf16 matmuls round differently: measured 1.5e-2, 2 ulps)


# ---- DP-SGD: per-example gradients, per-example clipping, an optimizer step ------------------------------------

def _dp_sgd(plans=("root",), steps=2, B=6):
    """Two DP-SGD steps (noise off) per path: per-example gradients (vmap(grad) or vmap(funcshard.value_and_grad),
    every rank the same examples), optim.per_example_global_norm_clip, the clipped sum over B, optim.adamw through
    optim.step; against the unsharded module: torch.func per-example gradients through functional_call, Opacus's
    clip factor on the full gradients, torch.optim.AdamW. Returns {path/plan: max abs difference of the parameters
    (shards), of the per-example losses, and (clipped, reference's) counts}."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.func import functional_call, grad, vmap

    import funcshard
    from funcshard import optim

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    m = _model()
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(B, 4, generator=g), torch.randn(B, 3, generator=g)) for _ in range(steps)]
    mse = lambda o, y: (o - y[None]).pow(2).sum()  # noqa: E731  (one example's loss)
    ref_one = lambda p, x, y: mse(functional_call(m, p, (x[None],)), y)  # noqa: E731
    out = {}
    for pname, kind in _plans(m, mesh).items():
        if pname not in plans:
            continue
        plan = funcshard.plan(m, mesh, **kind.kw)
        fwd = {"apply": lambda s, x: funcshard.apply(plan, s, x),
               "traced": lambda s, x: funcshard.traced_apply(plan, s, x),
               "gather": lambda s, x: functional_call(m, funcshard.gather(plan, s), (x,))}
        for path, how in (("apply", "grad"), ("apply", "value_and_grad"), ("traced", "value_and_grad"),
                          ("gather", "grad")):
            # (gather's gradient sums the W ranks' identical ones: each rank's loss divided by W)
            scale = W if path == "gather" else 1
            one = lambda s, x, y, f=fwd[path]: mse(f(s, x[None]), y) / scale  # noqa: E731
            full = {k: v.detach().clone() for k, v in m.named_parameters()}
            ref_opt = torch.optim.AdamW(list(full.values()), lr=0.05, weight_decay=0.1)
            tx = optim.adamw(lr=0.05, weight_decay=0.1)
            state = funcshard.shard(plan, full)
            opt_state = tx.init(state)
            dloss, counts = 0.0, []
            for x, y in data:
                ref_losses, ref_g = vmap(torch.func.grad_and_value(ref_one), in_dims=(None, 0, 0))(full, x, y)[::-1]
                norms = sum(t.reshape(B, -1).pow(2).sum(1) for t in ref_g.values()).sqrt()
                C = float(norms.sort().values[B // 2 - 1 : B // 2 + 1].mean())  # (half the examples clipped)
                factor = (C / (norms + 1e-6)).clamp(max=1.0)
                with torch.no_grad():
                    for k, p in full.items():
                        p.grad = torch.einsum("i,i...->...", factor, ref_g[k]) / B
                ref_opt.step()
                if how == "grad":
                    per_ex = vmap(grad(one), in_dims=(None, 0, 0))(state, x, y)
                else:
                    losses, per_ex = vmap(funcshard.value_and_grad(one), in_dims=(None, 0, 0))(state, x, y)
                    dloss = max(dloss, float((losses * scale - ref_losses).abs().max()))
                clipped, n = optim.per_example_global_norm_clip(per_ex, C, mesh=plan.mesh)
                counts.append((int(n), int((norms > C).sum())))
                state, opt_state = optim.step(tx, {k: v / B for k, v in clipped.items()}, opt_state, state)
            want = funcshard.shard(plan, {k: v.detach() for k, v in full.items()})
            out[f"{path}:{how}/{pname}"] = (max(float((state[k] - want[k]).abs().max()) for k in want), dloss, counts)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_dp_sgd(world):
    """The DP-SGD loop over sharded state (issue 32): vmap(grad) / vmap(value_and_grad) per-example gradients on
    apply, traced_apply and gather, optim.per_example_global_norm_clip (one all-reduce of the per-example squared
    norms), then optim.adamw; two steps equal the unsharded reference (torch.func + Opacus's clip factor +
    torch.optim.AdamW) within 1e-6 fp32, half the examples clipped."""
    plans = ("root",) if world == 1 else ("root", "per_block")
    for res in run_ranks(world, _dp_sgd, plans):
        assert len(res) == 4 * len(plans), res
        for key, (dparam, dloss, counts) in res.items():
            assert dparam < 1e-6 and dloss < 1e-6, (key, res[key])
            assert all(n == want == 3 for n, want in counts), (key, counts)


def test_optim_and_value_and_grad_under_transforms_refuse():
    """What cannot be right under a transform raises naming it: an optimizer step inside torch.func.grad (MAML
    through optim: its no_grad step would be a constant, measured 0 where the reference is not) or vmap (ensembles:
    no batching rules), per-example clipping inside vmap, a non-tensor aux of value_and_grad under vmap; and
    value_and_grad under vmap keeps its own leaf checks (funcshard's pytrees)."""
    import funcshard
    from funcshard import optim
    from torch.func import grad, vmap

    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))
    p = {"a": torch.randn(3, 2)}
    st = tx.init(p)
    loss = lambda q: q["a"].pow(2).sum()  # noqa: E731
    inner = lambda q: loss(optim.apply_updates(q, tx.update(grad(loss)(q), st, q)[0]))  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"optim\.chain got \['a'\], a tensor of the torch\.func transform "
                                                  r"grad\(\.\.\.\).*write it with torch ops"):
        grad(inner)(p)
    with pytest.raises(NotImplementedError, match=r"optim\.apply_updates .*grad\(\.\.\.\)"):
        grad(lambda q: loss(optim.apply_updates(q, {"a": -0.1 * q["a"]})))(p)
    with pytest.raises(NotImplementedError, match=r"optim\.scale got \['a'\], a tensor of the torch\.func transform"):
        grad(lambda q: loss(optim.scale(-0.1).update(q, optim.scale(-0.1).init(q))[0]))(p)
    with pytest.raises(NotImplementedError, match=r"optim\.adamw got \['a'\].*jvp\(\.\.\.\)"):
        tx2 = optim.adamw(0.1)
        torch.func.jvp(lambda q: optim.step(tx2, q, tx2.init(p), p)[0], (p,), (p,))
    stacked = {"a": torch.randn(4, 3, 2)}
    with pytest.raises(NotImplementedError, match=r"vmap\(\.\.\.\).*call tx\.update on the stacked trees"):
        vmap(lambda g: tx.update(g, st, p)[0])(stacked)
    with pytest.raises(NotImplementedError, match=r"per_example_global_norm_clip .*vmap\(\.\.\.\)"):
        vmap(lambda g: optim.per_example_global_norm_clip(g, 1.0)[0])({"a": torch.randn(2, 4, 3)})
    with pytest.raises(ValueError, match=r"same leading example dim .*\['a'\]: \(3, 2\), \['b'\]: \(4,\)"):
        optim.per_example_global_norm_clip({"a": torch.randn(3, 2), "b": torch.randn(4)}, 1.0)
    xs = torch.randn(5, 2)
    f = lambda q, x: (q["a"] * x).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"value_and_grad\(has_aux=True\) under vmap\(grad\(\.\.\.\)\): "
                                                  r".*aux at n is of type 'int'.*return it as a tensor"):
        vmap(funcshard.value_and_grad(lambda q, x: (f(q, x), {"n": 3}), has_aux=True), in_dims=(None, 0))(p, xs)
    with pytest.raises(TypeError, match=r"argument 0 at i is a torch\.int64 tensor"):
        vmap(funcshard.value_and_grad(f), in_dims=(None, 0))({**p, "i": torch.ones(2, dtype=torch.long)}, xs)
    with pytest.raises(ValueError, match=r"must return a scalar tensor \(shape \(\)\), got \(3, 2\)"):
        vmap(funcshard.value_and_grad(lambda q, x: q["a"] * x.sum()), in_dims=(None, 0))(p, xs)

    auxes = []

    def outer(q):  # under torch.func.grad alone a non-tensor aux is kept (as eagerly), and the gradient composes
        (_, aux), g = funcshard.value_and_grad(lambda r: (loss(r), 3), has_aux=True)(q)
        auxes.append(aux)
        return g["a"].sum()

    assert torch.equal(grad(outer)(p)["a"], torch.full((3, 2), 2.0)) and auxes == [3]


# ---- hypothesis: transform stacks up to depth 3 over sharded state, per path and plan -----------------------------

STACK_PATHS = ("gather", "traced", "traced_sum", "apply", "apply_sum")
STACK_PLANS = ("root", "per_block", "nested", "tied", "frozen")
def _scalar(out) -> torch.Tensor:
    return sum(torch.sin(t).sum() for t in torch.utils._pytree.tree_leaves(out))


def _state_stacks(cases):
    """Each case ``(stack, path, plan)``: the stack (outermost first) of G: grad of sum(sin(.)) w.r.t. the state,
    J: jvp along a tangent of the state, V: vmap over the state scaled by (1, -0.5), applied to the module's output
    on sharded state (float64) and to the unsharded module through functional_call; True where equal (1e-9), else
    the differences or the exception's text. The reference's gradient is scaled by ``c``: the sharded gradient of a
    replicated function (every rank the same) sums the W ranks' (gather, a factor-1 plan) or is their mean (the
    plan's factor); of a sharded one (a gradient's shards: each rank sums its own) it is the full one's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.func import functional_call, grad, jvp, vmap

    import funcshard

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    plans = _plans(_model(), mesh)
    sc = torch.tensor([1.0, -0.5], dtype=torch.float64)
    out = {}
    for stack, path, pname in cases:
        kind = plans[pname]
        m = kind.module.double()
        plan, fwd, _ = _paths(m, mesh, kind.kw)[path]
        every = {k: v.detach().clone() for k, v in m.named_parameters()}
        full = {k: v for k, v in every.items() if k not in kind.frozen}
        sharded = funcshard.shard(plan, every)
        consts = {k: v for k, v in sharded.items() if k in kind.frozen}
        state = {k: v for k, v in sharded.items() if k not in kind.frozen}
        g = torch.Generator().manual_seed(2)
        x = torch.randn(3, 4, generator=g, dtype=torch.float64)
        V = {k: torch.randn(t.shape, generator=g, dtype=torch.float64) for k, t in full.items()}
        Vs = {k: t for k, t in funcshard.shard(plan, {**every, **V}).items() if k in V}
        F = lambda s: fwd({**s, **consts}, x)  # noqa: E731
        R = lambda p: functional_call(m, {**p, **{k: every[k] for k in kind.frozen}}, (x,))  # noqa: E731
        inner_sharded, lead = False, 0
        for k in reversed(stack):
            if k == "G":
                c = (1.0 if path in ("traced", "apply") else float(W)) if not inner_sharded else (
                    1.0 / W if path in ("traced", "apply") else 1.0)
                F = (lambda h: lambda s: grad(lambda s: _scalar(h(s)))(s))(F)
                R = (lambda h, c: lambda p: {n: c * t for n, t in grad(lambda p: _scalar(h(p)))(p).items()})(R, c)
                inner_sharded, lead = True, 0
            elif k == "J":
                F = (lambda h: lambda s: jvp(h, (s,), (Vs,))[1])(F)
                R = (lambda h: lambda p: jvp(h, (p,), (V,))[1])(R)
            else:
                F = (lambda h: lambda s: vmap(lambda a: h({n: t * a for n, t in s.items()}))(sc))(F)
                R = (lambda h: lambda p: vmap(lambda a: h({n: t * a for n, t in p.items()}))(sc))(R)
                lead += 1
        key = f"{stack}/{path}/{pname}"
        try:
            got = F(state)
        except Exception as e:  # (every exception: the test reads which one, and its text)
            out[key] = f"{type(e).__name__}: {e}"
            continue
        want = R(full)
        if inner_sharded:  # full trees with `lead` leading dims -> this rank's shards with them
            flat = {n: t.reshape(-1, *t.shape[lead:]) for n, t in want.items()}
            each = [{n: t for n, t in funcshard.shard(plan, {**every, **{n: t[i] for n, t in flat.items()}}).items()
                     if n in flat} for i in range(len(sc) ** lead)]
            want = {n: torch.stack([e[n] for e in each]).reshape(*sc.shape * lead, *each[0][n].shape)
                    for n in flat}
        a, b = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
        out[key] = (len(a) == len(b) > 0 and all(p.shape == q.shape and torch.allclose(p, q, rtol=1e-9, atol=1e-9)
                                                 for p, q in zip(a, b))) or [
            (tuple(p.shape), tuple(q.shape), float((p - q).abs().max()) if p.shape == q.shape else None)
            for p, q in zip(a, b)]
    return out


def _check_stacks(res, world):
    """Every stack right on every path (before: two reverse levels refused on a divided gather at W > 1)."""
    for key, got in res.items():
        assert got is True, (key, got)


_CASES = st.lists(st.tuples(st.text("GJV", min_size=1, max_size=3), st.sampled_from(STACK_PATHS),
                            st.sampled_from(STACK_PLANS)), min_size=3, max_size=3)


def _drawn_stacks(world, cases):
    for res in run_ranks(world, _state_stacks, cases, timeout=600):
        assert len(res) == len(set(cases)), (cases, res)
        _check_stacks(res, world)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(cases=_CASES)
def test_drawn_stacks(cases):
    """Hypothesis draws transform stacks of grad / jvp / vmap of depth 1 to 3 over sharded state, a path (gather,
    traced_apply and apply, with the plan's factor and with 1) and a plan (root, per block, nested, tied, frozen), at
    W=2: each equals the same stack of the unsharded module (float64, 1e-9; before, two reverse levels through a
    divided gather were refused). Three draws here; more, and W=1 and 4, under slow; measured beforehand: all 39
    stacks on every path (root and per-block plans) and on gather and apply_sum (nested, tied, frozen) at W=2."""
    _drawn_stacks(2, cases)


@pytest.mark.slow
@pytest.mark.parametrize("world,examples", [(1, 10), (2, 30), (4, 10)])
def test_drawn_stacks_more(world, examples):
    settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)(
        given(cases=_CASES)(lambda cases: _drawn_stacks(world, cases)))()


# ---- torch.compile over nested transforms -------------------------------------------------------------------------

def _compiled_nested():
    """torch.compile (aot_eager) of vmap(grad), grad(grad), jvp(grad) and grad over traced_apply (a factor-1 plan)
    and of vmap(grad) over gather and apply: the compiled function's results against eager's (which the table checks
    against the reference), and fullgraph=True's error."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.func import grad, jvp, vmap

    import funcshard

    m = _model()
    plan = funcshard.plan(m, init_device_mesh("cpu", (dist.get_world_size(),)), groups=(torch.nn.Linear,),
                          grad_divide_factor=1.0)
    state = funcshard.shard(plan)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    one = lambda s, xi: funcshard.traced_apply(plan, s, xi[None]).pow(2).sum()  # noqa: E731
    f = lambda s: funcshard.traced_apply(plan, s, x).pow(2).mean()  # noqa: E731
    cases = {
        "vmap_grad": lambda s: vmap(grad(one), in_dims=(None, 0))(s, x),
        "grad_grad": lambda s: grad(lambda q: sum(t.pow(2).sum() for t in grad(f)(q).values()))(s),
        "jvp_grad": lambda s: jvp(grad(f), (s,), (s,))[1],
        "grad": lambda s: grad(f)(s),
        "gather_vmap_grad": lambda s: vmap(grad(lambda q, xi: torch.func.functional_call(
            m, funcshard.gather(plan, q), (xi[None],)).pow(2).sum()), in_dims=(None, 0))(s, x),
        "apply_vmap_grad": lambda s: vmap(grad(lambda q, xi: funcshard.apply(plan, q, xi[None]).pow(2).sum()),
                                          in_dims=(None, 0))(s, x),
    }
    out = {}
    torch._dynamo.reset()
    try:  # (first: traced before any eager call of the gather)
        torch.compile(cases["grad_grad"], backend="aot_eager", fullgraph=True)(state)
        out["fullgraph"] = "no error"
    except Exception as e:  # (dynamo's Unsupported: the test reads its text)
        out["fullgraph"] = f"{type(e).__name__}: {e}"
    for name, fn in cases.items():
        torch._dynamo.reset()
        a = torch.utils._pytree.tree_leaves(fn(state))
        b = torch.utils._pytree.tree_leaves(torch.compile(fn, backend="aot_eager")(state))
        out[name] = len(a) == len(b) > 0 and all(torch.equal(p, q) for p, q in zip(a, b))
    losses = {"traced": f, "apply": lambda s: funcshard.apply(plan, s, x).pow(2).mean(),
              "gather": lambda s: torch.func.functional_call(m, funcshard.gather(plan, s), (x,)).pow(2).mean()}
    for name, loss in losses.items():  # torch.func.grad(torch.compile(loss)): dynamo runs it eagerly, or refuses
        for fullgraph in (False, True):
            torch._dynamo.reset()
            try:
                got = grad(torch.compile(loss, backend="aot_eager", fullgraph=fullgraph))(state)
                want = grad(loss)(state)
                out["grad_of_compiled", name, fullgraph] = all(torch.equal(got[k], t) for k, t in want.items())
            except Exception as e:  # (dynamo's Unsupported: the test reads its text)
                out["grad_of_compiled", name, fullgraph] = f"{type(e).__name__}: {e}"
    torch._dynamo.reset()
    return out


@pytest.mark.slow
def test_compiled_nested_transforms():
    """torch.compile over a function that runs traced_apply under vmap(grad), grad(grad), jvp(grad) or grad: right
    (dynamo runs the transform eagerly at the composable gather's graph break: the same values as eagerly, bit for
    bit; before, a torch error on dynamo's GradTrackingTensors), and fullgraph=True refuses naming the way out.
    ``torch.func.grad(torch.compile(loss))`` over traced_apply, apply and gather: the eager gradient bit for bit
    (dynamo runs the loss eagerly under the outer transform), and with fullgraph=True torch's own refusal naming the
    way out (wrap the transform in torch.compile too)."""
    for out in run_ranks(2, _compiled_nested, timeout=600):
        for path in ("traced", "apply", "gather"):
            assert out["grad_of_compiled", path, False] is True, out
            assert re.search(r"^Unsupported: .*torch\.func\.grad\(compiled_fn\) function from eager mode is not "
                             r"supported", out["grad_of_compiled", path, True], re.S), out
        assert all(out[k] is True for k in ("vmap_grad", "grad_grad", "jvp_grad", "grad", "gather_vmap_grad",
                                            "apply_vmap_grad")), out
        assert out["fullgraph"].startswith("Unsupported: ") and re.search(
            r"run eagerly.*fullgraph=True\) refuses it\. For one graph, compile the first-order step", out["fullgraph"],
            re.S), out["fullgraph"]


# ---- a dividing gather's gradient gathered again by another kind of gather (review of the second-order change) ----


def _mixed_gathers():
    """MAML at W=2 with per-rank batches: the inner gradient through traced_apply's gather (the default divide
    factor), the adapted state gathered by another entry point. The runtime of apply (plain autograd) runs the traced
    path for such a state and is exact; the summing gathers (funcshard.gather, funcshard.all_gather, a factor-1 plan)
    are refused (they were 6e-2 off, silently, before the refusal)."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.func import functional_call, grad

    import funcshard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    plan = funcshard.plan(m, mesh)
    summed = funcshard.plan(m, mesh, grad_divide_factor=1.0)
    full = {k: v.detach().clone() for k, v in m.named_parameters()}
    state = funcshard.shard(plan, full)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 4, generator=g) for _ in range(world)]
    vxs = [torch.randn(5, 4, generator=g) for _ in range(world)]
    x, vx = xs[rank], vxs[rank]

    def f(s, xx=x):
        return funcshard.traced_apply(plan, s, xx).pow(2).mean()

    def ref(p, batches):  # the ranks' mean loss, unsharded
        return sum(functional_call(m, p, (b,)).pow(2).mean() for b in batches) / world

    def step(p, gs):
        return {k: p[k] - 0.3 * gs[k] for k in p}

    want = funcshard.shard(plan, grad(lambda p: ref(step(p, grad(lambda q: ref(q, xs))(p)), vxs))(full))
    out = {}

    def leaves():
        return {k: t.detach().clone().requires_grad_() for k, t in state.items()}

    s = leaves()
    gs = dict(zip(s, torch.autograd.grad(f(s), list(s.values()), create_graph=True)))
    got = dict(zip(s, torch.autograd.grad(funcshard.apply(plan, step(s, gs), vx).pow(2).mean(), list(s.values()))))
    out["autograd, then apply"] = max((got[k] - want[k]).abs().max().item() for k in want)
    s = leaves()
    funcshard.apply(plan, step(s, grad(f)(s)), vx).pow(2).mean().backward()
    out["torch.func, then apply's backward"] = max((s[k].grad - want[k]).abs().max().item() for k in want)

    def gathered(s):
        return functional_call(m, funcshard.gather(plan, s), (vx,)).pow(2).mean()

    def all_gathered(s):
        p = {k: funcshard.all_gather(t, mesh)[:full[k].shape[0]] for k, t in s.items()}
        return functional_call(m, p, (vx,)).pow(2).mean()

    outer = {"funcshard.gather": gathered, "funcshard.all_gather": all_gathered,
             "a factor-1 plan": lambda s: funcshard.traced_apply(summed, s, vx).pow(2).mean()}
    for name, fo in outer.items():
        try:
            grad(lambda s: fo(step(s, grad(f)(s))))(state)
            out[name] = "no error"
        except NotImplementedError as e:
            out[name] = str(e)
    return out


def test_a_dividing_gathers_gradient_gathered_again_by_another_kind():
    for out in run_ranks(2, _mixed_gathers):
        assert out.pop("autograd, then apply") < 1e-6 and out.pop("torch.func, then apply's backward") < 1e-6, out
        for name, text in out.items():
            assert "is gathered again by a gather that does neither" in text, (name, text)


def _series():
    """A state made from another traced_apply/apply call's output (a hypernetwork: one model's output is the other's
    weight shard), both gathers dividing: each path refused; with the second plan summing (factor 1), the gradient of
    the first model's state against the unsharded reference."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.func import functional_call, grad

    import funcshard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    hyper, target = torch.nn.Linear(4, 4), torch.nn.Linear(2, 3, bias=False)  # (target's weight shard: (2, 2) at W=2)
    p1 = funcshard.plan(hyper, mesh)
    p2, p2_sum = funcshard.plan(target, mesh), funcshard.plan(target, mesh, grad_divide_factor=1.0)
    s1 = funcshard.shard(p1)
    z, x = torch.randn(1, 4), torch.randn(5, 2)

    def loss(first, second, plan2):
        def f(s):
            state2 = {"weight": first(p1, s, z).reshape(2, 2)}
            return second(plan2, state2, x).pow(2).sum()
        return f

    out = {}
    apis = {"apply": funcshard.apply, "traced_apply": funcshard.traced_apply}
    for a, first in apis.items():
        for b, second in apis.items():
            f = loss(first, second, p2)
            for how, run in (("autograd", lambda: torch.autograd.grad(f(leaves := {k: v.detach().requires_grad_()
                                                                                   for k, v in s1.items()}),
                                                                      list(leaves.values()))),
                             ("torch.func", lambda: grad(f)(s1))):
                try:
                    run()
                    out[a, b, how] = "no error"
                except NotImplementedError as e:
                    out[a, b, how] = str(e)
            got = grad(loss(first, second, p2_sum))(s1)  # (the way out: the second plan sums)
            full = {k: v.detach().clone() for k, v in hyper.named_parameters()}

            def ref(p):
                h = functional_call(hyper, p, (z,)).reshape(2, 2)
                return functional_call(target, {"weight": torch.cat([h, h])[:3]}, (x,)).pow(2).sum()
            want = funcshard.shard(p1, grad(ref)(full))
            out[a, b, "factor 1"] = max((got[k] - want[k]).abs().max().item() for k in want)
    for factor in (None, 1.0):  # a fully_shard module's output as apply's state (its gather divides too)
        fs = torch.nn.Linear(4, 4)
        fs.load_state_dict(hyper.state_dict())
        funcshard.fully_shard(fs, mesh=mesh)
        if factor is not None:
            fs.set_gradient_divide_factor(factor)
        try:
            funcshard.apply(p2, {"weight": fs(z).reshape(2, 2)}, x).pow(2).sum().backward()
            want = grad(ref)(full)
            out["fully_shard", "apply", factor] = max((v.grad.full_tensor() - want[k]).abs().max().item()
                                                      for k, v in fs.named_parameters())
        except NotImplementedError as e:
            out["fully_shard", "apply", factor] = str(e)
    return out


def test_two_dividing_gathers_in_series_are_refused():
    """The output of one traced_apply/apply call feeding the state of another (W=2, both plans dividing): the
    gradient would be divided at each gather (off by W, silently, before); refused on every pair of paths under
    plain autograd and torch.func, naming grad_divide_factor=1.0; with the second plan's factor 1 the gradient is
    the unsharded reference's (1e-6). A funcshard.fully_shard module's output as apply's state likewise (before: not
    refused, 0.5x at W=2), exact with the module's set_gradient_divide_factor(1.0)."""
    for out in run_ranks(2, _series):
        assert out.pop(("fully_shard", "apply", 1.0)) < 1e-6, out  # (set_gradient_divide_factor(1.0): sums)
        assert "a funcshard.fully_shard module" in out[("fully_shard", "apply", None)], out
        for key, got in out.items():
            if key[2] == "factor 1":
                assert got < 1e-6, (key, got)
            else:
                assert re.search(r"got a state made from the output of another such gather .* divided at each of the "
                                 r"two gathers .*grad_divide_factor=1\.0", got), (key, got)


def _series_compiled():
    """A torch.compile'd traced_apply's output as apply's state (a hypernetwork): the compiled graph's gathers cannot
    be seen by the walk, so once a dividing gather was compiled in the process the state made by a compiled graph is
    refused; a compiled graph feeding apply's state before any was (no funcshard gather in it) still runs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard
    from funcshard import _primitives

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    hyper, target = torch.nn.Linear(4, 4), torch.nn.Linear(2, 3, bias=False)
    p1, p2 = funcshard.plan(hyper, mesh), funcshard.plan(target, mesh)
    s1 = {k: v.requires_grad_() for k, v in funcshard.shard(p1).items()}
    z, x = torch.randn(1, 4), torch.randn(5, 2)
    out = {}
    saved = _primitives._COMPILED["divides"]
    try:
        _primitives._COMPILED["divides"] = False  # (as in a process that compiled no dividing gather)
        plain = torch.compile(lambda w: (w * 2.0).reshape(2, 2))
        w = torch.randn(4, requires_grad=True)
        funcshard.apply(p2, {"weight": plain(w)}, x).pow(2).sum().backward()
        out["compiled, no gather"] = "no error"
        comp = torch.compile(lambda s: funcshard.traced_apply(p1, s, z))
        try:
            funcshard.apply(p2, {"weight": comp(s1).reshape(2, 2)}, x).pow(2).sum().backward()
            out["compiled traced_apply"] = "no error"
        except NotImplementedError as e:
            out["compiled traced_apply"] = str(e)
    finally:
        _primitives._COMPILED["divides"] = saved
    return out


@pytest.mark.slow  # (two torch.compile calls per rank: ~15 s)
def test_a_compiled_dividing_gather_in_series_is_refused():
    """The walk of apply's state passes through a torch.compile'd graph's backward node unseen: a compiled
    traced_apply feeding apply's state had its gradient divided twice (0.5x at W=2, silently, before)."""
    for out in run_ranks(2, _series_compiled):
        assert out["compiled, no gather"] == "no error", out
        assert re.search(r"divided at each of the two gathers .* made by a torch\.compile'd graph, and a dividing "
                         r"gather .* was compiled in this process", out["compiled traced_apply"]), out
