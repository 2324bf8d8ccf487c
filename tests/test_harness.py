"""The multi-rank harness hears every rank and fails fast when ranks fall out of step."""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch
import torch.distributed as dist

from .harness import launch, result, run_cases

TIMEOUT_S = 3.0


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise AssertionError("only rank 1 disagrees")
    return "fine"


def _extra_collective_on_rank_1():
    if dist.get_rank() == 1:
        dist.all_reduce(torch.ones(3))  # rank 0 never issues this one: gloo aborts rank 1
    return "issued"


def _rank_0_waits_alone(group):
    if dist.get_rank() == 0:
        dist.barrier(group=group)  # rank 1 never joins: a timeout, not an abort
    return "done"


def _collective():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def worker():
    return run_cases({
        "raises everywhere": lambda: 1 / 0,
        "symmetric": _collective,
        "rank 1 raises": _raise_on_rank_1,
        "never runs": _collective,
    })


def worker_desync():
    return run_cases({"desync": _extra_collective_on_rank_1, "after": _collective})


def worker_skip():
    group = dist.new_group([0, 1])
    return run_cases({"skip": lambda: _rank_0_waits_alone(group), "after": _collective})


@pytest.fixture(scope="module")
def results():
    return launch(2, worker)


def test_every_rank_is_heard(results):
    with pytest.raises(pytest.fail.Exception, match="division by zero"):
        result(results, "raises everywhere")
    assert result(results, "symmetric") == 2.0  # a case raising on every rank stops nothing
    with pytest.raises(pytest.fail.Exception, match="(?s)ERROR on rank 1.*only rank 1 disagrees"):
        result(results, "rank 1 raises")  # rank 0 returned "fine"
    with pytest.raises(pytest.fail.Exception,
                       match="'never runs' did not run: case 'rank 1 raises' raised on 1 of 2 ranks only"):
        result(results, "never runs")


def test_a_rank_that_dies_names_its_case():
    with pytest.raises(RuntimeError, match="worker_desync on 2 ranks died .*rank 1: in case 'desync'"):
        launch(2, worker_desync, timeout_s=TIMEOUT_S)


def test_ranks_out_of_step_fail_in_seconds():
    t0 = time.perf_counter()
    out = launch(2, worker_skip, timeout_s=TIMEOUT_S)
    assert time.perf_counter() - t0 < 30  # start-up included; the gloo default would wait 300 s
    with pytest.raises(pytest.fail.Exception, match="(?s)ERROR on rank 0.*(imeout|timed out)"):
        result(out, "skip")
    with pytest.raises(pytest.fail.Exception, match="'after' did not run: .*case 'skip'"):
        result(out, "after")


def _segfault_on_rank_1(marker):
    """Crash rank 1 the first time (``marker`` does not exist yet)."""
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        ctypes.string_at(0)  # SIGSEGV
    return "survived"


def worker_crash(marker):
    return run_cases({"crash": lambda: _segfault_on_rank_1(marker)})


def test_a_crashed_rank_is_retried_once_loudly(tmp_path):
    with pytest.warns(RuntimeWarning, match="(?s)in case 'crash'.*SIGSEGV.*Fatal Python error.*retrying"):
        out = launch(2, worker_crash, str(tmp_path / "once"), timeout_s=TIMEOUT_S)
    assert result(out, "crash") == "survived"
