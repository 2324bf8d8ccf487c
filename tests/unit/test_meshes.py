"""Meshes per module (Note [Meshes per module] in fsdptag/_mesh.py): expert parallelism's
layout, on the fake process group at world 4 (experts over ``("efsdp", "ep")``, the
rest over ``"fsdp"``), and ``gradient_divide_factor`` on one real gloo rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdptag
from fsdptag._state import module_state

EXPERTS = 4


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, 8, 6))

    def forward(self, x):
        w = self.w.to_local() if isinstance(self.w, DTensor) else self.w  # this rank's experts
        return torch.einsum("bd,efd->bf", x, w)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(6, 6)
        self.experts = Experts()
        self.down = nn.Linear(8, 6)

    def forward(self, x):
        return x + self.down(self.experts(self.dense(x)))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.out(x)


def _ep_model(sparse):
    """Each block's experts sharded over ``ep`` (what ``parallelize_module`` does)."""
    torch.manual_seed(0)
    model = MoE()
    for block in model.layers:
        block.experts.w = nn.Parameter(distribute_tensor(block.experts.w.detach(), sparse["ep"], [Shard(0)]))
    return model


def _meshes():
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    return sparse, sparse._flatten("fsdp")


EXPERT_MESHES = ["layers.0.experts", "layers.1.experts"]


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_experts_shard_over_what_ep_leaves(fake_pg):
    sparse, dense = _meshes()
    model = _ep_model(sparse)
    fsdptag.parametrize(model, {"": dense, **dict.fromkeys(EXPERT_MESHES, sparse)})
    w = model.layers[0].experts._parameters["w"]
    assert w.device_mesh.mesh_dim_names == ("efsdp", "ep") and w.to_local().shape == (1, 8, 6)
    dense_w = model.layers[0].dense._parameters["weight"]
    assert dense_w.device_mesh.mesh_dim_names == ("fsdp",) and dense_w.to_local().shape == (2, 6)
    buckets = {b.name: b for b in module_state(model.layers[0]).buckets}
    assert sorted(buckets) == ["layers.0", "layers.0[efsdp]"]
    # experts reduce-scatter over efsdp (2 ranks) and are averaged over all 4 data-parallel ranks
    experts, rest = buckets["layers.0[efsdp]"], buckets["layers.0"]
    assert (experts.world, experts.divide, rest.world, rest.divide) == (2, 4.0, 4, None)
    r = experts.reduction(torch.float32)
    assert (r.op, r.pre_divide, r.post_divide) == ("sum", 4.0, None)
    r = experts.reduction(torch.float16)  # split around the sum, as FSDP2's fp16 does
    assert (r.op, r.pre_divide * r.post_divide) == ("sum", 4.0)
    assert rest.reduction(torch.float32).op == "avg"
    model(torch.randn(3, 6)).sum().backward()  # runs (the fake group moves nothing)
    assert model.layers[0].experts._parameters["w"].grad.to_local().shape == (1, 8, 6)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_gradient_divide_factor_for_every_bucket(fake_pg):
    sparse, dense = _meshes()
    model = _ep_model(sparse)
    fsdptag.parametrize(model, {"": dense, **dict.fromkeys(EXPERT_MESHES, sparse)}, gradient_divide_factor=1.0)
    for bucket in module_state(model.layers[1]).buckets + module_state(model).buckets:
        r = bucket.reduction(torch.float32)
        assert (r.op, r.pre_divide, r.post_divide) == ("sum", None, None), bucket.name


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_meshes_refused(fake_pg):
    sparse, dense = _meshes()

    def error(mesh, exc=ValueError, **kwargs):
        model = _ep_model(sparse)
        with pytest.raises(exc) as info:
            fsdptag.parametrize(model, mesh, **kwargs)
        assert not fsdptag.is_parametrized(model)  # unchanged
        return str(info.value)

    experts = dict.fromkeys(EXPERT_MESHES, sparse)
    assert "under \"\"" in error(experts)
    assert "'layers.9', which is not in the model" in error({"": dense, "layers.9": sparse})
    nearer = {"": dense, "layers.0": sparse, "layers.0.dense": dense, "layers.0.down": dense, **experts}
    assert "mesh['layers.0'] has no parameters to shard" in error(nearer)
    # experts left on the dense mesh: their ep mesh is not part of it
    assert "not a sub-mesh" in error(dense)
    # an expert mesh without the ep dim: its ranks would average apart
    plain = MoE()
    with pytest.raises(ValueError, match="span different numbers of ranks"):
        fsdptag.parametrize(plain, {"": dense, "layers.0.experts": sparse["efsdp"]})
    assert not fsdptag.is_parametrized(plain)
    assert "positive number" in error(dense, gradient_divide_factor=0)
    assert "DeviceMesh or a dict" in error([dense], TypeError)


@pytest.mark.parametrize("how", ["blocks", "param", "outside forward", "replicate"])
def test_gradient_divide_factor_divides_the_sum(how):
    """One real gloo rank: the summed gradient is divided by the factor (0.5: doubled),
    bucketed, gathered alone (per parameter, or a bucketed one read outside its root's
    forward, as torchtitan's chunked loss reads lm_head) and in DDP."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        ref, model = MoE(), MoE()
        model.load_state_dict(ref.state_dict())
        fsdptag.parametrize(model, mesh, gradient_divide_factor=0.5, bucket="param" if how == "param" else "blocks",
                            mode="replicate" if how == "replicate" else None)
        x = torch.randn(3, 6)
        if how == "outside forward":
            ref, model = ref.out, model.out
        ref(x).sum().backward()
        model(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), 2 * q.grad, msg=name)
    finally:
        dist.destroy_process_group()
