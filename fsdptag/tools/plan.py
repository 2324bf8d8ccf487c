"""Which zero / AC / TP setting fits, and what it costs: ``python -m fsdptag.plan``.

    python -m fsdptag.plan --model llama3-8b --world-size 64 --memory 80GiB [--tp 1,2,4,8] [--batch 1] \\
        [--hsdp 1,8] [--microbatches 1,4] [--partial-reshard 8] [--ac none,layer,selective,full] \\
        [--bandwidth 50GB/s] [--tp-bandwidth 450GB/s] [--device-flops 400T] [--no-overlap] \\
        [--plot out.png] [--json out.json] [--all] [--jobs N]

Every combination of zero2 / zero3 (and zero3 with the last block and the root's own
parameters kept gathered, where that helps: zero2 does not fit, zero3 does), AC
none / layer / selective / full, each TP degree, HSDP replica count (``--hsdp``: the
data-parallel ranks split into that many replicas, each sharding over the rest),
batch and number of microbatches (all but the last without gradient sync) is estimated with
:mod:`fsdptag.estimate` (rank 0's step on fake tensors, fsdptag's tagged policy,
bf16 parameters / fp32 reduction, AdamW). What does not fit in ``--memory`` is
dropped; the Pareto set of peak memory vs. the time proxy is printed fastest first:
the first row is the recommendation, followed by the calls that set it up.
Models: as ``python -m fsdptag.estimate`` (``--model``, ``--hf-config``, ``--tp-plan``).

Note [Time proxy]
-----------------
A rank's step takes ``compute_s + exposed_s``: compute, and the communication
compute cannot hide. Both come from the estimate's timeline, the step's collectives
in the order the runtime issues and waits them with the FLOPs between (Note [Exposed
communication] in ``overlap.py``), replayed at these rates per GPU:

* data-parallel collectives over ``--bandwidth`` (default 50 GB/s: one 400 Gb/s NIC
  per GPU, between nodes), TP ones over ``--tp-bandwidth`` (default 450 GB/s: NVLink
  within a node, TP <= 8), the backward re-gathers of ``reshard_after_forward=k``
  (``--partial-reshard k``, rows "zero3@k") over k-rank groups over
  ``--partial-bandwidth`` (default 450 GB/s: a group within a node); ring algorithms:
  an all-gather or reduce-scatter of ``B`` bytes over ``n`` ranks sends ``B (n-1)/n``,
  an all-reduce twice that;
* forward + backward + recompute FLOPs over ``--device-flops`` (default 400 TFLOP/s:
  ~40% of an H100's / H200's dense bf16 peak).

``--no-overlap`` keeps the earlier proxy, ``comm_s + compute_s`` with ``comm_s`` every
collective's time summed, as if nothing overlapped. Either way the proxy ranks
configurations rather than predicting a step time (no latency, no kernel slowed by a
concurrent collective). Configurations are compared by GPU time per token,
``step_s * tp / (batch * microbatches * seq)``: a TP group of ``tp`` GPUs spends
``step_s`` on ``batch * microbatches`` sequences.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import pickle
import re
import sys
import time
from dataclasses import asdict
from typing import Callable, Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .compose import KEEP_LAST, keep_last_of, keep_last_policy
from .overlap import exposed_proxy, time_proxy
from .estimate import (AC_MODES, ModelSpec, StepConfig, add_model_args, complete_spec,
                       estimate_each, model_spec, spec_from_args)
from .records import Candidate, Plan, Rates, Row, speed_key
from .report import format_plan, label, plot, pyplot, reshard_of, size

__all__ = ["ZERO_MODES", "Candidate", "Plan", "Rates", "Row", "cpu_seconds", "exposed_proxy", "format_plan", "keep_last_policy",
           "parse_bytes", "plan", "plot", "time_proxy"]

ZERO_MODES = ("zero2", "zero3", "zero3-keep-last", "zero3@k")


def plan(model: str | ModelSpec | Callable[[], nn.Module], world_size: int, memory_bytes: int, *,
         tp: Sequence[int] = (1,), batch: Sequence[int] = (1,), ac: Sequence[str] = AC_MODES,
         rates: Rates = Rates(), seq_len: int | None = None,
         tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None,
         progress: Callable[[Row], None] | None = None, partial: Sequence[int] = (),
         hsdp: Sequence[int] = (1,), microbatches: Sequence[int] = (1,), compose: bool = True,
         jobs: int = 1) -> Plan:
    """Estimate every configuration (module docstring) and mark the Pareto set.
    ``partial``: k values of ``reshard_after_forward=k`` to try ("zero3@k") where zero3
    fits and zero2 does not. ``hsdp``: HSDP replica counts (1: fully sharded);
    ``microbatches``: forward+backward passes per optimizer step. ``compose``: as
    :func:`fsdptag.estimate.estimate` (two shallow copies measured, the other blocks
    composed: Note [Composed depth]). ``jobs``: processes estimating TP degrees side by
    side (Note [Parallel sweep]).

    A TP degree whose estimate raises ``ValueError`` (no TP plan, heads not divisible,
    world size not divisible) is skipped with the reason in ``Plan.skipped``, as is a
    replica count that does not divide the data-parallel ranks.

    Example::

        >>> p = plan("llama3-8b", 64, parse_bytes("80GiB"), tp=(1, 2, 4, 8))
        >>> p.recommended.candidate
        Candidate(zero='zero2', ac='none', tp=2, batch=1, hsdp=1, microbatches=1)
    """
    _check(world_size, memory_bytes, tp, batch, ac, hsdp, microbatches)
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs={jobs!r}: pass the number of processes to estimate in, >= 1 (e.g. --jobs 2)")
    spec = complete_spec(model_spec(model, seq_len=seq_len, tp_plan=tp_plan))
    result = Plan(spec.name, world_size, memory_bytes, rates, [], keep_last=keep_last_of(spec.build))
    work = functools.partial(_degree, spec, result, hsdp, batch, microbatches, ac, progress, partial, compose)
    jobs = min(jobs, len(tp))
    if jobs > 1 and _picklable(work):  # Note [Parallel sweep]
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            done = pool.map(work, tp, chunksize=1)
    else:
        done = [work(degree) for degree in tp]
    for rows, skipped, tp_plan_name in done:
        result.rows += rows
        result.skipped += skipped
        result.tp_plan = result.tp_plan or tp_plan_name
    _mark_pareto(result.rows)
    return result


def _picklable(work) -> bool:
    try:
        pickle.dumps(work)
        return True
    except (pickle.PicklingError, AttributeError, TypeError):
        return False


def _degree(spec: ModelSpec, p: Plan, hsdp, batch, microbatches, ac, progress, partial, compose,
            degree: int) -> tuple[list[Row], list[str], str | None]:
    """One TP degree's rows, what was skipped and why, and its TP plan's name.

    Note [Parallel sweep]
    ---------------------
    The TP degrees are independent: each has its own fake process group and mesh, its
    own optimizer reuse (Note [Optimizer reuse]: layouts differ by degree) and its own
    zero3-keep-last choices, so ``jobs`` worker processes (``spawn``: fresh interpreters,
    no process group inherited) take one degree each and the rows come back in the
    order of ``tp``, the same rows as one process makes. A model that does not pickle
    (a lambda factory) runs in this process."""
    replicas, skipped = [], []
    dp = p.world_size // degree
    for r in hsdp:
        if p.world_size % degree == 0 and (r == 1 or (dp % r == 0 and dp // r > 1)):
            replicas.append(r)
        else:
            skipped.append(f"tp={degree} hsdp={r}: {dp} data-parallel ranks do not split into {r} "
                           f"replicas of 2 or more")
    try:
        rows = _sweep(spec, p, degree, replicas, batch, microbatches, ac, progress, partial, compose)
    except ValueError as e:
        return [], skipped + [f"tp={degree}: {e}"], None
    name = None
    if degree > 1:
        fn = complete_spec(spec, True).tp_plan
        name = f"{fn.__module__}.{fn.__qualname__}"
    return rows, skipped, name


def _check(world_size: int, memory_bytes: int, tp, batch, ac, hsdp, microbatches) -> None:
    if not tp or any(not isinstance(t, int) or t < 1 for t in tp):
        raise ValueError(f"tp={list(tp)!r}: pass TP degrees >= 1, e.g. --tp 1,2,4,8")
    if not batch or any(not isinstance(b, int) or b < 1 for b in batch):
        raise ValueError(f"batch={list(batch)!r}: pass sequences per data-parallel rank >= 1, e.g. --batch 1,2")
    if not hsdp or any(not isinstance(r, int) or r < 1 for r in hsdp):
        raise ValueError(f"hsdp={list(hsdp)!r}: pass HSDP replica counts >= 1 (1: fully sharded), e.g. --hsdp 1,8")
    if not microbatches or any(not isinstance(m, int) or m < 1 for m in microbatches):
        raise ValueError(f"microbatches={list(microbatches)!r}: pass forward+backward passes per optimizer step "
                         f">= 1, e.g. --microbatches 1,4")
    unknown = [a for a in ac if a not in AC_MODES]
    if not ac or unknown:
        raise ValueError(f"ac={list(ac)!r}: use some of {AC_MODES}")
    if memory_bytes <= 0 or world_size < 1:
        raise ValueError(f"memory={memory_bytes} B, world_size={world_size}: both must be positive")


def _sweep(spec: ModelSpec, p: Plan, tp: int, replicas, batches, microbatches, acs, progress, partial=(),
           compose=True) -> list[Row]:
    """zero2 and zero3 for every (AC, HSDP, batch, microbatches) at one TP degree, then
    zero3-keep-last (and zero3@k) where it can be on the Pareto set: zero2 (faster, no
    backward gathers) does not fit, zero3 does."""
    def run(candidates: list[Candidate]) -> list[Row]:
        configs = [StepConfig(c.tp, c.hsdp, reshard_of(c.zero, KEEP_LAST), c.ac, "bf16", c.batch, "tagged",
                              c.microbatches) for c in candidates]
        rows = []
        for c, e in zip(candidates, estimate_each(spec, p.world_size, configs, compose=compose) if configs else ()):
            comm, compute = time_proxy(e, p.rates)
            exposed = exposed_proxy(e, p.rates) if p.rates.overlap else None
            rows.append(Row(c, e, comm, compute, e.peak_bytes <= p.memory_bytes, exposed_s=exposed))
            if progress is not None:
                progress(rows[-1])
        return rows

    shapes = [(r, b, m) for r in replicas for b in batches for m in microbatches]
    rows = run([Candidate(z, a, tp, b, r, m) for r, b, m in shapes for a in acs for z in ("zero2", "zero3")])
    fits = {(r.candidate.zero, r.candidate.ac, r.candidate.hsdp, r.candidate.batch, r.candidate.microbatches):
            r.fits for r in rows}
    extra = []
    for r, b, m in shapes:
        shard = p.world_size // tp // r
        ks = [k for k in partial if 1 < k < shard and shard % k == 0]  # others: not a partial reshard here
        extra += [Candidate(z, a, tp, b, r, m) for a in acs
                  if fits[("zero3", a, r, b, m)] and not fits[("zero2", a, r, b, m)]
                  for z in ("zero3-keep-last", *(f"zero3@{k}" for k in ks))]
    return rows + run(extra)


def _mark_pareto(rows: list[Row]) -> None:
    lowest = None
    for r in sorted((r for r in rows if r.fits), key=speed_key):
        if lowest is None or r.estimate.peak_bytes < lowest:
            r.pareto, lowest = True, r.estimate.peak_bytes


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str, unit: str = "B") -> float:
    """``"80GiB"`` -> 85899345920, ``"50GB/s"`` (``unit="B/s"``) -> 5e10, ``"400T"`` -> 4e14."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kmgtpKMGTP]i?)?\s*(" + re.escape(unit) + r"|FLOPS|FLOP/s)?\s*", text)
    try:
        value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()] if m else None
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise ValueError(f"cannot read {text!r}; write a positive number with an optional unit, e.g. "
                         f"80GiB, 50GB/s, 400T")
    return value


def _progress(t0: float, r: Row) -> None:
    print(f"  {label(r.candidate)}: {size(r.estimate.peak_bytes)}, {r.us_per_token:.4g} GPU-us/token "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write comma-separated integers, e.g. 1,2,4,8") from None


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the sweep's workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv: list[str] | None = None) -> Plan:
    ap = argparse.ArgumentParser(prog="python -m fsdptag.plan", description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--memory", required=True, help="per-GPU memory budget, e.g. 80GiB")
    ap.add_argument("--tp", type=_ints, default=[1], help="TP degrees to try, e.g. 1,2,4,8 (default 1)")
    ap.add_argument("--batch", type=_ints, default=[1],
                    help="sequences per data-parallel rank and microbatch, e.g. 1,2")
    ap.add_argument("--hsdp", type=_ints, default=[1], metavar="R,...",
                    help="HSDP replica counts to try (1: fully sharded; e.g. 1,8: also 8 replicas)")
    ap.add_argument("--microbatches", type=_ints, default=[1], metavar="M,...",
                    help="forward+backward passes per optimizer step to try, all but the last without sync")
    ap.add_argument("--ac", type=lambda s: s.split(","), default=list(AC_MODES),
                    help=f"AC modes to try (default {','.join(AC_MODES)})")
    ap.add_argument("--bandwidth", default="50GB/s", help="data-parallel bytes/s per GPU (Note [Time proxy])")
    ap.add_argument("--tp-bandwidth", default="450GB/s", help="TP bytes/s per GPU")
    ap.add_argument("--partial-reshard", type=_ints, default=[], metavar="K,...",
                    help="also try reshard_after_forward=K (kept sharded over K ranks, e.g. 8: one node)")
    ap.add_argument("--partial-bandwidth", default="450GB/s",
                    help="bytes/s per GPU of the K-rank re-gathers (default: within a node)")
    ap.add_argument("--device-flops", default="400T", help="FLOP/s per GPU")
    ap.add_argument("--no-overlap", action="store_true",
                    help="time proxy comm + compute, as if nothing overlapped (Note [Time proxy])")
    ap.add_argument("--plot", default=None, metavar="OUT.png", help="memory vs time proxy (needs matplotlib)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--all", action="store_true", help="also print every configuration")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="processes estimating TP degrees side by side (default: the CPUs, here %(default)s)")
    ap.add_argument("--full-depth", action="store_true",
                    help="run every block of every estimate instead of composing (the same numbers, slower)")
    args = ap.parse_args(argv)
    rates = Rates(parse_bytes(args.bandwidth, "B/s"), parse_bytes(args.tp_bandwidth, "B/s"),
                  parse_bytes(args.partial_bandwidth, "B/s"), parse_bytes(args.device_flops, "FLOP/s"),
                  overlap=not args.no_overlap)
    memory = int(parse_bytes(args.memory))
    if args.plot:
        pyplot()  # before the sweep, not after it
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    p = plan(spec_from_args(args), args.world_size, memory, tp=args.tp, batch=args.batch, ac=args.ac,
             rates=rates, progress=functools.partial(_progress, t0), partial=args.partial_reshard,
             hsdp=args.hsdp, microbatches=args.microbatches, compose=not args.full_depth, jobs=args.jobs)
    seq = p.rows[0].estimate.seq_len if p.rows else args.seq_len
    print(f"{p.model}: world {p.world_size}, seq {seq}, memory {size(memory)} per GPU; time proxy: "
          f"bytes sent / {rates.bandwidth / 1e9:g} GB/s (data parallel), / {rates.tp_bandwidth / 1e9:g} GB/s (TP) "
          f"+ FLOPs / {rates.device_flops / 1e12:g} TFLOP/s, "
          f"{'exposed communication only' if rates.overlap else 'no overlap'}; {len(p.rows)} configurations estimated in "
          f"{time.perf_counter() - t0:.0f} s ({cpu_seconds() - cpu0:.0f} s CPU, {min(args.jobs, len(args.tp))} "
          f"process{'es' if min(args.jobs, len(args.tp)) > 1 else ''})\n")
    print(format_plan(p, args.all))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": p.model, "world_size": p.world_size, "memory_bytes": p.memory_bytes,
                       "rates": asdict(rates), "skipped": p.skipped, "keep_last": p.keep_last,
                       "rows": [{**asdict(r.candidate), **r.estimate.report(), "comm_s": r.comm_s,
                                 "compute_s": r.compute_s, "exposed_s": r.exposed_s, "us_per_token": r.us_per_token, "fits": r.fits,
                                 "pareto": r.pareto} for r in p.rows]}, f, indent=1)
    if args.plot:
        plot(p, args.plot)
    return p


if __name__ == "__main__":
    main(sys.argv[1:])
