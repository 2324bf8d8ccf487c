"""Mutation testing: plant one realistic bug at a time and check that the tests notice.

    .venv/bin/python scripts/mutate.py [--only NAME ...] [--list] [--write docs/mutation.md]

Each mutant replaces one exact snippet of one file (the script stops if the snippet is
not found exactly once: the code moved, update the table). The working tree (tracked
and untracked-but-not-ignored files, as they are on disk now) is copied once into a
snapshot (or, with ``--rev``, a commit is); each mutant runs in a fresh copy of it with
``PYTHONPATH=<copy>``, so the copy's ``fsdptag`` shadows the editable install, in
pytest and in the ranks the tests spawn (checked once per run). A baseline run of the
same test files on the unmutated copy comes first: a mutant only counts as killed if
the tests passed without it. Results: killed (the tests failed), survived (they
passed), timeout (killed by the per-mutant timeout, e.g. ranks that deadlock).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARAM, CKPT, EST, REL, INTEG, UNIT = ("tests/test_parametrize.py", "tests/test_checkpoint.py", "tests/test_estimate.py",
                                      "tests/test_reliability.py", "tests/test_integrations.py", "tests/unit")
FLOAT8 = "tests/test_float8.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    plants: str  # the bug, in words
    file: str
    old: str  # must occur exactly once in file
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("tag-no-pad", "tag table drops constant_pad_nd (uneven shards: only padding ranks lose the tag)",
           "fsdptag/_tag.py", "    aten.constant_pad_nd.default,\n", "", (PARAM,)),
    Mutant("tag-no-slice", "tag table drops slice.Tensor from the view rule (DTensor's unpad)",
           "fsdptag/_tag.py", "    aten.slice.Tensor,\n", "", (PARAM,)),
    Mutant("zero2-ac-recomputes", "checkpoint policy recomputes zero2 all-gathers instead of saving",
           "fsdptag/_checkpoint.py",
           "if not tag.reshard_after_forward and func is _ALL_GATHER:\n            return save",
           "if not tag.reshard_after_forward and func is _ALL_GATHER:\n            return recompute", (CKPT,)),
    Mutant("regather-keeps-buffers", "zero3 re-gather never drops its buffers after the last unpack",
           "fsdptag/_reshard.py", "        if self.pending == 0:\n            self.buffers = None\n", "",
           (PARAM, REL)),
    Mutant("zero3-pack-keeps", "zero3 pack hook keeps zero3 tensors (condition inverted: no freeing)",
           "fsdptag/_reshard.py", "        if not tag.reshard_after_forward:\n            return t",
           "        if tag.reshard_after_forward:\n            return t", (PARAM,)),
    Mutant("bucket-marks-reversed", "bucket copy-out marks piece i with the tag of the mirrored parameter",
           "fsdptag/_bucket_gather.py", "zip(pieces, bucket.tag.parts)", "zip(pieces, reversed(bucket.tag.parts))",
           (PARAM,)),
    Mutant("slot-floor-rows", "bucket slot padded to rows // world instead of ceil(rows / world)",
           "fsdptag/_layout.py", "Slot(offset, rows, -(-rows // world),", "Slot(offset, rows, rows // world,",
           (PARAM,)),
    Mutant("bucket-no-version-check", "bucket scope no longer checks version counters when forward returns",
           "fsdptag/_scopes.py",
           "            check_unchanged((scope.gathered[p], v, p.fqn) for p, v in scope.versions.items())\n", "",
           (PARAM,)),
    Mutant("handouts-never-checked", "Handouts.close checks the frame it just cleared (never checks)",
           "fsdptag/_param.py", "for ref, version, fqn in handed or ())", "for ref, version, fqn in self._frame or ())",
           (PARAM,)),
    Mutant("bucket-reduce-param-dtype", "bucket backward packs gradients in their own (param) dtype, not reduce_dtype",
           "fsdptag/_bucket_gather.py", "dtype=bucket.reduce_dtype or grads[0].dtype)", "dtype=grads[0].dtype)", (PARAM,)),
    Mutant("param-reduce-param-dtype", "per-parameter gather reduces gradients in param_dtype",
           "fsdptag/_param.py", "backward_dtype=self.reduce_dtype,", "backward_dtype=self.param_dtype,", (PARAM,)),
    Mutant("estimate-short-tokens", "estimator builds seq_len tokens instead of seq_len + 1 (one short)",
           "fsdptag/tools/estimate.py", "(c.batch, spec.seq_len + 1))", "(c.batch, spec.seq_len))", (EST,)),
    Mutant("estimate-split-swapped", "estimator reports kept TP-collective and cast bytes swapped",
           "fsdptag/tools/measure.py",
           '"kept_collective_bytes": kept.get("collective", 0),\n        "kept_cast_bytes": kept.get("cast", 0),',
           '"kept_collective_bytes": kept.get("cast", 0),\n        "kept_cast_bytes": kept.get("collective", 0),',
           (EST,)),
    Mutant("estimate-fake-wait-allocates", "estimator no longer makes wait_tensor alias its input",
           "fsdptag/tools/measure.py", "            return args[0]\n", "            return func(*args, **(kwargs or {}))\n",
           (EST,)),
    Mutant("prefetch-no-drain-wait", "prefetcher drops unclaimed all-gathers without waiting for them",
           "fsdptag/_prefetch.py",
           "            self.pending.pop(bucket).wait()\n\n\ndef _successors", "            self.pending.pop(bucket)\n\n\ndef _successors",
           (PARAM,)),
    Mutant("prefetch-seen-by-sac", "the prefetch inside a SAC region is recorded by its replay",
           "fsdptag/_prefetch.py", "with sac_hidden(), torch.no_grad():\n            for following in ahead:",
           "with torch.no_grad():\n            for following in ahead:", (UNIT,)),
    Mutant("prefetch-not-served", "a prefetched bucket's gather in a SAC region skips the served ops",
           "fsdptag/_bucket_gather.py", "        if prefetched is not None and tagged:  # issued ahead",
           "        if False:  # issued ahead", (UNIT,)),
    Mutant("backward-end-once-ever", "the end-of-backward callback is queued in the first backward only (a stale flag)",
           "fsdptag/_compat/__init__.py", "        if task != self.queued_for:", "        if self.queued_for == -1:", (UNIT,)),
    Mutant("reduction-waited-at-once", "a bucket's gradient reduction is waited right after its issue",
           "fsdptag/_collectives.py", "        if not lazy or r.post_divide is not None or self.limit == 0:",
           "        if True:", (UNIT,)),
    Mutant("no-input-cast", "root pre-forward casts the inputs but drops the result (missing return)",
           "fsdptag/_state.py", "            return apply_to_tensors(self._cast, (args, kwargs))\n        return None",
           "            apply_to_tensors(self._cast, (args, kwargs))\n        return None", (PARAM,)),
    Mutant("zero3-hooks-in-backward", "zero3 hooks also pushed inside backward (recompute)",
           "fsdptag/_reshard.py", "(context is GatherContext.FORWARD and when_none)",
           "(context in (GatherContext.FORWARD, GatherContext.RECOMPUTE) and when_none)", (INTEG,)),
    Mutant("others-hooks-win", "someone else's saved-tensor hooks get the gathered parameters (save_on_cpu: zero3 kept)",
           "fsdptag/_reshard.py", "if context is not GatherContext.OTHER_HOOKS and not (", "if not (", (UNIT,)),
    Mutant("policy-tag-no-views", "torch 2.11's derived output tag misses views of a marked handout",
           "fsdptag/_tag.py", "    if args and _aliases_input(func):\n", "    if False:\n", (UNIT,)),
    Mutant("hsdp-no-replicate-reduce", "bucket backward all-reduces over the replicate dim only for DDP (HSDP skips it)",
           "fsdptag/_collectives.py", "if r.replicate_group is not None:",
           "if r.replicate_group is not None and r.world == 1:", (PARAM,)),
    Mutant("bucket-avg-ignores-replicas", "bucket gradient all-reduce sums over replicas instead of averaging",
           "fsdptag/_collectives.py", "c10d.all_reduce(flat, r.op, r.replicate_group)",
           'c10d.all_reduce(flat, "sum", r.replicate_group)', (PARAM,)),
    Mutant("bucket-grad-sum", "bucket gradients summed, not averaged, in fp32 / bf16",
           "fsdptag/_collectives.py", 'replicate_group, "avg", None, None)', 'replicate_group, "sum", None, None)',
           (PARAM,)),
    Mutant("param-grad-sum", "per-parameter gradients reduced with sum instead of avg",
           "fsdptag/_param.py", '(Partial("avg" if divide is None else "sum"),)', '(Partial("sum"),)', (PARAM,)),
    Mutant("scope-ignores-ac-region", "bucket scope serves accesses from any checkpoint region",
           "fsdptag/_access.py", "if not bucket.scopes or bucket.scopes[-1].region is not sac_region():",
           "if not bucket.scopes:",
           (UNIT,)),
    Mutant("keep-never-found", "a checkpoint's recompute never finds the zero2 gather kept for it (re-gathers)",
           "fsdptag/_keep.py", "        if ZERO2[gather_context()] is not Zero2.SERVE_KEPT:\n            return None\n"
           "        self.owned", "        return None\n        self.owned", (INTEG,)),
    Mutant("full-ac-plain-everywhere", "full AC is a plain checkpoint even where zero2 gathers are not kept (a block reads a root-bucket parameter)",
           "fsdptag/_ac.py", "return bool(states) and all(", "return bool(states) or all(", (UNIT,)),
    Mutant("float8-local-scales", "float8 scales from this rank's shard alone (no all-reduce of the amax)",
           "fsdptag/_float8.py", "        if self.world > 1:\n            amax = c10d.wait_tensor(",
           "        if False:\n            amax = c10d.wait_tensor(", (FLOAT8,)),
    Mutant("float8-backward-rescales", "a zero3 float8 re-gather recomputes its scales (an all-reduce in backward)",
           "fsdptag/_float8.py", "if backward and self.forward_scales is not None:", "if False:", (FLOAT8,)),
    Mutant("float8-zero3-keeps", "zero3 hooks keep torchao's float8 weight instead of packing its gathered bytes",
           "fsdptag/_reshard.py", "wrapped = _tagged_inner(t) if tag is None else None", "wrapped = None", (FLOAT8,)),
]

# tests/harness.py's report of ranks that went out of step (a collective timed out).
_DESYNC = re.compile(r"ranks out of step after case '([^']+)'|case '([^']+)' raised on \d+ of \d+ ranks only")
# The ranks' fsdptag must be the copy's: spawned like the tests spawn them.
_IMPORT_CHECK = ("from fsdptag.testing.launch import spawn; import fsdptag; "
                 "print(fsdptag.__file__); print(*spawn(2, eval, \"__import__('fsdptag').__file__\", all_ranks=True))")


def python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True).stdout


def snapshot(dest: Path, rev: str | None) -> str:
    """Copy commit ``rev``, or the working tree (tracked + untracked, not ignored), to
    ``dest``; returns what was copied, for the report."""
    dest.mkdir(parents=True)
    if rev is not None:
        with tarfile.open(fileobj=io.BytesIO(git("archive", rev))) as tar:
            tar.extractall(dest, filter="data")
        return f"commit {git('rev-parse', '--short', rev).decode().strip()}"
    for f in filter(None, git("ls-files", "-z", "--cached", "--others", "--exclude-standard").decode().split("\0")):
        if (ROOT / f).is_file():  # not deleted in the working tree
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    dirty = git("status", "--porcelain", "--", "fsdptag", "tests")
    return (f"the working tree at commit {git('rev-parse', '--short', 'HEAD').decode().strip()}"
            + (" with uncommitted changes" if dirty else ""))


def mutated(m: Mutant, root: Path) -> str:
    """``m.file`` under ``root`` with the mutation applied; stops if the snippet moved."""
    text = (root / m.file).read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutant {m.name}: snippet found {n} times in {m.file} (code moved?):\n{m.old}")
    return text.replace(m.old, m.new)


def env_for(copy: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports(copy: Path) -> None:
    out = subprocess.run([python(), "-c", _IMPORT_CHECK], cwd=copy, env=env_for(copy),
                         capture_output=True, text=True, timeout=300)
    paths = out.stdout.split()
    if out.returncode or len(paths) != 3 or not all(p.startswith(str(copy)) for p in paths):
        raise SystemExit(f"the copy's fsdptag is not the one imported:\n{out.stdout}{out.stderr}")


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """("passed" | "failed (why)" | "timeout", seconds, pytest output) for ``tests`` in ``copy``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([python(), "-m", "pytest", "-x", "-q", *tests],
                            cwd=copy, env=env_for(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # its own group: spawned ranks die with it
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "passed" if proc.returncode == 0 else f"failed ({why_failed(out) or f'exit {proc.returncode}'})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, status = proc.communicate()[0], "timeout"
    except BaseException:  # interrupted: take the ranks down too
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return status, time.perf_counter() - t0, out


def why_failed(out: str) -> str | None:
    """A rank desync the harness reported (the tests after it fail only because their
    cases never ran), else the first failing test."""
    desync = _DESYNC.search(out)
    if desync:
        return f"ranks out of step in case '{desync.group(1) or desync.group(2)}'"
    failed = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, re.M)  # ids may hold spaces
    return failed and failed.group(1).split("::")[-1]


def table(rows: list[tuple[str, str, tuple[str, ...], str, float]]) -> str:
    lines = ["| mutant | what it plants | tests run | result | s |", "|---|---|---|---|---|"]
    for name, plants, tests, result, secs in rows:
        tests_s = ", ".join(Path(t).name for t in tests)
        lines.append(f"| `{name}` | {plants} | {tests_s} | **{result}** | {secs:.0f} |")
    return "\n".join(lines)


HEADER = """# Mutation testing

Each row plants one realistic bug (`scripts/mutate.py` holds the exact snippet it
replaces) and runs the named test files, `pytest -x`, on a copy of the repository:
**killed** = the tests failed (in parentheses: the first failing test, or the case after
which the ranks went out of step), **survived** = they passed, **timeout** = stopped
after {timeout:.0f} s. The baseline row runs the same files without a mutation. Re-run with

    .venv/bin/python scripts/mutate.py [--only NAME ...] [--write docs/mutation.md]

(`--list` shows the mutants; `--rev HEAD` tests the last commit instead of the working
tree). This run: {source}, {date}.

"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--write", metavar="PATH", help="also write the table (markdown) to PATH")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant (default 600)")
    p.add_argument("--log-dir", help="keep each run's pytest output in DIR/<mutant>.log")
    p.add_argument("--rev", help="test this commit (e.g. HEAD) instead of the working tree")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up the copies and ranks

    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        p.error(f"unknown mutant(s) {sorted(unknown)}; --list shows them")
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:<30} {m.file:<24} {', '.join(m.tests)}\n    {m.plants}")
        return

    with tempfile.TemporaryDirectory(prefix="fsdptag-mutate-") as tmp:
        base = Path(tmp) / "snapshot"
        source = snapshot(base, args.rev)
        for m in mutants:  # every snippet still matches before anything runs
            mutated(m, base)
        check_imports(base)

        def run(name: str, tests: tuple[str, ...], mutant: Mutant | None = None) -> tuple[str, float]:
            copy = Path(tmp) / "run"
            shutil.copytree(base, copy)
            if mutant is not None:
                (copy / mutant.file).write_text(mutated(mutant, copy))
            status, secs, out = run_tests(copy, tests, args.timeout)
            shutil.rmtree(copy)
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                Path(args.log_dir, f"{name}.log").write_text(out)
            if mutant is not None:  # in mutation-testing words
                status = "survived" if status == "passed" else status.replace("failed", "killed", 1)
            print(f"{name:<30} {status:<60} {secs:5.0f} s", flush=True)
            return status, secs

        all_tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
        status, secs = run("baseline", all_tests)
        if status != "passed":
            raise SystemExit("baseline failed: the tests do not pass without a mutation")
        rows = [("baseline", "nothing (unmutated copy)", all_tests, status, secs)]
        rows += [(m.name, m.plants, m.tests, *run(m.name, m.tests, m)) for m in mutants]

    text = table(rows)
    print("\n" + text)
    if args.write:
        Path(args.write).write_text(HEADER.format(
            timeout=args.timeout, source=source, date=time.strftime("%Y-%m-%d")) + text + "\n")


if __name__ == "__main__":
    main()
