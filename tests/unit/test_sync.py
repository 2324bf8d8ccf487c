"""Gradient accumulation without sync (Note [Accumulation without sync] in
``fsdptag/_sync.py``): counts and bytes on the fake process group; numerics on two
gloo ranks in ``tests/test_parametrize.py`` (``no_sync`` case)."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.debug import CollectiveCounter
from tests.models import make_net


def _per_step(zero: int, ac: str, microbatches: int, mesh, how: str = "set") -> str:
    model = make_net(n_layers=3)
    fsdptag.parametrize(model, mesh, reshard_after_forward=zero == 3)
    fsdptag.apply_ac(model, ac)
    tokens = torch.randint(0, 34, (2, 6))
    with CollectiveCounter(mesh) as cc:
        if how == "set":
            fsdptag.set_requires_gradient_sync(model, False)
            for _ in range(microbatches - 1):
                model(tokens).sum().backward()
            fsdptag.set_requires_gradient_sync(model, True)
        else:
            with fsdptag.no_sync(model):
                for _ in range(microbatches - 1):
                    model(tokens).sum().backward()
        model(tokens).sum().backward()
    rs = [e for e in cc.events if e.kind in ("reduce_scatter", "all_reduce")]
    grads = {type(p.grad._local_tensor).__name__ for p in model.parameters()}
    return f"{len(rs)} reductions, {sum(e.nbytes for e in rs)} B, grads {grads}"


def test_reductions_per_step_do_not_depend_on_microbatches(fake_pg):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    lines = [f"zero{zero} {ac} x{n}: {_per_step(zero, ac, n, mesh)}"
             for zero in (2, 3) for ac in ("none", "selective", "full") for n in (1, 4)]
    lines.append(f"no_sync x3: {_per_step(2, 'selective', 3, mesh, how='ctx')}")
    assert_expected_inline("\n".join(lines), """\
zero2 none x1: 4 reductions, 18520 B, grads {'Tensor'}
zero2 none x4: 4 reductions, 18520 B, grads {'Tensor'}
zero2 selective x1: 4 reductions, 18520 B, grads {'Tensor'}
zero2 selective x4: 4 reductions, 18520 B, grads {'Tensor'}
zero2 full x1: 4 reductions, 18520 B, grads {'Tensor'}
zero2 full x4: 4 reductions, 18520 B, grads {'Tensor'}
zero3 none x1: 4 reductions, 18520 B, grads {'Tensor'}
zero3 none x4: 4 reductions, 18520 B, grads {'Tensor'}
zero3 selective x1: 4 reductions, 18520 B, grads {'Tensor'}
zero3 selective x4: 4 reductions, 18520 B, grads {'Tensor'}
zero3 full x1: 4 reductions, 18520 B, grads {'Tensor'}
zero3 full x4: 4 reductions, 18520 B, grads {'Tensor'}
no_sync x3: 4 reductions, 18520 B, grads {'Tensor'}""")


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_hsdp_reduces_once(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_net(n_layers=2)
    fsdptag.parametrize(model, mesh, mode="hybrid_shard")
    tokens = torch.randint(0, 34, (2, 6))
    with CollectiveCounter(mesh) as cc:
        with fsdptag.no_sync(model):
            model(tokens).sum().backward()
            model(tokens).sum().backward()
        model(tokens).sum().backward()
    assert_expected_inline(cc.summary(), """\
forward  all_gather shard [fsdp] x9
backward all_gather shard [fsdp] x9
backward all_reduce replicate x3
backward reduce_scatter shard x3""")


def test_per_block_and_unsynced_memory(fake_pg):
    """The flag is per bucket root (with ``recurse``); each bucket that does not sync
    holds one unsharded gradient in the reduce dtype until the syncing backward."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = make_net(n_layers=3)
    fsdptag.parametrize(model, mesh)
    tokens = torch.randint(0, 34, (2, 6))
    fsdptag.set_requires_gradient_sync(model.layers[0], False)
    with CollectiveCounter(mesh) as cc:
        model(tokens).sum().backward()
    from fsdptag._state import module_state
    held = module_state(model.layers[0]).buckets[0].unsynced_grad
    shard = sum(p._local_tensor.numel() for p in model.layers[0].parameters())
    assert held is not None and held.shape[0] == 2 and held.numel() >= 2 * shard
    assert all(p.grad is None for p in model.layers[0].parameters())
    assert all(p.grad is not None for p in model.layers[1].parameters())
    assert cc.count("backward", "reduce_scatter") == 3  # two blocks and the root's bucket
    fsdptag.set_requires_gradient_sync(model, True)
    model(tokens).sum().backward()
    assert module_state(model.layers[0]).buckets[0].unsynced_grad is None
    assert all(p.grad is not None for p in model.layers[0].parameters())


def test_frozen_weights_send_no_gradient(fake_pg):
    """Only parameters that require grad are reduce-scattered (Note [Buckets]): a bucket
    packs their slots alone, with or without sync; changing which ones require grad
    while gradients accumulate unsynced is refused."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = make_net(n_layers=2)
    for name, p in model.named_parameters():  # everything but the blocks' linear biases
        p.requires_grad_(name.startswith("layers.") and name.endswith("bias") and "norm" not in name)
    fsdptag.parametrize(model, mesh)
    tokens = torch.randint(0, 34, (2, 6))
    from fsdptag._state import module_state
    buckets = [b for m in model.modules() if (st := module_state(m)) is not None for b in st.buckets]
    trainable = sum(2 * slot.numel * 4 for b in buckets for slot, g in zip(b.slots, b.params)
                    if g.fqn.endswith("bias") and "norm" not in g.fqn)
    for microbatches in (1, 3):
        with CollectiveCounter(mesh) as cc:
            with fsdptag.no_sync(model):
                for _ in range(microbatches - 1):
                    model(tokens).sum().backward()
            model(tokens).sum().backward()
        rs = [e for e in cc.events if e.kind == "reduce_scatter"]
        assert (len(rs), sum(e.nbytes for e in rs)) == (2, trainable), (microbatches, rs)
        assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
        model.zero_grad()
    with fsdptag.no_sync(model):
        model(tokens).sum().backward()
    model.layers[0].fc1._parameters["weight"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="change requires_grad only after a backward that syncs"):
        model(tokens).sum().backward()
    model(tokens).sum().backward()  # what accumulated was dropped with the error: syncs afresh
    assert model.layers[0].fc1._parameters["weight"].grad is not None


def test_bad_input(fake_pg):
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError, match="not parametrized: call fsdptag.parametrize"):
        fsdptag.set_requires_gradient_sync(make_net(n_layers=1), False)
    model = make_net(n_layers=1)
    fsdptag.parametrize(model, mesh)
    with pytest.raises(TypeError, match="must be True or False"):
        fsdptag.set_requires_gradient_sync(model, 0)
    alone = make_net(n_layers=1)
    fsdptag.parametrize(alone, mesh, bucket="param")
    with pytest.raises(NotImplementedError, match="bucket='blocks'"):
        fsdptag.set_requires_gradient_sync(alone, False)
    with pytest.raises(NotImplementedError, match="bucket='blocks'"):
        with fsdptag.no_sync(alone):
            pass


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_tensor_parallel_reduces_once(fake_pg):
    """FSDP x TP (the built-in Llama's Megatron plan, dp 2 x tp 2): the data-parallel
    reductions happen once per step; TP collectives run in every microbatch."""
    from fsdptag.tools import estimate as est

    mesh = est.build_mesh("cpu", 4, 2, 1)
    spec = est.builtin_model("llama3-debug", 16)

    def step(microbatches: int) -> str:
        torch.manual_seed(0)
        model = est.build_model(spec, mesh, policy="tagged", reshard=False, ac="selective", mp="fp32")
        tokens = torch.randint(0, spec.vocab_size, (1, 16))
        with CollectiveCounter(mesh) as cc:
            with fsdptag.no_sync(model):
                for _ in range(microbatches - 1):
                    model(tokens).sum().backward()
            model(tokens).sum().backward()
        dp = [e for e in cc.events if e.kind == "reduce_scatter" and "dp" in e.group]
        tp = [e for e in cc.events if "tp" in e.group]
        return f"x{microbatches}: dp reduce-scatters {len(dp)} ({sum(e.nbytes for e in dp)} B), tp collectives {len(tp)}"

    assert_expected_inline("\n".join(step(n) for n in (1, 3)), """\
x1: dp reduce-scatters 3 (251136 B), tp collectives 30
x3: dp reduce-scatters 3 (251136 B), tp collectives 90""")
