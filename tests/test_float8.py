"""torchao float8 training with its float8 all-gather (Note [Float8 all-gather] in
fsdptag/_float8.py): float8 bytes on the wire, provenance kept, numerics as FSDP2's.

One 2-rank launch (gloo). torchao's float8 matmuls run on CPU here (``torch._scaled_mm``
has a CPU kernel), so the whole step runs: the Llama's linears (not the output head)
converted with ``enable_fsdp_float8_all_gather=True`` against the same model with it
off (fsdptag gathers bf16 and torchao casts it) and against FSDP2 with it on.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.debug import CollectiveCounter, LiveStorageTracker
from fsdptag.tools.llama import Llama, LlamaConfig

from .harness import launch, result, run_cases

torchao_float8 = pytest.importorskip("torchao.float8")  # the test extra pins torchao

CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128, max_seq_len=32)
STEPS = 3


def _model(float8_all_gather: bool, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = Llama(CFG)
    model.init_weights()
    model.to(dtype)
    torchao_float8.convert_to_float8_training(
        model, config=torchao_float8.Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather),
        module_filter_fn=lambda module, fqn: fqn != "output")
    return model


def _ours(mesh, float8_all_gather: bool, reshard: bool, ac: str = "none", **kwargs):
    model = _model(float8_all_gather)
    fsdptag.parametrize(model, mesh, reshard_after_forward=reshard, **kwargs)
    if ac != "none":
        fsdptag.apply_ac(model, ac)
    return model


def _fsdp2(mesh, reshard: bool):
    from torch.distributed.fsdp import fully_shard

    model = _model(True)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _tokens(step: int) -> torch.Tensor:
    torch.manual_seed(10 + dist.get_rank() + 2 * step)
    return torch.randint(0, CFG.vocab_size, (2, 17))


def _train(model, mesh):
    """Losses and final local shards of 3 AdamW steps; the first step's collectives."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, first = [], None
    for step in range(STEPS):
        tokens = _tokens(step)
        with CollectiveCounter(mesh) as cc:
            loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        first = first or cc
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, [p.to_local().clone() for p in model.parameters()], first


def _counts(cc: CollectiveCounter) -> str:
    """FSDP all-gathers forward/backward, their bytes (float8 buckets + the rest), and
    the all-reduces (float8 scales)."""
    def bytes_of(phase):
        events = [e for e in cc.events if e.kind == "all_gather" and e.phase == phase]
        float8 = sum(e.nbytes for e in events if e.fqn is not None and e.fqn.endswith("[float8]"))
        total = sum(e.nbytes for e in events)
        return f"float8 {float8} + other {total - float8}" if float8 else f"{total}"

    return (f"ag {cc.count('forward', 'all_gather')}/{cc.count('backward', 'all_gather')}, "
            f"fwd B {bytes_of('forward')}, bwd B {bytes_of('backward')}, "
            f"all-reduce {cc.count('forward', 'all_reduce')}/{cc.count('backward', 'all_reduce')}")


def _parity(mesh):
    """fsdptag float8 vs fsdptag gathering bf16 (torchao casts it) vs FSDP2 float8."""
    out = {}
    for reshard in (False, True):
        zero = f"zero{3 if reshard else 2}"
        fsdp2_losses, fsdp2_params, fsdp2_cc = _train(_fsdp2(mesh, reshard), mesh)
        out[f"{zero} FSDP2"] = _counts(fsdp2_cc)
        for ac in ("none", "full", "selective"):
            losses, params, cc = _train(_ours(mesh, True, reshard, ac), mesh)
            hp_losses, hp_params, hp_cc = _train(_ours(mesh, False, reshard, ac), mesh)
            row = {"counts": _counts(cc), "bf16 counts": _counts(hp_cc),
                   "vs bf16 gather": losses == hp_losses and all(map(torch.equal, params, hp_params)),
                   "vs FSDP2": losses == fsdp2_losses and all(map(torch.equal, params, fsdp2_params))}
            out[f"{zero} ac={ac}"] = row
    return out


def _gathered(mesh):
    """The weight compute gets: torchao's Float8TrainingTensor, bitwise torchao's own
    cast of the whole weight (gathered in bf16 here for the reference)."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    model = _ours(mesh, True, reshard=False)
    linear = model.layers[0].attention.wq
    seen = []
    linear.register_forward_pre_hook(lambda module, args: seen.append(module.weight))
    model(_tokens(0)[:, :-1])
    full = linear._parameters["weight"].full_tensor()
    reference = hp_tensor_to_float8_dynamic(full, torch.float8_e4m3fn, linear.linear_mm_config,
                                            gemm_input_role=GemmInputRole.WEIGHT)
    got = seen[0]
    return {"type": type(got).__name__, "dtype": str(got.dtype), "data dtype": str(got._data.dtype),
            "data equal": torch.equal(got._data.view(torch.uint8), reference._data.view(torch.uint8)),
            "scale equal": torch.equal(got._scale, reference._scale)}


def _memory(mesh):
    """Bytes forward keeps for backward (zero2, no AC): the float8 weights kept as float8."""
    out = {}
    for float8 in (True, False):
        model = _ours(mesh, float8, reshard=False)
        tokens = _tokens(0)
        with LiveStorageTracker(settle_collectives=True) as mem:
            loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
        out["float8" if float8 else "bf16"] = mem.live_bytes()
        loss.backward()
    return out


def _refusals(mesh):
    """What the float8 all-gather does not cover is refused before anything changes."""
    model = _model(True)
    before = type(model.layers[0].attention.wq.weight).__name__
    try:
        fsdptag.parametrize(model, mesh, bucket="param")
        error = "no error"
    except ValueError as e:
        error = str(e)
    return {"bucket=param": error, "unchanged": (before, type(model.layers[0].attention.wq.weight).__name__,
                                                 fsdptag.is_parametrized(model))}


def worker():
    mesh = init_device_mesh("cpu", (2,))
    return run_cases({
        "parity": functools.partial(_parity, mesh),
        "gathered": functools.partial(_gathered, mesh),
        "memory": functools.partial(_memory, mesh),
        "refusals": functools.partial(_refusals, mesh),
    })


@pytest.fixture(scope="module")
def results():
    return launch(2, worker)


def test_float8_gathers_float8_bytes_as_fsdp2(results):
    """Each block's float8 weights gather in one float8 all-gather (half their bf16 bytes),
    the rest in another; one scale all-reduce per float8 bucket in forward, none in
    backward; zero2 under AC re-gathers nothing, zero3 each bucket once; losses and
    parameters bitwise equal to gathering bf16 and to FSDP2's float8 all-gather."""
    r = result(results, "parity")
    rows = []
    for name, v in r.items():
        if name.endswith("FSDP2"):
            rows.append(f"{name}: {v}")
            continue
        assert v["vs bf16 gather"] and v["vs FSDP2"], (name, v)
        rows.append(f"{name}: {v['counts']} | bf16 gather: {v['bf16 counts']}")
    assert_expected_inline("\n".join(rows), """\
zero2 FSDP2: ag 3/0, fwd B 107136, bwd B 0, all-reduce 14/0
zero2 ac=none: ag 5/0, fwd B float8 73728 + other 33408, bwd B 0, all-reduce 2/0 | bf16 gather: ag 3/0, fwd B 180864, bwd B 0, all-reduce 0/0
zero2 ac=full: ag 5/0, fwd B float8 73728 + other 33408, bwd B 0, all-reduce 2/0 | bf16 gather: ag 3/0, fwd B 180864, bwd B 0, all-reduce 0/0
zero2 ac=selective: ag 5/0, fwd B float8 73728 + other 33408, bwd B 0, all-reduce 2/0 | bf16 gather: ag 3/0, fwd B 180864, bwd B 0, all-reduce 0/0
zero3 FSDP2: ag 3/3, fwd B 107136, bwd B 107136, all-reduce 14/14
zero3 ac=none: ag 5/5, fwd B float8 73728 + other 33408, bwd B float8 73728 + other 33408, all-reduce 2/0 | bf16 gather: ag 3/3, fwd B 180864, bwd B 180864, all-reduce 0/0
zero3 ac=full: ag 5/5, fwd B float8 73728 + other 33408, bwd B float8 73728 + other 33408, all-reduce 2/0 | bf16 gather: ag 3/3, fwd B 180864, bwd B 180864, all-reduce 0/0
zero3 ac=selective: ag 5/5, fwd B float8 73728 + other 33408, bwd B float8 73728 + other 33408, all-reduce 2/0 | bf16 gather: ag 3/3, fwd B 180864, bwd B 180864, all-reduce 0/0""")


def test_gathered_weight_is_torchaos_cast(results):
    assert result(results, "gathered") == {
        "type": "Float8TrainingTensor", "dtype": "torch.bfloat16", "data dtype": "torch.float8_e4m3fn",
        "data equal": True, "scale equal": True}


def test_float8_weights_kept_as_float8(results):
    r = result(results, "memory")
    assert r["float8"] < r["bf16"], r
    assert_expected_inline(f"kept for backward: float8 {r['float8']} B, bf16 {r['bf16']} B", """kept for backward: float8 309824 B, bf16 383496 B""")


def test_float8_outside_buckets_refused(results):
    r = result(results, "refusals")
    assert "use bucket='blocks' (the default)" in r["bucket=param"], r
    assert r["unchanged"] == ("WeightWithDynamicFloat8CastTensor", "WeightWithDynamicFloat8CastTensor", False), r
