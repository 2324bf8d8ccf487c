"""Compiled vs eager on 4 gloo ranks: the largest relative gradient difference after
one step, zero2/zero3 x AC none/selective/full, bf16 params / fp32 reduction.

    .venv/bin/python scripts/compile_check.py tp      # dp 2 x tp 2, whole model compiled
    .venv/bin/python scripts/compile_check.py hsdp    # 2 x 2 HSDP, each block compiled
    .venv/bin/python scripts/compile_check.py ddp     # 4-way replicate, each block compiled

About 80 s each. Not in the suite: compiling on 4 CPU ranks is slow.
"""
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.tools.llama import Llama, apply_tp
from tests.harness import launch, result, run_cases
from tests.test_checkpoint import CFG, _tokens

MP = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32)


def case(which, mesh, dp_rank):
    out = {}
    for reshard in (False, True):
        for ac in ("none", "selective", "full"):
            grads = []
            for compiled in (False, True):
                torch._dynamo.reset()
                torch.manual_seed(0)
                model = Llama(CFG)
                model.init_weights()
                if which == "tp":
                    apply_tp(model, mesh["tp"])
                fsdptag.parametrize(model, mesh, mode="replicate" if which == "ddp" else None,
                                    reshard_after_forward=reshard, mp_policy=MP)
                fsdptag.apply_ac(model, ac)
                if compiled and which == "tp":
                    model = torch.compile(model, backend="aot_eager")
                elif compiled:
                    for block in model.layers:
                        block.compile(backend="aot_eager")
                tokens = _tokens(dp_rank)
                F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten()).backward()
                grads.append([p.grad.to_local().clone() for p in model.parameters()])
            out[f"zero{3 if reshard else 2} {ac}"] = max(
                ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(*grads))
    return out


def worker(which):
    if which == "tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh["dp"].get_local_rank()
    elif which == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        dp_rank = dist.get_rank()
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("replicate",))
        dp_rank = dist.get_rank()
    return run_cases({"x": functools.partial(case, which, mesh, dp_rank)})


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "tp"
    if which not in ("tp", "hsdp", "ddp"):
        sys.exit(f"usage: {sys.argv[0]} tp|hsdp|ddp")
    out = launch(4, worker, which, timeout_s=300)
    for k, v in result(out, "x").items():
        print(f"{which} {k}: max relative gradient difference {v:.1e}")
