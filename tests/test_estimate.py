"""The memory estimator: fake-tensor estimates match real gloo runs at small scale."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from fsdptag import estimate as est

from .harness import launch

SEQ = 64
CASES = [(False, "selective"), (True, "full")]


def worker_real():
    """Each policy's real step on 2 gloo ranks, measured like the estimator does."""
    spec = est.builtin_model("llama3-debug", SEQ)
    mesh = est.build_mesh("cpu", dist.get_world_size(), 1, 1)
    out = {}
    for reshard, ac in CASES:
        for policy in est.POLICIES:
            torch.manual_seed(0)
            model = est.build_model(spec, mesh, policy=policy, reshard=reshard, ac=ac, mp="bf16")
            tokens = torch.randint(0, spec.vocab_size, (1, SEQ + 1))
            if policy == "fsdp2":
                # FSDP2 holds its collectives' Work objects itself (its c10d ops are not
                # functional, so the tracker cannot settle them): gloo's thread may free
                # their buffers late, which can only add to a real peak. Lowest of three.
                runs = [est.measure_step(model, tokens) for _ in range(3)]
                out[(reshard, ac, policy)] = min(runs, key=lambda m: m["peak_bytes"])
            else:  # the tracker settles functional collectives: one step is exact
                out[(reshard, ac, policy)] = est.measure_step(model, tokens)
    return out


@pytest.fixture(scope="module")
def real():
    return launch(2, worker_real)


@pytest.mark.parametrize("reshard, ac", CASES)
def test_estimate_matches_real_run(real, reshard, ac):
    estimates = est.estimate("llama3-debug", 2, reshard_after_forward=reshard, ac=ac, mp="bf16",
                             seq_len=SEQ, batch=1)
    assert [e.policy for e in estimates] == list(est.POLICIES)
    for e in estimates:
        measured = real[(reshard, ac, e.policy)]
        print(f"\n{e.policy} zero{3 if reshard else 2} {ac}: estimated peak {e.peak_bytes} B, "
              f"real {measured['peak_bytes']} B")
        if e.policy == "fsdp2":  # seen over 40 single steps: +0-12%, equal in most
            assert e.peak_bytes <= measured["peak_bytes"] <= 1.15 * e.peak_bytes, (e, measured)
        else:
            assert e.peak_bytes == measured["peak_bytes"], (e, measured)
        for key in ("param_bytes", "optimizer_bytes", "grad_bytes", "activation_bytes",
                    "gathered_param_bytes", "kept_collective_bytes", "kept_cast_bytes"):
            assert getattr(e, key) == measured[key], (key, e, measured)
        # Without TP no other collective's output is kept; casts are (the activations').
        assert e.kept_collective_bytes == 0 and e.kept_cast_bytes > 0, e


def test_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "est.json"
    est.main(["--model", "llama3-debug", "--world-size", "4", "--tp", "2", "--reshard-after-forward",
              "false", "--ac", "selective", "--seq-len", "32", "--json", str(path)])
    records = json.loads(path.read_text())
    keys = {"policy", "model", "world_size", "tp", "reshard_after_forward", "ac", "peak_bytes",
            "param_bytes", "gathered_param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"}
    assert [r["policy"] for r in records] == ["tagged", "op-name", "fsdp2"]
    assert all(keys <= r.keys() for r in records)
    tagged, op_name, _ = records
    # The op-name policy also keeps TP all-gathers and activation casts.
    assert op_name["activation_bytes"] > tagged["activation_bytes"]
    assert "| tagged |" in capsys.readouterr().out
