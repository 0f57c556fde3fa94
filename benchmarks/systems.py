"""The systems under test, each one training step of the same GPT (funcshard.demo's) with AdamW in fp32.

Every system is built from the same seed (same initial weights on every rank), takes this rank's slice of
the same global batch, and exposes ``step() -> local loss`` (one forward, backward and optimizer step).

* ``unsharded``   the plain module on this rank's batch, no communication (the compute floor; every rank runs
                  one at the same time, so the CPU is as busy as in the data-parallel systems)
* ``ddp``         DistributedDataParallel (``gradient_as_bucket_view=True``; the stock ``allreduce_hook`` so
                  its all-reduces go through ``torch.distributed.all_reduce`` and are counted)
* ``fsdp2``       torch's ``fully_shard`` on each Block, then on the root; ``torch.optim.AdamW(foreach=True)``
* ``fsdp2_async`` the same with FSDP2's private ``_set_unshard_async_op(True)`` (not in the default comparison;
                  ``trace_overlap.py`` shows what it changes)
* ``fs_apply``    ``funcshard.plan(groups=(Block,))`` + ``shard`` + ``apply`` under
                  ``funcshard.value_and_grad`` (first-order, plain autograd underneath: what the demo uses)
                  + ``funcshard.optim.adamw`` (with ``donate=True`` as the demo does, when funcshard.optim
                  has it); the planned module lives on the meta device (the idiomatic memory-lean setup: only
                  the shards hold data)
* ``fs_apply_torchfunc`` the same under ``torch.func.grad_and_value`` (the path that composes with other
                  torch.func transforms; it pays torch.func's per-op wrapping and keeps the loss's saved
                  tensors until backward ends, as it differentiates with create_graph=True)
* ``fs_fully_shard`` ``funcshard.fully_shard`` (FSDP2's module API) on each Block, then on the root, when it
                  exists; ``torch.optim.AdamW(foreach=True)``
* ``fsdp2_fp32``  FSDP2 without mixed precision whatever the precision asked for: the fp32 reference of a
                  mixed-precision run (its bytes, memory and losses)

Precision (``build(..., precision=)``, ``bench.py --mp``): ``"fp32"`` (the default) builds every system as above,
no mixed precision. ``"bf16"`` gives every sharded system the same policy, bf16 parameters (all-gather and
compute) and fp32 gradient reduce-scatter, each through its own API: ``fsdp2`` torch's ``MixedPrecisionPolicy``,
``fs_fully_shard`` funcshard's, ``fs_apply*`` ``funcshard.plan(mp_policy=...)``. Shards, gradients and AdamW
state stay fp32 (master weights) in all of them. ``unsharded``, ``ddp`` and ``fsdp2_fp32`` stay fp32 (no
autocast: autocast is not the same recipe as FSDP2's policy, so it would not be a like-for-like floor).
The loss is computed on fp32 logits (``logits.float()``, a no-op in fp32), as mixed-precision training does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard
from funcshard.demo import GPT, Block

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
SEED = 1234

ALL_SYSTEMS = ("unsharded", "ddp", "fsdp2", "fs_apply", "fs_apply_torchfunc", "fs_fully_shard")
SHARDED = ("fsdp2", "fs_apply", "fs_apply_torchfunc", "fs_fully_shard")

# precision -> (param_dtype, reduce_dtype) of the MixedPrecisionPolicy every sharded system gets (None: none)
PRECISIONS = {"fp32": None, "bf16": (torch.bfloat16, torch.float32)}
FP32_ONLY = ("unsharded", "ddp", "fsdp2_fp32")  # built in fp32 whatever the precision


def system_precision(name: str, precision: str) -> str:
    """The precision system ``name`` runs in when the benchmark asks for ``precision``."""
    return "fp32" if name in FP32_ONLY else precision


def policy_description(precision: str) -> str:
    dt = PRECISIONS[precision]
    if dt is None:
        return "fp32 (no mixed precision)"
    n = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    return f"param_dtype={n[dt[0]]}, reduce_dtype={n[dt[1]]}"


def mp_policy(precision: str, policy_class):
    """``policy_class(param_dtype=..., reduce_dtype=...)`` for ``precision``, None for fp32."""
    dt = PRECISIONS[precision]
    return None if dt is None else policy_class(param_dtype=dt[0], reduce_dtype=dt[1])


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    batch: int  # sequences per rank per step

    def build(self, device) -> GPT:
        torch.manual_seed(SEED)
        with torch.device(device):
            return GPT(self.vocab, self.dim, self.heads, self.layers, self.seq)

    def params(self) -> int:
        with torch.device("meta"):
            m = GPT(self.vocab, self.dim, self.heads, self.layers, self.seq)
        return sum(p.numel() for p in m.parameters())

    @property
    def groups(self) -> int:  # one per Block, plus the root (embeddings, final norm, tied head)
        return self.layers + 1

    def as_dict(self) -> dict:
        return {**asdict(self), "params": self.params(), "groups": self.groups}


def batch(cfg: ModelConfig, rank: int, world: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch (the same global batch whatever the system)."""
    g = torch.Generator().manual_seed(SEED + 1)
    data = torch.randint(0, cfg.vocab, (cfg.batch * world, cfg.seq + 1), generator=g)
    mine = data.chunk(world)[rank]
    return mine[:, :-1].contiguous().to(device), mine[:, 1:].contiguous().to(device)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # fp32 logits: the loss of a mixed-precision step in fp32 (a no-op when the logits already are)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)


class _ModuleSystem:
    """A module trained the usual way: loss.backward(), opt.step(), opt.zero_grad()."""

    name = "?"

    def __init__(self, model: nn.Module, opt, x, y):
        self.model, self.opt, self.x, self.y = model, opt, x, y

    def step(self) -> torch.Tensor:
        loss = _loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class Unsharded(_ModuleSystem):
    name = "unsharded"

    def __init__(self, cfg, mesh, device, x, y, precision="fp32"):  # fp32 whatever the precision
        model = cfg.build(device)
        super().__init__(model, _adamw(model.parameters()), x, y)


class DDP(_ModuleSystem):
    name = "ddp"

    def __init__(self, cfg, mesh, device, x, y, precision="fp32"):  # fp32 whatever the precision
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            allreduce_hook,
        )
        from torch.nn.parallel import DistributedDataParallel

        model = cfg.build(device)
        pg = mesh.get_group(0)
        ids = [device] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, process_group=pg, gradient_as_bucket_view=True)
        # DDP's gradient buckets live in its C++ reducer: keep a reference to them here so that the memory
        # instrument sees them between steps too (they are allocated whether we look or not)
        self.buckets: dict[int, torch.Tensor] = {}
        buckets = self.buckets

        def hook(state, bucket):
            buckets[bucket.index()] = bucket.buffer()
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(pg, hook)
        super().__init__(ddp, _adamw(ddp.parameters()), x, y)


class FSDP2(_ModuleSystem):
    """The same training script for both module APIs: only the fully_shard import differs (the drop-in)."""

    name = "fsdp2"

    @staticmethod
    def fully_shard(module, **kwargs):
        from torch.distributed.fsdp import fully_shard

        return fully_shard(module, **kwargs)

    @staticmethod
    def mp_policy(precision):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return mp_policy(precision, MixedPrecisionPolicy)

    def __init__(self, cfg, mesh, device, x, y, precision="fp32"):
        model = cfg.build(device)
        policy = self.mp_policy(precision)
        kw = {} if policy is None else {"mp_policy": policy}  # fp32: the call as before, no policy
        for blk in model.blocks:
            self.fully_shard(blk, mesh=mesh, **kw)
        self.fully_shard(model, mesh=mesh, **kw)
        super().__init__(model, _adamw(model.parameters()), x, y)


class FSDP2FP32(FSDP2):
    """FSDP2 without mixed precision, whatever the precision asked for: a mixed-precision run's fp32 reference."""

    name = "fsdp2_fp32"

    def __init__(self, cfg, mesh, device, x, y, precision="fp32"):
        super().__init__(cfg, mesh, device, x, y, precision="fp32")


class FSDP2Async(FSDP2):
    """FSDP2 with its private ``_set_unshard_async_op(True)`` (all-gathers issued async, waited at use): not in
    the default comparison (a private API), used by ``trace_overlap.py`` to show what it changes on gloo."""

    name = "fsdp2_async"

    def __init__(self, cfg, mesh, device, x, y, precision="fp32"):
        super().__init__(cfg, mesh, device, x, y, precision)
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m._set_unshard_async_op(True)


class FSFullyShard(FSDP2):
    name = "fs_fully_shard"
    fully_shard = staticmethod(funcshard.fully_shard)

    @staticmethod
    def mp_policy(precision):
        return mp_policy(precision, funcshard.MixedPrecisionPolicy)


class FSDP2Script(FSDP2):
    """The typical FSDP2 training script (issue 36): two microbatches of half the loss each, the first without
    gradient sync (``set_requires_gradient_sync``), ``clip_grad_norm_`` over the DTensor parameters, then
    ``torch.optim.AdamW``. ``max_norm`` is large enough that nothing is clipped (the norm is computed and the
    gradients scaled by 1.0, the same work): the losses stay comparable with the other systems'. Opt-in
    (``--systems``)."""

    name = "fsdp2_script"
    MICRO, MAX_NORM = 2, 1e9

    def step(self) -> torch.Tensor:
        total = 0.0
        for m in range(self.MICRO):
            self.model.set_requires_gradient_sync(m == self.MICRO - 1)
            loss = _loss(self.model(self.x), self.y) / self.MICRO
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.MAX_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


class FSFullyShardScript(FSDP2Script, FSFullyShard):
    """``FSDP2Script`` with funcshard's ``fully_shard`` (``FSFullyShard``'s: only the import differs)."""

    name = "fs_fully_shard_script"


class FSApply:
    name = "fs_apply"
    plan_kwargs: ClassVar[dict] = {}  # e.g. {"layout": "flat"} in a variant

    def __init__(self, cfg, mesh, device, x, y, precision="fp32"):
        from funcshard import optim

        full = cfg.build(device)
        with torch.device("meta"):
            skeleton = GPT(cfg.vocab, cfg.dim, cfg.heads, cfg.layers, cfg.seq)
        policy = mp_policy(precision, getattr(funcshard, "MixedPrecisionPolicy", None))
        kw = {} if policy is None else {"mp_policy": policy}
        self.plan = funcshard.plan(skeleton, mesh, groups=(Block,), **kw, **self.plan_kwargs)
        self.state = funcshard.shard(self.plan, dict(full.named_parameters()))
        del full
        self.tx = optim.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        self.opt_state = self.tx.init(self.state)
        plan = self.plan

        def loss_fn(state, x, y):
            return _loss(funcshard.apply(plan, state, x), y)

        self.step_fn = self.grad_transform(loss_fn)
        self.x, self.y = x, y
        self.donate = DONATE

    @staticmethod
    def grad_transform(loss_fn):
        """(state, x, y) -> (loss, grads)."""
        if hasattr(funcshard, "value_and_grad"):
            return funcshard.value_and_grad(loss_fn)
        return FSApplyTorchFunc.grad_transform(loss_fn)

    def step(self) -> torch.Tensor:
        loss, grads = self.step_fn(self.state, self.x, self.y)
        self.update(grads)
        return loss.detach()

    def update(self, grads) -> None:
        """AdamW as the demo does it: with buffer donation (in place) when funcshard.optim has it."""
        from funcshard import optim

        kw = {"donate": True} if self.donate else {}
        updates, self.opt_state = self.tx.update(grads, self.opt_state, self.state, **kw)
        self.state = optim.apply_updates(self.state, updates, **kw)


class FSApplyKept(FSApply):
    """``fs_apply`` with ``reshard_after_forward=False`` (bisect_cpu's: the saved-tensor hooks' cost where no group
    is freed after forward)."""

    name = "fs_apply_kept"
    plan_kwargs: ClassVar[dict] = {"reshard_after_forward": False}


class FSApplyTorchFunc(FSApply):
    name = "fs_apply_torchfunc"

    @staticmethod
    def grad_transform(loss_fn):
        grad_and_value = torch.func.grad_and_value(loss_fn)

        def step(*args):
            grads, loss = grad_and_value(*args)
            return loss, grads

        return step


def _has_donate() -> bool:
    import inspect

    from funcshard import optim

    return "donate" in inspect.signature(optim.apply_updates).parameters


DONATE = _has_donate()


BUILDERS = {"unsharded": Unsharded, "ddp": DDP, "fsdp2": FSDP2, "fsdp2_async": FSDP2Async, "fs_apply": FSApply,
            "fs_apply_kept": FSApplyKept,
            "fs_apply_torchfunc": FSApplyTorchFunc, "fs_fully_shard": FSFullyShard, "fsdp2_fp32": FSDP2FP32,
            "fsdp2_script": FSDP2Script, "fs_fully_shard_script": FSFullyShardScript}


def available(name: str) -> str | None:
    """None when the system can be built here, else why not."""
    if name == "fs_fully_shard" and not hasattr(funcshard, "fully_shard"):
        return "not built (funcshard.fully_shard does not exist yet)"
    return None


def build(name: str, cfg: ModelConfig, mesh, device, x, y, precision: str = "fp32"):
    if precision == "fp32":
        return BUILDERS[name](cfg, mesh, device, x, y)  # every system's fp32 build, as before
    return BUILDERS[name](cfg, mesh, device, x, y, precision=precision)


def world_loss(loss: torch.Tensor, group) -> float:
    """The mean over ranks of the local losses (the global batch's mean loss)."""
    t = loss.detach().float().reshape(1).clone()
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)
