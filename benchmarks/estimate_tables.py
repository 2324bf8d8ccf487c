"""The README's estimator tables: Llama 3 8B and 70B, zero2/zero3 x full/selective AC.

    python benchmarks/estimate_tables.py [MODEL:WORLD:TP ...] > estimate_tables.md

Runs ``fsdptag.estimate`` (fake tensors, one rank) for llama3-8b at world 64 with
TP 8 and TP 1 and llama3-70b at world 256 with TP 8 (or the setups given), seq 8192,
batch 1, bf16.
"""

from __future__ import annotations

import sys
import time

from fsdptag.estimate import estimate

SETUPS = [("llama3-8b", 64, 8), ("llama3-8b", 64, 1), ("llama3-70b", 256, 8)]


def main() -> None:
    setups = [(m, int(w), int(t)) for m, w, t in (a.split(":") for a in sys.argv[1:])] or SETUPS
    for model, world, tp in setups:
        t0 = time.perf_counter()
        print(f"\n#### {model}, world {world}, TP {tp} (rank 0, GiB)\n")
        print("| zero | AC | policy | peak | kept for bwd | gathered params | TP collectives | casts |")
        print("|---|---|---|---|---|---|---|---|")
        for reshard in (False, True):
            for ac in ("full", "selective"):
                for r in estimate(model, world, tp=tp, reshard_after_forward=reshard, ac=ac):
                    g = lambda n: f"{n / 2**30:.2f}"
                    print(f"| {3 if reshard else 2} | {ac} | {r.policy} | {g(r.peak_bytes)} | "
                          f"{g(r.activation_bytes)} | {g(r.gathered_param_bytes)} | "
                          f"{g(r.kept_collective_bytes)} | {g(r.kept_cast_bytes)} |", flush=True)
        print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
