"""Short fsdptag training run on CPU ranks: per-step loss and collective counts.

    torchrun --nproc-per-node 2 examples/train.py [--mode fully_shard] [--reshard-after-forward true] [--mp bf16]

(or ``bash scripts/demo.sh``, which sets up .venv first). Uses gloo on CPU,
NCCL when CUDA is available.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.debug import CollectiveCounter, LiveStorageTracker


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="fully_shard", choices=[m.value for m in fsdptag.DataParallelMode])
    p.add_argument("--reshard-after-forward", default="true", choices=["true", "false"])
    p.add_argument("--mp", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = (world // 2, 2) if args.mode == "hybrid_shard" else (world,)
    names = ("replicate", "shard") if args.mode == "hybrid_shard" else ("dp",)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)

    torch.manual_seed(0)
    vocab = 128
    model = Model(vocab, args.dim, args.layers).to(device)
    mp = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if args.mp == "bf16" else None
    fsdptag.parametrize(model, mesh, mode=args.mode,
                        reshard_after_forward=args.reshard_after_forward == "true", mp_policy=mp)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # A fixed synthetic task: predict the next token of a repeating sequence.
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        start = torch.randint(0, vocab, (8, 1), generator=g)
        seq = ((start + torch.arange(17)) % vocab).to(device)
        with CollectiveCounter(mesh) as cc:
            with LiveStorageTracker() as mem:
                logits = model(seq[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())
            kept = mem.live_bytes()  # bytes allocated in forward, still alive for backward
            loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            fwd = cc.count("forward", "all_gather")
            bwd_ag = cc.count("backward", "all_gather")
            bwd_red = cc.count("backward", "reduce_scatter") + cc.count("backward", "all_reduce")
            print(f"step {step}  loss {loss.item():.4f}  all-gathers fwd {fwd} bwd {bwd_ag}  "
                  f"reductions bwd {bwd_red}  kept for backward {kept / 1024:.1f} KiB")
    if rank == 0:
        print(f"done: mode={args.mode} reshard_after_forward={args.reshard_after_forward} "
              f"mp={args.mp} world={world}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
