"""torchtitan 0.3.0's own trainer with ``fsdptag.torchtitan`` vs its stock FSDP2 path.

``bash scripts/test_torchtitan.sh`` (its own venv; skipped where torchtitan is not
installed). Each case launches ``torchtitan.train.main`` through torchrun on CPU
ranks over gloo (``launch_cpu.py``: the CPU shims) with the llama3 debug model
(6 blocks) on offline assets, seq_len 64, local batch 2, 3 steps; rank 0 writes each
step's loss and grad norm and fsdptag's ``CollectiveCounter`` over step 2's forward
and backward to JSON.

Where torchtitan's ``ChunkedLossWrapper`` (the debug model's loss) applies
``lm_head`` per chunk, 8 chunks, outside the model's forward, fsdptag gathers
``lm_head.weight`` alone for each chunk and reduce-scatters its gradient per chunk:
8 of the 15 forward all-gathers and 8 of the 15 reduce-scatters (``per_parameter``
below). FSDP2 unshards its ``[norm, lm_head]`` unit once for the loop and syncs the
gradient at the last chunk only.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

import torch.nn as nn  # noqa: E402
from expecttest import assert_expected_inline  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from fsdptag.torchtitan import parallelize, with_fsdptag  # noqa: E402

from .assets import make_assets  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = Path(__file__).resolve().parent / "launch_cpu.py"
TINY = ["--training.seq-len", "64", "--training.local-batch-size", "2", "--training.steps", "3",
        "--lr-scheduler.warmup-steps", "1", "--debug.seed", "0", "--comm.trace-buf-size", "0",
        "--metrics.disable-color-printing"]
ZERO2 = ["--parallelism.fsdp-reshard-after-forward", "never"]
ZERO3 = ["--parallelism.fsdp-reshard-after-forward", "default"]  # torchtitan: zero3 without PP


class Titan:
    """Launches torchtitan's trainer; each named run once per module (tests share them)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.assets = make_assets(root / "assets")
        self.runs: dict[str, dict] = {}

    def run(self, name: str, config: str, *flags: str, nproc: int = 2, dump: str | None = None) -> dict:
        if name in self.runs:
            return self.runs[name]
        record = self.root / f"{name}.json"
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", FSDPTAG_TT_RECORD=str(record),
                   FSDPTAG_TT_ASSETS=str(self.assets), HF_HOME=str(self.root / "hf"),
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={_free_port()}", str(LAUNCHER), "--module", "tests.torchtitan.configs",
               "--config", config, "--dump-folder", str(self.root / (dump or name)), *TINY, *flags]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise AssertionError(f"{name} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
        self.runs[name] = json.loads(record.read_text())
        return self.runs[name]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> Titan:
    return Titan(tmp_path_factory.mktemp("torchtitan"))


def _breakdown(run: dict) -> str:
    return "\n".join(f"{key} x{n}" for key, n in run["per_parameter"].items())


def test_zero2_selective_ac_matches_fsdp2(titan):
    stock = titan.run("stock", "llama3_stock", *ZERO2)
    zero2 = titan.run("zero2", "llama3_fsdptag", *ZERO2)
    assert_expected_inline(stock["collectives"], """\
forward  all_gather fsdp x9
backward all_gather fsdp x1
backward reduce_scatter fsdp x9""")
    assert_expected_inline(zero2["collectives"], """\
forward  all_gather fsdp [fsdp] x15
backward reduce_scatter fsdp x15""")
    assert_expected_inline(_breakdown(zero2), """\
forward <root> x1
forward layers.0._checkpoint_wrapped_module x1
forward layers.1._checkpoint_wrapped_module x1
forward layers.2._checkpoint_wrapped_module x1
forward layers.3._checkpoint_wrapped_module x1
forward layers.4._checkpoint_wrapped_module x1
forward layers.5._checkpoint_wrapped_module x1
forward lm_head.weight x8""")
    assert zero2["steps"] == stock["steps"]


def test_zero3_selective_ac_matches_fsdp2(titan):
    stock = titan.run("stock", "llama3_stock", *ZERO2)
    zero3 = titan.run("zero3", "llama3_fsdptag", *ZERO3)
    assert_expected_inline(zero3["collectives"], """\
forward  all_gather fsdp [fsdp] x15
backward all_gather fsdp [fsdp] x7
backward reduce_scatter fsdp x15""")
    assert_expected_inline(_breakdown(zero3), """\
backward <root> x1
backward layers.0._checkpoint_wrapped_module x1
backward layers.1._checkpoint_wrapped_module x1
backward layers.2._checkpoint_wrapped_module x1
backward layers.3._checkpoint_wrapped_module x1
backward layers.4._checkpoint_wrapped_module x1
backward layers.5._checkpoint_wrapped_module x1
forward <root> x1
forward layers.0._checkpoint_wrapped_module x1
forward layers.1._checkpoint_wrapped_module x1
forward layers.2._checkpoint_wrapped_module x1
forward layers.3._checkpoint_wrapped_module x1
forward layers.4._checkpoint_wrapped_module x1
forward layers.5._checkpoint_wrapped_module x1
forward lm_head.weight x8""")
    assert zero3["steps"] == stock["steps"]


def test_zero2_full_ac_matches_fsdp2(titan):
    """Against the selective-AC FSDP2 run: AC recomputes, it changes no value."""
    stock = titan.run("stock", "llama3_stock", *ZERO2)
    full = titan.run("zero2_full", "llama3_fsdptag", *ZERO2, "activation-checkpoint:full")
    assert_expected_inline(full["collectives"], """\
forward  all_gather fsdp [fsdp] x15
backward reduce_scatter fsdp x15""")
    assert full["steps"] == stock["steps"]


def test_dcp_resume_repeats_the_uninterrupted_run(titan):
    flags = (*ZERO2, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2")
    whole = titan.run("dcp_whole", "llama3_fsdptag", *flags, dump="dcp")
    checkpoints = titan.root / "dcp" / "checkpoint"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4"]
    shutil.rmtree(checkpoints / "step-4")
    resumed = titan.run("dcp_resumed", "llama3_fsdptag", *flags, dump="dcp")
    assert list(resumed["steps"]) == ["3", "4"]
    assert resumed["steps"] == {step: whole["steps"][step] for step in ("3", "4")}


def test_dp2_tp2_matches_fsdp2(titan):
    tp = ("--parallelism.tensor-parallel-degree", "2", *ZERO2)
    stock = titan.run("stock_tp", "llama3_stock", *tp, nproc=4)
    fsdptag_tp = titan.run("zero2_tp", "llama3_fsdptag", *tp, nproc=4)
    assert_expected_inline(fsdptag_tp["collectives"], """\
forward  all_gather fsdp [fsdp] x15
forward  all_gather tp x13
forward  all_reduce tp x24
forward  reduce_scatter tp x13
backward all_gather tp x25
backward all_reduce tp x13
backward reduce_scatter fsdp x15
backward reduce_scatter tp x13""")
    assert fsdptag_tp["steps"] == stock["steps"]


def test_with_fsdptag_and_refusals():
    config = llama3_debugmodel()
    ours = with_fsdptag(config)
    assert ours.model_spec.parallelize_fn is parallelize
    assert ours.parallelism.spmd_backend == "partial_dtensor"
    assert config.model_spec.parallelize_fn is not parallelize  # a new config: the argument is unchanged
    kwargs = dict(training=TrainingConfig(), compile_config=CompileConfig(), ac_config=None, dump_folder="")
    partial = ParallelismConfig(spmd_backend="partial_dtensor")
    cases = {
        "context parallelism": dict(cp=2),
        "pipeline parallelism": dict(pp=2),
    }
    for what, degrees in cases.items():
        sizes = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1) | degrees
        world = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"] * sizes["pp"]
        dims = ParallelDims(**sizes, world_size=world, spmd_backend="partial_dtensor")
        with pytest.raises(ValueError, match=f"does not support {what}; use torchtitan's own"):
            parallelize(nn.Linear(2, 2), parallel_dims=dims, parallelism=partial, **kwargs)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
    with pytest.raises(ValueError, match="spmd_backend='partial_dtensor', got 'spmd_types'.*with_fsdptag"):
        parallelize(nn.Linear(2, 2), parallel_dims=dims, parallelism=ParallelismConfig(), **kwargs)
