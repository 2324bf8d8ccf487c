"""The prepared GPU check: one command, fsdptag beside FSDP2 on one GPU.

    PYTHONPATH=. python scripts/gpu_check.py                   # one CUDA GPU, NCCL (about 3 min on an H200)
    python scripts/gpu_check.py --device cpu --smoke           # the CPU smoke run (tests/test_gpu_check.py)

Nothing is installed: it runs on the machine's own torch (2.11 or newer) with
fsdptag on ``PYTHONPATH``. Three parts, each printed as a markdown table:

1. **parity**, world 1 (NCCL on CUDA, gloo on CPU): fsdptag vs FSDP2 for zero2/zero3
   x AC none/selective/full, bf16 params / fp32 reduce, 3 AdamW steps of a small
   Llama: losses and final parameters bitwise equal. FSDP2's blocks get
   ``cast_forward_inputs=False`` like fsdptag's (which casts the root's inputs only:
   the blocks' fp32 RoPE table stays fp32 in both).
2. **backward thread**: on CUDA the autograd engine runs backward on a device thread
   of its own; a forward under ``disable_tagging()`` with selective AC backwards there.
3. **throughput**, the ``fake`` process group at world 8 (real compute, collectives
   that move nothing): Llama-8B-shaped blocks (``--blocks``, dim 4096, seq
   ``--seq``), bf16 / fp32 reduce, zero2 + selective AC: tokens/s, peak
   ``max_memory_allocated``, host ms per step, fsdptag vs FSDP2, eager and compiled
   (``torch.compile`` per block).

Exit status 1 when a parity row or the backward-thread case fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MP, fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdptag  # noqa: E402
from fsdptag._compat import fake_store  # noqa: E402
from fsdptag.debug import disable_tagging  # noqa: E402
from fsdptag.tools.llama import Llama, LlamaConfig, _rope_cache  # noqa: E402

MP = fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32)


def _fsdp2(model: Llama, mesh, zero: int) -> Llama:
    block_mp = FSDP2MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=block_mp, reshard_after_forward=zero == 3)
    fully_shard(model, mesh=mesh, mp_policy=FSDP2MP(torch.bfloat16, torch.float32),
                reshard_after_forward=zero == 3)
    return model


def _fsdptag(model: Llama, mesh, zero: int) -> Llama:
    return fsdptag.parametrize(model, mesh, reshard_after_forward=zero == 3, mp_policy=MP)


def _model(cfg: LlamaConfig, device: torch.device, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    with torch.device(device):
        model = Llama(cfg)
    model.init_weights(seed)
    return model


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def parity(device: torch.device, smoke: bool) -> tuple[list[str], bool]:
    cfg = LlamaConfig(dim=64 if smoke else 256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                      ffn_hidden=176 if smoke else 704)
    mesh = init_device_mesh(device.type, (1,))
    rows, ok = ["| zero | AC | losses equal | parameters equal |", "|---|---|---|---|"], True
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 33), generator=gen).to(device) for _ in range(3)]
    for zero in (2, 3):
        for ac in ("none", "selective", "full"):
            results = []
            for wrap in (_fsdptag, _fsdp2):
                model = fsdptag.apply_ac(_model(cfg, device), ac)
                wrap(model, mesh, zero)
                optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
                losses = []
                for tokens in batches:
                    loss = _loss(model, tokens)
                    loss.backward()
                    optim.step()
                    optim.zero_grad()
                    losses.append(loss.detach().cpu())
                results.append((torch.stack(losses), {n: _full(p) for n, p in model.named_parameters()}))
            (l1, p1), (l2, p2) = results
            losses_equal = torch.equal(l1, l2)
            params_equal = p1.keys() == p2.keys() and all(torch.equal(p1[n], p2[n]) for n in p1)
            ok &= losses_equal and params_equal
            rows.append(f"| {zero} | {ac} | {losses_equal} | {params_equal} |")
    return rows, ok


def backward_thread(device: torch.device) -> tuple[list[str], bool]:
    """The backward of a forward under ``disable_tagging()``, with selective AC, on the
    engine's device thread (CUDA) or, on CPU, on a thread of our own."""
    model = fsdptag.apply_ac(_fsdptag(_model(LlamaConfig(), device), init_device_mesh(device.type, (1,)), 2),
                             "selective")
    tokens = torch.randint(0, 256, (2, 17), device=device)
    error: list[BaseException] = []
    with disable_tagging():
        loss = _loss(model, tokens)
        if device.type == "cuda":
            try:
                loss.backward()
            except RuntimeError as e:
                error.append(e)
        else:
            t = threading.Thread(target=lambda: _catch(loss.backward, error))
            t.start()
            t.join()
    ok = not error and all(p.grad is not None for p in model.parameters())
    return [f"backward on the autograd thread: {'ok' if ok else repr(error[0])}"], ok


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as e:
        errors.append(e)


def throughput(device: torch.device, smoke: bool, blocks: int, seq: int, steps: int,
               compile_too: bool) -> list[str]:
    world = 8
    cfg = (LlamaConfig(dim=64, n_layers=2) if smoke else
           LlamaConfig(dim=4096, n_layers=blocks, n_heads=32, n_kv_heads=8, vocab_size=128256,
                       ffn_hidden=14336, max_seq_len=seq))
    seq = min(seq, cfg.max_seq_len) if not smoke else 32
    mesh = init_device_mesh(device.type, (world,))
    rows = [f"world {world} (fake process group), {cfg.n_layers} blocks of dim {cfg.dim}, seq {seq}, "
            "batch 1, bf16 / fp32 reduce, zero2 + selective AC, median of the timed steps",
            "", "| runtime | compiled | tokens/s | peak memory | host ms/step |", "|---|---|---|---|---|"]
    for compiled in (False, True) if compile_too else (False,):
        for name, wrap in (("fsdptag", _fsdptag), ("FSDP2", _fsdp2)):
            with torch.device("meta"):
                model = Llama(cfg)
            fsdptag.apply_ac(model, "selective")
            wrap(model, mesh, 2)
            model.to_empty(device=device)
            with torch.no_grad(), fsdptag.disable_active_parametrization():
                for p in model.parameters():  # each rank's shard (FSDP2's and fsdptag's are DTensors)
                    local = p.to_local()
                    local.fill_(1.0) if p.dim() == 1 else local.normal_(0, 0.02)
            model.rope = _rope_cache(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta).to(device)
            if compiled:
                for block in model.layers:
                    block.compile()
            optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), device=device)
            times, host = [], []
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for step in range(steps + 2):
                t0 = time.perf_counter()
                loss = _loss(model, tokens)
                loss.backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                t1 = time.perf_counter()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t2 = time.perf_counter()
                if step >= 2:  # warm-up (and compilation) first
                    times.append(t2 - t0)
                    host.append(t1 - t0)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            step_s = statistics.median(times)
            rows.append(f"| {name} | {compiled} | {seq / step_s:,.0f} | {peak:.2f} GiB | "
                        f"{statistics.median(host) * 1e3:.1f} |")
            del model, optim, loss
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU run in the suite)")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    args = p.parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            rows, parity_ok = parity(device, args.smoke)
            print("\n## 1. parity, world 1 (%s)\n" % backend, *rows, sep="\n")
            rows, thread_ok = backward_thread(device)
            print("\n## 2. backward thread\n", *rows, sep="\n")
            ok = parity_ok and thread_ok
        finally:
            dist.destroy_process_group()
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=8)
    try:
        rows = throughput(device, args.smoke, args.blocks, args.seq, args.steps if not args.smoke else 1,
                          args.compile and not args.smoke)
        print("\n## 3. throughput\n", *rows, sep="\n")
    finally:
        dist.destroy_process_group()
    print("\n4. emulated link: not in this version (the overlap work has not landed)")
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
