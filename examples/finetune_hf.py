"""Fine-tune a Hugging Face causal LM with fsdptag and Hugging Face's own checkpointing.

    .venv/bin/torchrun --nproc-per-node 2 examples/finetune_hf.py --steps 20 --checkpoint-dir /tmp/ft
    .venv/bin/torchrun --nproc-per-node 2 examples/finetune_hf.py --steps 30 --checkpoint-dir /tmp/ft   # resumes at 20
    .venv/bin/torchrun --nproc-per-node 2 examples/finetune_hf.py --model-dir ./my-llama --save-pretrained ./out
    torchrun --nproc-per-node 8 examples/finetune_hf.py --device cuda      # NCCL, one GPU per rank

The model comes from a small ``LlamaConfig`` (or ``--model-dir``, a local directory
``from_pretrained`` reads: nothing is downloaded). Data: the bytes of a text file
(``--data``, default: this program's own source), as tokens of a 256-token vocabulary.
Each step prints loss and backward FSDP all-gathers (0 for zero2, also under
``activation_checkpointing_enable()``) on a progress bar. ``--checkpoint-dir`` saves
model and optimizer with DCP every ``--checkpoint-every`` steps and resumes from the
newest one; ``--save-pretrained`` writes a ``from_pretrained`` directory:
``save_pretrained`` on every rank gathers the full state dict and writes it from rank 0.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import fsdptag
from fsdptag.debug import CollectiveCounter


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None, help="a local from_pretrained directory (default: a small config)")
    p.add_argument("--data", default=__file__, help="a text file; its bytes are the tokens")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reshard-after-forward", default="false", choices=["true", "false"])
    p.add_argument("--mp", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--ac", default="hf", choices=["none", "hf", "full", "selective"],
                   help="hf: model.activation_checkpointing_enable(); full/selective: fsdptag.apply_ac")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--save-pretrained", default=None, help="write a from_pretrained directory at the end")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo; cuda: NCCL, the GPU of LOCAL_RANK (default when CUDA is present)")
    return p.parse_args()


def build_model(args) -> LlamaForCausalLM:
    if args.model_dir:
        return LlamaForCausalLM.from_pretrained(args.model_dir)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=args.seq_len,
        bos_token_id=0, eos_token_id=0, use_cache=False))


def batches(path: str, seq_len: int, batch: int, rank: int, world: int, start: int):
    """Step ``start``, ``start + 1``, ...: this rank's (batch, seq_len + 1) windows of the file's bytes."""
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if data.numel() < seq_len + 2:
        raise ValueError(f"--data {path!r} has {data.numel()} bytes; it needs at least {seq_len + 2}")
    step = start
    while True:
        g = torch.Generator().manual_seed(step * world + rank)
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=g)
        yield step, torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
        step += 1


def newest_checkpoint(root: str) -> tuple[int, str] | None:
    done = [d for d in os.listdir(root) if d.startswith("step-") and os.path.exists(os.path.join(root, d, ".metadata"))]
    if not done:
        return None
    step = max(int(d.removeprefix("step-")) for d in done)
    return step, os.path.join(root, f"step-{step}")


def main() -> None:
    args = parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    model = build_model(args).to(device)
    mp = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if args.mp == "bf16" else None
    fsdptag.parametrize(model, mesh, reshard_after_forward=args.reshard_after_forward == "true", mp_policy=mp)
    model.train()
    if args.ac == "hf":
        model.activation_checkpointing_enable()
    elif args.ac != "none":
        fsdptag.apply_ac(model, args.ac)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)

    start = 0
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        found = newest_checkpoint(args.checkpoint_dir)
        if found is not None:
            start, path = found
            with fsdptag.disable_active_parametrization():  # name lookups would gather each parameter
                model_sd, optim_sd = get_state_dict(model, optim)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=path)
                set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
            if rank == 0:
                print(f"resumed from {path}")

    data = batches(args.data, args.seq_len, args.batch, rank, world, start)
    bar = tqdm(range(start, args.steps), disable=rank != 0, desc="fine-tune")
    for _ in bar:
        step, tokens = next(data)
        tokens = tokens.to(device)
        with CollectiveCounter(mesh) as cc:
            loss = model(tokens[:, :-1], labels=tokens[:, :-1].clone()).loss
            loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.4f}", bwd_fsdp_ag=cc.count("backward", "all_gather", fsdp_tagged=True))
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            with fsdptag.disable_active_parametrization():
                model_sd, optim_sd = get_state_dict(model, optim)
            dcp.save({"model": model_sd, "optim": optim_sd},
                     checkpoint_id=os.path.join(args.checkpoint_dir, f"step-{step + 1}"))
    if rank == 0:
        print(f"final loss {loss.item():.4f}" if args.steps > start else "nothing to train")

    if args.save_pretrained:
        model.save_pretrained(args.save_pretrained)  # every rank: gathers the full state dict, rank 0 writes
        if rank == 0:
            print(f"saved {args.save_pretrained} (from_pretrained reads it)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
