"""Reliability (issue 21): a call that fails leaves everything as it was; bad settings fail with a clear error
naming what is wrong and the fix; nothing outlives its step."""

from __future__ import annotations

import re

import pytest
import torch

from funcshard import optim


# ---- a donating optimizer call that raises changes nothing ---------------------------------------------------


def _tree(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _snapshot(tree):
    leaves = []
    for x in (tree.values() if isinstance(tree, dict) else tree):
        if isinstance(x, torch.Tensor):
            leaves.append(x.clone())
        elif isinstance(x, (dict, tuple, list)):
            leaves.extend(_snapshot(x))
        elif hasattr(x, "_fields"):
            leaves.extend(_snapshot(tuple(x)))
    return leaves


_BAD_PARAMS = {"w": torch.zeros(4, 3), "b": torch.zeros(5)}  # a shape the updates do not have


@pytest.mark.parametrize("name, make, via_step, match", [
    ("adamw.update", lambda: optim.adamw(1e-2, weight_decay=0.1), False,
     r"add_decayed_weights: shape mismatch at \['b'\]: updates has shape \(3,\) but the params has shape \(5,\)"),
    ("clip+sgd.update", lambda: optim.chain(optim.clip_by_global_norm(0.5),
                                            optim.sgd(0.1, momentum=0.9, weight_decay=0.1)), False,
     r"add_decayed_weights: shape mismatch at \['b'\]"),
    ("clip+adamw.step", lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2)), True,
     r"adamw: shape mismatch at \['b'\]: grads has shape \(3,\) but the params has shape \(5,\)"),
    ("sgd.step", lambda: optim.sgd(0.1, momentum=0.9), True, r"sgd: shape mismatch at \['b'\]"),
    ("adam+scale.step", lambda: optim.chain(optim.scale_by_adam(), optim.scale(-0.1)), True,
     r"step: shape mismatch at \['b'\]"),
])
def test_failed_donating_update_changes_nothing(name, make, via_step, match):
    """Check first, then donate: before, adamw's moments and the gradients were already updated in place when
    add_decayed_weights found the params' mismatch, so a retry gave another update (1.6e-3 off)."""
    tx, params = make(), _tree(0)
    opt_state = tx.init(params)
    for seed in (1, 2):  # two steps, so that momentum and moments are not at their first-step values
        if via_step:
            params, opt_state = optim.step(tx, _tree(seed), opt_state, params)
        else:
            updates, opt_state = tx.update(_tree(seed), opt_state, params)
            params = optim.apply_updates(params, updates)
    grads = _tree(3)
    before = _snapshot([grads, opt_state, params])
    want = (optim.step(tx, _tree(3), opt_state, params) if via_step else tx.update(_tree(3), opt_state, params))
    with pytest.raises(ValueError, match=match):
        if via_step:
            optim.step(tx, grads, opt_state, dict(_BAD_PARAMS), donate=True)
        else:
            tx.update(grads, opt_state, dict(_BAD_PARAMS), donate=True)
    after = _snapshot([grads, opt_state, params])
    assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{name}: a failed donating call changed its inputs"
    # the retry gives the pure form's numbers
    got = (optim.step(tx, grads, opt_state, params, donate=True) if via_step
           else tx.update(grads, opt_state, params, donate=True))
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(list(want)), _snapshot(list(got))))


# ---- bad settings fail clearly, on every rank ------------------------------------------------------------------


def _too_small_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import funcshard
    from models import MLP

    out = {}
    small = init_device_mesh("cpu", (1,))  # on 2 ranks: rank 0 is on it, rank 1 is not
    for name, fn in [("plan", lambda: funcshard.plan(MLP(layers=2), small).world),
                     ("fully_shard", lambda: type(funcshard.fully_shard(MLP(layers=2), mesh=small)).__name__)]:
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    # a part of the world sliced from a mesh over every rank is fine (each rank its own 1-rank data-parallel mesh)
    part = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("part", "dp"))["dp"]
    out["sliced_world"] = funcshard.plan(MLP(layers=2), part).world
    # and so is each rank's own data-parallel group (DeviceMesh.from_group), as in FSDP2
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    own = DeviceMesh.from_group(groups[dist.get_rank()], "cpu", mesh_dim_names=("dp",))
    out["from_group"] = funcshard.plan(MLP(layers=2), own).world
    return out


def test_a_rank_off_its_mesh_fails_naming_the_mesh():
    """A (1,) mesh on 2 ranks: rank 1 got "no live process group ... list index out of range" (32e5200); now it raises
    naming the mesh, the world and the fix. Rank 0 is on its mesh and trains on it, as with FSDP2: a mesh over part of
    the world is how each rank gets the mesh of its own data-parallel group (DeviceMesh.from_group), which cannot be
    told apart from this one without asking the other ranks (upstream test_1d_process_group_init)."""
    from multirank import run_ranks

    r0, r1 = run_ranks(2, _too_small_mesh)
    assert r0 == {"plan": 1, "fully_shard": "FSDPMLP", "sliced_world": 1, "from_group": 1}
    assert r1.pop("sliced_world") == 1 and r1.pop("from_group") == 1
    for name, msg in r1.items():
        assert re.search(r"(ShardingError|ValueError): .*mesh DeviceMesh\('cpu', shape \(1\)\) does not contain this "
                         r"rank \(1 of a world of 2; the mesh spans ranks \[0\]\).*Build the mesh over every rank: "
                         r"init_device_mesh\('cpu', \(2,\)\).*DeviceMesh.from_group", msg), (name, msg)


def _model():
    from models import MLP

    torch.manual_seed(0)
    return MLP(layers=2)


@pytest.mark.parametrize("value, shown", [("x", r"'x' \(str\)"), (1.0, r"1\.0 \(float\)"), (True, r"True \(bool\)")])
def test_shard_placement_fn_returning_no_dim(fake_mesh2, value, shown):
    """'x' gave a raw int() ValueError naming nothing; 1.0 and True were taken as dim 1 (32e5200)."""
    import funcshard
    from funcshard import ShardingError

    with pytest.raises(ShardingError, match=rf"cannot shard over mesh .*\n  inp\.weight: shard_placement_fn returned "
                                            rf"{shown}, not a tensor dim; return an int \(0 for the first dim, -1 "
                                            rf"for the last\), a Shard\(dim\), or None for dim 0"):
        funcshard.plan(_model(), fake_mesh2, shard_placement_fn=lambda n, p: value if n == "inp.weight" else None)
    from torch.distributed.tensor import Shard

    plan = funcshard.plan(_model(), fake_mesh2, shard_placement_fn=lambda n, p: Shard(1) if p.dim() == 2 else -1)
    assert plan.specs["inp.weight"].dim == 1 and plan.specs["inp.bias"].dim == 0


class _NotThere(torch.nn.Module):
    pass


@pytest.mark.parametrize("policy, match", [
    (_NotThere, r"groups=_NotThere matches no submodule of MLP \(its submodule classes: \['Linear', 'ModuleList', "
                r"'Block'"),
    ((_NotThere, torch.nn.Conv2d), r"groups=\(_NotThere, Conv2d,\) matches no submodule of MLP"),
    (lambda fqn, m: fqn == "blocks.7", r"groups=.*<lambda> matches no submodule of MLP"),
    (torch.nn.ReLU, r"groups=ReLU matches 1 submodules \(\['1'\]\) of Sequential, none of which holds a parameter "
                    r"of its own"),
])
def test_group_policy_matching_nothing(fake_mesh2, policy, match):
    """A class or callable group policy that picks nothing gave one root group silently (32e5200)."""
    import funcshard
    from funcshard import ShardingError

    model = _model() if policy is not torch.nn.ReLU else torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ShardingError, match=match + r"[\s\S]*so every parameter would be in the root group[\s\S]*"
                                                    r"groups=None for one root group on purpose"):
        funcshard.plan(model, fake_mesh2, groups=policy)
    assert len(funcshard.plan(model, fake_mesh2, groups=None).groups) == 1  # on purpose: fine


# ---- nothing outlives its graph --------------------------------------------------------------------------------


class _Raise(Exception):
    pass


def _leaks():
    """Per model and way of running apply: the plan's live Steps once the results are dropped; per model, how many
    more tensors are alive after running every way once more than after the first (warm-up) round."""
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard
    from funcshard._runtime.step import _facts
    from models import GPT, MLP, Block, GPTBlock

    def tensors():
        gc.collect()
        return sum(type(o) is torch.Tensor or type(o) is torch.nn.Parameter for o in gc.get_objects())

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for name, model, groups, x in [
        ("gpt", GPT(vocab=64, d=32, heads=4, layers=2, seq=8), (GPTBlock,), torch.randint(0, 64, (2, 8))),
        ("mlp", MLP(layers=3), (Block,), torch.randn(4, 7)),
    ]:
        plan = funcshard.plan(model, mesh, groups=groups)
        state = funcshard.shard(plan)
        fail = [False]

        def pre(mod, args):
            if fail[0]:
                raise _Raise("a forward that raises half-way")

        model.blocks[1].register_forward_pre_hook(pre)

        def f(s):
            return funcshard.apply(plan, s, x).float().square().mean()

        def leaves():
            return {k: v.detach().requires_grad_() for k, v in state.items()}

        def vjp_called_twice():
            y, fn = torch.func.vjp(f, state)
            return fn(torch.ones_like(y)), fn(torch.ones_like(y))

        def raises(run):
            fail[0] = True
            try:
                run()
            except _Raise:
                pass
            finally:
                fail[0] = False

        modes = {
            "vjp never called": lambda: torch.func.vjp(f, state),
            "vjp called twice": vjp_called_twice,
            "grad": lambda: torch.func.grad(f)(state),
            "autograd backward": lambda: f(leaves()).backward(),
            "autograd, no backward": lambda: f(leaves()),
            "no_grad": lambda: torch.no_grad()(f)(state),
            "value_and_grad": lambda: funcshard.value_and_grad(f)(state),
            "grad, forward raises": lambda: raises(lambda: torch.func.grad(f)(state)),
            "autograd, forward raises": lambda: raises(lambda: f(leaves())),
        }
        if name == "mlp":  # (scaled_dot_product_attention has no forward-mode AD on CPU)
            modes["jvp"] = lambda: torch.func.jvp(f, (state,), ({k: torch.ones_like(v) for k, v in state.items()},))
        steps = _facts(plan).steps  # (weakly: every step apply made for this plan)
        before = None
        for round in range(2):
            for mode, run in modes.items():
                alive = len(steps)
                result = run()
                del result
                out[f"{name}: {mode}"] = len(steps) - alive  # (freed by reference counting: no collection needed)
            if round == 0:
                before = tensors()
        out[f"{name}: tensors"] = tensors() - before
    return out


def test_no_step_outlives_its_graph_in_any_mode():
    """A torch.func.vjp whose vjp_fn is never called leaked its Step and the root group's gathered parameters, +168
    tensors per call on a small GPT (32e5200): the step held its fused views, whose graph held the step."""
    from multirank import run_ranks

    for out in run_ranks(2, _leaks):
        assert all(v == 0 for v in out.values()), {k: v for k, v in out.items() if v != 0}


def _loss_of_an_inner_activation():
    """torch.func.grad of a loss taken from an activation of the root group (stashed by a hook), the model's output
    dropped: the hooks that hold the fused forward's views die with the output, and the root group, whose parameters
    get fewer gradients than were hooked, finishes in the whole-step gather's backward. A loss of an activation
    inside a group that reshards after forward, made to depend on the model's output too (``+ 0 * out.sum()``), gives
    the reference's gradients ("inner" keys; without that term: ``_inner_activation_backward``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard
    from models import MLP, Block

    torch.manual_seed(0)
    model = MLP(layers=3)
    stash = []
    model.inp.register_forward_hook(lambda m, a, o: stash.append(o))
    x = torch.randn(4, 7)

    def aux(out):
        del out
        return stash.pop().square().mean()

    full = {k: v.detach() for k, v in model.named_parameters()}
    ref = torch.func.grad(lambda p: aux(torch.func.functional_call(model, p, (x,))))(full)
    plan = funcshard.plan(model, init_device_mesh("cpu", (dist.get_world_size(),)), groups=(Block,))
    got = torch.func.grad(lambda s: aux(funcshard.apply(plan, s, x)))(funcshard.shard(plan))
    want = funcshard.shard(plan, ref)
    out = {k: torch.allclose(got[k], want[k], atol=1e-6) for k in want}
    model.blocks[1].l1.register_forward_hook(lambda m, a, o: stash.append(o))  # (runs after the root's)

    def inner(out):
        act = stash.pop()
        stash.pop()  # (the root group's)
        return act.square().mean() + 0 * out.sum()

    ref = torch.func.grad(lambda p: inner(torch.func.functional_call(model, p, (x,))))(full)
    got = torch.func.grad(lambda s: inner(funcshard.apply(plan, s, x)))(funcshard.shard(plan))
    want = funcshard.shard(plan, ref)
    return {**out, **{f"inner {k}": torch.allclose(got[k], want[k], atol=1e-6) for k in want}}


def _inner_activation_backward() -> dict:
    """Autograd reaching a group freed after forward without passing through its outputs (issue 31 item 5): a loss
    of an activation inside the group alone, by ``.backward()`` on apply (``reshard_after_forward`` True and 1; not
    under ``torch.func.grad``: docs/reliability.md); a loss of apply's output under non-reentrant ``torch.utils.checkpoint``
    (whose hooks these step aside for); the primal and tangent of ``torch.func.jvp`` over apply, differentiated by
    ``.backward()`` and by ``funcshard.value_and_grad``. Each raised torch's "setStorage ... out of bounds for storage of size 0" (FSDP2
    raises it on the same model); now the group is gathered again when autograd unpacks its saved parameters, and
    the gradients equal the one-process reference's bit for bit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard
    from models import MLP, Block

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = MLP(layers=2)
    stash = []
    model.blocks[1].l1.register_forward_hook(lambda m, a, o: stash.append(o))
    x = torch.randn(4, 7)
    full = {k: v.detach() for k, v in model.named_parameters()}

    def inner(out):
        del out
        return stash.pop().square().mean()

    ref = ref_inner = torch.func.grad(lambda p: inner(torch.func.functional_call(model, p, (x,))))(full)
    out = {}
    for reshard in (True, 1):
        plan = funcshard.plan(model, mesh, groups=(Block,), reshard_after_forward=reshard)
        state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
        inner(funcshard.apply(plan, state, x)).backward()
        want = funcshard.shard(plan, ref)
        out[f"apply {reshard}"] = all(torch.equal(state[k].grad, want[k]) for k in want)

    # non-reentrant torch.utils.checkpoint around apply: it saves none of apply's tensors (the hooks step aside; with
    # them its recomputation saved other tensors than its forward: CheckpointError "different metadata")
    ref = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).square().mean())(full)
    for reshard in (True, False):
        plan = funcshard.plan(model, mesh, groups=(Block,), reshard_after_forward=reshard)
        state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
        y = torch.utils.checkpoint.checkpoint(funcshard.apply, plan, state, x, use_reentrant=False)
        y.square().mean().backward()
        want = funcshard.shard(plan, ref)
        out[f"checkpoint(apply) {reshard}"] = all(torch.equal(state[k].grad, want[k]) for k in want)
    # saved-tensor hooks disabled by the caller (as aot_autograd's runtime wrappers do): apply pushes none (it raised
    # the caller's message)
    plan = funcshard.plan(model, mesh, groups=(Block,))
    state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
    with torch.autograd.graph.disable_saved_tensors_hooks("the caller's hooks are off"):
        y = funcshard.apply(plan, state, x)
    try:  # (a saved view of group 'blocks.1', freed after forward, without apply's hooks: autograd refuses it)
        stash[-1].grad_fn._saved_mat2
        out["hooks disabled: saved view read refused"] = False
    except RuntimeError as e:
        out["hooks disabled: saved view read refused"] = "inplace" in str(e)
    y.square().mean().backward()
    want = funcshard.shard(plan, ref)
    out["apply with saved-tensor hooks disabled"] = all(torch.equal(state[k].grad, want[k]) for k in want)
    # the caller's own hooks under apply's (save_on_cpu: bound into apply's pack hook, not kept in a module global)
    state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
    with torch.autograd.graph.save_on_cpu():
        y = funcshard.apply(plan, state, x)
    y.square().mean().backward()
    out["apply under save_on_cpu"] = all(torch.equal(state[k].grad, want[k]) for k in want)
    stash.clear()

    # a saved view of a freed group read outside backward (grad_fn._saved_*): an error, not freed memory (a segfault)
    plan = funcshard.plan(model, mesh, groups=(Block,))
    kept = funcshard.apply(plan, {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}, x)
    try:
        stash.pop().grad_fn._saved_mat2
        out["saved view read outside backward"] = False
    except RuntimeError as e:
        out["saved view read outside backward"] = "'blocks.1' is a view of the group's unsharded" in str(e)
    del kept
    _saved_view_reads(out, model, mesh, stash, x, full, ref_inner, (True, False))  # (int: _int_reshard_reads)
    _saved_view_reads(out, None, mesh, stash, x, full, ref_inner, (True, False), fully_shard=True)
    _after_backward_advice(model, mesh, stash, x)
    _changed_since_forward(out, mesh, x)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x, v = torch.randn(5, 3), torch.randn(5, 3)
    p = {k: t.detach() for k, t in m.named_parameters()}
    ref = torch.func.grad(lambda p: (lambda o, d: (o - d.detach()).pow(2).sum())(
        *torch.func.jvp(lambda z: torch.func.functional_call(m, p, (z,)), (x,), (v,))))(p)
    plan = funcshard.plan(m, mesh, groups=(torch.nn.Linear,))
    want = funcshard.shard(plan, ref)

    def loss(s):
        o, d = torch.func.jvp(lambda z: funcshard.apply(plan, s, z), (x,), (v,))
        return (o - d.detach()).pow(2).sum()

    state = {k: t.requires_grad_() for k, t in funcshard.shard(plan).items()}
    loss(state).backward()
    out["jvp .backward()"] = all(torch.equal(state[k].grad, want[k]) for k in want)
    got = funcshard.value_and_grad(loss)(funcshard.shard(plan))[1]
    out["jvp value_and_grad"] = all(torch.equal(got[k], want[k]) for k in want)
    return out


def _saved_view_reads(out: dict, model, mesh, stash: list, x, full: dict, ref: dict, modes: tuple,
                      fully_shard: bool = False) -> None:
    """Autograd's saved view of group 'blocks.1''s weight read outside backward (``grad_fn._saved_mat2``) with
    ``reshard_after_forward`` in ``modes``, before backward and after a backward that keeps the graph
    (``retain_graph=True``), then a second backward through the retained graph from the activation alone. Where
    apply runs its saved-tensor hooks (a group freed after forward: True, an int) they raise funcshard's error naming
    the group and whether it was freed after its forward or after the step's backward (it named neither), and gather
    the group again for the second backward (twice the gradients, ``ref``); elsewhere autograd refuses the read
    (GroupBuffers.mark_freed: its "modified inplace" error), where it read freed memory (SIGSEGV at W=1 and W=2:
    ``reshard_after_forward=False`` after backward, every ``fully_shard`` read of a freed group) or raised
    "setStorage ... out of bounds" (False's second backward). A group kept gathered reads its parameter."""
    import funcshard
    from models import MLP, Block

    def outcome(fn) -> str:
        try:
            got = fn()
        except RuntimeError as e:
            if "'blocks.1' is a view" in str(e):
                return "freed after forward" if "after the group's forward" in str(e) else (
                    "freed after backward" if "after the step's backward" in str(e) else str(e))
            return "autograd refused" if "inplace" in str(e) else str(e)
        return got

    for reshard in modes:
        key = f"{'fully_shard' if fully_shard else 'apply'} {reshard}"
        if fully_shard:  # (a model of the same weights, seed 0, per mode)
            torch.manual_seed(0)
            model = MLP(layers=2)
            model.blocks[1].l1.register_forward_hook(lambda m, a, o: stash.append(o))
            for b in model.blocks:
                funcshard.fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
            funcshard.fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            y = model(x)  # (its backward from the output: from the activation alone it needs apply's hooks)
        else:
            plan = funcshard.plan(model, mesh, groups=(Block,), reshard_after_forward=reshard)
            state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
            y = funcshard.apply(plan, state, x)
        act = stash.pop()
        hooked = not fully_shard and reshard is not False  # (apply pushes its hooks where a group is freed
        # after forward)

        def read():
            return "value" if torch.equal(act.grad_fn._saved_mat2, full["blocks.1.l1.weight"].t()) else "wrong"

        out[f"{key} read before backward"] = outcome(read) == (
            "value" if reshard is False else "freed after forward" if hooked else "autograd refused")
        (y if fully_shard else act).square().mean().backward(retain_graph=True)
        out[f"{key} read after backward"] = outcome(read) == ("freed after backward" if hooked else "autograd refused")
        if fully_shard:
            continue

        def again():
            act.square().mean().backward()
            want = funcshard.shard(plan, ref)
            return "twice" if all(torch.equal(state[k].grad, 2 * want[k]) for k in want) else "wrong"

        out[f"{key} second backward"] = outcome(again) == ("twice" if hooked else "autograd refused")
    stash.clear()


def _after_backward_advice(model, mesh, stash: list, x) -> None:
    """The error for a saved view of group 'blocks.1' read after backward (apply's hooks) gives advice that holds for
    the group: reshard_after_forward=True: not "before" the backward (it fails there, freed after forward: 4b67809
    advised it); False (another group reshards after forward, so the hooks run): before the backward (the read works
    there). Either way reshard_after_backward=False keeps it readable after the backward."""
    import dataclasses

    import funcshard
    from models import Block

    for mine in (True, False):
        plan = funcshard.plan(model, mesh, groups=(Block,), reshard_after_forward=True)
        plan = plan.replace(groups=tuple(dataclasses.replace(g, reshard_after_forward=mine) if g.name == "blocks.1"
                                         else g for g in plan.groups))
        state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
        y = funcshard.apply(plan, state, x)
        act = stash.pop()
        if mine:
            with pytest.raises(RuntimeError, match=r"'blocks.1' .* freed after the group's forward: read it inside "
                                                   r"backward, or keep the group gathered \(reshard_after_forward="):
                act.grad_fn._saved_mat2
        else:
            act.grad_fn._saved_mat2.sum().item()  # (gathered until the backward)
        y.square().mean().backward(retain_graph=True)  # (backward frees what it saved, without retain_graph)
        after = (r"freed after the step's backward \(the group reshards after forward too, so it cannot be read "
                 r"before the backward either\): read it inside the backward, or keep the group gathered after the "
                 r"backward \(reshard_after_backward=False for it\)" if mine else
                 r"freed after the step's backward: read it before or inside the backward, or keep the group "
                 r"gathered \(reshard_after_backward=False for it\)")
        with pytest.raises(RuntimeError, match=r"'blocks.1' .* " + after):
            act.grad_fn._saved_mat2
    stash.clear()


def _changed_since_forward(out: dict, mesh, x) -> None:
    """Parameters changed in place after the forward whose graph a backward then runs (plain torch refuses: "modified
    by an inplace operation"): a retained graph's second backward after ``opt.step()`` (fully_shard with
    reshard_after_forward / reshard_after_backward True and False; apply True and False), and a no_grad edit of a
    parameter between forward and backward (fully_shard, True). 4b67809 (and main before it) gave the gradients of
    the updated parameters, silently: the refill from the changed shards put the freed buffers' versions back. Now
    autograd refuses (the versions stay moved on: GroupBuffers.unmark_freed) or, under apply's saved-tensor hooks,
    funcshard's error names the group."""
    import funcshard
    from models import MLP, Block

    refused = r"modified by an inplace operation|has been modified inplace"
    for rafs in (True, False):
        for rab in (True, False):
            torch.manual_seed(0)
            model = MLP(layers=2)
            for b in model.blocks:
                funcshard.fully_shard(b, mesh=mesh, reshard_after_forward=rafs)
                b.set_reshard_after_backward(rab)
            funcshard.fully_shard(model, mesh=mesh, reshard_after_forward=rafs)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            loss = model(x).square().mean()
            loss.backward(retain_graph=True)
            opt.step()
            with pytest.raises(RuntimeError, match=refused):
                loss.backward()
            opt.zero_grad()
            loss = model(x).square().mean()  # (the next step's forward and backward: unaffected)
            loss.backward()
            out[f"fully_shard {rafs} {rab} retained after step: next step"] = all(
                p.grad is not None and torch.isfinite(p.grad.to_local()).all() for p in model.parameters())
    torch.manual_seed(0)
    model = MLP(layers=2)
    for b in model.blocks:
        funcshard.fully_shard(b, mesh=mesh)
    funcshard.fully_shard(model, mesh=mesh)
    loss = model(x).square().mean()
    with torch.no_grad():
        model.blocks[1].l1.weight.mul_(2)
    with pytest.raises(RuntimeError, match=refused):
        loss.backward()
    for rafs in (True, False):
        torch.manual_seed(0)
        model = MLP(layers=2)
        plan = funcshard.plan(model, mesh, groups=(Block,), reshard_after_forward=rafs)
        state = {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}
        loss = funcshard.apply(plan, state, x).square().mean()
        loss.backward(retain_graph=True)
        with torch.no_grad():
            for v in state.values():
                v.sub_(0.5 * v.grad)
        with pytest.raises(RuntimeError, match=r"funcshard: a tensor autograd saved in the forward of group '.*' "
                           r"is a view .* parameters were modified by an inplace operation since that forward"
                           if rafs else refused):
            loss.backward()
    out["changed since forward: refused"] = True


def _int_reshard_reads() -> dict:
    """``_saved_view_reads`` with an int ``reshard_after_forward`` (2 at W=4: kept sharded over 2 ranks after
    forward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from models import MLP

    torch.manual_seed(0)
    model = MLP(layers=2)
    stash = []
    model.blocks[1].l1.register_forward_hook(lambda m, a, o: stash.append(o))
    x = torch.randn(4, 7)
    full = {k: v.detach() for k, v in model.named_parameters()}
    ref = torch.func.grad(lambda p: (torch.func.functional_call(model, p, (x,)), stash.pop().square().mean())[1])(full)
    out = {}
    _saved_view_reads(out, model, init_device_mesh("cpu", (dist.get_world_size(),)), stash, x, full, ref, (2,))
    return out


def _threads_own_hooks() -> dict:
    """Two threads, each running apply's forward and backward under its own
    ``torch.autograd.graph.saved_tensors_hooks`` (torch keeps a hook stack per thread; apply binds the caller's hooks
    into its own pack hook, functools.partial), both forwards in flight at once (a barrier in a block's forward, after
    both pushed their hooks): each thread's pack hook runs only in its own thread, as often as in a one-thread run,
    its unpack hook gets only what it packed, and the gradients equal the one-thread run's bit for bit. (With the
    caller's hooks in a module global, as before 9d4a77c, one thread's tensors went to the other's hooks.)"""
    import threading

    from torch.distributed.device_mesh import init_device_mesh

    import funcshard
    from models import MLP, Block

    mesh = init_device_mesh("cpu", (1,))
    xs = [torch.randn(4, 7, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    barrier = threading.Barrier(2, timeout=60)
    packed, foreign, grads, errors = [[], []], [[], []], [None, None], []

    def build(threaded: bool) -> tuple:
        torch.manual_seed(0)  # (in this thread: torch's generator is the process's)
        model = MLP(layers=2)
        if threaded:
            model.blocks[0].register_forward_hook(lambda *_: [barrier.wait()] and None)  # (None: the output stays)
        plan = funcshard.plan(model, mesh, groups=(Block,))
        return plan, {k: v.requires_grad_() for k, v in funcshard.shard(plan).items()}

    def run(i: int, plan, state: dict, threaded: bool) -> None:
        me = threading.get_ident()

        def pack(t):
            packed[i].append(threading.get_ident() == me)
            return i, t

        def unpack(p):
            foreign[i].append(p[0] != i)
            return p[1]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = funcshard.apply(plan, state, xs[i])
            if threaded:
                barrier.wait()  # (both forwards done before either backward)
            y.square().mean().backward()
        grads[i] = {k: v.grad for k, v in state.items()}

    for i in range(2):
        run(i, *build(False), False)
    alone, counts = grads[:], [len(p) for p in packed]
    packed, foreign, grads = [[], []], [[], []], [None, None]

    built = [build(True) for _ in range(2)]

    def body(i: int) -> None:
        try:
            run(i, *built[i], True)
        except BaseException as e:  # (reported below, the other thread let go)
            errors.append(f"{type(e).__name__}: {e}")
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {"errors": errors}
    for i in range(2):
        out[f"thread {i} packed its own only"] = len(packed[i]) == counts[i] > 0 and all(packed[i])
        out[f"thread {i} unpacked its own only"] = bool(foreign[i]) and not any(foreign[i])
        out[f"thread {i} gradients"] = grads[i] is not None and all(torch.equal(grads[i][k], alone[i][k])
                                                                    for k in alone[i])
    return out


def test_grad_of_an_inner_activation_only():
    from multirank import run_ranks

    for out in run_ranks(2, _loss_of_an_inner_activation):
        assert all(out.values()), out
    for out in run_ranks(2, _inner_activation_backward):
        assert all(out.values()), out
    for out in run_ranks(4, _int_reshard_reads):
        assert len(out) == 3 and all(out.values()), out


def test_saved_tensor_hooks_of_two_threads():
    from multirank import run_ranks

    (out,) = run_ranks(1, _threads_own_hooks)
    assert out.pop("errors") == [] and len(out) == 6 and all(out.values()), out


# ---- buffers stay the module's own -------------------------------------------------------------------------------


class _WithBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(5, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.bn(self.inp(x)))


def _batchnorm():
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard

    torch.manual_seed(0)
    model = _WithBatchNorm()
    ref = copy.deepcopy(model)
    plan = funcshard.plan(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    state = funcshard.shard(plan)
    x = torch.randn(8, 5) + dist.get_rank()  # each rank its own batch: its own running statistics

    def loss(s):
        return funcshard.apply(plan, s, x).square().mean()

    out = {}
    try:
        torch.func.grad(loss)(state)
        out["func.grad, train mode"] = "no error"
    except RuntimeError as e:
        out["func.grad, train mode"] = str(e)
    out["untouched by the failed call"] = torch.equal(model.bn.running_mean, ref.bn.running_mean)
    funcshard.value_and_grad(loss)(state)  # plain autograd: the module updates its buffers, as on its own
    ref(x)
    out["value_and_grad updates them as the module"] = all(
        torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))
    for m in (model, ref):  # (the ranks' running statistics differ: buffers are not synced)
        m.bn.reset_running_stats()
        m.eval()
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))  # the same on every rank: the local gradient
    got = torch.func.grad(loss)(state)
    want = funcshard.shard(plan, torch.func.grad(lambda p: torch.func.functional_call(ref, p, (x,)).square().mean())(
        {k: v.detach() for k, v in ref.named_parameters()}))
    out["func.grad, eval mode"] = all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    return out


def test_batchnorm_buffers_are_the_modules_own():
    """Buffers are not in state; under torch.func.grad a train-mode BatchNorm failed with torch's generic "mutate a
    captured Tensor" (32e5200): now the error names the buffers and the fix."""
    from multirank import run_ranks

    for out in run_ranks(2, _batchnorm):
        msg = out.pop("func.grad, train mode")
        assert re.search(r"funcshard\.apply: the module updated a tensor in place .*its floating buffers: "
                         r"\['bn\.running_mean', 'bn\.running_var'\].*Buffers are not part of funcshard's state.*"
                         r"Fix: train with funcshard\.value_and_grad or loss\.backward\(\)", msg), msg
        assert all(out.values()), out


# ---- traced_apply under torch.func: right, or refused naming the transform stack (issue 31) -------------------

_TRACED_ROWS = {  # row -> None (right: checked against the unsharded reference); the nested transforms of the
    # state (jvp, vmap, vmap(grad), jvp(grad), jacrev, grad(grad), MAML, double backward): tests/test_transforms.py
    "autograd": None, "grad": None, "vjp": None, "jvp_inputs": None, "vmap_inputs": None, "grad_inputs": None,
    "hessian_inputs": None, "create_graph": None, "grad_penalty": None,
}


def _traced_transforms():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard

    W = dist.get_world_size()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    plan = funcshard.plan(m, init_device_mesh("cpu", (W,)))
    state = funcshard.shard(plan)
    full = {k: v.detach().clone() for k, v in m.named_parameters()}
    x, v = torch.randn(5, 4), torch.randn(5, 4)

    def f(s, xx=x):
        return funcshard.traced_apply(plan, s, xx).pow(2).sum()

    def ref(p, xx=x):
        return torch.func.functional_call(m, p, (xx,)).pow(2).sum()

    def shards(grads):  # the reference's full gradients, sharded as the plan shards: each rank's rows
        return funcshard.shard(plan, grads)

    def autograd():
        s = {k: t.detach().requires_grad_() for k, t in state.items()}
        f(s).backward()
        return {k: t.grad for k, t in s.items()}, shards(torch.func.grad(ref)(full))

    def leaves():
        return {k: t.detach().requires_grad_() for k, t in state.items()}

    def first(s):  # the shard gradients, with create_graph=True
        return torch.autograd.grad(f(s), list(s.values()), create_graph=True)

    def grad_penalty():  # the input gradient's norm, differentiated by the state: first order through the gather
        def penalty(fn, p):
            xx = x.clone().requires_grad_()
            (gx,) = torch.autograd.grad(fn(p, xx), xx, create_graph=True)
            return gx.pow(2).sum()
        s, p = leaves(), {k: t.detach().requires_grad_() for k, t in full.items()}
        penalty(f, s).backward()
        penalty(ref, p).backward()
        return {k: t.grad for k, t in s.items()}, shards({k: t.grad for k, t in p.items()})

    rows = {
        "autograd": autograd,
        "grad": lambda: (torch.func.grad(f)(state), shards(torch.func.grad(ref)(full))),
        "vjp": lambda: (torch.func.vjp(f, state)[1](torch.tensor(1.0)), (shards(torch.func.grad(ref)(full)),)),
        "jvp_inputs": lambda: (torch.func.jvp(lambda xx: f(state, xx), (x,), (v,)),
                               torch.func.jvp(lambda xx: ref(full, xx), (x,), (v,))),
        "vmap_inputs": lambda: (torch.func.vmap(lambda xx: f(state, xx))(torch.stack([x, v])),
                                torch.func.vmap(lambda xx: ref(full, xx))(torch.stack([x, v]))),
        "grad_inputs": lambda: (torch.func.grad(lambda xx: f(state, xx))(x),
                                torch.func.grad(lambda xx: ref(full, xx))(x)),
        "hessian_inputs": lambda: (torch.func.hessian(lambda xx: f(state, xx))(x),
                                   torch.func.hessian(lambda xx: ref(full, xx))(x)),
        "create_graph": lambda: (first(leaves()), list(shards(torch.func.grad(ref)(full)).values())),
        "grad_penalty": grad_penalty,
    }
    out = {}
    for name, row in rows.items():
        try:
            got, want = row()
        except Exception as e:  # (every exception: the test reads which one, and its text)
            out[name] = f"{type(e).__name__}: {e}"
            continue
        got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
        out[name] = len(got) == len(want) > 0 and all(torch.allclose(a, b, atol=1e-5, rtol=1e-5)
                                                       for a, b in zip(got, want))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_traced_apply_transforms_right_or_refused(world):
    """Each row, at W=1 and W=2: the values of the unsharded reference (torch.func.functional_call), or a
    NotImplementedError naming the transform stack and the way out. Before, at W=2: jvp of the state gave a zero
    tangent, a grad of a grad zeros, vmap over stacked states another rank's rows (no error), vmap(grad) and
    jvp(grad) torch's "does not have vmap support" / "must implement the jvp function", and a create_graph
    backward first-order gradients whose derivatives missed the gather."""
    from multirank import run_ranks

    for r in run_ranks(world, _traced_transforms):
        for name, want in _TRACED_ROWS.items():
            got = r[name]
            if want is None:
                assert got is True, (world, name, got)
            else:
                assert isinstance(got, str) and got.startswith("NotImplementedError: ") and re.search(want, got), \
                    (world, name, got)


# ---- bad input named, nothing changed (issue 31) ---------------------------------------------------------------


@pytest.mark.parametrize("edit, match", [
    (lambda p, g: (*p.groups, g(p.groups[1], name="nope", modules=("nope",), params=())),
     r"group 'nope' names modules \['nope'\] that MLP does not have \(known: \[.*\] and 4 more\); name modules by "
     r"their path"),
    (lambda p, g: (p.groups[0], g(p.groups[1], params=(*p.groups[1].params, "blocks.9.weight")), *p.groups[2:]),
     r"names parameters \['blocks\.9\.weight'\] that the plan does not shard .*name parameters by their path"),
    (lambda p, g: p.groups[1:] + p.groups[:1], r"the plan's first group must be the root group"),
    (lambda p, g: (*p.groups, p.groups[1]), r"appear more than once in the plan"),
])
def test_plan_replace_with_groups_that_do_not_exist(fake_mesh2, edit, match):
    """Plan.replace(groups=...) naming a module or parameter the model does not have: before, accepted, and apply
    failed with a raw AttributeError / KeyError inside the step."""
    import dataclasses

    import funcshard
    from models import MLP

    plan = funcshard.plan(MLP(layers=2), fake_mesh2, groups=(torch.nn.Linear,))
    groups = plan.groups
    with pytest.raises(funcshard.ShardingError, match=match):
        plan.replace(groups=edit(plan, dataclasses.replace))
    assert plan.groups == groups


def test_bf16_gradients_for_fp32_parameters():
    """Adam's moments are the params' dtype: bf16 gradients reached torch's "expected dtype float for `end` but got
    dtype c10::BFloat16" in lerp_; now a ValueError naming the leaf, the dtypes and the cast, nothing changed."""
    tx, params = optim.adamw(1e-2), _tree(0)
    opt_state = tx.init(params)
    grads = {k: v.bfloat16() for k, v in _tree(1).items()}
    before = _snapshot([grads, opt_state, params])
    with pytest.raises(ValueError, match=r"adamw: dtype mismatch at \['\w+'\]: grads are torch\.bfloat16 but the "
                                         r"optimizer state .* is torch\.float32\. Fix: give the grads the params' dtype"):
        optim.step(tx, grads, opt_state, params, donate=True)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot([grads, opt_state, params])))


def test_shard_does_not_cast(fake_mesh2):
    """float64 parameters given to a float32 plan were cast to float32 silently; FSDP2 shards a parameter in its own
    dtype (a float64 module stays float64, as funcshard's plan of one does): refused, naming the cast."""
    import funcshard

    m = torch.nn.Linear(4, 3)
    plan = funcshard.plan(m, fake_mesh2)
    full = {k: v.detach().double() for k, v in m.named_parameters()}
    with pytest.raises(funcshard.ShardingError, match=r"(?s)weight: dtype torch\.float64, the plan's is torch\.float32.*"
                                                      r"cast them \(v\.to\(plan\.specs\[k\]\.dtype\)\), or plan a "
                                                      r"module of their dtype"):
        funcshard.shard(plan, full)
    double = funcshard.plan(m.double(), fake_mesh2)
    assert {v.dtype for v in funcshard.shard(double).values()} == {torch.float64}


# ---- a checkpoint's own process group is named alike on every rank -------------------------------------------------


def _save_after_a_group_of_rank_0s_own(path):
    """Rank 0's process holds a process group that rank 1's does not (``new_group([0])``: only its members register it;
    so do groups made over a part of the ranks, by a user or an earlier job of a pooled worker), then both save and
    load a checkpoint. The save's gloo group (``new_group(use_local_synchronization=True)``) got torch's name, a hash
    of its ranks and of how many groups each process holds: two names, and the save hung at the plan's bound (in the
    test suite: test_tp's cross-load after the whole suite)."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import funcshard
    from models import MLP, Block

    own = dist.new_group([0])
    try:
        torch.manual_seed(0)
        plan = funcshard.plan(MLP(layers=2), init_device_mesh("cpu", (2,)), groups=(Block,), timeout=10.0)
        state = funcshard.shard(plan)
        start = time.monotonic()
        funcshard.checkpoint.save(plan, state, checkpoint_id=path)
        seconds = time.monotonic() - start
        back = funcshard.checkpoint.load(plan, path)
        alone = {}
        if dist.get_rank() == 0:  # rank 1 never saves: making the save's group waits for it up to the bound
            for how, bound in (("save", 1.01), ("async_save", 1.02)):  # (bounds no other test's plan has: a rank
                # that made a save group alone is out of step with the other for that key, and hangs its next one)
                small = funcshard.plan(MLP(layers=2), init_device_mesh("cpu", (2,)), groups=(Block,), timeout=bound)
                try:
                    getattr(funcshard.checkpoint, how)(small, funcshard.shard(small), checkpoint_id=f"{path}_{how}")
                except funcshard.CollectiveError as e:
                    alone[how] = str(e)
        return all(torch.equal(back[k], v) for k, v in state.items()), seconds, alone
    finally:
        if dist.get_rank() == 0:
            dist.destroy_process_group(own)


def test_a_save_after_groups_made_on_some_ranks_only(tmp_path):
    """Ranks whose processes hold other process groups save and load (``_save_after_a_group_of_rank_0s_own``); a rank
    whose peer never comes to the save raises a CollectiveError at the plan's bound, naming the checkpoint (it raised
    torch's DistStoreError from making the save's group)."""
    from multirank import run_ranks

    path = str(tmp_path / "ckpt")
    for rank, (same, seconds, alone) in enumerate(run_ranks(2, _save_after_a_group_of_rank_0s_own, path, timeout=60)):
        assert same and seconds < 8.0, (same, seconds)
        assert sorted(alone) == ([] if rank else ["async_save", "save"]), alone
        for how, message in alone.items():
            assert re.match(rf"funcshard: checkpoint save to {re.escape(path)}_{how} failed on this rank "
                            r"\(DistStoreError: .*\): a rank died or stalled during the save", message), message


# ---- a wait never takes a work's lock holding the GIL ------------------------------------------------------------


class _Work:
    """A gloo work as ``wait_work`` sees it; ``is_completed`` is the call that deadlocked."""

    def __init__(self):
        self.waited = []

    def is_completed(self):
        raise AssertionError("is_completed() was called: it holds the GIL while it takes the work's lock")

    def wait(self, timeout=None):
        self.waited.append(timeout)
        return True


def test_a_wait_never_holds_the_gil_on_the_works_lock():
    """bench.py hung in 2 of 4 runs (fs_apply's step under torch.profiler, W=2 and 4): a gloo thread finishing an
    all-gather held the work's lock and waited for the GIL (under the profiler its end callback restores the issuing
    thread's saved-tensor hooks, apply's: Python objects), while the main thread held the GIL in
    ``work.is_completed()``, waiting for that lock (py-spy --native). ``wait_work`` now waits with ``wait`` (it lets
    go of the GIL)."""
    from datetime import timedelta

    from funcshard._collectives import Bound, Where, wait_work

    class PG:  # (a process group that waits on the host, as gloo's)
        pass

    bound = Bound(PG(), 5.0, "a test plan", "funcshard.apply")
    for kind, waited in [("all-gather", [timedelta(seconds=5)]), ("re-gather", [timedelta(seconds=5)]),
                         ("reduce-scatter", [None])]:  # (the reduce-scatter's in the _Waiter thread)
        work = _Work()
        wait_work(work, Where(kind, "blocks.0", "backward", bound))
        assert work.waited == waited, kind

    class Wrapping(_Work):  # (FutureWrappingWork, torch's threaded test group: no finite-timeout wait)
        def wait(self, timeout=None):
            if timeout is not None:
                raise RuntimeError("FutureWrappingWork::wait() with finite timeout not implemented")
            return super().wait(timeout)

    for work, waited in [(Wrapping(), [None])]:  # (in the _Waiter thread)
        wait_work(work, Where("all-gather", "blocks.0", "forward", bound))
        assert work.waited == waited, type(work).__name__
