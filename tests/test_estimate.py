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
            # gloo's thread sometimes frees a collective's buffers late, which can only
            # add to a real peak (seen: +7% in about one run in ten); the lowest of three
            # steps is the program's own peak.
            runs = [est.measure_step(model, tokens) for _ in range(3)]
            out[(reshard, ac, policy)] = min(runs, key=lambda m: m["peak_bytes"])
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
        # A real run can only be higher: gloo's thread may hold a collective's buffers
        # a little past the point where the fake run frees them. Usually the two are
        # equal to the byte; seen in single steps: fsdptag +0-7%, FSDP2 (its c10d Work
        # objects keep its buffers until gloo finishes them) +0-12%.
        slack = 1.2 if e.policy == "fsdp2" else 1.05
        assert e.peak_bytes <= measured["peak_bytes"] <= slack * e.peak_bytes, (e, measured)
        assert e.param_bytes == measured["param_bytes"]
        assert e.optimizer_bytes == measured["optimizer_bytes"]


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
