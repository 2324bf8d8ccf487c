"""Micro-benchmark of the tag's cost: microseconds per op on a plain tensor, on a marked
one (what compute gets: Note [Marked handout]) and on a tagged one (the FSDP path), and
per checkpoint-policy call.

    python benchmarks/dispatch_overhead.py

Single process, CPU, 64x64 fp32 tensors; median of 7 runs of 2000 calls each.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.checkpoint import SelectiveCheckpointContext

from fsdptag import FSDPTag, FSDPTaggedTensor, checkpoint_policy
from fsdptag._tag import mark_gathered

aten = torch.ops.aten


def _us(fn, n: int = 2000, runs: int = 7) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    plain = torch.randn(64, 64)
    tagged = FSDPTaggedTensor(plain.clone(), FSDPTag("w", False))
    marked = mark_gathered(plain.clone(), FSDPTag("w", False))
    x = torch.randn(8, 64)
    # tagged: all but mm keep the tag; marked: the views share the marked storage,
    # the cast and mm make new, unmarked storage.
    ops = {
        "t()": lambda w: w.t(),
        "view": lambda w: w.view(-1),
        "narrow": lambda w: w.narrow(0, 0, 32),
        "_to_copy bf16": lambda w: w.to(torch.bfloat16),
        "mm": lambda w: torch.mm(x, w),
    }
    print("| op | plain µs | marked µs | tagged µs | tagged overhead µs |")
    print("|---|---|---|---|---|")
    for name, op in ops.items():
        p, m, t = _us(lambda: op(plain)), _us(lambda: op(marked)), _us(lambda: op(tagged))
        print(f"| {name} | {p:.1f} | {m:.1f} | {t:.1f} | {t - p:.1f} |")

    policy = checkpoint_policy([aten.mm.default])
    ctx_tagged = SelectiveCheckpointContext(is_recompute=False, op_output=tagged)
    ctx_plain = SelectiveCheckpointContext(is_recompute=False, op_output=plain)
    print()
    print("| policy call | µs |")
    print("|---|---|")
    print(f"| tagged output (all_gather) | "
          f"{_us(lambda: policy(ctx_tagged, torch.ops._c10d_functional.all_gather_into_tensor.default)):.2f} |")
    print(f"| plain output (mm, to the base list) | {_us(lambda: policy(ctx_plain, aten.mm.default)):.2f} |")
    ctx_marked = SelectiveCheckpointContext(is_recompute=False, op_output=marked.t())
    print(f"| marked view (t() of a gathered parameter) | {_us(lambda: policy(ctx_marked, aten.t.default)):.2f} |")


if __name__ == "__main__":
    main()
