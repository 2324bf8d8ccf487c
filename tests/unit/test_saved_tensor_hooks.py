"""Someone else's saved-tensor hooks around forward (``save_on_cpu``, a memory profiler):
zero3 still re-gathers once per bucket in backward, zero2 keeps its gathers where they
are, and only activations go through the other hooks (Note [Whose saved-tensor hooks]
in ``fsdptag/_reshard.py``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag._tag import get_fsdp_tag
from fsdptag.debug import CollectiveCounter, LiveStorageTracker
from tests.models import make_net


class _CountingHooks(saved_tensors_hooks):
    """A profiler-like pair of hooks: records what it is handed to pack."""

    def __init__(self) -> None:
        self.packed: list[torch.Tensor] = []
        super().__init__(self._pack, lambda x: x)

    def _pack(self, t):
        self.packed.append(t)
        return t


def _step(model, wrap, tokens):
    mesh_counter = CollectiveCounter()
    with mesh_counter:
        with wrap():
            loss = model(tokens).sum()
        loss.backward()
    return mesh_counter, loss


@pytest.mark.parametrize("zero", [2, 3])
def test_foreign_hooks_see_activations_only(fake_pg, zero):
    tokens = torch.randint(0, 34, (2, 6))
    model = make_net()
    fsdptag.parametrize(model, init_device_mesh("cpu", (2,)), reshard_after_forward=zero == 3)
    plain, _ = _step(model, contextlib.nullcontext, tokens)
    hooks = _CountingHooks()
    seen, _ = _step(model, lambda: hooks, tokens)
    on_cpu, _ = _step(model, lambda: save_on_cpu(pin_memory=False), tokens)
    # 3 buckets (root, 2 blocks): zero3 re-gathers each once in backward, zero2 none
    expected = 3 if zero == 3 else 0
    for counter in (plain, seen, on_cpu):
        assert counter.count("forward", "all_gather", fsdp_tagged=True) == 3
        assert counter.count("backward", "all_gather", fsdp_tagged=True) == expected
    assert hooks.packed and all(get_fsdp_tag(t) is None for t in hooks.packed)



def _hooks_around_each_block(model, make_hooks):
    """Open ``make_hooks()`` around each block's call, as Hugging Face's offload does."""
    opened = []

    def enter(module, args):
        opened.append(make_hooks())
        opened[-1].__enter__()

    def leave(module, args, output):
        opened.pop().__exit__(None, None, None)

    for block in model.layers:
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave, always_call=True)


@pytest.mark.parametrize("zero", [2, 3])
def test_foreign_hooks_around_each_block(fake_pg, zero):
    model = make_net()
    fsdptag.parametrize(model, init_device_mesh("cpu", (2,)), reshard_after_forward=zero == 3)
    hooks = _CountingHooks()
    _hooks_around_each_block(model, lambda: hooks)
    counter, _ = _step(model, contextlib.nullcontext, torch.randint(0, 34, (2, 6)))
    assert counter.count("backward", "all_gather", fsdp_tagged=True) == (3 if zero == 3 else 0)
    assert hooks.packed and all(get_fsdp_tag(t) is None for t in hooks.packed)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_foreign_hooks_over_checkpointed_blocks(fake_pg, ac):
    # the checkpoint regions' hooks are innermost inside each block: AC decides there
    for zero in (2, 3):
        model = make_net()
        fsdptag.parametrize(model, init_device_mesh("cpu", (2,)), reshard_after_forward=zero == 3)
        fsdptag.apply_ac(model, ac)
        counter, _ = _step(model, lambda: save_on_cpu(pin_memory=False), torch.randint(0, 34, (2, 6)))
        assert counter.count("backward", "all_gather", fsdp_tagged=True) == (3 if zero == 3 else 0)


@pytest.mark.parametrize("zero", [2, 3])
def test_gathered_bytes_kept_for_backward_are_as_without_hooks(fake_pg, zero):
    """What forward keeps of FSDP gathers: zero3 nothing, zero2 its buckets, with or
    without ``save_on_cpu`` around the forward (activations move, gathers do not)."""
    model = make_net()
    fsdptag.parametrize(model, init_device_mesh("cpu", (2,)), reshard_after_forward=zero == 3)
    tokens = torch.randint(0, 34, (2, 6))
    kept = {}
    for name, wrap in (("plain", contextlib.nullcontext), ("save_on_cpu", lambda: save_on_cpu(pin_memory=False))):
        with LiveStorageTracker() as mem:
            with wrap():
                loss = model(tokens).sum()
            at_forward_end = mem.snapshot()
            loss.backward()
            del loss
            kept[name] = LiveStorageTracker.kept(at_forward_end, mem.snapshot()).get("fsdp", 0)
    assert kept["save_on_cpu"] == kept["plain"], kept
    assert (kept["plain"] == 0) == (zero == 3), kept
