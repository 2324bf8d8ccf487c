"""Train a small Llama-3-style decoder with fsdptag on real text; checkpoint, survive faults, resume.

    torchrun --nproc-per-node 2 examples/train_llama.py
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 2 --ac selective --reshard-after-forward false --mp bf16
    torchrun --nproc-per-node 2 --max-restarts 1 examples/train_llama.py --steps 40 \\
        --checkpoint-dir /tmp/run --checkpoint-every 10 --fault exit@25 --state-digest /tmp/run.json

(``bash scripts/demo.sh`` sets up .venv and runs the first line with ``--steps 8``.)
gloo on CPU, NCCL when CUDA is present.

Data (``examples/_data.py``): a byte-level language model (vocabulary 256) of
``--data FILE``, by default of Python standard-library sources that ship with
Python; the last ``--val-fraction`` is held out and its loss printed every
``--eval-every`` steps and at the end. The data order is a function of
``(--seed, step)``. Per step it prints a progress bar, the loss (mean over ranks),
tokens/s, the FSDP and TP collectives of forward and backward, the bytes forward
kept for backward and the peak bytes of the step (tracked storages; on CUDA, the
allocator's peak); ``--plot loss.png`` draws the curves (needs matplotlib).

Checkpoints (``examples/_checkpointing.py``): ``--checkpoint-dir DIR`` saves model,
optimizer, data position and RNG state with DCP every ``--checkpoint-every`` steps
and at the end (``--checkpoint-mode async`` by default), keeps the last
``--keep-last``, and on start resumes from the newest complete one, also on another
number of ranks or TP degree (keep ``--batch`` x data-parallel ranks). ``--fault`` injects a crash (``examples/_faults.py``),
``--state-digest`` writes a sha256 of every parameter and optimizer state for
comparing runs bit for bit. docs/training.md walks through a killed and resumed run.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdptag
from fsdptag.debug import CollectiveCounter, LiveStorageTracker
from fsdptag.tools.llama import Llama, LlamaConfig, apply_tp

from _checkpointing import CheckpointError, Checkpointer, CheckpointPolicy, SaveMode, prepare_dir
from _data import Corpus, load_corpus, train_batch, val_batches
from _elastic import init_distributed
from _faults import Fault, FaultKind, exit_if_struck


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    p.add_argument("--steps", type=int, default=40, help="train until this many steps are done")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256, help="at least 256: every byte is a token")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                   help="count collectives and track memory per step (--no-trace: faster steps)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    data = p.add_argument_group("data")
    data.add_argument("--data", default=None, help="a text file (default: Python standard-library sources)")
    data.add_argument("--val-fraction", type=float, default=0.1, help="held-out tail of the corpus")
    data.add_argument("--eval-every", type=int, default=10, help="held-out loss every N steps and at the end")
    data.add_argument("--eval-batches", type=int, default=2)
    data.add_argument("--plot", default=None, metavar="PNG", help="write the loss curves (needs matplotlib)")
    ckpt = p.add_argument_group("checkpoints and faults")
    ckpt.add_argument("--checkpoint-dir", default=None, help="save here and resume from the newest complete one")
    ckpt.add_argument("--checkpoint-every", type=int, default=10)
    ckpt.add_argument("--checkpoint-mode", default="async", choices=[m.value for m in SaveMode])
    ckpt.add_argument("--keep-last", type=int, default=3, help="complete checkpoints to keep")
    ckpt.add_argument("--state-digest", default=None, metavar="JSON",
                      help="write a sha256 of all parameters and optimizer states at the end")
    ckpt.add_argument("--fault", action="append", default=[], metavar="KIND@STEP",
                      help="inject exit@K, kill-in-save@K or disk-full@K in torchrun's first attempt "
                           "(repeat: the next one in the next attempt)")
    ckpt.add_argument("--fault-rank", type=int, default=1)
    return p.parse_args(argv)


class UsageError(Exception):
    """A flag or input the program cannot run with; the message names the fix."""


@dataclass
class TrainState:
    """What the loop carries from step to step: the data position is ``step``
    (Note [Data order is a function of (seed, step)] in _data.py)."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    val_losses: list[list] = field(default_factory=list)  # [step, loss]


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


def build_model(args, cfg: LlamaConfig, mesh, device) -> tuple[Llama, torch.optim.Optimizer]:
    with torch.device(device):
        model = Llama(cfg)
    model.init_weights(args.seed)
    if args.tp > 1:
        apply_tp(model, mesh["tp"])
    mp = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if args.mp == "bf16" else None
    fsdptag.parametrize(model, mesh, mode=args.dp_mode, mp_policy=mp, bucket=args.bucket,
                        reshard_after_forward=args.reshard_after_forward == "true")
    fsdptag.apply_ac(model, args.ac, layer_every=args.ac_layer_every)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def validate(args) -> tuple[list[Fault], CheckpointPolicy | None]:
    """Check the flags before any rank starts; every error names the fix."""
    if args.vocab < 256:
        raise UsageError(f"--vocab {args.vocab} is below the 256 byte values of the text; use --vocab 256")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"--plot {args.plot} needs matplotlib, which is not installed: "
                         f"pip install matplotlib (or pip install -e '.[plot]')")
    policy = None
    if args.checkpoint_dir:
        policy = CheckpointPolicy(prepare_dir(args.checkpoint_dir), args.checkpoint_every, args.keep_last,
                                  SaveMode(args.checkpoint_mode))
    try:
        faults = [Fault.parse(text, args.fault_rank, attempt) for attempt, text in enumerate(args.fault)]
    except ValueError as e:
        raise UsageError(str(e)) from e
    for fault in faults:
        if fault.kind is not FaultKind.EXIT and (
                policy is None or (fault.step % policy.every and fault.step != args.steps)):
            raise UsageError(f"--fault {fault.kind.value}@{fault.step} hits the save of step {fault.step}, but "
                             f"no checkpoint is saved then; pass --checkpoint-dir and a --checkpoint-every "
                             f"dividing {fault.step}")
    return faults, policy


def evaluate(model, batches: list[torch.Tensor], device) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(b[:, :-1].to(device)).float().flatten(0, 1), b[:, 1:].flatten().to(device))
                  for b in batches]
    model.train()
    return torch.stack(losses).mean()


def mean_over_ranks(x: torch.Tensor) -> float:
    """The data-parallel mean (TP ranks hold equal copies, so the mean over all ranks)."""
    x = x.detach().float().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def state_digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """sha256 of every parameter's and optimizer state's full tensor (a collective: all ranks)."""
    hashes = {}

    def add(name: str, t: torch.Tensor) -> None:
        full = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().contiguous()
        h = hashlib.sha256(f"{full.dtype} {tuple(full.shape)}".encode())
        h.update(full.reshape(-1).view(torch.uint8).numpy())
        hashes[name] = h.hexdigest()

    for name, p in model.named_parameters():
        add(f"param {name}", p)
        for key, value in sorted(optim.state[p].items()):
            if isinstance(value, torch.Tensor):
                add(f"optim {name} {key}", value)
    total = hashlib.sha256("\n".join(f"{k} {v}" for k, v in hashes.items()).encode()).hexdigest()
    return {"sha256": total, "tensors": hashes}


def write_plot(path: str, state: TrainState, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(state.losses) + 1), state.losses, label="train (mean over ranks)")
    if state.val_losses:
        steps, losses = zip(*state.val_losses)
        ax.plot(steps, losses, "o-", label="held-out")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bar(done: int, total: int, width: int = 10) -> str:
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def train(args) -> None:
    faults, policy = validate(args)
    try:
        corpus = load_corpus(args.data, args.val_fraction, args.seq_len)
    except ValueError as e:
        raise UsageError(str(e)) from e
    cuda = torch.cuda.is_available()
    init_distributed("nccl" if cuda else "gloo", args.timeout_s)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh, dp_rank, dp = build_mesh(device.type, world, args.dp_mode, args.tp)
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"data: {corpus.description}, {corpus.train.numel() / 2**10:.0f} KiB to train on, "
        f"{corpus.val.numel() / 2**10:.0f} KiB held out")

    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      vocab_size=args.vocab, ffn_hidden=int(args.dim * 8 / 3 // 8 * 8) or 8,
                      max_seq_len=args.seq_len)
    model, optim = build_model(args, cfg, mesh, device)
    state, ckpt = TrainState(), None
    if policy is not None:
        ckpt = make_checkpointer(args, policy, faults, corpus.sha256, dp)
        loaded = ckpt.resume(model, optim)
        if loaded is not None:
            state = TrainState(**loaded)
    run_loop(args, model, optim, state, corpus, ckpt, faults, mesh, dp_rank, dp, device)

    if args.state_digest:
        digest = state_digest(model, optim)
        if rank == 0:
            with open(args.state_digest, "w") as f:
                json.dump({**asdict(state), **digest}, f, indent=1)
            log(f"state digest: sha256 {digest['sha256']} ({len(digest['tensors'])} tensors) -> {args.state_digest}")
    if args.plot and rank == 0:
        write_plot(args.plot, state, f"{cfg.n_layers} blocks, dim {cfg.dim}, {world} ranks, tp {args.tp}")
        log(f"loss curves -> {args.plot}")
    dist.barrier()
    dist.destroy_process_group()


def make_checkpointer(args, policy: CheckpointPolicy, faults: list[Fault], corpus_sha256: str,
                      dp: int) -> Checkpointer:
    """A checkpointer holding checkpoints to the settings that fix the model's shape and
    the data order (the global batch is what must match, not the number of ranks)."""
    fingerprint = {"--dim": args.dim, "--layers": args.layers, "--heads": args.heads, "--kv-heads": args.kv_heads,
                   "--vocab": args.vocab, "--seq-len": args.seq_len, "--seed": args.seed,
                   "--batch x data-parallel ranks": args.batch * dp, "--data (sha256)": corpus_sha256}
    hints = {"--batch x data-parallel ranks": lambda saved: (
        f"--batch {saved // dp}" if saved % dp == 0 else f"a data-parallel size dividing {saved}")}
    log = (lambda msg: print(msg, flush=True)) if dist.get_rank() == 0 else (lambda msg: None)
    return Checkpointer(policy, fingerprint, log=log, hints=hints, faults=faults)


def run_loop(args, model, optim, state: TrainState, corpus: Corpus, ckpt: Checkpointer | None,
             faults: list[Fault], mesh, dp_rank: int, dp: int, device) -> None:
    """Train from ``state.step`` to ``--steps``: a line per step, held-out loss, checkpoints."""
    rank = dist.get_rank()
    log = print if rank == 0 else (lambda *a, **k: None)
    held_out = val_batches(corpus, args.seed, args.eval_batches, dp_rank, args.batch, dp, args.seq_len)
    times, save_times, t_loop = [], [], time.perf_counter()
    if state.step >= args.steps:
        log(f"nothing to train: step {state.step} of --steps {args.steps} is done")
    for step in range(state.step, args.steps):
        exit_if_struck(faults, step + 1, rank)  # steps count from 1, as printed
        seq = train_batch(corpus, args.seed, step, dp_rank, args.batch, dp, args.seq_len).to(device)
        loss, elapsed, stats = train_step(args, model, optim, seq, mesh, device)
        times.append(elapsed)
        state.losses.append(mean_over_ranks(loss))
        state.step = step + 1
        log(f"step {state.step:>{len(str(args.steps))}}/{args.steps} {bar(state.step, args.steps)}  "
            f"loss {state.losses[-1]:.4f}  tok/s {args.batch * dp * args.seq_len / elapsed:8.0f}{stats}", flush=True)
        if state.step % args.eval_every == 0 or state.step == args.steps:
            val = mean_over_ranks(evaluate(model, held_out, device))
            state.val_losses.append([state.step, val])
            log(f"held-out loss {val:.4f} at step {state.step}", flush=True)
        if ckpt is not None and ckpt.is_due(state.step, args.steps):
            save_times.append(ckpt.save(state.step, model, optim, asdict(state)))
    if ckpt is not None:
        ckpt.close()
    if times:
        log(summary(args, state, times, save_times, time.perf_counter() - t_loop), flush=True)


def train_step(args, model, optim, seq: torch.Tensor, mesh, device) -> tuple[torch.Tensor, float, str]:
    """One optimizer step: the loss, its seconds and (``--trace``) its collectives and memory."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with (CollectiveCounter(mesh) if args.trace else nullcontext()) as cc, \
            (LiveStorageTracker(track_peak=not cuda) if args.trace else nullcontext()) as mem:
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())
        kept = mem.live_bytes() if mem is not None else 0
        loss.backward()
        optim.step()
        optim.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if cc is None:
        return loss, elapsed, ""
    peak = torch.cuda.max_memory_allocated() if cuda else mem.peak_bytes
    tp_name = "tp" if args.tp > 1 else None

    def n(phase, group_is_tp):
        return sum(1 for e in cc.events if e.phase == phase and e.kind == "all_gather"
                   and (e.group == tp_name) == group_is_tp)

    return loss, elapsed, (f"  FSDP ag fwd/bwd {n('forward', False)}/{n('backward', False)}"
                           f"  TP ag fwd/bwd {n('forward', True)}/{n('backward', True)}"
                           f"  kept {kept / 2**10:.0f} KiB  peak {peak / 2**20:.2f} MiB")


def summary(args, state: TrainState, times: list[float], save_times: list[float], loop_s: float) -> str:
    line = (f"summary: {args.dp_mode} world={dist.get_world_size()} tp={args.tp} reshard_after_forward="
            f"{args.reshard_after_forward} ac={args.ac} mp={args.mp}  final loss {state.losses[-1]:.4f}  "
            f"median step {statistics.median(times) * 1e3:.0f} ms{' (instrumented)' if args.trace else ''}  "
            f"loop {loop_s:.2f} s")
    if save_times:
        line += (f"  checkpoint {args.checkpoint_mode}: {len(save_times)} saves, blocking median "
                 f"{statistics.median(save_times) * 1e3:.0f} ms")
    return line


def main() -> None:
    args = parse_args()
    code = 0
    try:
        train(args)
    except (UsageError, CheckpointError) as e:  # a clear error, not a crash: rank 0 says it once
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 1
    # Skip interpreter teardown (as fsdptag.testing.launch does): gloo's C++ threads are
    # sometimes destroyed while joinable there, which aborts a finished process, and
    # after an error a save thread may still wait in a collective.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
