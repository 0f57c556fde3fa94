"""torchtitan 0.3.0's own FSDP recipe on its llama3 debug model, with funcshard's ``fully_shard`` swapped in.

``torchtitan.distributed.fsdp.apply_fsdp_to_decoder`` is called unchanged: bf16 parameters, fp32 reduction,
``cast_forward_inputs=False``, a grouped ``[norm, lm_head]`` unit that stays unsharded after forward, every block
its own unit, the root last, and the gradient divide disabled (``set_gradient_divide_factor(1.0)`` on every
``FSDPModule``; torchtitan divides the loss by the global token count itself). The swap is the one a user makes:
the module's ``fully_shard`` and ``FSDPModule`` names bound to funcshard's. On CPU FlexAttention has no backward,
so the blocks use causal SDPA (torchtitan's own ``ScaledDotProductAttention``).

torchtitan is a test dependency (``pip install -e '.[dev]'``); on a CPU build of torch it also needs ``triton``
(its package imports it). The test trains 5 steps of AdamW at W = 2 with torch's FSDP2 and with funcshard on the
same seeds and batches: the losses and the final parameters are bit-identical (~10 s).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F

import funcshard
from multirank import run_ranks
from test_fsdp import _local, _mesh

titan_fsdp = pytest.importorskip("torchtitan.distributed.fsdp", reason="pip install -e '.[dev]' installs torchtitan")

VOCAB, SEQ, BATCH, STEPS = 2048, 32, 2, 5


def _model():
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    model.init_states()
    for block in model.layers.values():  # FlexAttention has no backward on CPU: causal SDPA
        block.attention.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
    return model


def _train(system):
    """Shard with torchtitan's recipe under ``system`` (torch's FSDP2 or funcshard); losses and full parameters."""
    model = _model()
    saved = titan_fsdp.fully_shard, titan_fsdp.FSDPModule
    titan_fsdp.fully_shard, titan_fsdp.FSDPModule = system.fully_shard, system.FSDPModule
    try:
        titan_fsdp.apply_fsdp_to_decoder(model, _mesh(), param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         pp_enabled=False)
    finally:
        titan_fsdp.fully_shard, titan_fsdp.FSDPModule = saved
    units = [m for m in model.modules() if isinstance(m, system.FSDPModule)]
    for m in units:  # FSDP2 reduces with a divide factor of 1.0 by PREMUL_SUM, which gloo lacks: a plain sum
        m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4)
    losses = []
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)  # one batch per rank, learnt step by step
    for _ in range(STEPS):
        logits = model(tokens[:, :-1])
        # divided by the global token count, as torchtitan does when the FSDP divide is disabled
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        (loss / (BATCH * SEQ * dist.get_world_size())).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: _local(p).detach() for k, p in model.named_parameters()}, len(units), logits.dtype


def _both():
    ref_losses, ref, ref_units, ref_dtype = _train(torch_fsdp)
    losses, got, units, dtype = _train(funcshard)
    return (ref_losses, losses, max((ref[k].float() - got[k].float()).abs().max().item() for k in ref),
            {k: v.dtype for k, v in ref.items()} == {k: v.dtype for k, v in got.items()}, (ref_units, units),
            (ref_dtype, dtype))


def test_apply_fsdp_to_decoder_llama3_debugmodel_matches_fsdp2():
    for ref_losses, losses, param_diff, same_dtypes, units, dtypes in run_ranks(2, _both, timeout=300):
        assert units == (10, 10)  # the embedding, 6 blocks, norm and lm_head (one grouped unit), the root
        assert dtypes == (torch.bfloat16, torch.bfloat16)  # lm_head's output in param_dtype (no output_dtype)
        assert losses == ref_losses and ref_losses[-1] < ref_losses[0]
        assert param_diff == 0 and same_dtypes
