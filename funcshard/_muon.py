"""Muon's math, torch's op order (``torch/optim/_muon.py``, torch 2.13), and the module path: :class:`Muon`, a
``torch.optim.Optimizer`` over DTensor parameters (``fully_shard``'s or FSDP2's) that orthogonalizes each whole
matrix on its owner rank.

The functional transform (``funcshard.optim.muon``) and :class:`Muon` share everything here: the momentum and the
parameter update are element-wise and run on the shards; only Newton-Schulz needs the whole matrix, which
``_owner.Exchange`` assembles on its owner (in bfloat16: the cast is element-wise, so the owner sees exactly the
matrix one process would) and sends back as shards.

One difference from ``torch.optim.Muon``, on purpose: for a bfloat16 parameter with ``nesterov=False`` torch
normalises its momentum buffer in place (``update = buf``; ``buf.bfloat16()`` is ``buf`` itself, then ``div_``), so
its next step starts from a buffer divided by its norm; here the buffer is left as the momentum rule says (the
owner works on its own copy). Every other case is torch's arithmetic, op for op.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from funcshard._owner import Exchange, Owners, OwnerStep, assign_owners, ns_flops, owner_step
from funcshard._spec import ShardingError, ShardSpec, make_spec

__all__ = ["DEFAULT_NS_COEFFICIENTS", "EPS", "NS_STEPS", "Muon", "adjust_lr", "check_hyper", "newton_schulz"]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch's (Keller Jordan's)
EPS = 1e-7
NS_STEPS = 5
_ADJUST = (None, "original", "match_rms_adamw")


def check_hyper(where: str, lr: Any, momentum: float, weight_decay: float, ns_coefficients: Sequence[float],
                ns_steps: int, adjust_lr_fn: str | None) -> None:
    """torch.optim.Muon's checks of its arguments (same conditions), with funcshard's wording."""
    if not callable(lr) and not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"{where}: invalid learning rate {lr!r}; expected a number >= 0 or a schedule(count)")
    if not momentum >= 0:
        raise ValueError(f"{where}: invalid momentum {momentum!r}; expected a number >= 0")
    if not weight_decay >= 0:
        raise ValueError(f"{where}: invalid weight_decay {weight_decay!r}; expected a number >= 0")
    if adjust_lr_fn not in _ADJUST:
        raise ValueError(f"{where}: adjust_lr_fn={adjust_lr_fn!r} is not one of {list(_ADJUST)}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"{where}: ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"{where}: ns_steps={ns_steps!r}; torch.optim.Muon takes 0 <= ns_steps < 100")


def newton_schulz(x: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float) -> torch.Tensor:
    """torch's ``_zeropower_via_newtonschulz`` of ``x`` (a whole matrix, already bfloat16: torch's first op, which is
    element-wise), op for op; ``x`` is normalised in place (pass a buffer of your own)."""
    a, b, c = coefficients
    ortho = x.T if x.size(0) > x.size(1) else x
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if x.size(0) > x.size(1) else ortho


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch's ``_adjust_lr``: the learning rate of a matrix of the (global) ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def momentum_update(grads: list[torch.Tensor], bufs: list[torch.Tensor], momentum: float,
                    nesterov: bool) -> list[torch.Tensor]:
    """torch's ``buf.lerp_(grad, 1 - momentum)`` (in place) and the matrix Newton-Schulz takes, as bfloat16 shards
    (element-wise: the same numbers as on the whole matrix)."""
    out = []
    for g, buf in zip(grads, bufs):
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum) if nesterov else buf
        out.append(update.bfloat16() if update is not buf or update.dtype != torch.bfloat16 else update.clone())
    return out


def orthogonalize(exchange: Exchange, updates: dict[str, torch.Tensor], ns_coefficients: Sequence[float],
                  ns_steps: int, eps: float) -> dict[str, torch.Tensor]:
    """Newton-Schulz of each whole matrix on its owner, back as bfloat16 shards shaped like ``updates``. On one
    rank the matrices are the shards: Newton-Schulz's results as they come (a transposed view where torch's is one:
    a bfloat16 ``add_`` rounds differently on a strided operand than on a contiguous one)."""
    if exchange.world == 1 and all(tuple(u.shape) == tuple(exchange.specs[k].shape) for k, u in updates.items()):
        return {k: newton_schulz(u, ns_coefficients, ns_steps, eps) for k, u in updates.items()}
    return exchange.map(updates, lambda k, full: newton_schulz(full, ns_coefficients, ns_steps, eps),
                        {k: torch.bfloat16 for k in updates})


def apply_muon(params: list[torch.Tensor], ortho: list[torch.Tensor], shapes: list[Sequence[int]], lr: float,
               weight_decay: float, adjust_lr_fn: str | None) -> None:
    """torch's ``param.mul_(1 - lr * weight_decay)``, ``param.add_(update, alpha=-adjusted_lr)``, in place."""
    for p, o, shape in zip(params, ortho, shapes):
        p.mul_(1 - lr * weight_decay)
        p.add_(o, alpha=-adjust_lr(lr, adjust_lr_fn, shape))


# ---- the module path ------------------------------------------------------------------------------------


def _layout(name: str, p: torch.Tensor) -> tuple[ShardSpec, Any, int] | None:
    """How ``p`` is sharded for Muon: None (a plain tensor or a replicated DTensor: the whole matrix is here), or
    ``(spec, process group, rank on it)`` of its one ``Shard(dim)`` mesh axis; anything else raises."""
    if not isinstance(p, DTensor):
        return None
    mesh, placements = p.device_mesh, tuple(p.placements)
    sharded = [(i, pl) for i, pl in enumerate(placements) if not pl.is_replicate()]
    if not sharded:
        return None
    if len(sharded) > 1 or type(sharded[0][1]) is not Shard:
        raise ShardingError(
            f"optim.Muon: parameter {name} {tuple(p.shape)} is a DTensor with placements {placements} on mesh "
            f"{tuple(mesh.shape)} {mesh.mesh_dim_names or ''}: sharded on more than one mesh axis or not as a plain "
            f"Shard(dim) (FSDP over tensor parallel, or a Partial), and Muon needs each whole matrix on one rank, "
            f"which this optimizer assembles over one Shard(dim) axis (FSDP2's, HSDP's) only. Fix: give such "
            f"parameters to AdamW (optim.Muon for the FSDP-only matrices), or shard them over data-parallel axes only")
    axis, pl = sharded[0]
    return make_spec(name, p, pl.dim, axis=axis, world=mesh.size(axis)), mesh.get_group(axis), mesh.get_local_rank(axis)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` (same signature, defaults and arithmetic) over sharded parameters: a DTensor parameter
    sharded on one mesh axis (``funcshard.fully_shard``'s or torch's FSDP2 ``Shard(dim)``; HSDP's ``(Replicate(),
    Shard(dim))``: owners within the shard group, the replicas compute the same) has each whole matrix orthogonalized
    on one owner rank of that axis (longest processing time over Newton-Schulz FLOPs; :meth:`owners` prints who
    owns what), its momentum buffer sharded like the parameter (a DTensor, which DCP saves and reloads at another
    world size). A plain tensor (an unsharded model) is ``torch.optim.Muon`` bit for bit. Parameters sharded on two
    mesh axes (FSDP over tensor parallel) raise at construction, naming the parameter and the fix; so do non-2-D
    parameters (give them to AdamW). Every rank must step the same parameters (FSDP gives every rank a gradient of
    each parameter, or none). Owners follow the parameters' names (``named_parameters()``: any order on each rank);
    unnamed parameters are named by their position, so every rank must give them in the same order.

    Args:
        params: parameters or param groups, as for ``torch.optim`` (named parameters put their names in errors and
            in the owner table).
        lr: the learning rate (a float, or a one-element Tensor).
        weight_decay: decoupled decay: ``p *= 1 - lr * weight_decay`` before the update.
        momentum: the momentum buffer's decay (``buf.lerp_(grad, 1 - momentum)``).
        nesterov: Nesterov momentum (orthogonalize ``grad.lerp(buf, momentum)`` rather than ``buf``).
        ns_coefficients: Newton-Schulz's ``(a, b, c)``.
        eps: the floor of the norm the update is divided by before Newton-Schulz.
        ns_steps: Newton-Schulz iterations (``0 <= ns_steps < 100``).
        adjust_lr_fn: the learning rate's scaling by the matrix's global shape ``(rows, cols)``: None or
            ``"original"``: ``sqrt(max(1, rows / cols))``; ``"match_rms_adamw"``: ``0.2 * sqrt(max(rows, cols))``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                 eps: float = EPS, ns_steps: int = NS_STEPS, adjust_lr_fn: str | None = None) -> None:
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError("optim.Muon: a Tensor lr must have one element")
        else:
            check_hyper("optim.Muon", lr, momentum, weight_decay, ns_coefficients, ns_steps, adjust_lr_fn)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self._plans: dict[int, list] = {}  # param group index -> its parameters by process group, with owners
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, the group's parameters checked (2-D, sharded on one mesh axis
        at most) and given owners; nothing is added when a check fails.

        Args:
            param_group: a dict with ``params`` (and optionally ``param_names``, and hyperparameters that override
                the defaults), as for ``torch.optim``.
        """
        super().add_param_group(param_group)
        gi, group = len(self.param_groups) - 1, self.param_groups[-1]
        try:
            check_hyper("optim.Muon", 0.0, group["momentum"], group["weight_decay"], group["ns_coefficients"],
                        group["ns_steps"], group["adjust_lr_fn"])
            names = self._names(gi, group)
            for name, p in zip(names, group["params"]):
                if p.ndim != 2:
                    raise ValueError(
                        f"optim.Muon: parameter {name} has shape {tuple(p.shape)}; Muon updates 2-D matrices only. "
                        f"Fix: give embeddings, norms and biases to another optimizer (torch.optim.AdamW), Muon the "
                        f"hidden matrices")
            self._plans[gi] = self._plan(names, group["params"], group["ns_steps"])
        except Exception:
            self.param_groups.pop()
            raise

    @staticmethod
    def _names(gi: int, group: dict) -> list[str]:
        names = group.get("param_names")
        return list(names) if names else [f"param_groups[{gi}]['params'][{j}]" for j in range(len(group["params"]))]

    @staticmethod
    def _plan(names: list[str], params: list[torch.Tensor], ns_steps: int) -> list:
        """The group's parameters by process group: ``[(group, rank, specs, Owners, indices)]`` plus ``(None, ...)``
        for the whole ones (owned by every rank)."""
        by: dict[int, list] = {}
        order: list = []
        for j, (name, p) in enumerate(zip(names, params)):
            lay = _layout(name, p)
            if lay is None:
                key = -1
                if key not in by:
                    by[key] = [None, 0, {}, []]
                    order.append(key)
                by[key][3].append(j)
                continue
            spec, pg, rank = lay
            key = id(pg)
            if key not in by:
                by[key] = [pg, rank, {}, []]
                order.append(key)
            if name in by[key][2]:
                raise ValueError(
                    f"optim.Muon: the name {name!r} names two sharded parameters of one param group (shapes "
                    f"{tuple(by[key][2][name].shape)} and {tuple(p.shape)}); the owners and the exchange go by name. "
                    f"Fix: give unique names (model.named_parameters() of the whole model), or one param group per "
                    f"submodule")
            by[key][2][name] = spec
            by[key][3].append(j)
        out = []
        for key in order:
            pg, rank, specs, idx = by[key]
            owners = None
            if pg is not None:
                world = next(iter(specs.values())).world
                # by name: every rank the same table whatever order its parameters came in (equal-cost matrices
                # get their owners by position); unnamed parameters are named by position, so their order counts
                owners = assign_owners([(k, s.shape, ns_flops(s.shape, ns_steps)) for k, s in sorted(specs.items())],
                                       world)
            out.append((pg, rank, specs, owners, idx))
        return out

    def owners(self) -> list[Owners]:
        """Who owns each sharded matrix: one table per param group and shard process group (print them)."""
        return [o for plans in self._plans.values() for (_, _, _, o, _) in plans if o is not None]

    def owner_steps(self) -> list[OwnerStep]:
        """The step's owner exchanges, one per param group and shard process group (print them): who owns which
        matrix, the all-to-alls in issue order with every rank's bytes, every rank's FLOPs and extra memory (as
        ``funcshard.Plan.with_optimizer`` prints them on the functional path)."""
        return [owner_step(specs, o, torch.bfloat16) for plans in self._plans.values()
                for (_, _, specs, o, _) in plans if o is not None]

    def _init_group(self, group, params, grads, bufs) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            params.append(p)
            grads.append(p.grad)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (``torch.optim.Muon.step``); the all-to-alls to the owners and back run inside.

        Args:
            closure: None, or a callable that recomputes the loss (run with gradients enabled); its result is
                returned.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, torch.Tensor) else lr
            names = self._names(gi, group)
            for pg, rank, specs, owners, idx in self._plans[gi]:
                params, grads, bufs = [], [], []
                self._init_group({"params": [group["params"][j] for j in idx]}, params, grads, bufs)
                if not params:
                    continue
                keys = [names[j] for j in idx if group["params"][j].grad is not None]
                local_p = [_local(p) for p in params]
                updates = momentum_update([_local(g) for g in grads], [_local(b) for b in bufs], group["momentum"],
                                          group["nesterov"])
                if pg is None:
                    ortho = [newton_schulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"])
                             for u in updates]
                else:
                    ex = Exchange({k: specs[k] for k in keys}, owners, pg, rank, what="optim.Muon")
                    out = orthogonalize(ex, dict(zip(keys, updates)), group["ns_coefficients"], group["ns_steps"],
                                        group["eps"])
                    ortho = [out[k] for k in keys]
                apply_muon(local_p, ortho, [p.shape for p in params], lr, group["weight_decay"],
                           group["adjust_lr_fn"])
        return loss
