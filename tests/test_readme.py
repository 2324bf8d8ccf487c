"""The README's quick start, docs/usage.md's training-controls block (appended to it) and
its LoRA + ``Trainer`` script, copied out and run as their user would:
``torchrun --nproc-per-node 2 quickstart.py``."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
USAGE = README.parent / "docs" / "usage.md"


def _quick_start() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _controls() -> str:
    text = USAGE.read_text()
    section = text[text.index("### FSDP2's training controls, runnable"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _lora() -> str:
    text = USAGE.read_text()
    section = text[text.index("### LoRA with `Trainer`, runnable"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_lora_trainer_runs_on_two_ranks(tmp_path):
    pytest.importorskip("peft")  # the test extra pins it
    script = tmp_path / "lora.py"
    script.write_text(_lora())
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(re.findall(r"rank (\d): backward FSDP all-gathers (\d+), (\d+) reduce-scatters, (\d+) B",
                             run.stdout)) == [("0", "0", "6", "43008"), ("1", "0", "6", "43008")], run.stdout
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").exists()
    assert (tmp_path / "out" / "checkpoint-2" / "fsdptag_dcp").is_dir()  # TrainerCheckpointMixin's save


def test_training_controls_run_on_two_ranks(tmp_path):
    """The controls block, appended to the quick start before it tears down."""
    quick = _quick_start()
    script = tmp_path / "controls.py"
    script.write_text(quick.replace("dist.destroy_process_group()", _controls() + "dist.destroy_process_group()"))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(re.findall(r"rank (\d): 4 microbatches, (\d+) reduce-scatters", run.stdout)) == [
        ("0", "3"), ("1", "3")], run.stdout
    assert sorted(re.findall(r"rank (\d): float8 weights gathered as (\d+) B", run.stdout)) == [
        ("0", "131072"), ("1", "131072")], run.stdout


def test_quick_start_runs_on_two_ranks(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_quick_start())
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    losses = {}
    for rank, step, loss in re.findall(r"rank (\d) step (\d): loss ([\d.]+)", run.stdout):
        losses.setdefault(int(rank), []).append(float(loss))
    assert sorted(losses) == [0, 1] and all(len(v) == 3 for v in losses.values()), run.stdout
    assert all(v[-1] < v[0] for v in losses.values()), losses  # it trains
