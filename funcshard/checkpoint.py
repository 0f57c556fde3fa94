"""Checkpoints of the functional state: ``state`` (a plan's local shards) and ``funcshard.optim`` state.

    funcshard.checkpoint.save(plan, state, opt_state, checkpoint_id=path, tx=tx)       # every rank
    state, opt_state = funcshard.checkpoint.load(plan, path, opt_state=tx.init(state))  # any world size, any layout

Through ``torch.distributed.checkpoint`` (DCP), in the layout torch's FSDP2 writes with
``{"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}``: every shard is
presented to DCP as a piece of its global tensor (``state_dict``), so a checkpoint written at one world size (or
layout) loads at another, and checkpoints cross-load with FSDP2 + ``torch.optim.AdamW`` / ``SGD``: keys
``model.<path>`` (tied parameters under every name, as ``get_model_state_dict``), ``optim.state.<path>.exp_avg`` /
``exp_avg_sq`` / ``momentum_buffer`` / ``step`` and, when ``tx`` says what torch optimizer it is,
``optim.param_groups`` (an ``optim.multi_transform``: one torch optimizer's per label, as FSDP2 with several optimizers
writes them). ``optim.owner_compute``'s state, each matrix's on its owner, goes whole under ``optim.owned.<path>.<leaf>``
(any world size's owners read it).

Saves commit by a rename once every rank has written (``_checkpoint_commit``: a save killed half-way leaves the previous
checkpoint in place); ``async_save`` copies the state and writes in the background. ``init_state`` / ``init_module``
initialise sharded parameters from a meta-device model one module at a time (``_checkpoint_init``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, NamedTuple

import torch

from funcshard import optim
from funcshard._checkpoint_dcp import mark, present
from funcshard._checkpoint_safetensors import Reader, Writer, check_dtypes
from funcshard._collectives import bounded_all_reduce, public_where
from funcshard._pipeline import gather_tangents
from funcshard._comm import plain
from funcshard._compat import dtensor_local, new_named_group, process_group_store, root_mesh
from funcshard._layout import full_layouts
from funcshard._mesh import device_of, live_group
from funcshard._offload import HOST, place_state, to_host
from funcshard._plan import Plan, module_params
from funcshard._shard import _fail, check_state
from funcshard._spec import ShardingError
from funcshard._tree import tree_flatten, tree_flatten_with_path, tree_unflatten

__all__ = ["MODEL", "OPTIM", "async_save", "export_full", "import_full", "init_module", "init_state", "load", "save", "state_dict"]

MODEL = "model"
"""The checkpoint state dict's key of the parameters (and buffers): ``get_model_state_dict``'s part."""
OPTIM = "optim"
"""The checkpoint state dict's key of the optimizer state: ``get_optimizer_state_dict``'s part."""

# funcshard.optim's per-parameter state -> torch.optim's names for it
_TORCH_NAMES: dict[type, tuple[tuple[str, str], ...]] = {
    optim.ScaleByAdamState: (("mu", "exp_avg"), ("nu", "exp_avg_sq")),
    optim.TraceState: (("trace", "momentum_buffer"),),
}


def _rank(plan: Plan) -> int:
    return plan.mesh.get_local_rank(plan.shard_axis)


def _buffers(plan: Plan) -> dict[str, torch.Tensor]:
    """The module's persistent buffers (replicated: every rank saves the same; DCP keeps one)."""
    names = {a for s in plan.specs.values() for a in s.aliases}
    return {k: v for k, v in plan.module.state_dict(keep_vars=True).items() if k not in names}


def _parts(opt_state: Any, where: str = "opt_state", host: bool | None = None) -> list[tuple[str, Any, bool | None]]:
    """The NamedTuple states inside a (chained, offloaded) optimizer state, with where they are and, inside an
    ``optim.offload`` state (its groups' states, each over some of the parameters), whether that keeps them pinned on
    the host (None: not offloaded)."""
    if optim.is_chain_state(opt_state):
        return [p for i, s in enumerate(opt_state) for p in _parts(s, f"{where}[{i}]", host)]
    if isinstance(opt_state, optim.OffloadState):
        return [p for name, s in opt_state.groups.items()
                for p in _parts(s, f"{where}.groups[{name!r}]", bool(opt_state.pinned))]
    if isinstance(opt_state, optim.MultiTransformState):  # (each label's state, over its parameters)
        return [p for name, s in opt_state.inner_states.items()
                for p in _parts(s, f"{where}.inner_states[{name!r}]", host)]
    if not hasattr(opt_state, "_fields"):
        raise TypeError(f"{where} is a {type(opt_state).__name__}, not a funcshard.optim state; pass what "
                        f"tx.init(state) (or tx.update) returned")
    return [(where, opt_state, host)]


class _Tree(NamedTuple):
    """One per-parameter tree of an optimizer state: ``getattr(part, field)``, saved as ``optim.state.<path>.<name>``;
    ``host``: None, or (``optim.offload``'s) whether it lives pinned on the host."""

    where: str
    part: Any
    field: str
    name: str
    host: bool | None

    @property
    def tree(self) -> Mapping[str, torch.Tensor]:
        return getattr(self.part, self.field)


def _per_param(plan: Plan, opt_state: Any) -> tuple[list[_Tree], int]:
    """Every per-parameter tree of ``opt_state``, and its step count. Trees of one name (``optim.offload``'s
    groups' moments) hold disjoint parameters."""
    out: list[_Tree] = []
    counts = set()
    saved: dict[tuple[str, str], str] = {}  # (torch name, parameter) -> where
    for where, part, host in _parts(opt_state):
        if "count" in part._fields:
            counts.add(part.count)
        if isinstance(part, optim.OwnerComputeState):  # (whole matrices' state on their owners: _owned)
            continue
        names = _TORCH_NAMES.get(type(part))
        if names is None:
            if any(isinstance(v, (torch.Tensor, Mapping)) for v in part):
                raise TypeError(f"{where}: funcshard.checkpoint does not know how to name a {type(part).__name__} "
                                f"for torch.optim; it checkpoints {', '.join(t.__name__ for t in _TORCH_NAMES)}")
            continue
        for field, name in names:
            tree = getattr(part, field)
            if not isinstance(tree, Mapping) or not set(tree) <= set(plan.specs):
                raise ShardingError(f"{where}.{field} is not a dict keyed by the plan's parameters (all, or the "
                                    f"trained ones); pass the optimizer state of this plan's state (tx.init(state))")
            for k in tree:
                if saved.setdefault((name, k), where) != where:
                    raise ShardingError(f"{where}: two optimizer states would be saved as {name!r} of {k!r} (the "
                                        f"other at {saved[name, k]})")
            out.append(_Tree(where, part, field, name, host))
    if len(counts) > 1:
        raise ShardingError(f"opt_state holds different step counts {sorted(counts)}; pass one optimizer's state")
    return out, counts.pop() if counts else 0


def _held(plan: Plan, opt_state: Any, trees: list) -> list[str]:
    """The parameters (plan order) the optimizer state holds trees for: all of them, or a subset (frozen ones left
    out, as torch's optimizers leave out parameters they were not given); with no tree (plain SGD), every one."""
    if not trees:
        return list(plan.specs)
    keys = {k for t in trees for k in t.tree}
    return [k for k in plan.specs if k in keys]


OWNED = "owned"
"""The key, inside ``optim``, of ``optim.owner_compute``'s state: ``optim.owned.<path>.<leaf>``, each a whole matrix's
state as its owner holds it (a plain tensor: any rank of any world size reads it whole)."""


def _owned(plan: Plan, opt_state: Any) -> list[tuple[str, Any, dict[str, dict[str, torch.Tensor]]]]:
    """``optim.owner_compute``'s states in ``opt_state``: ``(where, part, {path: {leaf name: tensor}})`` for the
    matrices this rank owns (their owners hold them; another world size's owners read them by path). A leaf that is
    not a tensor, or two states of one path, raise naming it."""
    out, seen = [], {}
    for where, part, _ in _parts(opt_state):
        if not isinstance(part, optim.OwnerComputeState) or part.owned is None:
            continue
        leaves: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in part.owned.items():
            if k not in plan.specs:
                raise ShardingError(f"{where}.owned holds {k!r}, not a parameter of the plan; pass the optimizer "
                                    f"state of this plan's state (tx.init(state))")
            if seen.setdefault(k, where) != where:
                raise ShardingError(f"{where}: two owner_compute states of {k!r} (the other at {seen[k]}) would be "
                                    f"saved under one name; give each parameter to one owner_compute")
            paths, values, _ = tree_flatten_with_path(v)
            for path, leaf in zip(paths, values):
                if not isinstance(leaf, torch.Tensor):
                    raise TypeError(f"{where}.owned[{k!r}]{''.join(f'[{q!r}]' for q in path)} is of type "
                                    f"{type(leaf).__name__}; funcshard.checkpoint saves owner_compute state made of "
                                    f"tensors (in dicts, lists, tuples). Fix: keep it as a tensor (e.g. "
                                    f"torch.tensor(x)) in init_state and fn")
            leaves[k] = {"/".join(map(str, path)) or "value": leaf for path, leaf in zip(paths, values)}
        out.append((where, part, leaves))
    return out


def state_dict(plan: Plan, state: Mapping[str, torch.Tensor], opt_state: Any = None, *,
               tx: optim.GradientTransformation | None = None) -> dict[str, Any]:
    """The DCP state dict of ``state`` (and ``opt_state``): ``{"model": {path: DTensor}, "optim": {...}}``.

    Each value is a DTensor of the parameter's global shape over the shard (no copy: ``dcp.load`` into it writes
    into ``state`` and ``opt_state``; a tensor subclass's values are copied into a plain tensor, which a load does not
    write back: load such a state with :func:`load`); see the module docstring for the keys. ``tx``: the optimizer, for
    ``param_groups`` (``optim.adamw``/``optim.sgd`` know their torch hyperparameters), which torch's
    ``get_optimizer_state_dict`` asks for on load: required with ``opt_state`` (a ``TypeError`` without it); a
    ``tx`` that is not one of torch's optimizers writes none (such a checkpoint loads with :func:`load` only).

    Args:
        plan: the :class:`funcshard.Plan` the state was sharded by.
        state: this rank's shards (``funcshard.shard(plan)``, or what training made of them).
        opt_state: the optimizer state of ``state`` (``tx.init(state)`` and its updates), or None for parameters only.
        tx: the optimizer (``optim.adamw`` / ``optim.sgd`` / a chain ending in one): it gives torch's ``param_groups``;
            required with ``opt_state``.
    """
    return _state_dict(plan, state, opt_state, tx)


def _state_dict(plan: Plan, state: Mapping[str, torch.Tensor], opt_state: Any, tx: Any,
                copy: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, Any]:
    """``state_dict``, each tensor first passed through ``copy`` (``async_save``'s snapshot) when given."""
    check_state(plan, state)
    snap = copy or (lambda t: t)

    def take(t):
        return snap(t) if plain(t) else _values(t)

    rank, mesh, specs = _rank(plan), plan.mesh, plan.specs
    model = {}
    for k, s in specs.items():
        local = take(state[k])
        model.update((a, present(s, local, mesh, rank)) for a in s.aliases)
    model.update((k, take(b)) for k, b in _buffers(plan).items())
    out: dict[str, Any] = {MODEL: model}
    if opt_state is not None:
        if tx is None:
            raise TypeError("checkpoint.save / state_dict of an opt_state needs tx= (the optimizer, e.g. "
                            "optim.adamw(...)): its torch hyperparameters are saved as optim.param_groups, without "
                            "which torch's set_optimizer_state_dict (FSDP2) cannot load the checkpoint")
        trees, step = _per_param(plan, opt_state)
        held = _held(plan, opt_state, trees)  # the parameters with optimizer state (FSDP2: the trained ones)
        per = {k: {"step": torch.tensor(float(step))} for k in held}
        for t in trees:
            tree = t.tree
            check_state(plan, {**state, **tree}, what=f"optimizer state {t.field}",  # (a subset: the rest is state)
                        on_host=tree if t.host is not None else ())  # (optim.offload's: on the host)
            for k in tree:
                per[k][t.name] = present(specs[k], take(tree[k]), mesh, rank)
        out[OPTIM] = {"state": per}
        owned = {k: {name: take(t) for name, t in v.items()} for _, _, leaves in _owned(plan, opt_state)
                 for k, v in leaves.items()}
        if owned:
            out[OPTIM][OWNED] = owned
        groups = getattr(tx, "torch_param_groups", None)  # (optim.multi_transform: one torch optimizer per label)
        group = getattr(tx, "torch_param_group", None)
        if groups is not None:
            out[OPTIM]["param_groups"] = groups(step, {k: state[k] for k in held})
        elif group is not None:
            out[OPTIM]["param_groups"] = [{**group(step), "params": held}]
    return out


_pending: list[Future] = []  # the async save in flight on this process (at most one)


_part_groups: dict[tuple, Any] = {}  # (id(world), backend, ranks) -> a group over a part of the world's ranks


def _dcp_group(plan: Plan, backend: str | None = None):
    """The process group DCP's collectives run over: None (the world) when the plan's mesh spans every rank; else one
    over the mesh's ranks (``DeviceMesh.from_group`` meshes: each part of the world saves and loads a checkpoint of its
    own, its first rank the coordinator that commits it)."""
    import torch.distributed as dist

    ranks = tuple(sorted(set(root_mesh(plan.mesh).mesh.flatten().tolist())))
    if len(ranks) == dist.get_world_size():
        return None
    key = (id(dist.group.WORLD), backend, ranks)
    pg = _part_groups.get(key)
    if pg is None or not live_group(pg):  # (only the part's ranks take part in making it)
        pg = _part_groups[key] = _new_group(key, backend, None)
    return pg


def _new_group(key: tuple, backend: str | None, timeout: timedelta | None):
    """A new group over the ranks ``key[2]`` (only they call this) for ``key`` (what it is for, its ranks), named
    alike on each of them whatever other groups their processes made (``_compat.new_named_group``; torch's own name
    for it hung ranks whose processes had made other groups): ``funcshard.<key's hash>.<n>``, for the n-th group of
    that key made by this rank, counted in the default group's store (so a name is never used twice on a store).
    Every rank of the key makes its n-th group at the same call (saves are collective); a making that failed on some
    ranks only (a peer died or stalled: a CollectiveError) leaves their counts apart, and the next save of that plan
    in the same job waits out the bound too: restart the job, as that error says."""
    import torch.distributed as dist

    digest = hashlib.sha1(repr(key[1:]).encode()).hexdigest()[:16]
    n = process_group_store(dist.group.WORLD).add(f"funcshard/groups/{digest}/{dist.get_rank()}", 1)
    return new_named_group(list(key[2]), f"funcshard.{digest}.{n}", backend, timeout)


def _save_group(plan: Plan):
    """The gloo group a save's DCP collectives run over (``save`` and ``async_save``): the mesh's ranks, each wait
    bounded by the plan's timeout, so that a rank that dies or stalls mid-save ends the others' save within the bound
    (over the default group it took that group's own timeout: 30 min by default, 60 s in the tests), and apart from
    the training's groups (an async save's collectives run in its thread beside the step's)."""
    import torch.distributed as dist

    from funcshard._collectives import resolve_timeout

    ranks = tuple(sorted(set(root_mesh(plan.mesh).mesh.flatten().tolist())))
    seconds = resolve_timeout(plan.timeout)
    key = (id(dist.group.WORLD), "save", ranks, seconds)
    pg = _part_groups.get(key)
    if pg is None or not live_group(pg):  # (only the mesh's ranks take part in making it)
        pg = _part_groups[key] = _new_group(key, "gloo", None if seconds is None else timedelta(seconds=seconds))
    return pg


def _save_failed(checkpoint_id: str, error: BaseException, pg) -> BaseException:
    """What a save that failed inside DCP raises: a peer that died or stalled mid-save (gloo's "Connection reset by
    peer" or its timeout, as a RuntimeError, or DCP's CheckpointException, a BaseException that ``except Exception``
    misses) as a CollectiveError naming the checkpoint; other errors (a disk's OSError) as they were. The save's
    group is dropped: its collectives may be left unpaired (the next save makes another)."""
    from torch.distributed.checkpoint import CheckpointException

    from funcshard._collectives import CollectiveError

    for key in [k for k, v in _part_groups.items() if v is pg]:
        del _part_groups[key]
    if isinstance(error, CollectiveError) or not isinstance(error, (RuntimeError, CheckpointException)):
        return error
    text = str(error).strip().splitlines()
    return CollectiveError(
        f"funcshard: checkpoint save to {checkpoint_id} failed on this rank ({type(error).__name__}: "
        f"{text[-1] if text else ''}): a rank died or stalled during the save (each wait is bounded by the plan's "
        f"timeout), or DCP failed on a rank. Nothing was committed: {checkpoint_id} is the previous checkpoint, if "
        f"there was one. Restart the job and resume from it")


def _wait_pending() -> None:
    while _pending:
        _pending.pop().result()


def save(plan: Plan, state: Mapping[str, torch.Tensor], opt_state: Any = None, *, checkpoint_id: str,
         tx: optim.GradientTransformation | None = None, **dcp_kwargs: Any) -> None:
    """Write ``state`` (and ``opt_state``) to the directory ``checkpoint_id`` with ``torch.distributed.checkpoint``;
    every rank of the plan's mesh calls it. Extra keyword arguments go to ``dcp.save``.

    Safe: the files go to ``<checkpoint_id>.saving`` and replace ``checkpoint_id`` only once every rank's are
    written (a rename by rank 0), so a save interrupted half-way (a rank killed mid-write) leaves the previous
    checkpoint at ``checkpoint_id`` as it was; :func:`load` refuses an uncommitted directory. Waits for an
    :func:`async_save` still in flight first. DCP's collectives run over a gloo group of the mesh's ranks bounded by
    the plan's timeout: a rank that dies or stalls mid-save makes the others raise a CollectiveError within it.

    Args:
        plan: the :class:`funcshard.Plan` the state was sharded by.
        state: this rank's shards (``funcshard.shard(plan)``, or what training made of them).
        opt_state: the optimizer state of ``state`` (``tx.init(state)`` and its updates), or None for parameters only.
        checkpoint_id: the checkpoint directory (the same path on every rank: a shared file system).
        tx: the optimizer (``optim.adamw`` / ``optim.sgd`` / a chain ending in one): it gives torch's ``param_groups``;
            required with ``opt_state``.
        **dcp_kwargs: passed to ``torch.distributed.checkpoint.save`` (default ``process_group``: the plan's mesh's
            ranks).
    """
    import torch.distributed.checkpoint as dcp

    from funcshard._checkpoint_commit import CommittingWriter

    _wait_pending()
    sd = state_dict(plan, state, opt_state, tx=tx)
    try:  # (making the save's group waits for the other ranks too: bounded the same way)
        dcp_kwargs.setdefault("process_group", _save_group(plan))
        dcp.save(sd, storage_writer=CommittingWriter(checkpoint_id), **dcp_kwargs)
    except BaseException as e:
        raise _save_failed(checkpoint_id, e, dcp_kwargs.get("process_group")) from e


def async_save(plan: Plan, state: Mapping[str, torch.Tensor], opt_state: Any = None, *, checkpoint_id: str,
               tx: optim.GradientTransformation | None = None) -> Future:
    """:func:`save` in the background (``dcp.async_save``): returns once this rank's shards, moments and buffers are
    copied (training may change them at once); the write and the commit run in a thread, over a gloo process group
    of their own, overlapping the next steps. Returns a ``concurrent.futures.Future`` whose ``result()`` returns once
    the checkpoint is committed on every rank (and raises what the write raised). The checkpoint is the one
    :func:`save` writes of the same state, in either layout. At most one is in flight: a second ``async_save`` (or a
    ``save``) first waits for it. Memory: a copy of the rank's state and optimizer state, on their device, until
    the write ends.

    Args:
        plan: the :class:`funcshard.Plan` the state was sharded by.
        state: this rank's shards (``funcshard.shard(plan)``, or what training made of them).
        opt_state: the optimizer state of ``state`` (``tx.init(state)`` and its updates), or None for parameters only.
        checkpoint_id: the checkpoint directory, as for :func:`save`.
        tx: the optimizer (``optim.adamw`` / ``optim.sgd`` / a chain ending in one): it gives torch's ``param_groups``;
            required with ``opt_state``.
    """
    import torch.distributed.checkpoint as dcp

    from funcshard._checkpoint_commit import CommittingWriter, Staged

    _wait_pending()
    with torch.no_grad():  # the snapshot (DCP's own stager copies each DTensor without the pieces' protocol)
        sd = _state_dict(plan, state, opt_state, tx, copy=lambda t: t.detach().clone())
    try:
        pg = _save_group(plan)
    except BaseException as e:
        raise _save_failed(checkpoint_id, e, None) from e
    written = dcp.async_save(sd, storage_writer=CommittingWriter(checkpoint_id), process_group=pg,
                             async_stager=Staged())
    future: Future = Future()

    def done(f: Future) -> None:
        if f.exception() is not None:
            future.set_exception(_save_failed(checkpoint_id, f.exception(), pg))
        else:
            future.set_result(f.result())

    written.add_done_callback(done)
    _pending.append(future)
    return future


def _expect(problems: list[str], md: dict, key: str, shape: tuple, dtype: torch.dtype) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    got = md.get(key)
    if got is None:
        problems.append(f"  {key}: missing")
    elif not isinstance(got, TensorStorageMetadata):
        problems.append(f"  {key}: not a tensor in the checkpoint")
    elif tuple(got.size) != tuple(shape) or got.properties.dtype != dtype:
        problems.append(f"  {key}: {tuple(got.size)} {got.properties.dtype} in the checkpoint, the plan has "
                        f"{tuple(shape)} {dtype}")


def load(plan: Plan, checkpoint_id: str, opt_state: Any = None, *, state: Mapping[str, torch.Tensor] | None = None,
         **dcp_kwargs: Any):
    """Read a checkpoint (written by :func:`save` at any world size and layout, or by FSDP2) into new shards.

    Returns ``state``, or ``(state, opt_state)`` when ``opt_state`` is given: a template saying the optimizer
    state's structure (``tx.init(state)`` of any state of this plan, or the current one), filled from the
    checkpoint's ``optim`` part (all of its counts set to the checkpoint's ``step``; a checkpoint without steps, as
    torch's SGD writes, gives 1 where it holds momentum buffers, 0 where not: torch keeps a learning-rate schedule's
    count in its scheduler, so a schedule restarts there; torch's Muon + AdamW write steps for AdamW's parameters
    only, and the count is theirs). The template's moment trees may hold a subset of the
    parameters (frozen ones left out, as torch's optimizers keep no state for parameters they were not given);
    only their state is read. An ``optim.offload`` state loads on the host, pinned as the template's was (its
    checkpoint is ``tx``'s: either loads into the other).

    Tensor subclasses stay what they were (FSDP2's all-gather extension, ``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather``, e.g. an int8 or float8 all-gather, keeps running after a resume): a parameter's shard
    takes the class of ``state[path]`` (``state``: the current shards, a template, not modified; default: the
    planned module's parameter, as :func:`funcshard.shard` does), a moment the class of the template's; the values
    are read as plain tensors and copied into ``proto.new_zeros(...)`` of that class (a class whose ``new_zeros``
    does not keep it raises). The checkpoint is checked
    against the plan first (keys, shapes and dtypes of every parameter and moment: a ``ShardingError`` listing
    every mismatch); nothing passed in is modified (the module's buffers are loaded in place, after the check). A
    directory whose save did not commit (``<path>.saving``, or one without DCP's ``.metadata``) is refused.

    Args:
        plan: the :class:`funcshard.Plan` the state was sharded by.
        checkpoint_id: the checkpoint directory (committed: written by :func:`save`, :func:`async_save` or FSDP2).
        opt_state: a template of the optimizer state (``tx.init(state)``): its structure is filled from the checkpoint;
            None: parameters only.
        state: a template of the shards whose tensor classes the loaded shards take (not modified); None: the planned
            module's parameters'.
        **dcp_kwargs: passed to ``torch.distributed.checkpoint.load``.
    """
    import torch.distributed.checkpoint as dcp

    from funcshard._checkpoint_commit import check_committed, checked_metadata, load_error

    check_committed(checkpoint_id)
    reader = dcp.FileSystemReader(checkpoint_id)
    md = checked_metadata(checkpoint_id, reader).state_dict_metadata
    specs, rank, mesh = plan.specs, _rank(plan), plan.mesh
    device = device_of(plan.mesh, "funcshard.checkpoint.load")
    problems: list[str] = []
    keys = {}  # parameter path -> the name it has in the checkpoint (its first alias present there)
    for k, s in specs.items():
        keys[k] = next((a for a in s.aliases if f"{MODEL}.{a}" in md), k)
        _expect(problems, md, f"{MODEL}.{keys[k]}", s.global_shape, s.dtype)
    buffers = _buffers(plan)
    for k, b in buffers.items():
        _expect(problems, md, f"{MODEL}.{k}", tuple(b.shape), b.dtype)
    known = {f"{MODEL}.{a}" for s in specs.values() for a in s.aliases} | {f"{MODEL}.{k}" for k in buffers}
    problems += [f"  {k}: in the checkpoint, not a parameter or buffer of the planned module (extra key)"
                 for k in md if k.startswith(f"{MODEL}.") and k not in known]
    trees: list = []
    owned: list = []  # (optim.owner_compute's states: _owned)
    stepped: list[str] = []  # the parameters whose step the checkpoint holds (torch's SGD saves none)
    if opt_state is not None:
        trees, _ = _per_param(plan, opt_state)
        held = _held(plan, opt_state, trees)
        stepped = [k for k in held if f"{OPTIM}.state.{k}.step" in md]
        # torch's SGD and Muon keep no step beside a momentum buffer (a checkpoint of torch's Muon + AdamW has
        # steps for the AdamW parameters only): those may lack it; any other parameter may not
        kinds: dict[str, set[str]] = {}
        for t in trees:
            for k in t.tree:
                kinds.setdefault(k, set()).add(t.name)
        if stepped:
            problems += [f"  {OPTIM}.state.{k}.step: missing (the checkpoint has it for {stepped[0]})"
                         for k in held if k not in stepped and not (k in kinds and kinds[k] <= {"momentum_buffer"})]
        for k in stepped:
            _expect(problems, md, f"{OPTIM}.state.{k}.step", (), torch.float32)
        for t in trees:
            for k in t.tree:
                _expect(problems, md, f"{OPTIM}.state.{k}.{t.name}", specs[k].global_shape, specs[k].dtype)
        owned = _owned(plan, opt_state)
        for _, _, leaves in owned:
            for k, v in leaves.items():
                for name, t in v.items():
                    _expect(problems, md, f"{OPTIM}.{OWNED}.{k}.{name}", tuple(t.shape), t.dtype)
    if problems:
        raise _fail(plan, f"checkpoint {checkpoint_id} does not fit the plan", problems,
                    "Load a checkpoint of this model (same parameter names, shapes and dtypes), or plan the model "
                    "the checkpoint was written from.")

    def fresh(s, where=device):
        return torch.zeros(s.local_shape, dtype=s.dtype, device=where)

    protos = _classes(plan, state)  # (checked before anything is read)
    state = place_state(plan, {k: fresh(s) for k, s in specs.items()})  # (CPU offload: on the host)
    sd: dict[str, Any] = {MODEL: {keys[k]: present(s, state[k], mesh, rank) for k, s in specs.items()}}
    new_buffers = {k: torch.empty_like(b) for k, b in buffers.items()}
    sd[MODEL].update(new_buffers)
    filled: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    if opt_state is not None:
        sd[OPTIM] = {"state": {k: {"step": torch.zeros(())} for k in stepped}}
        for t in trees:
            if t.host is None:  # where the plan puts the parameters (an offloaded group's: on the host)
                tree = place_state(plan, {k: fresh(specs[k]) for k in t.tree})
            else:  # optim.offload's: on the host, pinned as it was
                tree = {k: to_host(fresh(specs[k], HOST), t.host) for k in t.tree}
            filled[id(t.part), t.field] = tree
            for k in tree:
                sd[OPTIM]["state"].setdefault(k, {})[t.name] = present(specs[k], tree[k], mesh, rank)
        for _, part, leaves in owned:  # (this rank's matrices under this world size's owners, each read whole)
            new_owned = {k: {name: torch.empty_like(t) for name, t in v.items()} for k, v in leaves.items()}
            filled[id(part), "owned"] = new_owned
            if new_owned:
                sd[OPTIM].setdefault(OWNED, {}).update(new_owned)
    dcp_kwargs.setdefault("process_group", _dcp_group(plan))
    try:
        dcp.load(sd, checkpoint_id=checkpoint_id, **dcp_kwargs)
    except dcp.CheckpointException as e:
        raise load_error(checkpoint_id, e) from None
    if opt_state is not None:  # every check before the first change to anything passed in (the module's buffers)
        # no step saved (torch's SGD): a momentum buffer exists only once a step was taken
        steps = {float(sd[OPTIM]["state"][k]["step"]) for k in stepped} or {1.0 if trees else 0.0}
        if len(steps) != 1:
            raise ShardingError(f"checkpoint {checkpoint_id}: the parameters' optimizer steps differ "
                                f"({sorted(steps)}); funcshard.optim keeps one count for all")
    del sd
    # tensor subclasses (FSDP2's all-gather extension) as they were: the parameters' like the template's (or the
    # planned module's) shards, the optimizer's like the template's leaves
    state = {k: _retyped(protos.get(k), v, f"parameter {k!r}") for k, v in state.items()}
    for t in trees:
        tree = filled[id(t.part), t.field]
        for k in tree:
            tree[k] = _retyped(t.tree[k], tree[k], f"{t.where}.{t.field}[{k!r}]")
    for _, part, _ in owned:  # (each matrix's state in its template's structure)
        filled[id(part), "owned"] = {k: tree_unflatten(tree_flatten(v)[1], list(filled[id(part), "owned"][k].values()))
                                     for k, v in part.owned.items()}
    with torch.no_grad():
        for k, b in buffers.items():
            b.copy_(new_buffers[k])
    mark(specs.values(), state.values())
    if opt_state is None:
        return state
    step = int(steps.pop())
    for tree in filled.values():
        mark([specs[k] for k in tree], tree.values())
    return state, _rebuild(opt_state, filled, step)


def _classes(plan: Plan, like: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The parameters whose shards are tensor subclasses, each with a tensor of its class: ``like``'s shards (checked
    against the plan), else the planned module's parameters (a model-sharded one's local tensor)."""
    if like is not None:
        check_state(plan, like, what="load(..., state=): the template state")
        out = {k: v for k, v in like.items() if not plain(v)}
    else:
        out = {}
        for k, v in module_params(plan).items():
            v = dtensor_local(v) if plan.specs[k].model is not None else v
            if not plain(v):
                out[k] = v
    for k, v in out.items():  # (before anything is read: a class that cannot be re-made raises here)
        with torch.no_grad():
            _check_class(v, v.new_zeros((0,)), f"parameter {k!r}")
    return out


def _check_class(proto: torch.Tensor, made: torch.Tensor, where: str) -> None:
    if type(made) is not type(proto):
        raise ShardingError(
            f"funcshard.checkpoint: {where} is a {type(proto).__name__}, and {type(proto).__name__}.new_zeros made a "
            f"{type(made).__name__}; it makes each such shard with the class's new_zeros and copies the "
            f"checkpoint's values in (copy_). Make new_zeros keep the class (as torchao's float8 weights do), "
            f"or pass state= a template of plain tensors and wrap the loaded ones yourself")


def _as_module(plan: Plan, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (plain shards just made) with each shard of a tensor-subclass parameter of the planned module made of
    its class (the all-gather extension kept, as :func:`funcshard.shard` keeps it)."""
    protos = _classes(plan, None)
    return {k: _retyped(protos.get(k), v, f"parameter {k!r}") for k, v in state.items()} if protos else state


def _values(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass's values as a plain tensor (``copy_`` into one, as ``_retyped`` copies them back): what a
    checkpoint holds, so that it loads without the class (``torch.load(weights_only=True)``, FSDP2)."""
    with torch.no_grad():
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        out.copy_(t)
    return out


def _retyped(proto: torch.Tensor | None, t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` (a plain tensor just loaded) as ``proto``'s tensor subclass: ``t`` itself where ``proto`` is plain."""
    if proto is None or plain(proto):
        return t
    with torch.no_grad():
        out = proto.new_zeros(t.shape, dtype=t.dtype, device=t.device)
        _check_class(proto, out, where)
        out.copy_(t)
    return out


def _rebuild(opt_state: Any, filled: dict, step: int) -> Any:
    if isinstance(opt_state, optim.OffloadState):
        return opt_state._replace(groups={n: _rebuild(s, filled, step) for n, s in opt_state.groups.items()})
    if isinstance(opt_state, optim.MultiTransformState):
        return opt_state._replace(inner_states={n: _rebuild(s, filled, step)
                                                for n, s in opt_state.inner_states.items()})
    if optim.is_chain_state(opt_state):
        parts = [_rebuild(s, filled, step) for s in opt_state]
        return tuple(parts) if type(opt_state) is tuple else type(opt_state)(*parts)
    changes = {f: filled[id(opt_state), f] for f in opt_state._fields if (id(opt_state), f) in filled}
    if "count" in opt_state._fields:
        changes["count"] = step
    return opt_state._replace(**changes)


# ---- full (unsharded) state dicts, streamed one group at a time ------------------------------------------------


def export_full(plan: Plan, state: Mapping[str, torch.Tensor], to: str | Callable[[str, torch.Tensor], None], *,
                rank: int = 0) -> None:
    """Write the full parameters (and the module's buffers) from rank ``rank``, one group at a time.

    ``to``: a path (a ``safetensors`` file, parameters under their canonical paths: tied ones once) or a callable
    ``fn(name, tensor)`` called on rank ``rank`` (the index on the shard axis; on an HSDP mesh, of the first replica)
    for each parameter and buffer, in group order (the tensor is valid during the call). Every rank of the mesh calls it (each group is all-gathered): the peak memory on every rank
    is the sharded state plus one group's full tensors (its all-gather buffer and the parameters copied out of it),
    never the whole model. On an HSDP mesh the first replica (index 0 on the replicate axis) gathers and writes; the
    other replicas only wait for the outcome.

    The file is written to ``<to>.tmp`` and renamed to ``to`` once complete, so an export that fails or is
    interrupted leaves the previous file as it was. Dtypes safetensors cannot name are refused on every rank before
    the first collective; should the writing rank fail later (the disk, the callable), it keeps taking part in the
    all-gathers and every rank raises at the end (the others a ``ShardingError`` carrying its error).

    Args:
        plan: the :class:`funcshard.Plan` the state was sharded by.
        state: this rank's shards (``funcshard.shard(plan)``, or what training made of them).
        to: a ``.safetensors`` path, or a callable ``fn(name, tensor)`` called on the writing rank.
        rank: the writing rank's index on the shard axis (of the first replica on an HSDP mesh).
    """
    import os

    import torch.distributed as dist

    check_state(plan, state)
    _not_model_sharded(plan, "export_full")
    if not (isinstance(rank, int) and 0 <= rank < plan.mesh.size(plan.shard_axis)):
        raise ValueError(f"export_full: rank={rank!r} is not an index on the shard axis (axis {plan.shard_axis} of "
                         f"{plan.mesh}, size {plan.mesh.size(plan.shard_axis)}); pass 0 <= rank < "
                         f"{plan.mesh.size(plan.shard_axis)} (on an HSDP mesh: the index in the first replica)")
    pg, me = plan.shard_group()
    rg = plan.replicate_group()  # HSDP: the replicas hold the same shards; the first one gathers and writes
    first = rg is None or plan.mesh.get_local_rank(plan.replicate_axis) == 0
    lay, buffers = full_layouts(plan), _buffers(plan)
    entries = [(p, plan.specs[p].shape, plan.specs[p].dtype) for g in plan.groups for p in g.params]
    entries += [(k, tuple(b.shape), b.dtype) for k, b in buffers.items()]
    if not callable(to):
        check_dtypes(entries)  # on every rank: all raise alike, before any collective
    tmp = None if callable(to) else f"{to}.tmp"
    failed: BaseException | None = None
    writer: Writer | None = None

    def attempt(fn: Callable, *args) -> None:
        nonlocal failed
        if failed is None:
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - kept, raised after the collectives (no rank left waiting)
                failed = e

    def start() -> None:
        nonlocal writer
        writer = Writer(tmp, entries, {"format": "pt"})

    def put(name: str, t: torch.Tensor) -> None:
        (to if tmp is None else writer.write)(name, t)

    def emit(name: str, t: torch.Tensor) -> None:
        attempt(put, name, t)

    def commit() -> None:
        writer.finish()
        os.replace(tmp, to)

    writes = me == rank and first
    if writes and tmp is not None:
        attempt(start)

    where = public_where("all-gather", "checkpoint.export_full", pg, plan.timeout)  # (bounded, errors named)
    try:
        for g in plan.groups if first else ():
            if g.params:
                full = gather_tangents(lay[g.name], [state[p] for p in g.params], pg, me, where)
                if writes:
                    for p, t in zip(g.params, full):
                        emit(p, t)
                del full
        if writes:
            for k, b in buffers.items():
                emit(k, b.detach())
            if tmp is not None:
                attempt(commit)
    finally:
        if writer is not None:
            writer.close()
        if tmp is not None and writes and os.path.exists(tmp):
            os.remove(tmp)  # what a failed export wrote; ``to`` is the previous file
    # the writer's outcome on every rank (and the file complete on every rank's return): over the first replica's
    # shard group, then from each of its ranks over its replicate group
    flag = torch.tensor([failed is not None], dtype=torch.int32,
                        device=device_of(plan.mesh, "funcshard.checkpoint.export_full"))
    if first:  # (bounded by the plan's timeout: once every rank is past them, the broadcasts below pair up)
        bounded_all_reduce(flag, pg, "checkpoint.export_full's outcome", timeout=plan.timeout)
    if rg is not None:
        bounded_all_reduce(flag, rg, "checkpoint.export_full's outcome", timeout=plan.timeout)
    if flag.item():
        msg = [f"{type(failed).__name__}: {failed}" if failed is not None else None]
        if first:
            dist.broadcast_object_list(msg, src=dist.get_global_rank(pg, rank), group=pg)
        if rg is not None:
            dist.broadcast_object_list(msg, src=dist.get_global_rank(rg, 0), group=rg)
        if failed is not None:
            raise failed
        where = f"{rank} of axis {plan.shard_axis}"
        if rg is not None:
            where += f" in replica 0 of axis {plan.replicate_axis}"
        raise ShardingError(f"export_full: the writing rank ({where}) failed, "
                            f"{'the previous file is kept' if tmp else 'the callable stopped'}: {msg[0]}")


def _not_model_sharded(plan: Plan, what: str) -> None:
    tp = [k for k, s in plan.specs.items() if s.model is not None]
    if tp:
        raise NotImplementedError(f"{what} of a plan with model-sharded (tensor-parallel) parameters ({tp[:3]}) is not "
                                  f"built; save with funcshard.checkpoint.save (DCP), which handles them")


def import_full(plan: Plan, path: str) -> dict[str, torch.Tensor]:
    """This rank's shards read from a full ``safetensors`` file (e.g. a Hugging Face checkpoint, or
    :func:`export_full`'s): each rank reads only the bytes of its own rows, so the peak memory is the sharded
    state plus one parameter's local piece, never a full tensor. A parameter is found under any of its names (tied
    ones under either); shapes and dtypes are checked first (a ``ShardingError`` listing every mismatch, nothing
    loaded). The module's buffers found in the file are loaded into it. A tensor-subclass parameter's shards are
    made of its class (as :func:`load` does).

    Args:
        plan: the :class:`funcshard.Plan` the state was sharded by.
        path: the ``.safetensors`` file (the same path on every rank).
    """
    _not_model_sharded(plan, "import_full")
    reader = Reader(path)
    try:
        problems, names = [], {}
        for k, s in plan.specs.items():
            name = next((a for a in s.aliases if a in reader.header), None)
            if name is None:
                problems.append(f"  {k}: missing")
                continue
            names[k] = name
            shape, dtype = reader.shape_dtype(name)
            if shape != s.shape or dtype != s.dtype:
                problems.append(f"  {name}: {shape} {dtype} in the file, the plan has {s.shape} {s.dtype}")
        buffers = {k: b for k, b in _buffers(plan).items() if k in reader.header}
        for k, b in buffers.items():
            if reader.shape_dtype(k) != (tuple(b.shape), b.dtype):
                problems.append(f"  {k}: {reader.shape_dtype(k)} in the file, the module's buffer is "
                                f"{tuple(b.shape)} {b.dtype}")
        known = {a for s in plan.specs.values() for a in s.aliases} | set(_buffers(plan))
        problems += [f"  {k}: in the file, not a parameter or buffer of the planned module (extra key)"
                     for k in reader.header if k not in known]
        if problems:
            raise _fail(plan, f"{path} does not fit the plan", problems,
                        "Load a file of this model, or plan the model the file was written from.")
        me, device = _rank(plan), device_of(plan.mesh, "funcshard.checkpoint.import_full")
        state = {}
        for k, s in plan.specs.items():
            local = torch.zeros(s.local_shape, dtype=s.dtype)
            for box in s.boxes(me):
                reader.read_box(names[k], box.offsets, box.sizes, box.view(local))
            state[k] = local.to(device)
        with torch.no_grad():
            for k, b in buffers.items():
                reader.read_box(k, (0,) * b.dim(), tuple(b.shape), b)
    finally:
        reader.close()
    state = _as_module(plan, place_state(plan, state))  # (CPU offload: on the host)
    mark(plan.specs.values(), state.values())
    return state


# ---- sharded initialisation: one module materialised at a time -------------------------------------------------


def init_state(plan: Plan, init: Callable[[torch.nn.Module], None] | None = None, *, seed: int | None = None,
               order: str = "modules") -> dict[str, torch.Tensor]:
    """This rank's shards of freshly initialised parameters, without the full model anywhere: the planned module may
    live on the meta device (its parameters are neither read nor changed).

    Bit-equal to sharding (``funcshard.shard``) the full model initialised on one process by::

        torch.manual_seed(seed)          # seed=None: the global RNG as it is (checked to be equal on every rank)
        for m in model.modules():        # order="apply": the order of model.apply(init) (children first)
            init(m)                      # init=None: m.reset_parameters() where m defines one

    Every rank runs that loop, one module at a time: before each call the module's own parameters (``recurse=False``)
    are full tensors on the mesh's device (a parameter tied to an earlier one: its current value, all-gathered),
    after it the rank keeps its shards. Peak memory: the sharded state plus one module's full parameters. ``init``
    must initialise only the module it is given (a parent initialising its children's parameters raises). With
    ``seed``, the caller's RNG is left untouched. Meta buffers become zeros on the mesh's device unless the init sets
    them (compute non-persistent tables, e.g. RoPE's, in your init). A tensor-subclass parameter's shards are made of
    its class (as :func:`load` does).

    Args:
        plan: a plan of the model (its module may be on the meta device).
        init: ``init(module)`` initialises that module's own parameters; None: ``module.reset_parameters()`` where
            defined.
        seed: seeds the RNG for the loop (the caller's RNG untouched); None: the global RNG as it is, checked equal on
            every rank.
        order: ``"modules"``: ``model.modules()``'s order; ``"apply"``: ``model.apply``'s, children first.
    """
    from funcshard._checkpoint_init import check_default_init, gather_one, modules_in_order, rng, run

    mods = modules_in_order(plan.module, order)
    if init is None:
        check_default_init(mods)
    specs, device = plan.specs, device_of(plan.mesh, "funcshard.checkpoint.init_state")
    pg, rank = plan.shard_group()
    key_of = {id(p): k for k, p in module_params(plan).items()}
    state: dict[str, torch.Tensor] = {}

    def make(p):
        spec = specs[key_of[id(p)]]
        if spec.fqn in state:  # tied to a parameter an earlier init set: the next init may read it
            return gather_one(spec, state[spec.fqn], pg)
        return torch.empty(spec.shape, dtype=spec.dtype, device=device)

    def keep(p, full):
        spec = specs[key_of[id(p)]]
        state[spec.fqn] = spec.local_shard(full, rank)

    with rng(seed, device, [plan.mesh.get_group(a) for a in range(plan.mesh.ndim)]):
        run(mods, init, device, make, keep)
    out = _as_module(plan, place_state(plan, {k: state[k] for k in specs}))  # (CPU offload: on the host)
    mark(specs.values(), out.values())
    return out


def init_module(module: torch.nn.Module, init: Callable[[torch.nn.Module], None] | None = None, *,
                seed: int | None = None, order: str = "modules") -> None:
    """:func:`init_state` for a module whose parameters are DTensors (``funcshard.fully_shard`` or torch's
    ``fully_shard`` applied on the meta device, then ``module.to_empty(device=...)``): each DTensor parameter's local
    shard is set, in place, to its piece of the full parameter the reference loop (see :func:`init_state`) gives;
    one module's full parameters exist at a time. Plain parameters are initialised in place by the same calls.

    Args:
        module: a model whose parameters are DTensors (``fully_shard`` on the meta device, then ``to_empty``).
        init: as for :func:`init_state`.
        seed: as for :func:`init_state`.
        order: as for :func:`init_state`.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    from funcshard._checkpoint_init import check_default_init, modules_in_order, rng, run
    from funcshard._compat import dtensor_local

    mods = modules_in_order(module, order)
    if init is None:
        check_default_init(mods)
    named = list(module.named_parameters())
    sharded = [p for _, p in named if isinstance(p, DTensor)]
    meta = [n for n, p in named if (dtensor_local(p) if isinstance(p, DTensor) else p).is_meta]
    if not sharded or meta:
        raise ShardingError(
            f"init_module initialises DTensor parameters in place: {type(module).__name__} has "
            + (f"parameters on the meta device ({meta[:4]}{' ...' if len(meta) > 4 else ''}): call "
               f"module.to_empty(device=...) first (FSDP2's order: fully_shard on the meta device, to_empty, init)"
               if meta else "no DTensor parameters: apply fully_shard first (for the functional state, "
                            "funcshard.checkpoint.init_state(plan))"))
    mesh, device = sharded[0].device_mesh, dtensor_local(sharded[0]).device
    done: set[int] = set()

    def make(p):
        if not isinstance(p, DTensor):
            return None  # a plain, real parameter: the init writes it in place
        if id(p) in done:  # tied to a parameter an earlier init set
            with torch.no_grad():
                return p.full_tensor()
        return torch.empty(p.shape, dtype=p.dtype, device=device)

    def keep(p, full):
        done.add(id(p))
        with torch.no_grad():
            dtensor_local(p).copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())

    with rng(seed, device, [mesh.get_group(a) for a in range(mesh.ndim)]):
        run(mods, init, device, make, keep)
