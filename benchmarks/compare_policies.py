"""Side by side on one model and inputs: how each policy handles FSDP under AC.

    python benchmarks/compare_policies.py --quick [--json out.json] [--plot out.png]
    python benchmarks/compare_policies.py --device cuda --world 4      # NCCL, one GPU per rank

Spawns 4 gloo ranks (``--world``) on CPU (``--device cuda``: NCCL ranks on GPUs) and runs, for zero2 and zero3, without TP (4-way
FSDP) and with TP (2 dp x 2 tp, sequence parallel), each AC mode asked for:

  tagged    fsdptag's policy (``fsdptag.apply_ac``)
  op-name   save every all_gather / wait_tensor / _to_copy by name
  no-fix    the base policy alone: AC recomputes the FSDP all-gathers
  fsdp2     FSDP2 ``fully_shard`` (per block + root) with the same AC
  untagged  the tagged runtime with tagging disabled and the policy that gives it
            the same collectives (op-name for zero2, no-fix for zero3): the tag's cost
  no-prefetch  tagged with ``prefetch=False`` (each gather waited right after its issue)

With ``--compile BACKEND`` the variants default to ``tagged,tagged+compile,fsdp2+compile``:
a ``+compile`` variant is compiled with BACKEND, each block on its own (torchtitan
style; fsdptag with TP: the whole model, see docs/compile.md). Compiled code cannot run
under the collective counter or the storage tracker (dispatch modes), so for compiled
variants the backward all-gathers, bytes gathered and peak are not measured (the graph
counts are pinned by tests/test_compile.py), and "kept for bwd" is the bytes of the
distinct storages autograd saves for backward (a saved-tensor hook; parameters not
counted), a close proxy of the tracker's figure that eager variants report. Once dynamo
compiles, every live bucket unbinds its flat storage (Note [Bound storage]), so the eager
``tagged`` variant of a --compile run packs its gathers with ``cat``: a little slower
than eager fsdptag alone. Under --compile the ``time_vs_no_fix`` field holds the ratio to
eager ``tagged``, and ``time_vs_fsdp2`` the ratio to ``fsdp2+compile``.

Per variant: backward all-gathers on the data-parallel mesh, bytes all-gathered per
step (FSDP), bytes forward keeps for backward, peak bytes of a step (tracked
storages, parameters included), and the median step time over --steps steps after
a warm-up step, with its ratio to no-fix. The variants of one setting are built side
by side and their timed steps alternate, so slow drift of the machine cancels out.
bf16 params, fp32 reduction.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdptag
from fsdptag.tools.baselines import apply_baseline_ac
from fsdptag.debug import CollectiveCounter, LiveStorageTracker, disable_tagging
from fsdptag.testing.launch import rank_device, spawn
from fsdptag.tools.llama import Llama, LlamaConfig, apply_tp

DEFAULT_VARIANTS = ("tagged", "op-name", "no-fix", "fsdp2", "untagged")
COMPILE_VARIANTS = ("tagged", "tagged+compile", "fsdp2+compile")
KNOWN_VARIANTS = DEFAULT_VARIANTS + ("no-prefetch", "tagged+compile", "fsdp2+compile")


@dataclass
class Record:
    variant: str
    reshard_after_forward: bool
    tp: int
    ac: str
    bwd_fsdp_all_gathers: int
    fsdp_all_gather_bytes: int
    saved_bytes: int
    peak_bytes: int
    step_time_s: float
    time_vs_no_fix: float = float("nan")
    time_vs_fsdp2: float = float("nan")


def _ac_args(ac: str):
    return ("selective", 2) if ac == "layer" else (ac, None)


def _build(variant, cfg, mesh, tp, reshard, ac, bucket, backend=None):
    base, compiled = variant.removesuffix("+compile"), variant.endswith("+compile")
    model = _build_eager(base, cfg, mesh, tp, reshard, ac, bucket)
    if not compiled:
        return model
    if base == "tagged" and tp > 1:  # a TP block cannot be compiled alone (docs/compile.md)
        return torch.compile(model, backend=backend)
    for block in model.layers:
        block.compile(backend=backend)
    return model


def _build_eager(variant, cfg, mesh, tp, reshard, ac, bucket):
    torch.manual_seed(0)
    model = Llama(cfg)
    model.init_weights()
    model.to(rank_device())
    if tp > 1:
        apply_tp(model, mesh["tp"])
    mode, every = _ac_args(ac)
    if variant == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        fsdptag.apply_ac(model, mode, layer_every=every)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        dp_mesh = mesh["dp"] if tp > 1 else mesh
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        return model
    fsdptag.parametrize(model, mesh, mode="fully_shard", reshard_after_forward=reshard,
                        mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32),
                        bucket=bucket, prefetch=variant != "no-prefetch")
    if variant in ("tagged", "no-prefetch"):
        fsdptag.apply_ac(model, mode, layer_every=every)
    else:
        policy = {"op-name": "op-name", "no-fix": "no-fix",
                  "untagged": "no-fix" if reshard else "op-name"}[variant]
        apply_baseline_ac(model, mode, layer_every=every, policy=policy)
    return model


def _step(model, optim, tokens):
    loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _synchronize() -> None:
    """Step times on CUDA: the GPU's work, not only the CPU's queueing of it."""
    if rank_device().type == "cuda":
        torch.cuda.synchronize()


def _untagged_if(variant):
    return disable_tagging() if variant == "untagged" else contextlib.nullcontext()


def _measure_group(variants, cfg, mesh, tp, reshard, ac, steps, tokens, bucket, backend=None) -> list[Record]:
    """All variants of one setting, built side by side; timed steps alternate between
    them (round robin) so that drift in the machine's speed hits every variant alike."""
    torch._dynamo.reset()
    models = {v: _build(v, cfg, mesh, tp, reshard, ac, bucket, backend) for v in variants}
    optims = {v: torch.optim.AdamW(m.parameters(), lr=1e-3) for v, m in models.items()}
    times = {v: [] for v in variants}
    for v in variants:
        with _untagged_if(v):
            _step(models[v], optims[v], tokens)  # warm-up
    for _ in range(steps):
        for v in variants:
            with _untagged_if(v):
                dist.barrier()
                _synchronize()
                t0 = time.perf_counter()
                _step(models[v], optims[v], tokens)
                _synchronize()
                times[v].append(time.perf_counter() - t0)
    return [_instrumented(v, models[v], optims[v], mesh, tp, reshard, ac, tokens,
                          statistics.median(times[v])) for v in variants]


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct storages autograd saves for backward, parameters excluded."""

    def __init__(self, model) -> None:
        self.exclude = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t):
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in self.exclude:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _instrumented_compiled(variant, model, optim, tp, reshard, ac, tokens, step_time) -> Record:
    """A compiled variant: only what saved-tensor hooks can see (no dispatch modes)."""
    saved = _SavedBytes(model)
    with saved:
        loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optim.zero_grad(set_to_none=True)
    return Record(variant=variant, reshard_after_forward=reshard, tp=tp, ac=ac,
                  bwd_fsdp_all_gathers=-1, fsdp_all_gather_bytes=-1,
                  saved_bytes=sum(saved.seen.values()), peak_bytes=-1, step_time_s=step_time)


def _instrumented(variant, model, optim, mesh, tp, reshard, ac, tokens, step_time) -> Record:
    """One step under the collective counter and the storage tracker."""
    if variant.endswith("+compile"):
        return _instrumented_compiled(variant, model, optim, tp, reshard, ac, tokens, step_time)
    with _untagged_if(variant), CollectiveCounter(mesh) as cc, \
            LiveStorageTracker(track_inputs=True, track_peak=True) as mem:
        loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
        at_forward_end = mem.snapshot()
        loss.backward()
        del loss
        saved = sum(LiveStorageTracker.kept(at_forward_end, mem.snapshot()).values())
        optim.zero_grad(set_to_none=True)
    fsdp = [e for e in cc.events if e.kind == "all_gather" and e.group == "dp"]
    return Record(
        variant=variant, reshard_after_forward=reshard, tp=tp, ac=ac,
        bwd_fsdp_all_gathers=sum(1 for e in fsdp if e.phase == "backward"),
        fsdp_all_gather_bytes=sum(e.nbytes for e in fsdp),
        saved_bytes=saved, step_time_s=step_time,
        # on CUDA the caching allocator's peak of the step, else the tracked storages'
        peak_bytes=mem.allocator_peak_bytes if mem.allocator_peak_bytes is not None else mem.peak_bytes,
    )


def _worker(cfg: LlamaConfig, acs, steps, batch, seq_len, bucket, tps, variants, backend=None):
    records = []
    world = dist.get_world_size()
    for tp in tps:
        shape, names = ((world,), ("dp",)) if tp == 1 else ((world // tp, tp), ("dp", "tp"))
        mesh = init_device_mesh(rank_device().type, shape, mesh_dim_names=names)
        dp_rank = (mesh["dp"] if tp > 1 else mesh).get_local_rank()
        g = torch.Generator().manual_seed(dp_rank)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g).to(rank_device())
        for reshard in (False, True):
            for ac in acs:
                group = _measure_group(variants, cfg, mesh, tp, reshard, ac, steps, tokens, bucket, backend)
                times = {r.variant: r.step_time_s for r in group}
                base = "tagged" if backend else "no-fix"  # --compile: ratios to eager fsdptag
                fsdp2 = "fsdp2+compile" if backend else "fsdp2"
                for r in group:
                    r.time_vs_no_fix = r.step_time_s / times.get(base, float("nan"))
                    r.time_vs_fsdp2 = r.step_time_s / times.get(fsdp2, float("nan"))
                records += group
    return [asdict(r) for r in records]


def _table(records, compiled: bool = False) -> str:
    base, fsdp2 = ("tagged", "fsdp2+compile") if compiled else ("no-fix", "fsdp2")
    head = ("| zero | tp | ac | variant | bwd FSDP all-gathers | FSDP all-gathered KiB/step | "
            f"kept for bwd KiB | peak KiB | step ms | vs {base} | vs {fsdp2} |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def kib(n):
        return "-" if n < 0 else f"{n / 1024:.0f}"

    for r in records:
        gathers = "-" if r["bwd_fsdp_all_gathers"] < 0 else r["bwd_fsdp_all_gathers"]
        lines.append(
            f"| {3 if r['reshard_after_forward'] else 2} | {r['tp']} | {r['ac']} | {r['variant']} | "
            f"{gathers} | {kib(r['fsdp_all_gather_bytes'])} | "
            f"{kib(r['saved_bytes'])} | {kib(r['peak_bytes'])} | "
            f"{r['step_time_s'] * 1e3:.1f} | {r['time_vs_no_fix']:.2f} | {r['time_vs_fsdp2']:.2f} |"
        )
    return "\n".join(lines)


def _plot(records, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install -e '.[plot]'")
    labels = [f"z{3 if r['reshard_after_forward'] else 2} tp{r['tp']} {r['ac']}\n{r['variant']}"
              for r in records]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, len(records) * 0.45), 8), sharex=True)
    xs = range(len(records))
    ax1.bar(xs, [max(r["saved_bytes"], 0) / 1024 for r in records], color="tab:blue")
    ax1.set_ylabel("kept for backward (KiB)")
    ax2.bar(xs, [max(r["bwd_fsdp_all_gathers"], 0) for r in records], color="tab:orange")  # -1: not measured
    ax2.set_ylabel("backward FSDP all-gathers")
    ax2.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, selective AC only (< 3 min)")
    p.add_argument("--ac", default=None, help="comma list of none,full,selective,layer")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bucket", default="blocks", choices=["blocks", "param", "module"],
                   help="fsdptag's gather buckets (blocks: one per transformer block + the root)")
    p.add_argument("--tp", default="1,2", help="comma list of TP degrees to run (1 and/or 2)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma list of {', '.join(KNOWN_VARIANTS)}")
    p.add_argument("--world", type=int, default=4, help="ranks (TP 2 needs an even number)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo ranks; cuda: NCCL ranks, one GPU each")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="compare compiled fsdptag and FSDP2 (e.g. inductor, aot_eager)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    if args.compile and args.variants == ",".join(DEFAULT_VARIANTS):
        args.variants = ",".join(COMPILE_VARIANTS)
    dim = args.dim or (64 if args.quick else 128)
    layers = args.layers or (2 if args.quick else 4)
    acs = tuple((args.ac or ("selective" if args.quick else "full,selective,layer")).split(","))
    seq_len, batch = (32, 2) if args.quick else (64, 4)
    cfg = LlamaConfig(dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=512,
                      ffn_hidden=dim * 8 // 3 // 8 * 8, max_seq_len=64)
    t0 = time.perf_counter()
    tps = tuple(int(t) for t in args.tp.split(","))
    variants = tuple(args.variants.split(","))
    unknown = sorted(set(variants) - set(KNOWN_VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; use some of {', '.join(KNOWN_VARIANTS)}")
    if any(v.endswith("+compile") for v in variants) and not args.compile:
        p.error("a +compile variant needs --compile BACKEND")
    records = spawn(args.world, _worker, cfg, acs, max(args.steps, 5), batch, seq_len, args.bucket, tps,
                    variants, args.compile, device=args.device)
    print(f"compare_policies: dim={dim} layers={layers} batch={batch} seq={seq_len} per dp rank, "
          f"bucket={args.bucket}, "
          f"{args.world} ranks ({'NCCL, CUDA' if args.device == 'cuda' else 'gloo, CPU'}), bf16 params, median of {max(args.steps, 5)} steps"
          f"{f', compiled with {args.compile}' if args.compile else ''}; "
          f"{time.perf_counter() - t0:.0f} s\n")
    print(_table(records, compiled=bool(args.compile)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.plot:
        _plot(records, args.plot)


if __name__ == "__main__":
    main()
