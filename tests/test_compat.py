"""The private torch APIs of ``fsdptag/_compat/``: each assumption fsdptag makes, pinned.

When a torch upgrade breaks one of these, this file names it.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils._python_dispatch import TorchDispatchMode

from fsdptag import _compat as compat


@pytest.fixture
def fake_pg():
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _save_all(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def test_sac_modes_and_current_region():
    caching, cached = create_selective_checkpoint_contexts(_save_all)
    assert isinstance(caching, compat.SACCachingMode) and isinstance(cached, compat.SACCachedMode)
    seen = []

    def region(x):
        seen.append(type(compat.current_sac_region()))
        return x.sin().cos()

    assert compat.current_sac_region() is None
    x = torch.randn(3, requires_grad=True)
    checkpoint(region, x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(_save_all)).sum().backward()
    assert seen == [compat.SACCachingMode, compat.SACCachedMode]  # forward, then the recompute


def test_sac_replay_error_text():
    x = torch.randn(3, requires_grad=True)
    y = checkpoint(lambda t: t.sin().cos(), x, use_reentrant=False,
                   context_fn=lambda: create_selective_checkpoint_contexts(_save_all)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError) as e:
        y.backward()
    assert compat.is_sac_replay_error(e.value), str(e.value)
    assert not compat.is_sac_replay_error(RuntimeError("something else"))


def test_dispatch_mode_skip_dynamo_hook_exists():
    # _checkpoint's SAC subclasses override it to skip a per-op torch._disable_dynamo wrapper.
    assert callable(getattr(TorchDispatchMode, "_should_skip_dynamo", None))


def test_set_alias_storage():
    from fsdptag import FSDPTag, FSDPTaggedTensor

    base = FSDPTaggedTensor(torch.randn(4, 4), FSDPTag("w", True))
    out = FSDPTaggedTensor(base._elem.t(), FSDPTag("w", True))  # a fresh wrapper: own storage
    assert out.untyped_storage()._cdata != base.untyped_storage()._cdata
    compat.set_alias_storage(out, base)
    assert out.untyped_storage()._cdata == base.untyped_storage()._cdata
    assert out.size() == (4, 4) and out.stride() == (1, 4)  # its own view geometry is kept


def test_saved_tensor_hooks_and_backward_probes():
    assert compat.top_saved_tensor_hooks() is None
    pack, unpack = (lambda t: t), (lambda t: t)
    with saved_tensors_hooks(pack, unpack):
        assert compat.top_saved_tensor_hooks() == (pack, unpack)
        assert not compat.is_checkpoint_hook(pack)
    in_region = []
    checkpoint(lambda t: in_region.append(compat.top_saved_tensor_hooks()) or t.sin(),
               torch.randn(2, requires_grad=True), use_reentrant=False)
    assert compat.is_checkpoint_hook(in_region[0][0])  # a checkpoint's own hooks, told apart
    assert not compat.in_backward()
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(compat.in_backward())
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(compat.in_backward())
            return g

    Probe.apply(torch.randn(2, requires_grad=True)).sum().backward()
    assert seen == [False, True]


def test_contiguous_strides():
    assert compat.contiguous_strides((3, 0, 2)) == (2, 2, 1)
    assert compat.contiguous_strides(()) == ()


def test_concatenate_meshes(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    both = compat.concatenate_meshes([mesh["dp"], mesh["tp"]])
    assert both.mesh_dim_names == ("dp", "tp") and both.mesh.tolist() == mesh.mesh.tolist()
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    with pytest.raises(RuntimeError):  # _plan turns this into an error that names the fix
        compat.concatenate_meshes([mesh["dp"], other])


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    ids: torch.Tensor


def test_apply_to_tensors_reaches_nested_inputs():
    args = ({"a": [torch.ones(1)], "b": _Batch(torch.ones(1), torch.arange(1))},)
    cast = compat.apply_to_tensors(
        lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, args)
    assert cast[0]["a"][0].dtype == torch.bfloat16
    assert cast[0]["b"].x.dtype == torch.bfloat16 and cast[0]["b"].ids.dtype == torch.int64


def test_strided_shard_and_async_collective_tensor():
    s = compat.StridedShard(0, split_factor=2)
    assert s.dim == 0 and s.split_factor == 2
    inner = torch.randn(2)
    assert compat.AsyncCollectiveTensor(inner).elem is inner


def test_storage_weak_refs():
    t = torch.randn(8)
    ref = compat.StorageWeakRef(t.untyped_storage())
    assert not compat.storage_expired(ref.cdata)
    assert compat.storage_from_weak(ref.cdata).nbytes() == 32
    del t
    gc.collect()
    assert compat.storage_expired(ref.cdata)


def test_storage_use_count_sees_views():
    t = torch.randn(8)
    base = compat.storage_use_count(t)
    view = t.detach()  # a new tensor on t's storage, holding no reference to t
    assert compat.storage_use_count(t) == base + 1 and t._use_count() == 1
    del view
    assert compat.storage_use_count(t) == base


def test_compile_start_callback_runs_before_tracing():
    torch._dynamo.reset()
    seen = []
    traced = []

    def on_start(args):
        seen.append(len(traced))  # nothing traced yet (torch 2.13+ also says is_compiling())

    def fn(x):
        traced.append(1)  # runs while dynamo traces fn
        return x + 1

    compat.on_compile_start(on_start)
    compat.on_compile_start(on_start)  # once per function
    torch.compile(fn, backend="eager")(torch.ones(2))
    assert seen == [0] and traced and not compat.is_compiling()
    torch._dynamo.reset()


def test_compiled_checkpoint_saving_a_mesh_and_an_rng_state(fake_pg):
    """Note [Compiled checkpoint, DeviceMesh saved]: the partitioner bug, fsdptag-free,
    and the fix, on every torch that saves opaque nodes (2.13, 2.14: the bug is there
    with a random op; 2.14 no longer counts SDPA without dropout as one). torch 2.11
    saves no opaque nodes: no bug, and the fix is not installed. When a torch fixes
    the bug, the first half fails: gate the fix off there."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch._functorch import partitioners
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,))
    w = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))

    def block(x):
        q = x @ w.redistribute(mesh, [Replicate()]).to_local()
        return F.dropout(q, 0.5)  # an RNG op, saved with the mesh

    def run():
        torch._dynamo.reset()
        f = torch.compile(lambda x: checkpoint(block, x, use_reentrant=False), backend="aot_eager")
        f(torch.randn(1, 2, 4, 8, requires_grad=True)).sum().backward()
        return type(w.grad).__name__

    compat.fix_compiled_rng_states()
    installed = partitioners.functionalize_rng_ops
    if compat.is_opaque_node is None:
        assert not getattr(installed, "_fsdptag_fix", False)
        assert run() == "DTensor"
        torch._dynamo.reset()
        return
    assert installed._fsdptag_fix
    partitioners.functionalize_rng_ops = installed.__wrapped__
    try:
        with pytest.raises(AssertionError, match="DeviceMesh"):
            run()
    finally:
        partitioners.functionalize_rng_ops = installed
    assert run() == "DTensor"
    torch._dynamo.reset()


def test_dynamo_checkpoint_side_effect_switch_exists():
    # Note [Compiled buckets]: fsdptag sets it when compiling (torchtitan does too).
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint in (False, True)


def test_sac_policy_sees_output_where_the_context_has_it():
    # torch 2.13+ passes the op's output to the policy; 2.11 calls it before the op.
    from torch.utils.checkpoint import SelectiveCheckpointContext

    seen = []

    def policy(ctx, func, *args, **kwargs):
        seen.append(getattr(ctx, "op_output", "absent"))
        return CheckpointPolicy.MUST_SAVE

    x = torch.randn(3, requires_grad=True)
    checkpoint(lambda t: t.sin(), x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(policy)).sum().backward()
    assert compat.SAC_POLICY_SEES_OUTPUT == ("op_output" in vars(SelectiveCheckpointContext(is_recompute=False)))
    if compat.SAC_POLICY_SEES_OUTPUT:
        assert isinstance(seen[0], torch.Tensor)
    else:
        assert seen[0] == "absent"
    storage = compat.sac_storage()
    assert isinstance(storage["op"], dict if compat.SAC_POLICY_SEES_OUTPUT else list)


def test_gqa_sdpa_flops_count_kv_heads_broadcast():
    # torch 2.11's formulas assert equal heads; the widened ones count GQA as 2.13+ does.
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    formulas = compat.gqa_sdpa_flop_formulas(flop_registry)
    q = torch.empty(2, 8, 16, 32, device="meta")
    kv, kv_full = torch.empty(2, 2, 16, 32, device="meta"), torch.empty(2, 8, 16, 32, device="meta")
    for op in (aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention):
        assert formulas[op](q, kv, kv, out_val=None) == formulas[op](q, kv_full, kv_full, out_val=None) > 0


def test_fake_collectives_wait_at_first_use_only_when_asked(fake_pg):
    """``lazy_wait`` leaves an issued output in flight (AsyncCollectiveTensor); under a
    fake mode torch waits at once instead (its ``_are_we_tracing``), and
    ``fakes_run_eager`` lifts that: no ``wait_tensor`` dispatched."""

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func._opname)
            return func(*args, **(kwargs or {}))

    def waits() -> bool:
        with FakeTensorMode():
            t = torch.empty(2)
            with Ops() as ops:
                compat.lazy_wait(t)
        return "wait_tensor" in ops.names

    assert waits()
    with compat.fakes_run_eager():
        assert not waits()
    assert waits()
    assert type(compat.lazy_wait(torch.empty(2))) is compat.AsyncCollectiveTensor  # eager: in flight


def test_dtensor_locals_kernels_and_ops(fake_pg):
    """``local_of`` / ``replace_local`` / ``dtensor_of`` (DTensor's private field and
    constructor), ``chunk_cat`` and ``foreach_amax`` (private kernels), ``OpOverload._op``
    (the tag's dispatch calls it)."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    d = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)], src_data_rank=None)
    assert compat.local_of(d) is d._local_tensor and compat.local_of(d).tolist() == [0.0, 1.0]
    again = compat.dtensor_of(torch.tensor([5.0, 6.0]), d._spec)
    assert type(again) is type(d) and again.placements == d.placements and again.shape == d.shape
    assert not again.requires_grad and compat.local_of(again).tolist() == [5.0, 6.0]
    compat.replace_local(again, torch.tensor([7.0, 8.0]))
    assert again.to_local().tolist() == [7.0, 8.0]
    out = torch.empty(2, 3)  # rows: chunk i of every tensor, side by side (dim 0 padded)
    compat.chunk_cat([torch.arange(4.0), torch.arange(2.0)], 2, out)
    assert out.tolist() == [[0.0, 1.0, 0.0], [2.0, 3.0, 1.0]]
    assert [t.item() for t in compat.foreach_amax([torch.tensor([-3.0, 2.0]), torch.tensor([0.5])])] == [3.0, 0.5]
    add = torch.ops.aten.add.Tensor
    assert add._op(torch.ones(1), torch.ones(1)).item() == 2.0
