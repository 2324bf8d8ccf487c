"""torchtitan's Qwen3-MoE with expert parallelism 2 on 4 CPU ranks: its FSDP2 path vs
``fsdptag.torchtitan.parallelize`` (experts over ``("efsdp", "ep")``, the rest over
``"fsdp"``: Note [Meshes per module] in fsdptag/_mesh.py), under torchtitan's full and
selective AC as it ships. One launch of ``moe_worker.py`` runs every variant; this
file pins what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from expecttest import assert_expected_inline  # noqa: E402

from .test_trainer import REPO, _free_port  # noqa: E402

WORKER = Path(__file__).resolve().parent / "moe_worker.py"


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe") / "rows.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--master-port={_free_port()}",
           str(WORKER), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        raise AssertionError(f"moe_worker failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(out.read_text())


def _table(rows: dict) -> str:
    keys = ["forward FSDP all-gathers", "backward FSDP all-gathers", "reduce-scatters", "forward all-to-alls",
            "backward all-to-alls", "kept"]
    return "\n".join(f"{name}: " + ", ".join(f"{k} {row[k]}" for k in keys) for name, row in rows.items())


def test_moe_ep_matches_fsdp2(rows):
    """zero2: no FSDP all-gather in backward under full or selective AC; zero3 one per
    bucket (each MoE block: its dense bucket and its experts'); the EP all-to-alls
    are FSDP2's under each policy (full AC recomputes them, torchtitan's selective AC
    saves them); kept bytes below FSDP2's."""
    assert_expected_inline(_table(rows), """\
fsdp2 zero2 full: forward FSDP all-gathers 6, backward FSDP all-gathers 0, reduce-scatters 6, forward all-to-alls 6, backward all-to-alls 10, kept 479492
fsdptag zero2 full: forward FSDP all-gathers 5, backward FSDP all-gathers 0, reduce-scatters 5, forward all-to-alls 6, backward all-to-alls 10, kept 413956
fsdptag averaging zero2 full: forward FSDP all-gathers 5, backward FSDP all-gathers 0, reduce-scatters 5, forward all-to-alls 6, backward all-to-alls 10, kept 413956
fsdp2 zero2 selective: forward FSDP all-gathers 6, backward FSDP all-gathers 0, reduce-scatters 6, forward all-to-alls 6, backward all-to-alls 4, kept 680516
fsdptag zero2 selective: forward FSDP all-gathers 5, backward FSDP all-gathers 0, reduce-scatters 5, forward all-to-alls 6, backward all-to-alls 4, kept 614980
fsdp2 zero3 full: forward FSDP all-gathers 6, backward FSDP all-gathers 6, reduce-scatters 6, forward all-to-alls 6, backward all-to-alls 10, kept 148228
fsdptag zero3 full: forward FSDP all-gathers 5, backward FSDP all-gathers 5, reduce-scatters 5, forward all-to-alls 6, backward all-to-alls 10, kept 148228""")
    losses = {name: row["losses"] for name, row in rows.items()}
    assert all(v == losses["fsdp2 zero2 full"] for v in losses.values()), losses
    for zero, ac in (("zero2", "full"), ("zero2", "selective"), ("zero3", "full")):
        ours, theirs = rows[f"fsdptag {zero} {ac}"], rows[f"fsdp2 {zero} {ac}"]
        assert ours["kept"] <= theirs["kept"]
        for phase in ("forward", "backward"):
            assert ours[f"{phase} all-to-alls"] == theirs[f"{phase} all-to-alls"]
