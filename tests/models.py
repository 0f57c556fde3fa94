"""Models shared by the tests (importable by the rank workers)."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class FailOnce(torch.autograd.Function):
    """Identity whose backward raises once when ``FailOnce.fail`` is set (a transient failure, e.g. a caught
    out-of-memory error), then passes gradients on again."""

    fail = False

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        if FailOnce.fail:
            FailOnce.fail = False
            raise RuntimeError("transient failure in backward")
        return g


class Block(nn.Module):
    def __init__(self, d: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 3 * d + 1  # odd on purpose: uneven shards
        self.l1 = nn.Linear(d, hidden)
        self.l2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.l2(F.gelu(self.l1(x)))


class ScheduleLog:
    """Records, on funcshard's runtime, each group all-gather issued, each collective, and block forwards."""

    def __init__(self):
        self.events: list[str] = []

    def __enter__(self):
        from funcshard import _collectives, _pipeline, _runtime

        names = (_collectives._AG_NAME, _collectives._RS_NAME)  # torch.distributed's, looked up per call
        self._saved = (_runtime.GroupRun.unshard, *(getattr(dist, n) for n in names))
        unshard, ag, rs = self._saved
        log = self.events

        def logged_unshard(run):
            if run.buffers.status.value == "sharded":
                log.append(f"AG {run.name or '<root>'}")
            return unshard(run)

        def counted(*a, _fn, _kind, **k):
            log.append(_kind)
            return _fn(*a, **k)

        finish = self._finish = _pipeline.PendingReduce.finish

        def logged_finish(pending, *args, **kwargs):
            log.append("RS taken")
            return finish(pending, *args, **kwargs)

        _runtime.GroupRun.unshard = logged_unshard
        _pipeline.PendingReduce.finish = logged_finish
        for n, fn, kind in zip(names, (ag, rs), ("ag", "rs")):
            setattr(dist, n, functools.partial(counted, _fn=fn, _kind=kind))
        return self

    def __exit__(self, *exc):
        from funcshard import _collectives, _pipeline, _runtime

        _runtime.GroupRun.unshard = self._saved[0]
        _pipeline.PendingReduce.finish = self._finish
        for n, fn in zip((_collectives._AG_NAME, _collectives._RS_NAME), self._saved[1:]):
            setattr(dist, n, fn)

    def take(self, kinds=("ag", "rs")):
        out = [e for e in self.events if e.split()[0] in kinds]
        self.events.clear()
        return out


class EditsFrozen(Block):
    """A block that edits its frozen parameter in place (under no_grad) in its forward."""

    def __init__(self, d: int):
        super().__init__(d)
        self.scale = nn.Parameter(torch.ones(d), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.scale.mul_(1.0)
        return super().forward(x) * self.scale


class MLP(nn.Module):
    """Input projection (root), L residual blocks (groups), head (root)."""

    def __init__(self, d_in: int = 7, d: int = 6, layers: int = 3, d_out: int = 3):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.out = nn.Linear(d, d_out)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class ReversedMLP(MLP):
    """Blocks run in the reverse of their registration order (the plan's default group order)."""

    def forward(self, x):
        h = self.inp(x)
        for b in reversed(self.blocks):
            h = b(h)
        return self.out(h)


class Leafy(nn.Module):
    """A module tree built from a list of parameter specs: (path, shape, dtype), plus integer buffers."""

    def __init__(self, specs, buffers=()):
        super().__init__()
        for path, shape, dtype in specs:
            mod = self
            *parents, name = path.split(".")
            for p in parents:
                if not hasattr(mod, p):
                    mod.add_module(p, nn.Module())
                mod = getattr(mod, p)
            mod.register_parameter(name, nn.Parameter(torch.randn(shape).to(dtype), requires_grad=dtype.is_floating_point))
        for path, shape in buffers:
            self.register_buffer(path, torch.randint(0, 100, shape))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 16, tied: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.5 / math.sqrt(p.shape[-1]))

    def forward(self, idx):
        h = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))
