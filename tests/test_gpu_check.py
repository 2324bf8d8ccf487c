"""The prepared GPU check (``scripts/gpu_check.py``) in its CPU smoke form: every part
runs, and parity and the backward-thread case pass (gloo, world 1)."""

from __future__ import annotations

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "gpu_check.py"


def test_gpu_check_smoke_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--device", "cpu", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.count("| True | True |") == 6  # zero2/zero3 x none/selective/full, bitwise
    assert "backward on the autograd thread: ok" in out
    assert "| fsdptag | False |" in out and "| FSDP2 | False |" in out
