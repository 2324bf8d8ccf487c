"""Kill a rank, resume, compare bit for bit: every fault against an uninterrupted run.

    .venv/bin/python examples/fault_matrix.py            # the full matrix: 40 torchrun launches
    .venv/bin/python examples/fault_matrix.py --quick    # one row per fault kind

For each configuration ({zero2, zero3} x {no AC, full AC}, on 2 ranks and with TP 2
on 4 ranks) it runs ``train_llama.py`` uninterrupted for 8 steps, then once per fault
(``exit@5``: rank 1 dies at the start of step 5; ``kill-in-save@4``: rank 1 dies while
writing checkpoint step-4; each with sync and async saves) under ``torchrun
--max-restarts 1`` with checkpoints every 2 steps, and prints which checkpoint the
restarted attempt resumed from and whether the final parameters and optimizer states
(``--state-digest``) are bitwise equal to the uninterrupted run's. ``tests/test_train_example.py``
runs a subset with the helpers below.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train_llama.py")
# A model small enough that a 4-rank launch takes seconds on two CPU cores.
TINY = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "16",
        "--no-trace", "--eval-every", "4", "--eval-batches", "1", "--timeout-s", "120"]
_STEP_LINE = re.compile(r"^step +(\d+)/\d+ .*?loss (\S+)", re.M)
_HELD_OUT = re.compile(r"^held-out loss (\S+) at step (\d+)", re.M)


@dataclass
class Run:
    """One torchrun launch of train_llama.py: exit code, rank 0's output, what it printed."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def losses(self) -> dict[int, float]:
        """Training loss by step (the last attempt's value where a step ran twice)."""
        return {int(s): float(v) for s, v in _STEP_LINE.findall(self.stdout)}

    @property
    def held_out(self) -> dict[int, float]:
        return {int(s): float(v) for v, s in _HELD_OUT.findall(self.stdout)}

    @property
    def resumed_from(self) -> list[str]:
        return re.findall(r"^checkpoint: resumed from (\S+)", self.stdout, re.M)

    def lines(self, prefix: str) -> list[str]:
        return [line for line in (self.stdout + self.stderr).splitlines() if line.startswith(prefix)]

    def check(self) -> "Run":
        if self.returncode != 0:
            raise AssertionError(f"torchrun exited with {self.returncode}\n--- stdout\n{self.stdout[-4000:]}"
                                 f"\n--- stderr\n{self.stderr[-4000:]}")
        return self


def torchrun(nproc: int, args: list[str], *, max_restarts: int = 0, timeout_s: float = 300) -> Run:
    """Run ``torchrun --standalone --nproc-per-node nproc [--max-restarts N] train_llama.py args``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", TRAIN, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
    return Run(p.returncode, p.stdout, p.stderr, time.perf_counter() - t0)


def digest(path: str) -> str:
    with open(path) as f:
        return json.load(f)["sha256"]


def config_args(zero: int, ac: str, tp: int) -> list[str]:
    return ["--reshard-after-forward", "true" if zero == 3 else "false", "--ac", ac, "--tp", str(tp)]


def faulted(tmp: str, nproc: int, config: list[str], faults: list[str], *, mode: str = "async",
            steps: int = 8, extra: list[str] = ()) -> Run:
    """``train_llama.py`` under ``torchrun --max-restarts len(faults)``, checkpointing every
    2 steps into ``tmp/ckpt`` (keeping 2), each fault armed in its own attempt; the final
    state's digest goes to ``tmp/faulted.json``."""
    args = [*TINY, *config, "--steps", str(steps), "--checkpoint-dir", os.path.join(tmp, "ckpt"),
            "--checkpoint-every", "2", "--keep-last", "2", "--checkpoint-mode", mode,
            "--state-digest", os.path.join(tmp, "faulted.json"), *extra]
    for fault in faults:
        args += ["--fault", fault]
    return torchrun(nproc, args, max_restarts=len(faults)).check()


def uninterrupted(tmp: str, nproc: int, config: list[str], *, steps: int = 8, extra: list[str] = ()) -> Run:
    """The same training without checkpoints or faults; its digest goes to ``tmp/uninterrupted.json``."""
    return torchrun(nproc, [*TINY, *config, "--steps", str(steps), *extra,
                            "--state-digest", os.path.join(tmp, "uninterrupted.json")]).check()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one configuration per fault kind")
    args = p.parse_args()
    faults = [("exit@5", "async"), ("exit@5", "sync"), ("kill-in-save@4", "async"), ("kill-in-save@4", "sync")]
    rows = {(2 * tp, zero, ac, tp): faults for tp in (1, 2) for zero in (2, 3) for ac in ("none", "full")}
    if args.quick:
        rows = {(2, 2, "full", 1): faults[:1], (2, 3, "none", 1): faults[3:], (4, 2, "none", 2): faults[2:3]}
    print(f"{'ranks':>5} {'zero':>4} {'AC':>4} {'TP':>2}  {'fault':<15} {'save':<5} {'resumed from':<13} "
          f"{'bitwise':<7} {'s':>5}", flush=True)
    failures = 0
    for (nproc, zero, ac, tp), row_faults in rows.items():
        config = config_args(zero, ac, tp)
        with tempfile.TemporaryDirectory() as ref_dir:
            uninterrupted(ref_dir, nproc, config)
            reference = digest(os.path.join(ref_dir, "uninterrupted.json"))
        for fault, mode in row_faults:
            with tempfile.TemporaryDirectory() as tmp:
                run = faulted(tmp, nproc, config, [fault], mode=mode)
                bitwise = digest(os.path.join(tmp, "faulted.json")) == reference
            resumed = ",".join(os.path.basename(p) for p in run.resumed_from) or "-"
            failures += not bitwise
            print(f"{nproc:>5} {zero:>4} {ac:>4} {tp:>2}  {fault:<15} {mode:<5} {resumed:<13} "
                  f"{str(bitwise):<7} {run.seconds:5.1f}", flush=True)
    print("all bitwise equal" if not failures else f"{failures} NOT bitwise equal")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
