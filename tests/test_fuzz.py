"""Fuzzed bad input (issue 31): hypothesis draws malformed ``Plan.replace`` edits, states, optimizer trees and damaged
checkpoint directories. Each must raise an error naming what is wrong and how to fix it (a ``ShardingError`` for
plans, states and checkpoints; optim's ``ValueError`` / ``TypeError`` with its "Fix:"), or, where the input is in
fact valid, work; and leave the state, optimizer state, template and module parameters as they were.

The default suite draws a few examples of each (``derandomize``: the same ones every run); ``FUZZ_EXAMPLES=n`` draws
more (the ``slow`` variant sets 200)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import funcshard
from funcshard import ShardingError, optim
from models import MLP

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _clones(tree) -> list[torch.Tensor]:
    return [t.detach().clone() for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _same(before: list[torch.Tensor], tree) -> bool:
    after = [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.fixture(scope="module")
def setup():
    from funcshard.cost import fake_mesh

    torch.manual_seed(0)
    model = MLP(layers=2)
    plan = funcshard.plan(model, fake_mesh(2), groups=(torch.nn.Linear,))
    yield model, plan
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


# ---- Plan.replace edits -----------------------------------------------------------------------------------------
_NAMES = st.sampled_from(["", "nope", "blocks", "blocks.0", "blocks.0.l1", "blocks.9.l1", "x.y", "blocks.0.l1.weight"])


def _group_edit(draw, plan):
    groups = list(plan.groups)
    op = draw(st.sampled_from(["module", "param", "drop", "duplicate", "swap_root", "move_param", "rename"]))
    i = draw(st.integers(1, len(groups) - 1))
    g = groups[i]
    if op == "module":
        groups[i] = dataclasses.replace(g, modules=(*g.modules, draw(_NAMES)))
    elif op == "param":
        groups[i] = dataclasses.replace(g, params=(*g.params, draw(_NAMES)))
    elif op == "drop":
        del groups[i]
    elif op == "duplicate":
        groups.append(g)
    elif op == "swap_root":
        groups[0], groups[i] = groups[i], groups[0]
    elif op == "move_param" and g.params:  # (valid: the parameter stays in exactly one group)
        j = draw(st.integers(0, len(groups) - 1).filter(lambda j: j != i))
        p = g.params[0]
        groups[i] = dataclasses.replace(g, params=g.params[1:])
        groups[j] = dataclasses.replace(groups[j], params=(*groups[j].params, p))
    elif op == "rename":
        groups[i] = dataclasses.replace(g, name=draw(_NAMES))
    return {"groups": tuple(groups)}


@st.composite
def _plan_edits(draw, plan):
    field = draw(st.sampled_from(["groups", "forward_prefetch", "backward_prefetch", "grad_divide_factor", "timeout",
                                  "layout", "prefetch_lists"]))
    if field == "groups":
        return _group_edit(draw, plan)
    if field in ("forward_prefetch", "backward_prefetch"):
        return {field: draw(st.one_of(st.integers(-3, 5), st.floats(-2, 5), st.none(), st.just("1")))}
    if field == "grad_divide_factor":
        return {field: draw(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none(), st.just(0),
                                      st.just("2")))}
    if field == "timeout":
        return {field: draw(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none(), st.just("5")))}
    if field == "layout":
        return {field: draw(st.sampled_from(["per_param", "flat", "rows", ""]))}
    name = draw(st.sampled_from([g.name for g in plan.groups] + ["nope"]))
    return {"forward_prefetch_lists": {name: (draw(_NAMES),)}}


@SETTINGS
@given(data=st.data())
def test_plan_replace_fuzzed(setup, data):
    """A malformed edit raises a ShardingError naming it; a valid one gives a plan that shards and prints."""
    model, plan = setup
    params = _clones(dict(model.named_parameters()))
    edit = data.draw(_plan_edits(plan))
    try:
        new = plan.replace(**edit)
    except ShardingError as e:
        assert str(e), edit
    else:
        funcshard.check_state(new, funcshard.shard(new))
        str(new)
    assert _same(params, dict(model.named_parameters()))


# ---- states -----------------------------------------------------------------------------------------------------
@st.composite
def _bad_states(draw, state):
    state = dict(state)
    key = draw(st.sampled_from(sorted(state)))
    op = draw(st.sampled_from(["missing", "extra", "shape", "dtype", "not_tensor", "none", "not_dict", "meta",
                               "zero_dim"]))
    if op == "missing":
        del state[key]
    elif op == "extra":
        state[draw(st.sampled_from(["nope", "blocks.0.l1.scale", key + ".x"]))] = state[key]
    elif op == "shape":
        state[key] = torch.zeros(draw(st.lists(st.integers(0, 5), max_size=3)))
    elif op == "dtype":
        state[key] = state[key].to(draw(st.sampled_from([torch.float64, torch.bfloat16, torch.int64])))
    elif op == "not_tensor":
        state[key] = draw(st.sampled_from([1.0, [1.0], "w", None]))
    elif op == "none":
        state[key] = None
    elif op == "meta":
        state[key] = torch.empty_like(state[key], device="meta")
    elif op == "zero_dim":
        state[key] = torch.tensor(1.0)
    else:
        return list(state.values())
    return state


@SETTINGS
@given(data=st.data())
def test_states_fuzzed(setup, data):
    """A malformed state raises a ShardingError naming the key (check_state, and apply before any collective); the
    state and the module's parameters are as they were."""
    model, plan = setup
    state = funcshard.shard(plan)
    bad = data.draw(_bad_states(state))
    before, params = _clones(state), _clones(dict(model.named_parameters()))
    for fn in (lambda: funcshard.check_state(plan, bad), lambda: funcshard.apply(plan, bad, torch.randn(2, 8))):
        with pytest.raises(ShardingError, match=r"\w"):
            fn()
    assert _same(before, state) and _same(params, dict(model.named_parameters()))


# ---- optimizer trees --------------------------------------------------------------------------------------------
def _tree(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


_TXS = {
    "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
    "sgd": lambda: optim.sgd(0.1, momentum=0.9),
    "clip+adamw": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)),
}


@st.composite
def _bad_grads(draw):
    grads = _tree(1)
    op = draw(st.sampled_from(["missing", "extra", "shape", "dtype", "not_tensor", "nested", "list"]))
    key = draw(st.sampled_from(["w", "b"]))
    if op == "missing":
        del grads[key]
    elif op == "extra":
        grads["z"] = torch.zeros(2)
    elif op == "shape":
        grads[key] = torch.zeros(draw(st.integers(4, 9)))  # (never the shape of w (4, 3) or b (3,))
    elif op == "dtype":
        grads[key] = grads[key].to(draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float64])))
    elif op == "not_tensor":
        grads[key] = draw(st.sampled_from([1.0, "g", [1.0]]))
    elif op == "nested":
        grads[key] = {"x": grads[key]}
    else:
        return [grads["w"], grads["b"]]
    return grads


@SETTINGS
@given(name=st.sampled_from(sorted(_TXS)), grads=_bad_grads(), donate=st.booleans())
def test_optimizer_trees_fuzzed(name, grads, donate):
    """optim.step with malformed gradients: a ValueError / TypeError whose message says the fix, nothing donated is
    changed; or (sgd with gradients of another float dtype, which it promotes) a right update."""
    tx, params = _TXS[name](), _tree(0)
    opt_state = tx.init(params)
    before = _clones([grads, opt_state, params])
    try:
        optim.step(tx, grads, opt_state, params, donate=donate)
    except (ValueError, TypeError) as e:
        assert "Fix" in str(e) or "fix" in str(e), (name, e)
        assert _same(before, [grads, opt_state, params]), name
    else:  # (only a float dtype sgd promotes)
        assert name == "sgd" and isinstance(grads, dict) and set(grads) == {"w", "b"}, (name, grads)


# ---- damaged checkpoint directories -----------------------------------------------------------------------------
def _damaged_checkpoints(path, examples):
    import shutil

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from funcshard import checkpoint

    torch.manual_seed(0)
    plan = funcshard.plan(MLP(layers=2), init_device_mesh("cpu", (1,)), groups=(torch.nn.Linear,))
    tx = optim.adamw(1e-2)
    state = funcshard.shard(plan)
    opt_state = tx.init(state)
    checkpoint.save(plan, state, opt_state, checkpoint_id=f"{path}/good", tx=tx)
    files = sorted(os.listdir(f"{path}/good"))
    seen = []

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(name=st.sampled_from(files), op=st.sampled_from(["delete", "truncate", "garbage", "marker", "empty_dir"]),
           cut=st.floats(0, 0.99))
    def damage(name, op, cut):
        where = f"{path}/d{len(seen)}"
        shutil.copytree(f"{path}/good", where)
        target = f"{where}/{name}"
        if op == "delete":
            os.remove(target)
        elif op == "truncate":
            with open(target, "r+b") as f:
                f.truncate(int(os.path.getsize(target) * cut))
        elif op == "garbage":  # (the metadata only: DCP's data files carry no checksum, a same-size overwrite of
            target = f"{where}/.metadata"  # one is not detectable; see the report)
            with open(target, "r+b") as f:
                f.seek(int(os.path.getsize(target) * cut))
                f.write(b"\x00garbage\xff" * 4)
        elif op == "marker":
            open(f"{where}/.funcshard-uncommitted", "w").close()
        else:
            shutil.rmtree(where)
            os.makedirs(where)
        template = tx.init(state)
        before = _clones([state, template])
        try:
            checkpoint.load(plan, where, opt_state=template, state=state)
            seen.append((op, name, "loaded"))
        except ShardingError as e:
            seen.append((op, name, "ShardingError"))
            assert str(e)
        except Exception as e:  # noqa: BLE001 (anything else is a failure of the test: reported with its text)
            seen.append((op, name, f"{type(e).__name__}: {e}"))
        assert _same(before, [state, template])
        shutil.rmtree(where)

    damage()
    dist.barrier()
    return seen


def test_checkpoint_directories_fuzzed(tmp_path):
    """A damaged checkpoint directory (a file deleted, truncated at a drawn point, garbage written into the metadata,
    the uncommitted marker, nothing in it) is refused with a ShardingError; the template and the state are
    unchanged. A damage that leaves every byte the metadata reads in place (a truncated file whose cut is past the
    last byte read, or an unused file) loads."""
    from multirank import run_ranks

    seen = run_ranks(1, _damaged_checkpoints, str(tmp_path), EXAMPLES)[0]
    bad = [s for s in seen if s[2] not in ("ShardingError", "loaded")]
    assert not bad, bad
    assert any(s[2] == "ShardingError" for s in seen), seen
