"""Sharded initialisation: a model's parameters initialised on every rank one module at a time, each rank keeping
only its shards (``funcshard.checkpoint.init_state`` for a plan, ``init_module`` for DTensor parameters: funcshard's
or torch's ``fully_shard`` on a meta-device model).

The reference is the full model initialised on one process::

    torch.manual_seed(seed)                      # (or whatever RNG state every rank shares)
    for m in model.modules():                    # order="modules"; order="apply": model.apply(init)'s post-order
        init(m)                                  # default: m.reset_parameters() where a module defines it

and sharded afterwards. Every rank runs exactly that loop, drawing the same random numbers in the same order, but
before each call the module's *own* parameters (``recurse=False``) are swapped for full tensors made for the call
(empty; or, for a parameter tied to one initialised earlier, its current value, all-gathered), and after it each
rank keeps its shard of them and drops the rest. So the result is bit-equal to the reference, and the peak memory is
the sharded state plus one module's full parameters. An init that touches another module's parameters (a parent
initialising its children, torchtitan's root ``init_weights``) would see them on the meta device: that raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from funcshard._collectives import bounded_all_reduce
from funcshard._compat import buffer_slots, param_slots
from funcshard._spec import ShardingError, ShardSpec

Init = Callable[[nn.Module], None]
ORDERS = ("modules", "apply")


def modules_in_order(module: nn.Module, order: str) -> list[tuple[str, nn.Module]]:
    """(path, module) in the reference loop's order: ``named_modules()`` (pre-order, each once) or ``nn.Module.apply``'s
    (children first, then the module; a module shared by two parents visited under each)."""
    if order == "modules":
        return list(module.named_modules())
    if order != "apply":
        raise ValueError(f"order must be one of {ORDERS} (the reference loop: for m in model.modules(): init(m), or "
                         f"model.apply(init)), got {order!r}")
    out: list[tuple[str, nn.Module]] = []

    def visit(path: str, m: nn.Module) -> None:
        for name, c in m.named_children():
            visit(f"{path}.{name}" if path else name, c)
        out.append((path, m))

    visit("", module)
    return out


def check_default_init(mods: Iterable[tuple[str, nn.Module]]) -> None:
    """Without an ``init``, every module holding parameters of its own must define ``reset_parameters``."""
    bare = [f"  {path or '(root)'} ({type(m).__name__}): {sorted(k for k, p in param_slots(m).items() if p is not None)}"
            for path, m in mods if getattr(m, "reset_parameters", None) is None
            and any(p is not None for p in param_slots(m).values())]
    if bare:
        raise ShardingError("these modules hold parameters but define no reset_parameters, so nothing would "
                            "initialise them:\n" + "\n".join(dict.fromkeys(bare)) +
                            "\nPass init=fn, called as fn(module) for every module (as model.apply(fn) would), that "
                            "initialises each module's own parameters (e.g. calls reset_parameters where there is one "
                            "and nn.init.normal_(module.pos) for the others).")


class _NoMeta(TorchFunctionMode):
    """Raises when an init makes or changes a meta tensor: it reached a parameter funcshard has not materialised."""

    def __init__(self, path: str, module: nn.Module):
        super().__init__()
        self.where = f"{path or '(root)'} ({type(module).__name__})"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise ShardingError(
                    f"the init of module {self.where} used a tensor on the meta device ({getattr(func, '__name__', func)}"
                    f" gave a {tuple(t.shape)} meta tensor): sharded initialisation materialises one module's own "
                    f"parameters and buffers (recurse=False) per init call, so an init must touch only those (a "
                    f"parent's init that initialises its children's parameters cannot be run one module at a time): "
                    f"initialise each module's parameters in the call for that module")
        return out


def run(mods: list[tuple[str, nn.Module]], init: Init | None, device: torch.device,
        make: Callable[[nn.Parameter], torch.Tensor | None], keep: Callable[[nn.Parameter, torch.Tensor], None]) -> None:
    """The reference loop, one module materialised at a time: for each module, its own parameters are swapped for
    ``make(param)`` (a full tensor; None: leave the parameter, it is real), ``init`` runs, then ``keep(param, full)``
    takes each one's shard, and the module gets its parameters back. Meta buffers become zeros on ``device``, for
    good (they are replicated, small, and the module needs them)."""
    for path, m in mods:
        buffers = buffer_slots(m)
        for k, b in buffers.items():
            if b is not None and b.is_meta:
                buffers[k] = torch.zeros(b.shape, dtype=b.dtype, device=device)
        fn = init if init is not None else getattr(m, "reset_parameters", None)
        if fn is None:
            continue
        slots = param_slots(m)
        swapped: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        made: dict[int, nn.Parameter] = {}  # one full tensor for a parameter held under two names of this module
        for name, p in slots.items():
            if p is None:
                continue
            if id(p) not in made:
                full = make(p)
                if full is None:
                    continue
                made[id(p)] = nn.Parameter(full, requires_grad=p.requires_grad)
            swapped[name] = (p, made[id(p)])
        for name, (_, full) in swapped.items():
            slots[name] = full
        try:
            with _NoMeta(path, m):
                fn(m) if init is not None else fn()
        finally:
            for name, (p, _) in swapped.items():
                slots[name] = p
        done = set()
        for p, full in swapped.values():
            if id(p) not in done:
                done.add(id(p))
                keep(p, full.detach())


@contextlib.contextmanager
def rng(seed: int | None, device: torch.device, groups: Iterable[dist.ProcessGroup]):
    """The RNG the loop draws from: ``seed`` set in a forked RNG (the caller's is left as it was), or, with no seed,
    the global RNG as it is (and advanced as the reference loop advances it), after checking that every rank's is
    the same (different states would shard different full tensors: silently mixed parameters)."""
    devices = [device] if device.type not in ("cpu", "meta") else []
    if seed is not None:
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            torch.manual_seed(seed)
            yield
        return
    states = [torch.get_rng_state()]
    if devices:
        states.append(torch.get_device_module(device.type).get_rng_state(device))
    digest = hashlib.sha256(b"".join(s.cpu().numpy().tobytes() for s in states)).digest()
    mine = int.from_bytes(digest[:7], "little")
    for pg in groups:
        t = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
        bounded_all_reduce(t, pg, "init_state's random-state check", op=dist.ReduceOp.MAX)
        if t[0].item() != mine or -t[1].item() != mine:
            raise ShardingError(
                "the ranks' random number generators are in different states, so they would initialise different "
                "full tensors and keep shards of each (silently mixed parameters); pass seed=... (every rank the "
                "same), or call torch.manual_seed(seed) with one seed on every rank first")
    yield


def gather_one(spec: ShardSpec, local: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor of one parameter from every rank's shard (either layout): each rank's local shard is
    all-gathered (padded to the longest) and its boxes (``ShardSpec.boxes``) copied into place. For a parameter
    tied to one initialised earlier, which the next module's init may read."""
    world = spec.world

    def local_shape(r: int) -> tuple[int, ...]:
        return spec.local_shape if spec.flat is None else (spec.flat.piece(spec.numel, world, r)[1],)

    n = max(math.prod(local_shape(r)) for r in range(world))
    mine = local.new_zeros(n)
    mine[:local.numel()].copy_(local.reshape(-1))
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=pg)
    full = local.new_empty(spec.shape)
    for r, part in enumerate(parts):
        theirs = part[:math.prod(local_shape(r))].view(local_shape(r))
        for box in spec.boxes(r):
            region = full
            for d, (o, s) in enumerate(zip(box.offsets, box.sizes)):
                region = region.narrow(d, o, s)
            region.copy_(box.view(theirs))
    return full
