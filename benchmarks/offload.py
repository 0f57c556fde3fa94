"""CPU offload (issue 19): peak device-side memory and step time against the run without offload, 2 gloo ranks.

    python benchmarks/offload.py            # ~1-2 min on 2 cores; prints the table, --write puts it in OFFLOAD.md

Systems, one training step each (forward, backward, AdamW), the same GPT (funcshard.demo's), seeds and batches:
FSDP2 and funcshard's fully_shard without and with ``CPUOffloadPolicy(pin_memory=False)``; the functional path
(``plan`` + ``value_and_grad`` + ``optim.step``) without offload, with ``plan(offload_policy=...)``, and with
``optim.offload(adamw, plan)`` (moments on the host, stepped group by group).

Memory: ``benchmarks/instruments.LiveBytes`` (the storages reachable from the system at entry plus those the step
allocates, under a dispatch mode) over one step, without the host state (what the offload keeps on the host: sharded parameters, their persistent ``.grad``, optimizer state; nothing
for the runs without offload). On this CPU-only machine the host is the device, so this is what the device would hold;
on CUDA the device also holds the copies in flight (one group's shards before its all-gather, one group's gradient
shards before their copy out, with ``optim.offload`` two groups' moments). The functional path's gradients are new
tensors each step, counted (an upper bound: on CUDA they are host tensors). With ``CPUOffloadPolicy`` the optimizer
steps on the host: the peak covers forward and backward (the step's temporaries are host memory); otherwise it covers
the optimizer step too. Time: median of the slowest rank's step
over interleaved repeats; no copies happen on CPU, so the ratios measure the bookkeeping only.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests"), str(HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.fsdp as torch_fsdp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import funcshard  # noqa: E402
from funcshard import optim  # noqa: E402
from funcshard.demo import GPT, Block  # noqa: E402
from instruments import LiveBytes, _storages  # noqa: E402
from multirank import run_ranks  # noqa: E402

CFG = dict(vocab=256, d=128, heads=4, layers=6, seq=64)
SYSTEMS = ["fsdp2", "fsdp2_offload", "fully_shard", "fully_shard_offload", "apply", "apply_offload",
           "apply_optim_offload"]


def _batch(i):
    g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
    idx = torch.randint(0, CFG["vocab"], (8, CFG["seq"] + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _module_system(fs, offload):
    torch.manual_seed(0)
    model = GPT(**CFG)
    kw = {"offload_policy": fs.CPUOffloadPolicy(pin_memory=False)} if offload else {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in model.blocks:
        fs.fully_shard(b, mesh=mesh, **kw)
    fs.fully_shard(model, mesh=mesh, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def fwd_bwd(i):
        x, y = _batch(i)
        loss = _loss(model(x), y)
        loss.backward()
        return loss.item()

    def update():
        opt.step()
        opt.zero_grad(set_to_none=False)  # (the .grad tensors persist: host state when offloaded)

    def host():
        if not offload:
            return []
        locals_ = [p.to_local() for p in model.parameters()]
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        moments = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return locals_ + grads + moments

    return fwd_bwd, update, host, offload


def _functional_system(kind):
    torch.manual_seed(0)
    model = GPT(**CFG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    pol = funcshard.CPUOffloadPolicy(pin_memory=False) if kind == "offload" else None
    plan = funcshard.plan(model, mesh, groups=(Block,), offload_policy=pol)
    tx = optim.offload(optim.adamw(lr=1e-3), plan, pin_memory=False) if kind == "optim" else optim.adamw(lr=1e-3)
    box = {"state": funcshard.shard(plan)}
    box["opt"] = tx.init(box["state"])

    def fwd_bwd(i):
        x, y = _batch(i)
        loss, box["grads"] = funcshard.value_and_grad(lambda s: _loss(funcshard.apply(plan, s, x), y))(box["state"])
        return loss.item()

    def update():
        box["state"], box["opt"] = optim.step(tx, box.pop("grads"), box["opt"], box["state"], donate=True)

    def host():
        moments = [t for t in optim_leaves(box["opt"]) if isinstance(t, torch.Tensor)]
        if kind == "offload":
            return list(box["state"].values()) + moments
        return moments if kind == "optim" else []

    return fwd_bwd, update, host, kind == "offload"


def optim_leaves(state):
    from funcshard._tree import tree_leaves

    return tree_leaves(state)


class DeviceBytes(LiveBytes):
    """``LiveBytes`` (everything reachable from the system at entry, plus what the step allocates) without the
    storages of ``ignore``: the host state."""

    def __init__(self, roots, ignore):
        self.ignored = {id(st) for t in ignore for st in _storages(t)}  # (a DTensor: its local tensor's)
        self._keep = list(ignore)  # (ids stay valid)
        super().__init__(roots)

    def _see(self, st):
        if id(st) not in self.ignored:
            super()._see(st)


def _make(name):
    if name.startswith("fsdp2"):
        return _module_system(torch_fsdp, name.endswith("offload"))
    if name.startswith("fully_shard"):
        return _module_system(funcshard, name.endswith("offload"))
    return _functional_system({"apply": "none", "apply_offload": "offload", "apply_optim_offload": "optim"}[name])


def _run(repeats, steps):
    torch.set_num_threads(1)
    systems = {n: _make(n) for n in SYSTEMS}
    out = {n: {"times": [], "losses": []} for n in SYSTEMS}
    for n, (fwd_bwd, update, host, host_optimizer) in systems.items():  # warm-up: optimizer state, .grad exist
        out[n]["losses"].append(fwd_bwd(0))
        update()
        state = host()
        with DeviceBytes([fwd_bwd, update], ignore=state) as mem:
            out[n]["losses"].append(fwd_bwd(1))
            if not host_optimizer:  # (on the device: its temporaries count)
                update()
        if host_optimizer:  # (the optimizer steps on the host: nothing of it on the device)
            update()
        out[n]["peak"] = mem.peak
        out[n]["host"] = sum(st.nbytes() for st in {id(st): st for t in state for st in _storages(t)}.values())
    for r in range(repeats):
        for n, (fwd_bwd, update, _, _) in systems.items():
            dist.barrier()
            t = time.perf_counter()
            for s in range(steps):
                out[n]["losses"].append(fwd_bwd(2 + r * steps + s))
                update()
            dist.barrier()
            out[n]["times"].append((time.perf_counter() - t) / steps)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    res = run_ranks(2, _run, 5, 3, timeout=900)
    rows = []
    base = {"fsdp2": "fsdp2", "fsdp2_offload": "fsdp2", "fully_shard": "fully_shard",
            "fully_shard_offload": "fully_shard", "apply": "apply", "apply_offload": "apply",
            "apply_optim_offload": "apply"}
    for n in SYSTEMS:
        times = [max(r[n]["times"][i] for r in res) for i in range(len(res[0][n]["times"]))]
        ratio = statistics.median(t / max(r[base[n]]["times"][i] for r in res) for i, t in enumerate(times))
        peak, host = max(r[n]["peak"] for r in res), max(r[n]["host"] for r in res)
        bpeak = max(r[base[n]]["peak"] for r in res)
        same = res[0][n]["losses"] == res[0][base[n]]["losses"]
        rows.append(f"| {n} | {statistics.median(times) * 1e3:.1f} | {ratio:.2f} | {peak / 2**20:.2f} | "
                    f"{peak / bpeak:.2f} | {host / 2**20:.2f} | {'yes' if same else 'NO'} |")
    ref_same = res[0]["fsdp2_offload"]["losses"] == res[0]["fully_shard_offload"]["losses"]
    pairs = [max(r["fully_shard_offload"]["times"][i] for r in res) / max(r["fsdp2_offload"]["times"][i] for r in res)
             for i in range(len(res[0]["fsdp2_offload"]["times"]))]
    table = "\n".join([
        f"GPT {CFG}, 2 gloo ranks, AdamW, {torch.__version__}; load average {_load()}.",
        "",
        "| system | step ms (median) | vs no offload | device-side peak MiB | vs no offload | host state MiB "
        "| losses = no offload |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"fully_shard_offload losses = fsdp2_offload losses, bit for bit: {'yes' if ref_same else 'NO'}; its step "
        f"time vs fsdp2_offload's: {statistics.median(pairs):.2f}x (paired median, range {min(pairs):.2f}-"
        f"{max(pairs):.2f}); device-side peak vs fsdp2_offload's: "
        f"{max(r['fully_shard_offload']['peak'] for r in res) / max(r['fsdp2_offload']['peak'] for r in res):.2f}.",
    ])
    print(table)
    if "--write" in argv:
        doc = (HERE / "OFFLOAD.md").read_text() if (HERE / "OFFLOAD.md").exists() else ""
        head = doc.split("## Measured")[0] if doc else "# CPU offload\n\n"
        (HERE / "OFFLOAD.md").write_text(head + "## Measured (`python benchmarks/offload.py --write`)\n\n" + table
                                         + "\n")
    return 0


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())
