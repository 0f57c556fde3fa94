"""Start-up (issue 36): ``import funcshard`` imports the core planning needs, not torch._dynamo, torch's
distributed checkpoint (DCP), torch.distributed.fsdp, triton or torch's flop counter; the public names imported on
first read resolve to the objects of their modules. One fresh interpreter (benchmarks/STARTUP.md has the times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ["torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.utils.flop_counter", "triton",
         "torch._inductor"]

CHILD = r"""
import json, sys
import funcshard
from torch import nn
heavy = %r
out = {"import": [m for m in heavy if m in sys.modules]}
mesh = funcshard.cost.fake_mesh(4)
p = funcshard.plan(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), mesh)
out["plan"] = [m for m in heavy if m in sys.modules]
out["plan_ok"] = type(p).__name__
out["dir"] = sorted(set(funcshard.__all__) - set(dir(funcshard)))
try:
    funcshard.no_such_name
except AttributeError as e:
    out["missing"] = str(e)
import funcshard._apply, funcshard._shard, funcshard.fsdp
from funcshard import checkpoint, value_and_grad
out["same"] = [funcshard.apply is funcshard._apply.apply, funcshard.shard is funcshard._shard.shard,
               funcshard.fully_shard is funcshard.fsdp.fully_shard, checkpoint is sys.modules["funcshard.checkpoint"],
               value_and_grad is funcshard.value_and_grad, "apply" in vars(funcshard),
               funcshard.DataParallelMeshDims is (getattr(sys.modules["torch.distributed.fsdp"], "DataParallelMeshDims",
                                                          None) or funcshard._mesh._DataParallelMeshDims),
               funcshard.fsdp.DataParallelMeshDims is funcshard.DataParallelMeshDims]
# any submodule read as an attribute is imported when read (as when the package imported them all)
out["submodules"] = ["funcshard._checkpoint_init" not in sys.modules,
                     funcshard._checkpoint_init is sys.modules["funcshard._checkpoint_init"],
                     funcshard._schedule is sys.modules["funcshard._schedule"], not hasattr(funcshard, "__nope__")]
print(json.dumps(out))
"""


def test_import_funcshard_leaves_out_dynamo_and_dcp():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", CHILD % (HEAVY,)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["import"] == [], f"import funcshard imports {out['import']}"
    # the cost model's fake mesh and a plan: still none of them (the flop counter is the cost model's trace's)
    assert out["plan"] == [], f"funcshard.plan imports {out['plan']}"
    assert out["plan_ok"] == "Plan"
    assert out["dir"] == [], f"names of funcshard.__all__ missing from dir(funcshard): {out['dir']}"
    assert out["missing"] == "module 'funcshard' has no attribute 'no_such_name'"
    assert out["same"] == [True] * 8, out["same"]
    assert out["submodules"] == [True] * 4
