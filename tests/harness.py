"""Helpers shared by the multi-rank tests.

Starting ranks costs seconds, so tests run many cases per launch: a worker runs
``run_cases`` and returns a dict; the pytest functions read entries with ``result``.
"""

from __future__ import annotations

import traceback
from typing import Callable

import pytest
import torch.distributed as dist

import fsdptag
from fsdptag.testing.launch import spawn as launch

__all__ = ["launch", "run_cases", "result", "parametrize_error"]


def run_cases(cases: dict[str, Callable]) -> dict:
    """Run each case on every rank; a raising case is recorded, not fatal to the launch."""
    out = {}
    for name, case in cases.items():
        try:
            out[name] = case()
        except Exception:  # reported by the test that reads this case
            out[name] = "ERROR\n" + traceback.format_exc()
        dist.barrier()
    return out


def result(results: dict, name: str):
    """A case's value, failing the test with rank 0's traceback if it raised."""
    value = results[name]
    if isinstance(value, str) and value.startswith("ERROR"):
        pytest.fail(f"case {name!r} raised on rank 0:\n{value}")
    return value


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
