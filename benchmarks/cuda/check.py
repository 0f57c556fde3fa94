"""CUDA checks of funcshard in one process on one GPU (issue 35), one stage per call; ``run.sh`` runs them all.

    python benchmarks/cuda/check.py STAGE --out DIR      # STAGE: env, parity, fake8, trace, cost
    FUNCSHARD_DEVICE=cpu python benchmarks/cuda/check.py STAGE --out DIR    # the CPU dry run: gloo, tiny models

Each stage writes ``DIR/STAGE.json`` (its numbers and a ``checks`` list of ``[name, ok, detail]``) and prints them;
it exits 1 when a check failed, 2 when it raised (the traceback is in the JSON and on stderr).

* ``env``: versions, the card, NCCL, optree, ``import funcshard`` and its lazy names.
* ``parity``: W=1 NCCL, a small GPT, fp32 and bf16 (``MixedPrecisionPolicy(bf16, fp32 reduce)``): gradients of the
  first step and losses/parameters after 3 AdamW steps of ``funcshard.fully_shard`` and ``funcshard.apply``
  against FSDP2 and the unsharded module (bit-identical where the arithmetic is the same, else the max
  difference); ``set_all_reduce_hook(hook, stream=torch.cuda.Stream())`` on both module APIs; ``CPUOffloadPolicy``
  (pinned) on ``fully_shard`` against FSDP2's and on ``apply``.
* ``fake8``: the fake process group at W=8 on the one GPU: FSDP2, ``fully_shard`` and ``apply`` in fp32 and bf16
  run their steps (numbers are meaningless: the fake collectives move nothing), peak memory of each.
* ``trace``: one ``fs_apply``, ``fs_fully_shard`` and ``fully_shard`` + ``CPUOffloadPolicy`` step at W=1 NCCL under
  ``funcshard.trace`` and ``torch.profiler``: the Chrome traces (gzip) and which CUDA streams ran the collectives
  (none at W=1: FSDP2 and funcshard skip them there), the copies and the compute.
* ``cost``: ``funcshard.cost.estimate``'s peak against the measured ``torch.cuda.max_memory_allocated`` of the same
  plan (``benchmarks/systems.py``'s ``fs_apply``), W=1 NCCL fp32 and bf16, and fake-PG W=8 fp32.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
for p in (str(BENCH), str(BENCH.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DEVICE = os.environ.get("FUNCSHARD_DEVICE", "cuda")
DRY = DEVICE == "cpu"
if not DRY and not torch.cuda.is_available():
    raise SystemExit("check.py: no CUDA device here; FUNCSHARD_DEVICE=cpu runs the CPU dry run")


def _cfg(kind: str):
    import systems as S

    if DRY:  # everything tiny on the CPU
        return {"small": S.ModelConfig("gpt-dry", 64, 32, 2, 2, 16, 2),
                "big": S.ModelConfig("gpt-dry2", 128, 64, 2, 3, 32, 2)}[kind]
    return {"small": S.ModelConfig("gpt-check", 1024, 256, 4, 4, 128, 4),
            "big": S.ModelConfig("gpt-100M-b8", 8192, 768, 12, 12, 512, 8)}[kind]


class Report:
    def __init__(self, stage: str, out: Path):
        self.stage, self.out, self.data, self.checks = stage, out, {}, []

    def check(self, name: str, ok: bool, detail="") -> None:
        self.checks.append([name, bool(ok), str(detail)])
        print(f"[{'PASS' if ok else 'FAIL'}] {name}  {detail}", flush=True)

    def info(self, name: str, detail="") -> None:
        """A reading, not a pass/fail check (``ok`` is None in the JSON)."""
        self.checks.append([name, None, str(detail)])
        print(f"[INFO] {name}  {detail}", flush=True)

    def save(self, error: str | None = None) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        body = {"stage": self.stage, "device": DEVICE, "checks": self.checks, "data": self.data}
        if error:
            body["error"] = error
        (self.out / f"{self.stage}.json").write_text(json.dumps(body, indent=1, default=str))


def _device() -> torch.device:
    if DRY:
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _init(world: int = 1):
    """W=1 on NCCL (gloo in the dry run), or the fake process group of ``world`` ranks; a 1-D mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = _device()
    if world == 1:
        dist.init_process_group("gloo" if DRY else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    else:
        from funcshard._compat import fake_store

        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
    return dev, init_device_mesh(dev.type, (world,))


def _sync():
    if not DRY:
        torch.cuda.synchronize()


def _peak_reset():
    gc.collect()
    if not DRY:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def _peak(base):
    if DRY:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _maxdiff(a: dict, b: dict) -> float:
    keys = sorted(set(a) & set(b))
    if not keys or set(a) != set(b):
        return float("nan")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys)


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _full(t):
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().to("cpu", copy=True)  # a copy on the CPU too: a donated buffer is overwritten later


# ---- stages ------------------------------------------------------------------------------------------------


def stage_env(rep: Report) -> None:
    d = rep.data
    d["python"] = platform.python_version()
    d["torch"] = torch.__version__
    d["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        d["device_name"] = torch.cuda.get_device_name(0)
        d["capability"] = torch.cuda.get_device_capability(0)
        d["memory_GiB"] = torch.cuda.get_device_properties(0).total_memory / 2**30
        d["cuda"] = torch.version.cuda
        try:
            d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001
            d["nccl"] = f"? {e}"
        d["bf16_supported"] = torch.cuda.is_bf16_supported()
    try:
        import optree

        d["optree"] = optree.__version__
    except ImportError as e:
        d["optree"] = f"missing: {e}"
    from importlib import metadata

    try:  # optree's one dependency (>= 4.10)
        d["typing_extensions"] = metadata.version("typing_extensions")
    except metadata.PackageNotFoundError as e:
        d["typing_extensions"] = f"missing: {e}"
    t = time.perf_counter()
    import funcshard

    d["import_funcshard_s"] = time.perf_counter() - t
    d["funcshard_file"] = funcshard.__file__
    missing = []
    for name in funcshard.__all__:
        try:
            getattr(funcshard, name)
        except Exception as e:  # noqa: BLE001
            missing.append(f"{name}: {type(e).__name__}: {e}")
    rep.check("every funcshard.__all__ name imports", not missing, "; ".join(missing))
    rep.check("optree importable", not str(d["optree"]).startswith("missing"), d["optree"])
    if not DRY:
        rep.check("CUDA device present", torch.cuda.is_available(), d.get("device_name"))


def _grads_first_step(name, cfg, mesh, dev, x, y, precision):
    """The system's first-step loss and full (unsharded) gradients, then the system, ready for more steps."""
    import systems as S

    sysobj = S.build(name, cfg, mesh, dev, x, y, precision=precision)
    if isinstance(sysobj, S.FSApply):
        loss, grads = sysobj.step_fn(sysobj.state, x, y)
        full = {k: _full(v) for k, v in grads.items()}
        sysobj.update(grads)
    else:
        loss = S._loss(sysobj.model(x), y)
        loss.backward()
        full = {n: _full(p.grad) for n, p in sysobj.model.named_parameters() if p.grad is not None}
        sysobj.opt.step()
        sysobj.opt.zero_grad(set_to_none=True)
    return loss.item(), full, sysobj


def _params(sysobj) -> dict:
    import funcshard
    import systems as S

    if isinstance(sysobj, S.FSApply):
        return {k: _full(v) for k, v in funcshard.gather(sysobj.plan, sysobj.state).items()}
    return {n: _full(p) for n, p in sysobj.model.named_parameters()}


def _parity_precision(rep, cfg, mesh, dev, precision):
    import systems as S

    x, y = S.batch(cfg, 0, 1, dev)
    res = {}
    for name in ("unsharded", "fsdp2", "fs_fully_shard", "fs_apply"):
        base = _peak_reset()
        loss1, grads, sysobj = _grads_first_step(name, cfg, mesh, dev, x, y, precision)
        losses = [loss1] + [sysobj.step().item() for _ in range(2)]
        res[name] = {"losses": losses, "grads": grads, "params": _params(sysobj), "peak": _peak(base)}
        del sysobj
    d = rep.data.setdefault("parity", {})[precision] = {}
    for n, r in res.items():
        d[n] = {"losses": r["losses"], "peak_bytes": r["peak"]}
    f = res["fsdp2"]
    for n in ("fs_fully_shard", "fs_apply"):
        r = res[n]
        d[n]["vs_fsdp2"] = {"grad_maxdiff": _maxdiff(r["grads"], f["grads"]),
                            "param_maxdiff_after3": _maxdiff(r["params"], f["params"]),
                            "loss_diffs": [a - b for a, b in zip(r["losses"], f["losses"])]}
        rep.check(f"{precision} {n} step-1 gradients == FSDP2's bit for bit", _equal(r["grads"], f["grads"]),
                  f"max diff {d[n]['vs_fsdp2']['grad_maxdiff']:.3g}")
        rep.check(f"{precision} {n} step-1 loss == FSDP2's", r["losses"][0] == f["losses"][0],
                  f"{r['losses'][0]!r} vs {f['losses'][0]!r}")
    # fully_shard uses torch's AdamW like FSDP2: the same arithmetic, bit for bit after 3 steps
    r = res["fs_fully_shard"]
    rep.check(f"{precision} fs_fully_shard params after 3 steps == FSDP2's bit for bit",
              _equal(r["params"], f["params"]), f"max diff {d['fs_fully_shard']['vs_fsdp2']['param_maxdiff_after3']:.3g}")
    # apply: funcshard.optim.adamw (not torch's foreach AdamW): last-bit differences, bf16 may round them up
    tol = 1e-5 if precision == "fp32" else 1e-2
    r = res["fs_apply"]
    md = d["fs_apply"]["vs_fsdp2"]["param_maxdiff_after3"]
    rep.check(f"{precision} fs_apply params after 3 steps close to FSDP2's (funcshard.optim.adamw)", md <= tol,
              f"max diff {md:.3g} (tol {tol})")
    u = res["unsharded"]  # fp32 module, no policy
    gd, pd = _maxdiff(f["grads"], u["grads"]), _maxdiff(f["params"], u["params"])
    d["fsdp2_vs_unsharded"] = {"grad_maxdiff": gd, "param_maxdiff_after3": pd,
                               "grads_equal": _equal(f["grads"], u["grads"])}
    if precision == "fp32":
        rep.check("fp32 FSDP2 vs unsharded (W=1) gradients close", gd <= 1e-5, f"max diff {gd:.3g}, "
                  f"bit-identical: {d['fsdp2_vs_unsharded']['grads_equal']}")
    else:
        rep.info("bf16 FSDP2 vs fp32 unsharded", f"grad max diff {gd:.3g}, params after 3 steps {pd:.3g}")


def _hook_stream(rep, cfg, mesh, dev):
    """set_all_reduce_hook(hook, stream=...) on both module APIs: the hook runs on the stream, the same numbers."""
    import torch.distributed.fsdp as torch_fsdp

    import funcshard
    import systems as S

    x, y = S.batch(cfg, 0, 1, dev)
    out = {}
    for label, fs in (("fsdp2", torch_fsdp), ("funcshard", funcshard)):
        model = cfg.build(dev)
        for b in model.blocks:
            fs.fully_shard(b, mesh=mesh)
        fs.fully_shard(model, mesh=mesh)
        stream = torch.cuda.Stream() if not DRY else torch.get_device_module("cpu").Stream()
        mod = torch.cuda if not DRY else torch.get_device_module("cpu")
        seen = []

        def hook(t, stream=stream, mod=mod, seen=seen):
            seen.append(mod.current_stream() == stream)
            t.mul_(0.5)

        for m in (model, *model.blocks):
            m.set_all_reduce_hook(hook, stream=stream)
        opt = S._adamw(model.parameters())
        losses = []
        for _ in range(2):
            loss = S._loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        _sync()
        out[label] = (losses, {n: _full(p) for n, p in model.named_parameters()}, len(seen), all(seen))
    (lt, pt, nt, st), (lf, pf, nf, sf) = out["fsdp2"], out["funcshard"]
    rep.data["hook_stream"] = {"fsdp2_hook_calls": nt, "fsdp2_on_stream": st, "funcshard_hook_calls": nf,
                               "funcshard_on_stream": sf, "param_maxdiff": _maxdiff(pf, pt)}
    rep.check("set_all_reduce_hook(stream=): funcshard's hook ran, always on the given stream", nf > 0 and sf,
              f"{nf} calls (FSDP2: {nt}, on stream: {st})")
    rep.check("set_all_reduce_hook(stream=): losses and params == FSDP2's bit for bit", lf == lt and _equal(pf, pt),
              f"losses {lf} vs {lt}, max diff {_maxdiff(pf, pt):.3g}")


def _offload(rep, cfg, mesh, dev):
    """CPUOffloadPolicy(pin_memory=True): fully_shard against FSDP2's, and the apply path against no offload."""
    import torch.distributed.fsdp as torch_fsdp

    import funcshard
    import systems as S
    from funcshard import optim

    x, y = S.batch(cfg, 0, 1, dev)
    pin = not DRY
    out = {}
    for label, fs in (("fsdp2", torch_fsdp), ("funcshard", funcshard)):
        model = cfg.build("cpu")  # on the host: offloaded shards stay there
        kw = {"offload_policy": fs.CPUOffloadPolicy(pin_memory=pin)}
        for b in model.blocks:
            fs.fully_shard(b, mesh=mesh, **kw)
        fs.fully_shard(model, mesh=mesh, **kw)
        opt = S._adamw(model.parameters())
        base = _peak_reset()
        losses, place = [], set()
        for _ in range(2):
            loss = S._loss(model(x), y)
            loss.backward()
            place |= {(p.to_local().device.type, p.to_local().is_pinned(), p.grad.to_local().device.type,
                       p.grad.to_local().is_pinned()) for p in model.parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out[label] = (losses, {n: _full(p) for n, p in model.named_parameters()}, sorted(place), _peak(base))
    (lt, pt, plt, mt), (lf, pf, plf, mf) = out["fsdp2"], out["funcshard"]
    rep.data["offload_fully_shard"] = {"fsdp2": {"losses": lt, "placement": plt, "peak_bytes": mt},
                                       "funcshard": {"losses": lf, "placement": plf, "peak_bytes": mf},
                                       "param_maxdiff": _maxdiff(pf, pt)}
    rep.check("CPUOffloadPolicy fully_shard: placement == FSDP2's (host, pinned, grads too)",
              plf == plt == [("cpu", pin, "cpu", pin)], f"{plf} vs FSDP2 {plt}")
    rep.check("CPUOffloadPolicy fully_shard: losses and params == FSDP2's bit for bit", lf == lt and _equal(pf, pt),
              f"losses {lf} vs {lt}, max diff {_maxdiff(pf, pt):.3g}")
    # the functional path: host shards in, host gradients out; the same gradients as without offload
    with torch.device("meta"):
        from funcshard.demo import GPT, Block

        skeleton = GPT(cfg.vocab, cfg.dim, cfg.heads, cfg.layers, cfg.seq)
    full = dict(cfg.build(dev).named_parameters())
    grads = {}
    for key, kw in (("plain", {}), ("offload", {"offload_policy": funcshard.CPUOffloadPolicy(pin_memory=pin)})):
        plan = funcshard.plan(skeleton, mesh, groups=(Block,), **kw)
        state = funcshard.shard(plan, full)

        def loss_fn(s, plan=plan):
            return S._loss(funcshard.apply(plan, s, x), y)

        _, grads[key] = funcshard.value_and_grad(loss_fn)(state)
        if key == "offload":
            splace = sorted({(v.device.type, v.is_pinned()) for v in state.values()})
            gplace = sorted({(g.device.type, g.is_pinned()) for g in grads[key].values()})
            tx = optim.adamw(lr=1e-3)
            p2, _ = optim.step(tx, grads[key], tx.init(state), state)
            p2place = sorted({(v.device.type, v.is_pinned()) for v in p2.values()})
    same = all(torch.equal(grads["offload"][k].cpu(), grads["plain"][k].cpu()) for k in grads["plain"])
    rep.data["offload_apply"] = {"state": splace, "grads": gplace, "after_step": p2place}
    rep.check("CPUOffloadPolicy apply: host shards and gradients, gradients == no offload's bit for bit",
              splace == [("cpu", pin)] and gplace == [("cpu", pin)] and same,
              f"state {splace}, grads {gplace}, equal {same}")


def stage_parity(rep: Report) -> None:
    # bit-for-bit comparisons need run-to-run deterministic kernels (cuBLAS workspaces, no atomics-ordered sums);
    # warn_only: an op without a deterministic kernel warns (in the log) instead of raising
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    rep.data["deterministic"] = {"use_deterministic_algorithms": True, "warn_only": True,
                                 "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"]}
    dev, mesh = _init(1)
    cfg = _cfg("small")
    rep.data["model"] = cfg.as_dict()
    for name, fn in (("parity fp32", lambda: _parity_precision(rep, cfg, mesh, dev, "fp32")),
                     ("parity bf16", lambda: _parity_precision(rep, cfg, mesh, dev, "bf16")),
                     ("all-reduce hook on a stream", lambda: _hook_stream(rep, cfg, mesh, dev)),
                     ("CPU offload", lambda: _offload(rep, cfg, mesh, dev))):
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the next part still runs
            traceback.print_exc()
            rep.check(f"{name} ran", False, f"{type(e).__name__}: {str(e)[:500]}")
            rep.data.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
        rep.data.setdefault("seconds", {})[name] = time.perf_counter() - t
        rep.save()
    dist.destroy_process_group()


def stage_fake8(rep: Report) -> None:
    import systems as S

    dev, mesh = _init(8)
    cfg = _cfg("small")
    x, y = S.batch(cfg, 0, 8, dev)
    rep.data["model"] = cfg.as_dict()
    for precision in ("fp32", "bf16"):
        for name in ("fsdp2", "fs_fully_shard", "fs_apply"):
            key = f"{precision} {name}"
            try:
                base = _peak_reset()
                sysobj = S.build(name, cfg, mesh, dev, x, y, precision=precision)
                for _ in range(2):
                    sysobj.step()
                _sync()
                shards = {tuple(v.shape) for v in (sysobj.state.values() if isinstance(sysobj, S.FSApply) else
                                                   (p.to_local() for p in sysobj.model.parameters()))}
                rep.data[key] = {"peak_bytes": _peak(base), "n_shard_shapes": len(shards)}
                rep.check(f"fake-PG W=8 {key}: 2 steps ran", True, f"peak {rep.data[key]['peak_bytes']}")
                del sysobj
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rep.check(f"fake-PG W=8 {key}: 2 steps ran", False, f"{type(e).__name__}: {str(e)[:500]}")
                rep.data.setdefault("tracebacks", {})[key] = traceback.format_exc()[-4000:]
    fp = {p: {n: rep.data.get(f"{p} {n}", {}).get("peak_bytes") for n in ("fsdp2", "fs_fully_shard", "fs_apply")}
          for p in ("fp32", "bf16")}
    for p, m in fp.items():
        if not DRY and all(v is not None for v in m.values()):
            rep.check(f"fake-PG W=8 {p}: fully_shard / apply peak <= FSDP2's", max(m["fs_fully_shard"],
                      m["fs_apply"]) <= m["fsdp2"], json.dumps(m))
    dist.destroy_process_group()


def _stream_summary(prof) -> dict:
    """CUDA kernels and copies per stream: what ran where (NCCL vs compute vs copies)."""
    out: dict[str, dict] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        s = out.setdefault(str(e.device_resource_id), {"nccl": 0, "memcpy": 0, "host_copies": 0, "other": 0,
                                                        "us": 0.0, "examples": []})
        kind = "nccl" if "nccl" in e.name.lower() else "memcpy" if e.name.startswith(("Memcpy", "Memset")) else "other"
        s[kind] += 1
        s["host_copies"] += e.name.startswith(("Memcpy HtoD", "Memcpy DtoH"))
        s["us"] += e.device_time if hasattr(e, "device_time") else e.cuda_time
        if len(s["examples"]) < 4 and e.name[:60] not in s["examples"]:
            s["examples"].append(e.name[:60])
    return out


def _offload_system(cfg, mesh, x, y):
    """fully_shard with CPUOffloadPolicy (pinned on CUDA) per Block and on the root, torch's AdamW."""
    import funcshard
    import systems as S

    model = cfg.build("cpu")  # on the host: offloaded shards stay there
    kw = {"offload_policy": funcshard.CPUOffloadPolicy(pin_memory=not DRY)}
    for b in model.blocks:
        funcshard.fully_shard(b, mesh=mesh, **kw)
    funcshard.fully_shard(model, mesh=mesh, **kw)
    return S._ModuleSystem(model, S._adamw(model.parameters()), x, y)


def stage_trace(rep: Report) -> None:
    import funcshard
    import funcshard.trace as ft
    import systems as S
    from torch.profiler import ProfilerActivity, profile

    dev, mesh = _init(1)
    cfg = _cfg("small")
    x, y = S.batch(cfg, 0, 1, dev)
    acts = [ProfilerActivity.CPU] + ([] if DRY else [ProfilerActivity.CUDA])
    for name in ("fs_apply", "fs_fully_shard", "fs_fully_shard_offload"):
        sysobj = _offload_system(cfg, mesh, x, y) if name.endswith("offload") else S.build(name, cfg, mesh, dev, x, y)
        sysobj.step()
        sysobj.step()
        _sync()
        host = rep.out / f"trace_funcshard_{name}.json.gz"
        with ft.trace(host) as tr, profile(activities=acts) as prof:
            sysobj.step()
            _sync()
        raw = rep.out / f"trace_profiler_{name}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
        streams = _stream_summary(prof)
        nccl = {s for s, v in streams.items() if v["nccl"]}
        compute = {s for s, v in streams.items() if v["other"]}
        rep.data[name] = {"overlap": tr.overlap(), "events": len(tr.events), "streams": streams,
                          "profiler_trace_bytes": os.path.getsize(str(raw) + ".gz")}
        rep.check(f"trace {name}: funcshard.trace saw the runtime's events", len(tr.events) > 0,
                  f"{len(tr.events)} events, overlap {tr.overlap()}")
        copies = {s for s, v in streams.items() if v["memcpy"]}
        where = (f"nccl kernels on streams {sorted(nccl)}, other kernels on {sorted(compute)}, copies/memsets on "
                 f"{sorted(copies)}")
        if name.endswith("offload") and not DRY:
            host = {s for s, v in streams.items() if v["host_copies"]}
            rep.check(f"trace {name}: host<->device copies on a stream of their own (the copy stream)",
                      bool(host) and not (host & compute), f"host copies on {sorted(host)}; " + where)
        if nccl:
            rep.check(f"trace {name}: NCCL kernels on a stream of their own (not a compute stream)",
                      not (nccl & compute), where)
        else:  # (NCCL at W=1 may copy without a kernel; the CPU dry run has no CUDA events)
            rep.info(f"trace {name}: no NCCL kernel in the step", where)
        del sysobj
        rep.save()
    _ = funcshard  # (imported for the lazy runtime)
    dist.destroy_process_group()


def stage_cost(rep: Report) -> None:
    worlds = [int(w) for w in os.environ.get("CHECK_COST_WORLDS", "1").split(",")]
    import funcshard.cost as C
    import systems as S
    from funcshard import optim

    world = worlds[0]
    dev, mesh = _init(world)
    cfg = _cfg("big")
    rep.data["model"] = cfg.as_dict()
    x, y = S.batch(cfg, 0, world, dev)
    for precision in (("fp32", "bf16") if world == 1 else ("fp32",)):
        key = f"W={world} {'nccl' if world == 1 and not DRY else 'gloo' if world == 1 else 'fake'} {precision}"
        try:
            base = _peak_reset()
            sysobj = S.build("fs_apply", cfg, mesh, dev, x, y, precision=precision)
            sysobj.step()
            sysobj.step()
            _sync()
            gc.collect()
            between = (torch.cuda.memory_allocated() - base) if not DRY else None
            if not DRY:
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            sysobj.step()
            _sync()
            step_s = time.perf_counter() - t
            peak = _peak(base)
            reserved = torch.cuda.max_memory_reserved() if not DRY else None
            tx = optim.adamw(lr=S.LR, betas=S.BETAS, eps=S.EPS, weight_decay=S.WD)
            t = time.perf_counter()
            cost = C.estimate(sysobj.plan, x, loss=lambda out: S._loss(out, y), optimizer=tx, donate=S.DONATE)
            est_s = time.perf_counter() - t
            # the measured peak counts the batch (x, y) too, allocated before base: the prediction's inputs
            inputs = x.numel() * x.element_size() + y.numel() * y.element_size()
            row = {"measured_peak_bytes": peak, "measured_between_steps": between, "max_reserved": reserved,
                   "inputs_bytes": inputs, "predicted_peak_bytes": cost.peak_bytes, "peak_at": cost.peak.what,
                   "predicted_by_category": cost.peak.bytes, "traced_on": cost.traced_on, "estimate_s": est_s,
                   "step_s": step_s}
            if peak:
                row["error"] = cost.peak_bytes / peak - 1
            rep.data[key] = row
            detail = (f"predicted {cost.peak_bytes / 2**20:.1f} MiB vs measured {(peak or 0) / 2**20:.1f} MiB (peak "
                      f"at {cost.peak.what}; traced on {cost.traced_on}; estimate {est_s:.1f} s)")
            if DRY:  # no CUDA allocator to measure with
                rep.info(f"cost {key}: predicted peak (dry run: nothing measured)", detail)
            else:
                rep.check(f"cost {key}: predicted peak within 10% of max_memory_allocated", abs(row["error"]) <= 0.1,
                          detail)
            del sysobj, cost
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rep.check(f"cost {key} ran", False, f"{type(e).__name__}: {str(e)[:500]}")
            rep.data.setdefault("tracebacks", {})[key] = traceback.format_exc()[-4000:]
        rep.save()
    dist.destroy_process_group()


STAGES = {"env": stage_env, "parity": stage_parity, "fake8": stage_fake8, "trace": stage_trace, "cost": stage_cost}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=sorted(STAGES))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    rep = Report(args.stage + os.environ.get("CHECK_SUFFIX", ""), args.out)
    t = time.perf_counter()
    try:
        STAGES[args.stage](rep)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rep.data["seconds_total"] = time.perf_counter() - t
        rep.save(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-6000:]}")
        return 2
    rep.data["seconds_total"] = time.perf_counter() - t
    rep.save()
    return 0 if all(ok is not False for _, ok, _ in rep.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
