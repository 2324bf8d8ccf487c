"""What checkpointing costs a training step: no checkpoints, sync saves, async saves, side by side.

    .venv/bin/python examples/bench_checkpoint.py
    .venv/bin/python examples/bench_checkpoint.py --nproc 2 --dim 256 --layers 4 --steps 40 --every 5 --repeats 3

Runs ``train_llama.py --no-trace`` under torchrun once per mode and repeat (the
modes take turns in a rotating order, so a busy machine slows all of them alike) and
prints, per mode, the median over repeats of: the loop's wall time per step
(training, saves, waiting for the last async save), the median step without the
save, and the median time a save blocked the loop (for async: waiting for the
previous save, taking the state dict and copying it to CPU memory); then each mode's
cost per step and per save over no checkpoints.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile

from fault_matrix import torchrun

_SUMMARY = re.compile(r"median step (\d+) ms.*?loop (\S+) s(?:.*?blocking median (\d+) ms)?")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="--checkpoint-every")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model = ["--dim", str(args.dim), "--layers", str(args.layers), "--heads", "8", "--kv-heads", "4",
             "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--no-trace", "--eval-every", "100000"]
    results: dict[str, list[tuple[float, float, float]]] = {"none": [], "sync": [], "async": []}
    size = ""
    modes = list(results)
    for repeat in range(args.repeats):
        for mode in modes[repeat % 3:] + modes[:repeat % 3]:  # each mode in each position in turn
            with tempfile.TemporaryDirectory() as tmp:
                ckpt = [] if mode == "none" else ["--checkpoint-dir", tmp, "--checkpoint-every", str(args.every),
                                                  "--checkpoint-mode", mode, "--keep-last", "1"]
                run = torchrun(args.nproc, [*model, *ckpt]).check()
            step, loop, blocking = _SUMMARY.search(run.stdout).groups()
            results[mode].append((float(loop) / args.steps * 1e3, float(step), float(blocking or 0)))
            size = size or next(iter(re.findall(r"\((?:sync|async), (\d+ KiB)", run.stdout)), "")
            print(f"  {mode:<5} loop/step {results[mode][-1][0]:6.1f} ms  step {step} ms  "
                  f"save blocks {blocking or '-'} ms", file=sys.stderr, flush=True)
    saves = args.steps // args.every
    print(f"{args.nproc} ranks, dim {args.dim}, {args.layers} blocks, seq {args.seq_len}, {args.steps} steps, "
          f"a save every {args.every} ({saves} saves of {size}), median of {args.repeats} runs:")
    print(f"| checkpoints | loop per step | step (no save) | a save blocks | cost per step | cost per save |")
    print(f"|---|---|---|---|---|---|")
    base = statistics.median(r[0] for r in results["none"])
    for mode, rows in results.items():
        loop, step, blocking = (statistics.median(r[i] for r in rows) for i in range(3))
        cost = loop - base
        print(f"| {mode} | {loop:.1f} ms | {step:.0f} ms | {'-' if mode == 'none' else f'{blocking:.0f} ms'} | "
              f"{'-' if mode == 'none' else f'{cost:+.1f} ms'} | "
              f"{'-' if mode == 'none' else f'{cost * args.steps / saves:+.0f} ms'} |")


if __name__ == "__main__":
    main()
