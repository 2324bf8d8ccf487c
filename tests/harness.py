"""Helpers shared by the multi-rank tests.

Starting ranks costs seconds, so tests run many cases per launch: a worker runs
``run_cases`` and returns a dict per rank; the pytest functions read a case with
``result``, which fails on an error from *any* rank, naming the rank and the case.

Collectives time out after ``COLLECTIVE_TIMEOUT_S``: a case that leaves the ranks
out of step (one rank skips or adds a collective) fails within that time, and the
launch stops running cases, so every later case reports which case broke it.
"""

from __future__ import annotations

import os
import tempfile
import traceback
import warnings
from typing import Callable

import pytest
import torch
import torch.distributed as dist

import fsdptag
from fsdptag.testing.launch import spawn

__all__ = ["launch", "run_cases", "result", "parametrize_error", "COLLECTIVE_TIMEOUT_S"]

COLLECTIVE_TIMEOUT_S = 30.0
_ABORTED = "__aborted__"


class RankResults(dict):
    """Rank 0's case results (as a dict), with every rank's of every launch merged
    into it in ``ranks``."""

    ranks: list[dict]

    def update(self, other: dict) -> None:
        super().update(other)
        self.ranks = self.ranks + getattr(other, "ranks", [other])


_PROGRESS = "FSDPTAG_TEST_PROGRESS_DIR"  # where run_cases notes the case each rank is in
_FAULTS = "FSDPTAG_FAULT_DIR"  # where a crashing rank's faulthandler writes (fsdptag.testing.launch)


def launch(world_size: int, worker: Callable, *args, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> RankResults:
    """Run ``worker(*args)`` on ``world_size`` ranks; it returns ``run_cases(...)``.

    A rank that dies (gloo aborts the process on some mismatched collectives) fails
    the launch with the case each rank was running, with the crashed rank's stacks
    (faulthandler). A rank killed by SIGSEGV (seen once in ~15 suite runs, in
    torch.distributed.checkpoint's load on CPU, not reproduced since) is retried once,
    loudly: a warning carries those stacks; a second crash fails."""
    try:
        return _launch_once(world_size, worker, *args, timeout_s=timeout_s)
    except _RankCrashed as e:
        warnings.warn(f"{e}; retrying the launch once", RuntimeWarning)
        return _launch_once(world_size, worker, *args, timeout_s=timeout_s)


class _RankCrashed(RuntimeError):
    pass


def _launch_once(world_size: int, worker: Callable, *args, timeout_s: float) -> RankResults:
    with tempfile.TemporaryDirectory() as progress:
        os.environ[_PROGRESS] = os.environ[_FAULTS] = progress  # inherited by the spawned ranks
        try:
            ranks = spawn(world_size, worker, *args, all_ranks=True, timeout_s=timeout_s)
        except Exception as e:
            where = ", ".join(f"rank {r}: {_read(os.path.join(progress, str(r)))}" for r in range(world_size))
            faults = "".join(_read(os.path.join(progress, f"fault{r}"), "") for r in range(world_size))
            # SIGSEGV only: gloo aborts (SIGABRT) a rank on mismatched collectives, a real failure
            error = _RankCrashed if getattr(e, "signal_name", None) == "SIGSEGV" else RuntimeError
            raise error(f"{worker.__name__} on {world_size} ranks died ({where}): {e}"
                        + (f"\n{faults}" if faults else "")) from e
        finally:
            del os.environ[_PROGRESS], os.environ[_FAULTS]
    if not isinstance(ranks[0], dict):
        return ranks[0]
    out = RankResults(ranks[0])
    out.ranks = ranks
    return out


def run_cases(cases: dict[str, Callable]) -> dict:
    """Run each case on every rank; a raising case is recorded, not fatal to the launch,
    as long as it raised on every rank. A case that raised on some ranks only, or left
    the ranks out of step, stops the launch: later cases would be meaningless."""
    out: dict = {}
    world = dist.get_world_size()
    progress = os.environ.get(_PROGRESS)
    for name, case in cases.items():
        if progress:
            with open(os.path.join(progress, str(dist.get_rank())), "w") as f:
                f.write(f"in case {name!r}")
        failed = 0
        try:
            out[name] = case()
        except Exception:  # reported by the test that reads this case
            out[name] = f"ERROR on rank {dist.get_rank()}\n" + traceback.format_exc()
            failed = 1
        try:
            flag = torch.tensor([failed])
            dist.all_reduce(flag)  # also the barrier between cases
        except Exception as e:
            out[_ABORTED] = f"ranks out of step after case {name!r} ({type(e).__name__}: {e})"
            break
        if 0 < flag.item() < world:
            out[_ABORTED] = f"case {name!r} raised on {flag.item()} of {world} ranks only"
            break
    return out


def _read(path: str, missing: str = "before any case") -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return missing


def result(results: dict, name: str):
    """A case's value on rank 0, failing the test if the case raised on any rank or did
    not run because an earlier case broke the launch."""
    per_rank = getattr(results, "ranks", [results])
    errors = [r[name] for r in per_rank if isinstance(r.get(name), str) and r[name].startswith("ERROR")]
    if errors:
        pytest.fail(f"case {name!r} raised:\n" + "\n".join(errors))
    if name not in results:
        why = "; ".join(sorted({r[_ABORTED] for r in per_rank if _ABORTED in r})) or "no such case"
        pytest.fail(f"case {name!r} did not run: {why}")
    return results[name]


def parametrize_error(make_model: Callable, **kwargs) -> str:
    """Call ``fsdptag.parametrize`` on a fresh model expecting a clear error.

    Returns "<type>: <message>", with "[MODEL CHANGED]" appended if the failed
    call touched the model's parameters or module classes, or "no error".
    """
    model = make_model()
    before = {n: (id(p), type(p)) for n, p in model.named_parameters()}
    classes = [type(m) for m in model.modules()]
    try:
        fsdptag.parametrize(model, **kwargs)
        return "no error"
    except (ValueError, TypeError) as e:
        msg = f"{type(e).__name__}: {e}"
    unchanged = (before == {n: (id(p), type(p)) for n, p in model.named_parameters()}
                 and classes == [type(m) for m in model.modules()])
    return msg + ("" if unchanged else "  [MODEL CHANGED]")
