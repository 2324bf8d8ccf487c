"""Note [Policy without the output] in ``fsdptag/_checkpoint.py``: the tag told from an
op and its inputs before it runs (what torch 2.11's policy can see) equals the tag of
its output (what 2.13+'s policy sees), op by op, on every op of training steps."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import fsdptag
from fsdptag._tag import first_tag, output_tag
from tests.models import make_net


class _Compare(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.tagged = 0
        self.mismatches: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = output_tag(func, args)
        out = func(*args, **(kwargs or {}))
        after = first_tag(out)
        self.ops += 1
        self.tagged += after is not None
        if before != after:
            self.mismatches.append(f"{func}: from inputs {before}, output {after}")
        return out


@pytest.mark.parametrize("bucket", ["blocks", "param"])
@pytest.mark.parametrize("zero", [2, 3])
def test_tag_from_inputs_equals_tag_of_output(fake_pg, zero, bucket):
    model = make_net()
    fsdptag.parametrize(model, init_device_mesh("cpu", (2,)), reshard_after_forward=zero == 3,
                        bucket=bucket, mp_policy=fsdptag.MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    fsdptag.apply_ac(model, "selective")
    compare = _Compare()
    with compare:
        for _ in range(2):
            model(torch.randint(0, 34, (2, 6))).float().sum().backward()
    assert compare.mismatches == []
    assert compare.tagged > 10 and compare.ops > 100  # the gathers, their views, the compute
