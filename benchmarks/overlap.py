"""Exposed communication over an emulated slow link: fsdptag and FSDP2 side by side.

    python benchmarks/overlap.py [--bandwidth 50,150,500] [--ac none,full] [--steps 6] [--param-dtype bf16]

Spawns 2 gloo ranks (``--world``) on CPU. Each collective completes no earlier than its
bytes over ``--bandwidth`` (MB/s) after its issue (``fsdptag.testing.slow_link``), so
what a runtime leaves exposed shows in its step time. For zero2 and zero3, each AC mode
and each variant, one model per variant, steps alternating between them:

  fsdptag             defaults (prefetch on, reductions in flight)
  fsdptag-no-prefetch ``prefetch=False`` (gathers waited at once; reductions still in flight)
  fsdp2               ``fully_shard`` per block + root, defaults
  fsdp2-prefetch      plus explicit forward / backward prefetch of the neighbouring block
                      (without FSDP2's ``_set_unshard_async_op``: on CPU its unshards then
                      read the all-gather output before gloo has filled it, as CUDA events
                      are stubs there; measured: NaN and 7e32 losses in fp32)

Per row: the step time over an infinitely fast link (the emulation's own per-op cost
included), over the slow link, the difference (exposed communication), the link's own count of the time waits stalled past the real
collective (``stalled``), the bytes sent per step, and the peak of live tensor storage
in one step without the link (``LiveStorageTracker``). Numerics: the losses of every
variant over the timed steps (bitwise equal between the fsdptag variants).

Read with care: on CPU, FSDP2's collectives block at the call (its overlap on a GPU
comes from CUDA streams, which are stubs on CPU), so this measures what each runtime's
issue / wait order leaves exposed on the CPU, not what FSDP2 exposes on NCCL.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.debug import LiveStorageTracker
from fsdptag.testing.launch import spawn
from fsdptag.tools.llama import Llama, LlamaConfig
from fsdptag.testing.slow_link import SlowLink

VARIANTS = ("fsdptag", "fsdptag-no-prefetch", "fsdp2", "fsdp2-prefetch")


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _build(variant: str, cfg: LlamaConfig, mesh, reshard: bool, ac: str, param_dtype: torch.dtype):
    torch.manual_seed(0)
    model = Llama(cfg)
    model.init_weights()
    if variant.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        fsdptag.apply_ac(model, ac)  # the same checkpointing: its tagged policy is plain AC here
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        if variant == "fsdp2-prefetch":
            blocks = list(model.layers)
            for i, block in enumerate(blocks):
                if i + 1 < len(blocks):
                    block.set_modules_to_forward_prefetch([blocks[i + 1]])
                if i > 0:
                    block.set_modules_to_backward_prefetch([blocks[i - 1]])
        return model
    fsdptag.parametrize(model, mesh, reshard_after_forward=reshard,
                        mp_policy=fsdptag.MixedPrecisionPolicy(param_dtype, torch.float32),
                        prefetch=variant != "fsdptag-no-prefetch")
    fsdptag.apply_ac(model, ac)
    return model


def _step(model, optim, tokens) -> float:
    loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.item()


def _peak(model, optim, tokens) -> int:
    with LiveStorageTracker(track_inputs=True, track_peak=True, settle_collectives=True) as mem:
        _step(model, optim, tokens)
    return mem.peak_bytes


def _worker(cfg, bandwidths, acs, steps, batch, seq_len, variants, param_dtype):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g)
    rows = []
    for reshard in (False, True):
        for ac in acs:
            models = {v: _build(v, cfg, mesh, reshard, ac, param_dtype) for v in variants}
            optims = {v: torch.optim.SGD(models[v].parameters(), lr=1e-3) for v in variants}
            peaks = {v: _peak(models[v], optims[v], tokens) for v in variants}  # also the warm-up
            for v in variants:
                _step(models[v], optims[v], tokens)
            for bw in (None, *bandwidths):
                times = {v: [] for v in variants}
                stalled = {v: [] for v in variants}
                sent = {v: 0 for v in variants}
                losses = {v: [] for v in variants}
                for _ in range(steps):
                    for v in variants:
                        dist.barrier()
                        # the baseline runs under an infinitely fast link: the mode's own cost
                        link = SlowLink(bw * 1e6 if bw is not None else float("inf"))
                        t0 = time.perf_counter()
                        with link:
                            losses[v].append(_step(models[v], optims[v], tokens))
                        times[v].append(time.perf_counter() - t0)
                        stalled[v].append(link.stalled_s)
                        sent[v] = link.sent_bytes
                for v in variants:
                    rows.append(dict(zero=3 if reshard else 2, ac=ac, variant=v, bandwidth=bw,
                                     step_s=statistics.median(times[v]),
                                     stalled_s=statistics.median(stalled[v]) if stalled[v] else 0.0,
                                     sent_bytes=sent[v], peak_bytes=peaks[v], losses=losses[v]))
    return rows


def _table(rows) -> str:
    base = {(r["zero"], r["ac"], r["variant"]): r["step_s"] for r in rows if r["bandwidth"] is None}
    head = ("| zero | ac | MB/s | variant | step ms (fast link) | step ms | exposed ms | stalled ms | "
            "MB sent/step | peak MiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["bandwidth"] is None:
            continue
        b = base[r["zero"], r["ac"], r["variant"]]
        lines.append(
            f"| {r['zero']} | {r['ac']} | {r['bandwidth']:g} | {r['variant']} | {b * 1e3:.0f} | "
            f"{r['step_s'] * 1e3:.0f} | {(r['step_s'] - b) * 1e3:.0f} | {r['stalled_s'] * 1e3:.0f} | "
            f"{r['sent_bytes'] / 1e6:.1f} | {r['peak_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def _numerics(rows) -> str:
    out = []
    for zero in sorted({r["zero"] for r in rows}):
        for ac in dict.fromkeys(r["ac"] for r in rows):
            by = {}
            for r in rows:
                if r["zero"] == zero and r["ac"] == ac:
                    by.setdefault(r["variant"], []).extend(r["losses"])
            ref = by.get("fsdptag")
            same = all(ls == ref for v, ls in by.items() if v.startswith("fsdptag"))
            diff = max((abs(a - b) for v, ls in by.items() for a, b in zip(ls, ref)), default=0.0)
            out.append(f"zero{zero} {ac}: fsdptag variants bitwise equal: {same}; "
                       f"max |loss - fsdptag's| over all variants: {diff:.2e}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bandwidth", default="50,150,500", help="comma list of link bandwidths, MB/s")
    p.add_argument("--ac", default="none,full", help="comma list of none,selective,full")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--param-dtype", default="bf16", choices=sorted(DTYPES),
                   help="gathered dtype (fp32 on a CPU without native bf16 matmuls: AVX2 runs them ~100x slower)")
    args = p.parse_args()
    variants = tuple(args.variants.split(","))
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; use some of {', '.join(VARIANTS)}")
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, vocab_size=512,
                      ffn_hidden=args.dim * 8 // 3 // 8 * 8, max_seq_len=64)
    bandwidths = tuple(float(b) for b in args.bandwidth.split(","))
    t0 = time.perf_counter()
    rows = spawn(args.world, _worker, cfg, bandwidths, tuple(args.ac.split(",")), args.steps, 4, 64, variants,
                 DTYPES[args.param_dtype])
    print(f"overlap: dim={args.dim} layers={args.layers} batch=4 seq=64 per rank, {args.world} gloo ranks, "
          f"{args.param_dtype} params / fp32 reduce, median of {args.steps} steps; {time.perf_counter() - t0:.0f} s\n")
    print(_table(rows))
    print()
    print(_numerics(rows))


if __name__ == "__main__":
    main()
