"""Note [Buckets] in ``fsdptag/_bucket.py``: a bucket scope serves only accesses from the
checkpoint region it was opened in. A user's own selective-checkpoint region inside a
bucket root (not seen at ``parametrize`` time) gathers per parameter, in forward and in
its recompute alike, so SAC's replay sees the same all-gathers."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import fsdptag
from fsdptag.debug import CollectiveCounter
from tests.models import make_net


def _checkpoint_each_feed_forward(model) -> None:
    """Each block's fc1 and fc2 in the user's own SAC region (fsdptag's policy), inside the
    block's bucket scope."""
    for block in model.layers:
        for name in ("fc1", "fc2"):
            inner = getattr(block, name)
            inner.forward = functools.partial(
                lambda f, x: checkpoint(f, x, use_reentrant=False,
                                        context_fn=fsdptag.checkpoint_context_fn()), inner.forward)


@pytest.mark.parametrize("zero", [2, 3])
def test_user_region_inside_a_bucket_root_gathers_per_parameter(fake_pg, zero):
    model = make_net()
    fsdptag.parametrize(model, init_device_mesh("cpu", (2,)), reshard_after_forward=zero == 3)
    _checkpoint_each_feed_forward(model)
    with CollectiveCounter() as cc:
        model(torch.randint(0, 34, (2, 6))).sum().backward()  # the replay check would raise
    fwd = [e.fqn for e in cc.events if e.phase == "forward" and e.kind == "all_gather"]
    bwd = [e.fqn for e in cc.events if e.phase == "backward" and e.kind == "all_gather"]
    # 3 buckets, plus fc1/fc2 weight and bias of each block gathered alone inside their regions
    assert len(fwd) == 3 + 2 * 4, fwd
    assert sorted(f for f in fwd if f.endswith(("weight", "bias"))) == sorted(
        f"layers.{i}.{m}.{p}" for i in range(2) for m in ("fc1", "fc2") for p in ("weight", "bias"))
    # zero2: the policy saves the regions' gathers; zero3: the recompute gathers them again,
    # and the zero3 hooks re-gather the 3 buckets
    assert len(bwd) == (0 if zero == 2 else 3 + 2 * 4), bwd


class _SharedEmbedding(torch.nn.Module):
    """A block that also reads the root's embedding table (tied: registered in both)."""

    def __init__(self, block, embedding) -> None:
        super().__init__()
        self.block, self.shared = block, embedding

    def forward(self, x):
        return self.block(x + self.shared.weight[:1])  # first: the recompute runs it


def test_full_ac_saves_gathers_a_block_reads_from_the_root_bucket(fake_pg):
    """Full AC on a block that reads a parameter of the root's bucket: plain checkpointing
    would serve it from the root's scope in forward and gather the root bucket again in
    the recompute, so there full AC is the tagged policy (Note [Tagged checkpoint policy])."""
    model = make_net()
    model.layers = torch.nn.ModuleList(_SharedEmbedding(b, model.tok) for b in model.layers)
    fsdptag.parametrize(model, init_device_mesh("cpu", (2,)), reshard_after_forward=False)
    fsdptag.apply_ac(model, "full")
    with CollectiveCounter() as cc:
        model(torch.randint(0, 34, (2, 6))).sum().backward()
    assert cc.count("backward", "all_gather") == 0, [e.fqn for e in cc.events if e.phase == "backward"]
