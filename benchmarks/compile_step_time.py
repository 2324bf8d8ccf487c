"""Step time: compiled fsdptag vs eager fsdptag vs FSDP2 (eager and compiled per block).

    .venv/bin/python benchmarks/compile_step_time.py [--dim 256 --layers 4 --steps 6 --backend inductor]

2 gloo ranks on CPU (``--device cuda``: 2 NCCL ranks, one GPU each), bf16 compute / fp32 reduce, zero2 + selective AC and zero3 without
AC. Blocks are compiled one by one (torchtitan style). Prints the median step time of
the steps after the first two (compilation and warm-up), its ratio to eager fsdptag,
and the losses of the last step, which must agree between fsdptag eager and compiled.
Bytes kept are not measured here: the live-storage tracker is a dispatch mode, under
which dynamo does not compile.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MP, fully_shard

import fsdptag
from fsdptag.tools.baselines import apply_baseline_ac
from fsdptag.testing.launch import rank_device, spawn
from fsdptag.tools.llama import Llama, LlamaConfig

MP = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32)


def _model(cfg, mesh, variant, reshard, ac, backend):
    torch.manual_seed(0)
    model = Llama(cfg)
    model.init_weights()
    model.to(mesh.device_type)
    if variant.startswith("fsdp2"):
        mp = FSDP2MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if ac != "none":
            apply_baseline_ac(model, ac, policy="no-fix")
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    else:
        fsdptag.parametrize(model, mesh, reshard_after_forward=reshard, mp_policy=MP)
        fsdptag.apply_ac(model, ac)
    if variant.endswith("compiled"):
        for block in model.layers:
            block.compile(backend=backend)
    return model


def _worker(cfg, steps, batch, backend):
    mesh = init_device_mesh(rank_device().type, (2,))
    cuda = mesh.device_type == "cuda"
    rank = mesh.get_local_rank()
    out = {}
    for reshard, ac in ((False, "selective"), (True, "none")):
        for variant in ("fsdptag eager", "fsdptag compiled", "fsdp2 eager", "fsdp2 compiled"):
            torch._dynamo.reset()
            model = _model(cfg, mesh, variant, reshard, ac, backend)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
            times, loss = [], None
            for step in range(steps):
                g = torch.Generator().manual_seed(1000 * step + rank)
                tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g).to(rank_device())
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
                loss.backward()
                optim.step()
                optim.zero_grad()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            out[(f"zero{3 if reshard else 2} ac={ac}", variant)] = (
                statistics.median(times[2:]), times[0], loss.item())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: gloo; cuda: NCCL, one GPU per rank")
    a = p.parse_args()
    cfg = LlamaConfig(dim=a.dim, n_layers=a.layers, n_heads=8, n_kv_heads=4, vocab_size=512,
                      ffn_hidden=4 * a.dim, max_seq_len=a.seq_len)
    rows = spawn(2, _worker, cfg, a.steps, a.batch, a.backend, device=a.device)
    print(f"dim {a.dim}, {a.layers} layers, batch {a.batch} x {a.seq_len}, backend {a.backend}, 2 {'NCCL ranks on GPUs' if a.device == 'cuda' else 'gloo ranks on CPU'}")
    print(f"{'setting':<22}{'variant':<18}{'step ms':>9}{'vs eager':>10}{'1st step s':>12}  last loss")
    for (setting, variant), (median, first, loss) in rows.items():
        base = rows[(setting, "fsdptag eager")][0]
        print(f"{setting:<22}{variant:<18}{median * 1e3:>9.1f}{median / base:>10.2f}{first:>12.1f}  {loss:.6f}")


if __name__ == "__main__":
    main()
