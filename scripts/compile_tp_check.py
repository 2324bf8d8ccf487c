"""dp 2 x tp 2 (4 gloo ranks), whole-model compile (aot_eager) vs eager: the largest
relative gradient difference after one step, zero2/zero3 x AC none/selective/full.

    .venv/bin/python scripts/compile_tp_check.py     # about 80 s
"""
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from tests.harness import launch, run_cases, result
from tests.test_checkpoint import CFG, _tokens
from fsdptag.testing.llama import Llama, apply_tp
import fsdptag
MP = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
def case(mesh, dp_rank):
    out = {}
    for reshard in (False, True):
        for ac in ("none", "selective", "full"):
            grads = []
            for compiled in (False, True):
                torch._dynamo.reset(); torch.manual_seed(0)
                model = Llama(CFG); model.init_weights(); apply_tp(model, mesh["tp"])
                fsdptag.parametrize(model, mesh, reshard_after_forward=reshard, mp_policy=MP)
                fsdptag.apply_ac(model, ac)
                if compiled: model = torch.compile(model, backend="aot_eager")
                tokens = _tokens(dp_rank)
                F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten()).backward()
                grads.append([p.grad.to_local().clone() for p in model.parameters()])
            out[f"zero{3 if reshard else 2} {ac}"] = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(*grads))
    return out
def worker():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return run_cases({"x": functools.partial(case, mesh, mesh["dp"].get_local_rank())})
if __name__ == "__main__":
    out = launch(4, worker, timeout_s=300)
    for k, v in result(out, "x").items(): print(k, "max rel grad diff", v)
