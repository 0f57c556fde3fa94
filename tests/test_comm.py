"""Issue 19's extension points: FSDP2's custom comms (``set_custom_all_gather`` / ``set_custom_reduce_scatter``),
the all-reduce hook and ``set_requires_all_reduce(False)`` on a 1-D mesh, the tensor-subclass all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) and funcshard's functional comm hooks (``CommHook``).

Parity with torch's FSDP2 is bit for bit: the same comm objects (counting their calls, allocations and bytes) see the
same buffers; FSDP2 asks a custom reduce-scatter for ``op=AVG`` (gloo: the sum, then a divide by the group size in the
same dtype), funcshard for ``op=SUM`` and divides once after: the same bits at W=2 (an exact divide).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp

import funcshard
from models import MLP
from multirank import run_ranks
from test_fsdp import _fit, _mesh, _nested

try:  # FSDP2's comm protocols (torch 2.9+)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover (torch < 2.9)
    AllGather = ReduceScatter = None

needs_protocols = pytest.mark.skipif(AllGather is None or not hasattr(torch_fsdp.FSDPModule, "set_custom_all_gather"),
                                     reason="this torch's FSDP2 has no AllGather / ReduceScatter comm protocols")


# ---- FSDP2's custom comms -----------------------------------------------------------------------------------------


def _counting(base):
    class Counting(base):
        """Runs the collective with torch.distributed and counts what it was given."""

        def __init__(self):
            self.calls, self.allocs = [], []

        def allocate(self, size, *, dtype, device):
            self.allocs.append((tuple(size), dtype))
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
            self.calls.append((tuple(output_tensor.shape), tuple(input_tensor.shape), output_tensor.dtype,
                               output_tensor.numel() * output_tensor.element_size()))
            if op is None:
                return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return Counting


def _custom_comms(fs, mesh):
    torch.manual_seed(0)
    model = _nested(fs, MLP(layers=3), mesh)
    comms = []
    for m in (model, *model.blocks):
        ag, rs = _counting(AllGather)(), _counting(ReduceScatter)()
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
        comms.append((ag, rs))
    numbers, params = _fit(model, steps=3)
    return numbers, params, [(ag.calls, ag.allocs, rs.calls, rs.allocs) for ag, rs in comms]


def _hooks_1d(fs, mesh):  # the all-reduce hook after the reduce-scatter; set_requires_all_reduce(False): no effect
    torch.manual_seed(0)
    model = _nested(fs, MLP(layers=3), mesh)
    for m in (model, *model.blocks):
        m.set_all_reduce_hook(lambda t: t.mul_(0.5))
    numbers, params = _fit(model, steps=3, micro=2, each=lambda m, s, k: m.set_requires_all_reduce(k == 1))
    return numbers, params, None


def _parity(scenario):
    mesh = _mesh()
    n_ref, s_ref, c_ref = scenario(torch_fsdp, mesh)
    n_got, s_got, c_got = scenario(funcshard, mesh)
    return (n_ref == n_got, max((s_ref[k] - s_got[k]).abs().max().item() for k in s_ref), c_ref == c_got,
            c_got)


@needs_protocols
def test_custom_comms_match_fsdp2_bit_for_bit():
    for same_losses, param_diff, same_comms, comms in run_ranks(2, _parity, _custom_comms):
        assert same_losses and param_diff == 0.0
        assert same_comms, comms
        root_ag, _, root_rs, _ = comms[0]
        # the root is gathered once (kept for backward); each block twice (forward, backward), 3 steps
        assert len(root_ag) == 3 and all(len(c[0]) == 6 and len(c[2]) == 3 for c in comms[1:])
        assert len(root_rs) == 3


def test_all_reduce_hook_and_requires_all_reduce_on_1d_mesh_match_fsdp2():
    for same_losses, param_diff, _, _ in run_ranks(2, _parity, _hooks_1d):
        assert same_losses and param_diff == 0.0


def _bad_comm():
    model = _nested(funcshard, MLP(layers=1), _mesh())
    with pytest.raises(TypeError, match=r"Block: set_custom_all_gather\(function\): expects an object with FSDP2's "
                                        r"AllGather protocol"):
        model.blocks[0].set_custom_all_gather(lambda out, inp, group, async_op=False: None)
    return True


def test_custom_comm_without_the_protocol_is_refused():
    assert run_ranks(2, _bad_comm) == [True, True]
