"""examples/train_llama.py survives faults: a rank killed mid-save or mid-run resumes bit for
bit under ``torchrun --max-restarts``, a checkpoint of 4 ranks with TP 2 resumes on 2 ranks
without TP, and bad checkpoint directories fail with the fix, never touching the last good one.

Launches: five torchruns of the example (two of them restart once); the checkpointer's
own cases run on a 1-rank process group in this process.
The full matrix of configurations and faults is ``examples/fault_matrix.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.tools.llama import Llama, LlamaConfig

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import fault_matrix as fm  # noqa: E402
import train_llama  # noqa: E402
from _checkpointing import (  # noqa: E402
    CheckpointError, Checkpointer, CheckpointPolicy, SaveMode, find_problem, prepare_dir)
from _faults import Fault, FaultKind  # noqa: E402

ZERO3 = fm.config_args(3, "none", 1)
TP_AC = [*fm.config_args(2, "full", 2), "--batch", "2"]  # 4 ranks: dp 2 x tp 2, global batch 4
NO_TP_AC = [*fm.config_args(2, "full", 1), "--batch", "2"]  # 2 ranks: dp 2, global batch 4


def _digest(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- torchrun: faults


def _faulted_and_uninterrupted(tmp: str, nproc: int, config: list[str], fault: str, mode: str) -> fm.Run:
    run = fm.faulted(tmp, nproc, config, [fault], mode=mode, steps=6)
    fm.uninterrupted(tmp, nproc, config, steps=6)
    return run


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """2 ranks, zero3, sync saves every 2 steps: rank 1 exits at the start of step 5."""
    tmp = str(tmp_path_factory.mktemp("zero3"))
    return tmp, _faulted_and_uninterrupted(tmp, 2, ZERO3, "exit@5", "sync")


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    """4 ranks, TP 2, zero2 + full AC, async saves every 2 steps: rank 1 killed while saving step-4."""
    tmp = str(tmp_path_factory.mktemp("tp"))
    return tmp, _faulted_and_uninterrupted(tmp, 4, TP_AC, "kill-in-save@4", "async")


def _assert_bitwise(tmp: str) -> None:
    faulted, reference = _digest(f"{tmp}/faulted.json"), _digest(f"{tmp}/uninterrupted.json")
    assert faulted["sha256"] == reference["sha256"], [k for k in reference["tensors"]
                                                      if faulted["tensors"][k] != reference["tensors"][k]]
    assert len(faulted["tensors"]) == 4 * 21  # 21 parameters, each with exp_avg, exp_avg_sq and step
    assert faulted["losses"] == reference["losses"]


def test_zero3_rank_exits_resumes_bitwise(zero3):
    tmp, run = zero3
    ckpt = os.path.join(tmp, "ckpt")
    assert run.lines("fault:") == ["fault: rank 1 exits at the start of step 5 (injected)"]
    assert run.resumed_from == [f"{ckpt}/step-4"]  # a sync save is complete before the next step
    _assert_bitwise(tmp)
    saved = run.lines("checkpoint: saved")  # step-2 and step-4, then step-6 after the restart
    assert len(saved) == 3 and all(line.endswith(" KiB, 0 FSDP all-gathers)") for line in saved), saved
    assert sorted(os.listdir(ckpt)) == ["step-4", "step-6"]  # --keep-last 2


def test_tp2_on_4_ranks_killed_in_async_save_resumes_bitwise(tp):
    tmp, run = tp
    ckpt = os.path.join(tmp, "ckpt")
    assert run.lines("fault:") == [
        f"fault: rank 1 killed while saving {ckpt}/step-4.tmp (__1_0.distcp truncated; injected)"]
    assert run.lines("checkpoint: skipping") == [
        f"checkpoint: skipping {ckpt}/step-4.tmp: no complete.json, its save did not finish (killed mid-save?); "
        "removing it"]
    # The next save waits for the one in flight: step-2 was complete before step-4 began.
    assert run.resumed_from == [f"{ckpt}/step-2"]
    _assert_bitwise(tmp)


def test_resume_4_ranks_tp2_on_2_ranks_without_tp_skips_corrupted_newest(tp, tmp_path):
    tmp, _ = tp
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(tmp, "ckpt"), ckpt)
    with open(os.path.join(ckpt, "step-6", "__2_0.distcp"), "r+b") as f:
        f.truncate(100)
    run = fm.torchrun(2, [*fm.TINY, *NO_TP_AC, "--steps", "6", "--checkpoint-dir", ckpt,
                          "--state-digest", str(tmp_path / "resumed.json")]).check()
    skipped = run.lines("checkpoint: skipping")
    assert len(skipped) == 1 and skipped[0].startswith(
        f"checkpoint: skipping {ckpt}/step-6: __2_0.distcp has 100 bytes, complete.json says "), skipped
    assert skipped[0].endswith(f"(truncated); moved to {ckpt}/step-6.corrupt, never loaded")
    assert run.resumed_from == [f"{ckpt}/step-4"]
    assert "holds the RNG states of 4 ranks and this run has 2" in run.stdout
    resumed, reference = _digest(str(tmp_path / "resumed.json")), _digest(f"{tmp}/uninterrupted.json")
    assert resumed["losses"][:4] == reference["losses"][:4]  # carried in the checkpoint
    diffs = [abs(a - b) for a, b in zip(resumed["losses"][4:], reference["losses"][4:])]
    assert len(diffs) == 2 and max(diffs) < 1e-6, diffs


# ---------------------------------------------------------------- the checkpointer, in this process


SETTINGS = {"--dim": 32, "--batch x data-parallel ranks": 8}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A 1-rank gloo process group in this process (destroyed at the end of the module)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's ranks: on a busy 2-core box more threads are slower
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


def _model(mesh, dim: int = 32, seed: int = 0):
    cfg = LlamaConfig(dim=dim, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=32, max_seq_len=16)
    model = Llama(cfg)
    model.init_weights(seed)
    fsdptag.parametrize(model, mesh)  # bucketed: the stored shards are views into one buffer
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optim, steps: int) -> None:
    g = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 9), generator=g)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optim.step()
        optim.zero_grad()


def _checkpointer(root, mode: str = "sync", settings=None, *, faults=(), keep_last: int = 3):
    logs: list[str] = []
    policy = CheckpointPolicy(prepare_dir(str(root)), 2, keep_last, SaveMode(mode))
    hints = {"--batch x data-parallel ranks": lambda saved: f"--batch {saved}"}  # 1 data-parallel rank
    ckpt = Checkpointer(policy, settings or SETTINGS, log=lambda m: logs.append(m.replace(str(root), "DIR")),
                        hints=hints, faults=faults)
    return ckpt, logs


def _listing(root) -> dict:
    return {name: find_problem(os.path.join(root, name)) for name in sorted(os.listdir(root))}


def _error(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_round_trip_is_bitwise(mesh, tmp_path, mode):
    # async: the stored shards are views into one bucket buffer, which torch's own stagers cannot copy
    model, optim = _model(mesh)
    _train(model, optim, 2)
    ckpt, logs = _checkpointer(tmp_path, mode)
    ckpt.save(2, model, optim, {"step": 2, "note": "hello"})
    ckpt.close()
    fresh, fresh_optim = _model(mesh, seed=1)
    resumer, resume_logs = _checkpointer(tmp_path, mode)
    assert resumer.resume(fresh, fresh_optim) == {"step": 2, "note": "hello"}
    assert train_llama.state_digest(fresh, fresh_optim) == train_llama.state_digest(model, optim)
    assert len(logs) == 1 and logs[0].startswith(f"checkpoint: saved DIR/step-2 ({mode}, "), logs
    assert resume_logs == ["checkpoint: resumed from DIR/step-2 (step 2)"]
    assert _listing(tmp_path) == {"step-2": None}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full_keeps_last_good_checkpoint(mesh, tmp_path, mode):
    model, optim = _model(mesh)
    ckpt, _ = _checkpointer(tmp_path, mode, faults=[Fault(FaultKind.DISK_FULL, 4, rank=0)])
    ckpt.save(2, model, optim, {"step": 2})

    def save_4():
        ckpt.save(4, model, optim, {"step": 4})
        ckpt.close()  # an async save's error surfaces here

    assert _error(save_4).replace(str(tmp_path), "DIR") == (
        "saving DIR/step-4 failed (rank 0: OSError: [Errno 28] No space left on device (injected by --fault "
        "disk-full): 'DIR/step-4.tmp'). The last good checkpoint DIR/step-2 is untouched and the partial "
        "DIR/step-4.tmp was removed. Free space on the checkpoint volume (or pass another --checkpoint-dir) "
        "and rerun: the run resumes from its newest complete checkpoint")
    assert _listing(tmp_path) == {"step-2": None}


def test_other_model_or_settings_never_load(mesh, tmp_path):
    model, optim = _model(mesh)
    _checkpointer(tmp_path)[0].save(2, model, optim, {"step": 2})
    before = _listing(tmp_path)

    def resume(dim, settings):
        return _error(lambda: _checkpointer(tmp_path, settings=settings)[0].resume(*_model(mesh, dim=dim)))

    assert resume(48, {**SETTINGS, "--dim": 48}).replace(str(tmp_path), "DIR") == (
        "DIR/step-2 was written with other settings: --dim 32 there, 48 here. To continue it, rerun with "
        "--dim 32; to start over, pass another --checkpoint-dir (nothing was loaded or deleted)")
    assert resume(32, {**SETTINGS, "--batch x data-parallel ranks": 16}).replace(str(tmp_path), "DIR") == (
        "DIR/step-2 was written with other settings: --batch x data-parallel ranks 8 there, 16 here. To "
        "continue it, rerun with --batch 8; to start over, pass another --checkpoint-dir (nothing was loaded or "
        "deleted)")
    # A model of another shape behind matching settings: DCP's own check, with the fix added.
    error = resume(48, SETTINGS).replace(str(tmp_path), "DIR")
    assert error.startswith("loading DIR/step-2 failed (rank 0: ") and "Size mismatch" in error, error
    assert error.endswith("it does not fit this run's model: rerun with the settings it was written with, "
                          "or pass another --checkpoint-dir (nothing was changed)"), error
    assert _listing(tmp_path) == before


def test_corrupted_and_incomplete_checkpoints_are_skipped(mesh, tmp_path):
    model, optim = _model(mesh)
    ckpt, _ = _checkpointer(tmp_path, "async")
    for step in (2, 4, 6):
        _train(model, optim, 1)
        ckpt.save(step, model, optim, {"step": step})
    ckpt.close()
    with open(tmp_path / "step-6" / "__0_0.distcp", "r+b") as f:  # one bit flipped
        f.seek(200)
        byte = f.read(1)[0]
        f.seek(200)
        f.write(bytes([byte ^ 1]))
    with open(tmp_path / "step-4" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    (tmp_path / "step-8.tmp").mkdir()  # a save killed midway
    (tmp_path / "step-8.tmp" / "__0_0.distcp").write_bytes(b"partial")
    resumer, logs = _checkpointer(tmp_path, "async")
    assert resumer.resume(*_model(mesh, seed=1)) == {"step": 2}
    size = json.loads((tmp_path / "step-4.corrupt" / "complete.json").read_text())["files"]["__0_0.distcp"][0]
    assert logs == [
        "checkpoint: skipping DIR/step-8.tmp: no complete.json, its save did not finish (killed mid-save?); "
        "removing it",
        "checkpoint: skipping DIR/step-6: __0_0.distcp does not match its sha256 in complete.json (corrupted); "
        "moved to DIR/step-6.corrupt, never loaded",
        f"checkpoint: skipping DIR/step-4: __0_0.distcp has 1000 bytes, complete.json says {size} (truncated); "
        "moved to DIR/step-4.corrupt, never loaded",
        "checkpoint: resumed from DIR/step-2 (step 2)"]
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4.corrupt", "step-6.corrupt"]


def test_keep_last(mesh, tmp_path):
    model, optim = _model(mesh)
    ckpt, logs = _checkpointer(tmp_path, keep_last=2)
    for step in (2, 4, 6):
        ckpt.save(step, model, optim, {"step": step})
    assert _listing(tmp_path) == {"step-4": None, "step-6": None}
    assert logs[-1] == "checkpoint: removed DIR/step-2 (--keep-last 2)"


# ---------------------------------------------------------------- flags (no ranks)


def test_checkpoint_dir_errors_name_the_fix(tmp_path):
    with pytest.raises(CheckpointError) as e:
        prepare_dir(str(tmp_path / "missing" / "run"))
    assert str(e.value) == (f"--checkpoint-dir {tmp_path}/missing/run: its parent {tmp_path}/missing does not "
                            f"exist; create it (mkdir -p {tmp_path}/missing) or fix the path")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        with pytest.raises(CheckpointError) as e:
            prepare_dir(str(read_only))
    finally:
        read_only.chmod(0o755)
    assert str(e.value) == (f"--checkpoint-dir {read_only} is read-only (mode 555); make it writable "
                            f"(chmod u+w {read_only}) or pass another --checkpoint-dir")
    assert prepare_dir(str(tmp_path / "new")) == str(tmp_path / "new") and (tmp_path / "new").is_dir()


def test_bad_flags_name_the_fix(tmp_path):
    def error(*argv):
        try:
            train_llama.validate(train_llama.parse_args(list(argv)))
            return "no error"
        except (train_llama.UsageError, CheckpointError) as e:
            return str(e)

    assert error("--fault", "kill-in-save@3", "--checkpoint-dir", str(tmp_path / "c")) == (
        "--fault kill-in-save@3 hits the save of step 3, but no checkpoint is saved then; pass --checkpoint-dir "
        "and a --checkpoint-every dividing 3")
    assert error("--fault", "crash@3") == (
        "--fault 'crash@3': use one of exit@STEP, kill-in-save@STEP, disk-full@STEP with STEP >= 1, "
        "e.g. --fault exit@5")
    assert error("--vocab", "128") == "--vocab 128 is below the 256 byte values of the text; use --vocab 256"
    plot = error("--plot", str(tmp_path / "loss.png"))
    if importlib.util.find_spec("matplotlib") is None:
        assert plot == (f"--plot {tmp_path}/loss.png needs matplotlib, which is not installed: pip install "
                        f"matplotlib (or pip install -e '.[plot]')")
    else:
        assert plot == "no error"
