"""Train a small Llama-3-style decoder with fsdptag on synthetic tokens.

    torchrun --nproc-per-node 2 examples/train_llama.py
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 2 --ac selective --reshard-after-forward false --mp bf16

(``bash scripts/demo.sh`` sets up .venv and runs the first line.) gloo on CPU,
NCCL when CUDA is present. Per step it prints the loss, tokens/s, the FSDP and
TP collectives of forward and backward, the bytes forward kept for backward and
the peak bytes of the step (tracked storages; on CUDA, the allocator's peak).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.debug import CollectiveCounter, LiveStorageTracker
from fsdptag.testing.llama import Llama, LlamaConfig, apply_tp


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp-mode", default="fully_shard", choices=[m.value for m in fsdptag.DataParallelMode])
    p.add_argument("--reshard-after-forward", default="true", choices=["true", "false"])
    p.add_argument("--ac", default="none", choices=[m.value for m in fsdptag.ACMode])
    p.add_argument("--ac-layer-every", type=int, default=None,
                   help="with --ac selective: full AC on every Nth block (layer-selective AC)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (sequence parallel)")
    p.add_argument("--mp", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--bucket", default="blocks", choices=["blocks", "param", "module"],
                   help="gather buckets: per transformer block + root, per parameter, or per module")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_mesh(device_type: str, world: int, dp_mode: str, tp: int):
    if world % tp:
        raise SystemExit(f"--tp {tp} must divide the world size {world}")
    dp = world // tp
    if dp_mode == "hybrid_shard":
        if dp % 2:
            raise SystemExit(f"hybrid_shard needs an even data-parallel size, got {dp}")
        shape, names = (2, dp // 2), ("replicate", "shard")
    else:
        shape, names = (dp,), ("dp",)
    if tp > 1:
        shape, names = shape + (tp,), names + ("tp",)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    dp_names = names[:-1] if tp > 1 else names
    dp_mesh = mesh[dp_names] if tp > 1 else mesh
    dp_rank = dp_mesh._flatten().get_local_rank() if dp_mesh.ndim > 1 else dp_mesh.get_local_rank()
    return mesh, dp_rank, dp


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh, dp_rank, dp = build_mesh(device.type, world, args.dp_mode, args.tp)

    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      vocab_size=args.vocab, ffn_hidden=int(args.dim * 8 / 3 // 8 * 8) or 8,
                      max_seq_len=args.seq_len)
    with torch.device(device):
        model = Llama(cfg)
    model.init_weights(args.seed)
    if args.tp > 1:
        apply_tp(model, mesh["tp"])
    mp = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if args.mp == "bf16" else None
    fsdptag.parametrize(model, mesh, mode=args.dp_mode, mp_policy=mp, bucket=args.bucket,
                        reshard_after_forward=args.reshard_after_forward == "true")
    fsdptag.apply_ac(model, args.ac, layer_every=args.ac_layer_every)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # Synthetic task: continue an arithmetic sequence of tokens (learnable, deterministic).
    g = torch.Generator().manual_seed(1000 + dp_rank)
    tp_name = "tp" if args.tp > 1 else None
    times = []
    for step in range(args.steps):
        start = torch.randint(0, cfg.vocab_size, (args.batch, 1), generator=g)
        stride = torch.randint(1, 4, (args.batch, 1), generator=g)
        seq = ((start + stride * torch.arange(args.seq_len + 1)) % cfg.vocab_size).to(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with CollectiveCounter(mesh) as cc, LiveStorageTracker(track_peak=not cuda) as mem:
            logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())
            kept = mem.live_bytes()
            loss.backward()
            optim.step()
            optim.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        times.append(elapsed)
        peak = torch.cuda.max_memory_allocated() if cuda else mem.peak_bytes

        def n(phase, kind, group_is_tp):
            return sum(1 for e in cc.events if e.phase == phase and e.kind == kind
                       and (e.group == tp_name) == group_is_tp)

        if rank == 0:
            print(
                f"step {step}  loss {loss.item():.4f}  tok/s {args.batch * dp * args.seq_len / elapsed:8.0f}  "
                f"FSDP ag fwd/bwd {n('forward', 'all_gather', False)}/{n('backward', 'all_gather', False)}  "
                f"TP ag fwd/bwd {n('forward', 'all_gather', True)}/{n('backward', 'all_gather', True)}  "
                f"kept {kept / 2**10:.0f} KiB  peak {peak / 2**20:.2f} MiB",
                flush=True,
            )
    if rank == 0:
        print(
            f"summary: {args.dp_mode} world={world} tp={args.tp} reshard_after_forward="
            f"{args.reshard_after_forward} ac={args.ac} mp={args.mp}  final loss {loss.item():.4f}  "
            f"median step {statistics.median(times) * 1e3:.0f} ms (instrumented)"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
