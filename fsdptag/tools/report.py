"""The tools' output: an estimate's tables; the planner's rows as a table, the calls that
set a row up, the plan in words and its plot (``python -m fsdptag.plan --plot``)."""

from __future__ import annotations

import importlib

from .measure import COLLECTIVE_FIELDS
from .records import Candidate, MemoryEstimate, Plan, Row

__all__ = ["AC_CALLS", "calls", "format_cost_table", "format_plan", "format_rows", "format_table", "label", "plot",
           "pyplot", "reshard_of", "size"]

AC_CALLS = {
    "none": None,
    "full": 'fsdptag.apply_ac(model, "full")',
    "selective": 'fsdptag.apply_ac(model, "selective")',
    "layer": 'fsdptag.apply_ac(model, "selective", layer_every=2)',
}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def format_table(results: list[MemoryEstimate]) -> str:
    head = ("| policy | peak GiB | params GiB | grads GiB | unsynced grads GiB | optim GiB | kept for bwd GiB | "
            "of which gathered params | TP collectives | casts |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.policy} | {_gib(r.peak_bytes)} | {_gib(r.param_bytes)} | {_gib(r.grad_bytes)} | "
            f"{_gib(r.unsynced_grad_bytes)} | {_gib(r.optimizer_bytes)} | {_gib(r.activation_bytes)} | "
            f"{_gib(r.gathered_param_bytes)} | {_gib(r.kept_collective_bytes)} | "
            f"{_gib(r.kept_cast_bytes)} |"
        )
    return "\n".join(lines)


def format_cost_table(results: list[MemoryEstimate]) -> str:
    """Per policy: GiB moved by each kind of collective in the step, and TFLOPs."""
    head = ("| policy | FSDP all-gather GiB | of k-groups GiB | FSDP reduce-scatter GiB | FSDP all-reduce GiB | "
            "TP all-gather GiB | TP reduce-scatter GiB | TP all-reduce GiB | fwd TFLOP | bwd TFLOP | "
            "recompute TFLOP |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        moved = " | ".join(_gib(getattr(r, f)) for f in COLLECTIVE_FIELDS[:-1])
        flops = " | ".join(f"{n / 1e12:.2f}" for n in (r.forward_flops, r.backward_flops, r.recompute_flops))
        lines.append(f"| {r.policy} | {moved} | {flops} |")
    return "\n".join(lines)


def reshard_of(zero: str, keep_last: dict[str, bool] | None):
    if zero.startswith("zero3@"):  # partial reshard over k ranks (Note [Partial reshard])
        return int(zero.removeprefix("zero3@"))
    return {"zero2": False, "zero3": True}.get(zero, keep_last)


def _flops(n: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} FLOP"


def size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def label(c: Candidate) -> str:
    hsdp = f" HSDP{c.hsdp}" if c.hsdp > 1 else ""
    mb = f"x{c.microbatches}" if c.microbatches > 1 else ""
    return f"{c.zero} {c.ac} TP{c.tp}{hsdp} b{c.batch}{mb}"


def format_rows(rows: list[Row]) -> str:
    head = ("| # | zero | AC | TP | HSDP | batch | peak | FSDP collectives | TP collectives | compute (recompute) | "
            "comm ms | exposed ms | compute ms | GPU-us/token |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rows, 1):
        c, e = r.candidate, r.estimate
        fsdp = (e.fsdp_all_gather_bytes + e.fsdp_reduce_scatter_bytes + e.fsdp_all_reduce_bytes)
        tp = e.tp_all_gather_bytes + e.tp_reduce_scatter_bytes + e.tp_all_reduce_bytes
        flops = e.forward_flops + e.backward_flops + e.recompute_flops
        batch = f"{c.batch} x {c.microbatches}" if c.microbatches > 1 else f"{c.batch}"
        exposed = "-" if r.exposed_s is None else f"{1e3 * r.exposed_s:.4g}"
        lines.append(f"| {i} | {c.zero} | {c.ac} | {c.tp} | {c.hsdp} | {batch} | {size(e.peak_bytes)} | "
                     f"{size(fsdp)} | {size(tp)} | {_flops(flops)} ({_flops(e.recompute_flops)}) | "
                     f"{1e3 * r.comm_s:.4g} | {exposed} | {1e3 * r.compute_s:.4g} | {r.us_per_token:.4g} |")
    return "\n".join(lines)


def calls(p: Plan, r: Row) -> str:
    """The setup of row ``r``: mesh, TP plan, ``parametrize``, ``apply_ac``."""
    c = r.candidate
    dp = p.world_size // c.tp
    shape, names = ((c.hsdp, dp // c.hsdp), ("replicate", "shard")) if c.hsdp > 1 else ((dp,), ("dp",))
    if c.tp > 1:
        shape, names = shape + (c.tp,), names + ("tp",)
    quoted = ", ".join(f'"{n}"' for n in names) + ("," if len(names) == 1 else "")
    lines = [f'mesh = init_device_mesh("cuda", {shape!r}, mesh_dim_names=({quoted}))']
    if c.tp > 1:
        lines.append(f'{p.tp_plan}(model, mesh["tp"])')
    reshard = reshard_of(c.zero, p.keep_last)
    mode = 'mode="hybrid_shard", ' if c.hsdp > 1 else ""
    lines.append(f"fsdptag.parametrize(model, mesh, {mode}reshard_after_forward={reshard!r}, "
                 "mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32))")
    if AC_CALLS[c.ac]:
        lines.append(AC_CALLS[c.ac])
    lines.append(f"# batch: {c.batch} x {r.estimate.seq_len} tokens per data-parallel rank"
                 + (f" and microbatch, {c.microbatches} microbatches per step: "
                    "fsdptag.set_requires_gradient_sync(model, False) before all but the last backward"
                    if c.microbatches > 1 else ""))
    return "\n".join(lines)


def format_plan(p: Plan, show_all: bool = False) -> str:
    fitting = sum(r.fits for r in p.rows)
    out = [f"Pareto set: {len(p.pareto)} of {fitting} configurations that fit in {size(p.memory_bytes)} "
           f"({len(p.rows) - fitting} do not), fastest first", "", format_rows(p.pareto)]
    best = p.recommended
    if best is not None:
        out += ["", f"Recommended ({label(best.candidate)}, peak {size(best.estimate.peak_bytes)}):", "",
                calls(p, best)]
    else:
        out += ["", "Nothing fits: try more GPUs, a larger TP degree or a smaller batch."]
    rejected = sorted((r for r in p.rows if not r.fits), key=lambda r: r.estimate.peak_bytes)
    if rejected:
        out += ["", "Closest that does not fit: " + ", ".join(
            f"{label(r.candidate)} {size(r.estimate.peak_bytes)}" for r in rejected[:3])]
    out += [f"Skipped {s}" for s in p.skipped]
    if show_all:
        out += ["", "All configurations, in the order estimated:", "", format_rows(p.rows)]
    return "\n".join(out)


def pyplot():
    """matplotlib, an optional dependency: only ``--plot`` needs it."""
    try:
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib==3.11.2") from None


def plot(p: Plan, path: str) -> None:
    """Peak memory vs time proxy of every configuration, the Pareto set joined, the budget marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for fits, marker in ((True, "o"), (False, "x")):
        rows = [r for r in p.rows if r.fits == fits]
        ax.scatter([r.estimate.peak_bytes / 2**30 for r in rows], [r.us_per_token for r in rows], marker=marker,
                   label="fits" if fits else "does not fit")
    front = sorted(p.pareto, key=lambda r: r.estimate.peak_bytes)
    ax.plot([r.estimate.peak_bytes / 2**30 for r in front], [r.us_per_token for r in front], "k--", lw=1,
            label="Pareto set")
    for r in p.rows:
        ax.annotate(label(r.candidate), (r.estimate.peak_bytes / 2**30, r.us_per_token), fontsize=6)
    ax.axvline(p.memory_bytes / 2**30, color="r", lw=1, label="memory budget")
    ax.set_xlabel("peak memory, rank 0 (GiB)")
    ax.set_ylabel("time proxy (GPU microseconds per token)")
    ax.set_title(f"{p.model}, world {p.world_size}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
