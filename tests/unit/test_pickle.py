"""Note [Pickling generated classes] in ``fsdptag/_class_swap.py``: ``torch.save(model)``
and ``torch.load`` round-trip a parametrized (and checkpointed) model, here and in a
fresh process, and the loaded model computes what the saved one does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.debug import CollectiveCounter
from tests.models import make_net


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(zero: int, ac: str):
    model = make_net()
    fsdptag.parametrize(model, init_device_mesh("cpu", (1,)), reshard_after_forward=zero == 3,
                        mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    return fsdptag.apply_ac(model, ac)


def _step(model, tokens):
    model.zero_grad(set_to_none=True)
    out = model(tokens).float()
    out.sum().backward()
    return out.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("zero,ac", [(2, "none"), (3, "selective"), (2, "full")])
def test_save_load_round_trip(one_rank, tmp_path, zero, ac):
    model = _model(zero, ac)
    tokens = torch.randint(0, 34, (2, 6))
    before = _step(model, tokens)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert type(loaded).__name__ == type(model).__name__ and fsdptag.is_parametrized(loaded)
    assert [type(b).__name__ for b in loaded.layers] == [type(b).__name__ for b in model.layers]
    with CollectiveCounter() as cc:
        after = _step(loaded, tokens)
    assert torch.equal(before[0], after[0])
    assert before[1].keys() == after[1].keys() and all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    assert cc.count("forward") == cc.count("backward") == 0  # world 1: casts only, no collective


def test_load_in_a_fresh_process(one_rank, tmp_path):
    model = _model(3, "selective")
    tokens = torch.randint(0, 34, (2, 6))
    expected = model(tokens).float().sum().item()
    torch.save({"model": model, "tokens": tokens}, tmp_path / "model.pt")
    program = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / 'store2')!r}, 1), rank=0, world_size=1)
        saved = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)
        out = saved["model"](saved["tokens"]).float().sum()
        out.backward()
        print(type(saved["model"]).__name__, repr(out.item()))
        dist.destroy_process_group()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    name, value = run.stdout.split()
    assert name == type(model).__name__ and float(value) == expected


def test_one_generated_class_per_module(one_rank):
    """However many kinds a module took (root, parameters, bucket root, checkpointed),
    its class is one generated class directly over the user's (issue 21)."""
    from fsdptag._class_swap import user_class

    model = _model(2, "full")
    generated = {name or "<root>": type(m) for name, m in model.named_modules()
                 if "_fsdptag_generated" in type(m).__dict__}
    assert generated  # the root, the blocks, their linears
    assert {n: (c.__mro__[1] is user_class(c), sum("_fsdptag_generated" in k.__dict__ for k in c.__mro__))
            for n, c in generated.items()} == {n: (True, 1) for n in generated}
    assert type(model.layers[0]).__name__.startswith("CheckpointedBucketed")
