"""torch.func transforms that compose over sharded state (issue 32).

Every rank runs its local function; the reference is one process simulating every rank in float64 (``_sim``): a
rank's gradient of a shard is the derivative of the *sum* of every rank's function (the reduce-scatter sums), its jvp
the derivative of its own function along every rank's tangent together.
"""

from __future__ import annotations

import pytest
import torch

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
