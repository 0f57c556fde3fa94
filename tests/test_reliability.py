"""Reliability (issue 21): a call that fails leaves everything as it was; bad settings fail with a clear error
naming what is wrong and the fix; nothing outlives its step."""

from __future__ import annotations

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
