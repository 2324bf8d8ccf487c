"""A Hugging Face Llama under each way of checkpointing it: fsdptag vs FSDP2.

    .venv/bin/python benchmarks/hf_checkpointing.py [--world 2]

2 gloo ranks, transformers' LlamaForCausalLM from a config (hidden 64, 2 layers,
vocab 256, seq 32, batch 2 per rank), bf16 params / fp32 reduction, one measured
step after a warm-up. Per checkpointing path and zero2 / zero3: FSDP all-gathers in
forward / backward and the bytes forward keeps for backward (rank 0), for fsdptag
(``parametrize``, default block buckets) and FSDP2 (``fully_shard`` per decoder
layer + root).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision, fully_shard
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM

import fsdptag
from fsdptag.debug import CollectiveCounter, LiveStorageTracker
from fsdptag.testing.launch import rank_device, spawn

PATHS = ("none", "plain", "reentrant", "hf default", "hf reentrant", "fsdptag full", "fsdptag selective")


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0, use_cache=False))


def _checkpoint(model, path: str) -> None:
    if path in ("plain", "reentrant"):
        for layer in model.model.layers:
            forward = layer.forward
            layer.forward = (lambda f: lambda *a, **k: checkpoint(  # kwargs as HF passes them
                functools.partial(f, **k), *a, use_reentrant=path == "reentrant"))(forward)
    elif path.startswith("hf"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": True} if path == "hf reentrant" else None)
    elif path.startswith("fsdptag"):
        fsdptag.apply_ac(model, path.removeprefix("fsdptag "))


def _step(model, mesh, tokens):
    with CollectiveCounter(mesh) as cc:
        with LiveStorageTracker(track_inputs=True, settle_collectives=True) as mem:
            logits = model(tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            del logits
        at_forward_end = mem.live_bytes()
        loss.backward()
        del loss
    for p in model.parameters():
        p.grad = None
    return cc.count("forward", "all_gather"), cc.count("backward", "all_gather"), at_forward_end - mem.live_bytes()


def _worker():
    world = torch.distributed.get_world_size()
    device = rank_device()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(mesh.get_local_rank())
    tokens = torch.randint(0, 256, (2, 33), generator=g).to(device)
    rows = []
    for reshard in (False, True):
        for path in PATHS:
            cells = []
            for impl in ("fsdptag", "fsdp2"):
                model = _model().to(device)
                model.train()
                if impl == "fsdptag":
                    fsdptag.parametrize(model, mesh, reshard_after_forward=reshard,
                                        mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32))
                else:
                    mp = FSDP2MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                    for layer in model.model.layers:
                        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
                    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
                _checkpoint(model, path)
                _step(model, mesh, tokens)  # warm-up
                cells.append(_step(model, mesh, tokens))
            rows.append((3 if reshard else 2, path, *cells))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: gloo; cuda: NCCL, one GPU per rank")
    args = p.parse_args()
    rows = spawn(args.world, _worker, device=args.device)
    print("| zero | checkpointing | fsdptag all-gathers fwd/bwd | fsdptag kept B | FSDP2 all-gathers fwd/bwd | FSDP2 kept B |")
    print("|---|---|---|---|---|---|")
    for zero, path, (f1, b1, k1), (f2, b2, k2) in rows:
        print(f"| {zero} | {path} | {f1}/{b1} | {k1} | {f2}/{b2} | {k2} |")


if __name__ == "__main__":
    main()
