"""Partial reshard (Note [Partial reshard] in ``fsdptag/_partial.py``): collectives on
the fake process group; numerics and memory on four gloo ranks in
``tests/test_parametrize.py`` (``test_partial_reshard_4ranks``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdptag
from fsdptag._partial import PartialReshard, partial_groups
from fsdptag._state import module_state
from fsdptag.debug import CollectiveCounter
from tests.models import make_net


def _summary(model, mesh) -> str:
    with CollectiveCounter(mesh) as cc:
        model(torch.randint(0, 34, (2, 6))).sum().backward()
    return cc.summary()


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_per_module_k_and_one_group_per_k(fake_pg):
    """Per module, as the bool: a dict of prefixes to k; backward re-gathers run on the
    k-groups (bytes as zero3's); one process group per distinct (shard group, k),
    however many models and buckets use it."""
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    model = make_net(n_layers=3)
    fsdptag.parametrize(model, mesh, reshard_after_forward={"": True, "layers.0": 2, "layers.1": 4,
                                                            "layers.2": False})
    again = make_net(n_layers=2)
    fsdptag.parametrize(again, mesh, reshard_after_forward=2)
    with CollectiveCounter(mesh) as cc:
        model(torch.randint(0, 34, (2, 6))).sum().backward()
    lines = [f"{e.phase} {e.kind} {e.group} {e.fqn}: {e.nbytes} B" for e in cc.events if e.kind == "all_gather"]
    assert_expected_inline("\n".join(lines), """\
forward all_gather dp <root>: 5248 B
forward all_gather dp layers.0: 5088 B
forward all_gather dp layers.1: 5088 B
forward all_gather dp layers.2: 5088 B
backward all_gather dp <root>: 5248 B
backward all_gather dp/4 layers.1: 5088 B
backward all_gather dp/2 layers.0: 5088 B""")
    assert sorted(k for _, k in partial_groups().values()) == [2, 4]
    assert [b.partial.k for b in module_state(again.layers[0]).buckets] == [2]


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_hsdp_regathers_within_the_shard_dim(fake_pg):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = make_net(n_layers=2)
    fsdptag.parametrize(model, mesh, mode="hybrid_shard", reshard_after_forward=2)
    fsdptag.apply_ac(model, "selective")
    assert_expected_inline(_summary(model, mesh), """\
forward  all_gather shard [fsdp] x3
backward all_gather shard/2 [fsdp] x3
backward all_reduce replicate x3
backward reduce_scatter shard x3""")


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_bad_k(fake_pg):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    cases = [
        (dict(reshard_after_forward=3), ValueError, "must divide"),
        (dict(reshard_after_forward=4), ValueError, "use False"),
        (dict(reshard_after_forward=1), TypeError, "an int k > 1"),
        (dict(reshard_after_forward=-2), TypeError, "an int k > 1"),
        (dict(reshard_after_forward={"layers.0": 2.0}), TypeError, "an int k > 1"),
        (dict(reshard_after_forward=lambda fqn, m: "2"), TypeError, "an int k > 1"),
        (dict(reshard_after_forward=2, bucket="param"), NotImplementedError, "needs bucketed gathers"),
    ]
    for kwargs, error, text in cases:
        model = make_net()
        with pytest.raises(error, match=text):
            fsdptag.parametrize(model, mesh, **kwargs)
        assert not fsdptag.is_parametrized(model)


def test_partial_groups_of_a_destroyed_process_group_are_gone():
    """A k-group lives as long as its process group: one left from an earlier process
    group (an estimate run in this process) is not listed, so counters do not label by it."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        sub = PartialReshard(2, 4, dist.group.WORLD.group_name).group_name
        assert partial_groups()[sub][1] == 2
    finally:
        dist.destroy_process_group()
    assert sub not in partial_groups()
