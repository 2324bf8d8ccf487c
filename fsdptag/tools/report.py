"""The planner's output: its rows as a table, the calls that set a row up, the plan in
words and its plot (``python -m fsdptag.plan --plot``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from .plan import Candidate, Plan, Row

__all__ = ["AC_CALLS", "calls", "format_plan", "format_rows", "label", "plot", "pyplot", "reshard_of", "size"]

AC_CALLS = {
    "none": None,
    "full": 'fsdptag.apply_ac(model, "full")',
    "selective": 'fsdptag.apply_ac(model, "selective")',
    "layer": 'fsdptag.apply_ac(model, "selective", layer_every=2)',
}


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
    return f"{c.zero} {c.ac} TP{c.tp} b{c.batch}"


def format_rows(rows: list[Row]) -> str:
    head = ("| # | zero | AC | TP | batch | peak | FSDP collectives | TP collectives | compute (recompute) | "
            "comm ms | compute ms | GPU-us/token |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rows, 1):
        c, e = r.candidate, r.estimate
        fsdp = (e.fsdp_all_gather_bytes + e.fsdp_reduce_scatter_bytes + e.fsdp_all_reduce_bytes)
        tp = e.tp_all_gather_bytes + e.tp_reduce_scatter_bytes + e.tp_all_reduce_bytes
        flops = e.forward_flops + e.backward_flops + e.recompute_flops
        lines.append(f"| {i} | {c.zero} | {c.ac} | {c.tp} | {c.batch} | {size(e.peak_bytes)} | {size(fsdp)} | "
                     f"{size(tp)} | {_flops(flops)} ({_flops(e.recompute_flops)}) | {1e3 * r.comm_s:.4g} | "
                     f"{1e3 * r.compute_s:.4g} | {r.us_per_token:.4g} |")
    return "\n".join(lines)


def calls(p: Plan, r: Row) -> str:
    """The setup of row ``r``: mesh, TP plan, ``parametrize``, ``apply_ac``."""
    c = r.candidate
    dp = p.world_size // c.tp
    if c.tp > 1:
        lines = [f'mesh = init_device_mesh("cuda", ({dp}, {c.tp}), mesh_dim_names=("dp", "tp"))',
                 f'{p.tp_plan}(model, mesh["tp"])']
    else:
        lines = [f'mesh = init_device_mesh("cuda", ({dp},), mesh_dim_names=("dp",))']
    reshard = reshard_of(c.zero, p.keep_last)
    lines.append(f"fsdptag.parametrize(model, mesh, reshard_after_forward={reshard!r}, "
                 "mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32))")
    if AC_CALLS[c.ac]:
        lines.append(AC_CALLS[c.ac])
    lines.append(f"# batch: {c.batch} x {r.estimate.seq_len} tokens per data-parallel rank")
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
