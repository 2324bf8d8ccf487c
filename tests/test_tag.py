"""Single-process specification of FSDPTaggedTensor and its op table."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdptag import FSDPTag, FSDPTaggedTensor, get_fsdp_tag, is_fsdp_tagged
from fsdptag._handout import tag_shard, untag
from fsdptag._tag import TAG_KEEPING_OPS, first_tag, mark_gathered

TAG = FSDPTag("layers.0.weight", True)


def tagged(*shape):
    return FSDPTaggedTensor(torch.randn(*shape), TAG)


def test_op_table():
    assert_expected_inline("\n".join(sorted(str(op) for op in TAG_KEEPING_OPS)), """\
_c10d_functional._wrap_tensor_autograd.default
_c10d_functional.all_gather_into_tensor.default
_c10d_functional.wait_tensor.default
aten._to_copy.default
aten._unsafe_view.default
aten.alias.default
aten.as_strided.default
aten.cat.default
aten.chunk.default
aten.clone.default
aten.constant_pad_nd.default
aten.detach.default
aten.expand.default
aten.narrow.default
aten.new_zeros.default
aten.permute.default
aten.select.int
aten.slice.Tensor
aten.split.Tensor
aten.split_with_sizes.default
aten.split_with_sizes_copy.default
aten.squeeze.dim
aten.t.default
aten.transpose.int
aten.unbind.int
aten.unsqueeze.default
aten.view.default""")


@pytest.mark.parametrize("name, fn", [
    ("t", lambda w: w.t()),
    ("view", lambda w: w.view(-1)),
    ("slice", lambda w: w[1:3]),
    ("narrow", lambda w: w.narrow(0, 0, 2)),
    ("split", lambda w: w.split(2)[1]),
    ("chunk", lambda w: w.chunk(2)[0]),
    ("detach", lambda w: w.detach()),
    ("transpose", lambda w: w.transpose(0, 1)),
    ("cast", lambda w: w.to(torch.bfloat16)),
    ("cat", lambda w: torch.cat([w, w.new_zeros(2, 4)])),
    ("pad", lambda w: F.pad(w, (0, 0, 0, 1))),
    ("contiguous", lambda w: w.t().contiguous()),
])
def test_fsdp_path_keeps_tag(name, fn):
    out = fn(tagged(4, 4))
    assert type(out) is FSDPTaggedTensor and out.tag is TAG


@pytest.mark.parametrize("name, fn", [
    ("mm", lambda w: w @ w),
    ("add", lambda w: w + 1),
    ("relu", lambda w: w.relu()),
    ("sum", lambda w: w.sum()),
    ("linear", lambda w: F.linear(torch.randn(2, 4), w)),
    ("layer_norm", lambda w: F.layer_norm(w, (4,))),
])
def test_compute_drops_tag(name, fn):
    assert type(fn(tagged(4, 4))) is torch.Tensor


def test_marked_handout_tags_its_views_not_compute():
    # Note [Marked handout]: compute gets a plain tensor; views find the tag on its storage.
    w = untag(FSDPTaggedTensor(torch.randn(4, 4), TAG).requires_grad_())
    assert type(w) is torch.Tensor and get_fsdp_tag(w) is TAG
    for view in (w.t(), w.view(-1), w[1:3], w.detach(), w.t().t().unsqueeze(0)):
        assert type(view) is torch.Tensor and first_tag(view) is TAG
    for out in (w @ w, w + 1, w.t().contiguous(), torch.randn(4, 4)):
        assert first_tag(out) is None
    (w.t() @ torch.ones(4, 1)).sum().backward()  # untag is differentiable


def test_mark_seen_through_dtensor_local_views():
    # DTensor takes views of its local tensor inside its dispatch, where _base is not set.
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        d = DTensor.from_local(mark_gathered(torch.randn(4, 2), TAG), mesh, [Replicate()], run_check=False)
        assert d.t()._local_tensor._base is None and is_fsdp_tagged(d.t())
        assert not is_fsdp_tagged(d @ d.t())
    finally:
        dist.destroy_process_group()


def test_views_alias_their_base():
    w = tagged(4, 4)
    v = w.t()
    assert v._is_view() and v._elem.untyped_storage().data_ptr() == w._elem.untyped_storage().data_ptr()
    assert v.size() == (4, 4) and v.stride() == (1, 4)


def test_flatten_unflatten_roundtrip():
    w = tagged(3, 2)
    names, tag = w.__tensor_flatten__()
    back = FSDPTaggedTensor.__tensor_unflatten__({n: getattr(w, n) for n in names}, tag, w.size(), w.stride())
    assert names == ["_elem"] and back.tag == TAG and torch.equal(back._elem, w._elem)


def test_async_collective_wrap_keeps_tag_inside():
    # _wrap_tensor_autograd wraps the gather output; the later wait sees ACT's inner tensor.
    out = torch.ops._c10d_functional._wrap_tensor_autograd(tagged(2, 2))
    assert type(out) is AsyncCollectiveTensor and type(out.elem) is FSDPTaggedTensor
    assert is_fsdp_tagged(out) and get_fsdp_tag(out) is TAG
    waited = torch.ops._c10d_functional.wait_tensor(out.elem)
    assert type(waited) is FSDPTaggedTensor


def test_tag_seen_through_dtensor():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        d = DTensor.from_local(tagged(2, 2), mesh, [Replicate()], run_check=False)
        assert is_fsdp_tagged(d) and not is_fsdp_tagged(DTensor.from_local(torch.ones(2), mesh, [Replicate()]))
    finally:
        dist.destroy_process_group()


def test_in_place_on_gathered_param_is_an_error():
    with pytest.raises(RuntimeError, match="in-place op .* 'layers.0.weight'.*disable_active_parametrization"):
        tagged(2, 2).mul_(2)


def test_tag_shard_is_differentiable_and_grads_are_plain():
    shard = torch.randn(3, 2, requires_grad=True)
    out = tag_shard(shard, TAG)
    assert type(out) is FSDPTaggedTensor and out.requires_grad
    (out.t() @ torch.ones(3, 1)).sum().backward()
    assert type(shard.grad) is torch.Tensor and torch.equal(shard.grad, torch.ones(3, 2))
