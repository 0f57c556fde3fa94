"""Train a small GPT with funcshard's functional API on several local ranks.

    python -m funcshard.demo                 # 2 CPU ranks (gloo); on a CUDA machine: NCCL, one GPU per rank
    python -m funcshard.demo --ranks 4 --steps 40

Each rank holds 1/W of the parameters and of the AdamW state; every step all-gathers the blocks just in time
(prefetching the next one), reduce-scatters the gradients, and updates its shards with funcshard.optim.
Under torchrun (``WORLD_SIZE`` set) it uses the launcher's ranks instead of spawning its own.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import funcshard
from funcshard import optim
from funcshard._tree import tree_leaves


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: planned once, in the root group
        for n, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        h = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))


TEXT = (
    "funcshard shards parameters as pytrees of local tensors; pure functions gather them just in time, "
    "and gradients come back reduce-scattered, because all-gather and reduce-scatter are transposes. "
)


def batches(seq: int, batch: int, rank: int, world: int, steps: int, device):
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch * world,), generator=g)
        chunk = torch.stack([data[s : s + seq + 1] for s in starts]).chunk(world)[rank]  # this rank's slice
        yield chunk[:, :-1].to(device), chunk[:, 1:].to(device)


def human(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def train(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # same initial model on every rank
    model = GPT(256, args.dim, 4, args.layers, args.seq).to(device)
    mesh = init_device_mesh(device.type, (world,))
    plan = funcshard.plan(model, mesh, groups=(Block,), prefetch=1)
    state = funcshard.shard(plan)
    warmup = lambda step: 3e-3 * min(1.0, (step + 1) / 10)  # noqa: E731 - a schedule is a function of the step
    tx = optim.chain(optim.clip_by_global_norm(1.0, mesh=mesh), optim.adamw(lr=warmup, weight_decay=0.01))
    opt_state = tx.init(state)

    def loss_fn(s, x, y):
        logits = funcshard.apply(plan, s, x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    step_fn = funcshard.value_and_grad(loss_fn)  # first-order, plain autograd underneath (torch.func.grad works too)
    if rank == 0:
        print(f"funcshard demo: GPT {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
              f"{args.layers} blocks, {world} ranks ({dist.get_backend()} on {device.type}), "
              f"{args.steps} steps of {args.batch * world}x{args.seq} tokens")
        print("\n".join(str(plan).splitlines()[:1]))
    tokens = 0
    every = max(1, args.steps // 8)
    t0 = time.perf_counter()
    first = None
    for i, (x, y) in enumerate(batches(args.seq, args.batch, rank, world, args.steps, device), 1):
        loss, grads = step_fn(state, x, y)
        # donate=True: the old updates, optimizer state and shards are reused in place (JAX's donation)
        updates, opt_state = tx.update(grads, opt_state, state, donate=True)
        state = optim.apply_updates(state, updates, donate=True)
        mean_loss = funcshard.all_reduce(loss.detach()) / world
        first = first if first is not None else mean_loss.item()
        tokens += x.numel() * world
        if rank == 0 and (i % every == 0 or i == args.steps):  # a log line, not a bar: readable in any log
            rate = tokens / (time.perf_counter() - t0)
            print(f"step {i:>3}/{args.steps} loss {mean_loss.item():.3f} {rate:,.0f} tok/s", flush=True)
    last = mean_loss.item()
    shard_bytes = sum(t.numel() * t.element_size() for t in state.values())
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt_bytes = sum(t.numel() * t.element_size() for t in tree_leaves(opt_state)
                    if isinstance(t, torch.Tensor))
    peak_unsharded = max(
        sum(math.prod(plan.specs[p].padded_shape) * plan.specs[p].dtype.itemsize for p in g.params)
        for g in plan.groups[1:]
    )
    if rank == 0:
        print(f"loss {first:.3f} -> {last:.3f}")
        print(f"per-rank parameters: {human(shard_bytes)} sharded vs {human(full_bytes)} unsharded "
              f"({shard_bytes / full_bytes:.2f}x); AdamW state {human(opt_bytes)} vs {human(2 * full_bytes)} "
              f"unsharded; largest block gathered at a time {human(peak_unsharded)}")
    if last >= first:
        raise SystemExit(f"rank {rank}: loss did not go down ({first:.3f} -> {last:.3f})")


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        train(args)
        dist.barrier()  # every rank done with its collectives before any rank tears gloo down
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="local ranks to spawn (default 2)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        try:
            train(args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    sys.exit(main())
