"""Backward on another thread, as on CUDA (autograd runs it on a per-device thread):
the settings a forward ran under must hold for its recompute there too."""

from __future__ import annotations

import threading

import torch
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.debug import disable_tagging
from tests.models import make_net


def _backward_on_another_thread(loss: torch.Tensor) -> None:
    errors: list[BaseException] = []

    def run():
        try:
            loss.backward()
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def _net(zero: int, ac: str):
    model = make_net()
    fsdptag.parametrize(model, init_device_mesh("cpu", (2,)), reshard_after_forward=zero == 3)
    return fsdptag.apply_ac(model, ac)


def test_disable_tagging_holds_in_a_backward_on_another_thread(fake_pg):
    for zero in (2, 3):
        model = _net(zero, "selective")
        with disable_tagging():
            loss = model(torch.randint(0, 34, (2, 6))).sum()
            _backward_on_another_thread(loss)
        assert all(p.grad is not None for p in model.parameters())


def test_disable_active_parametrization_spanning_backward_on_another_thread(fake_pg):
    model = _net(2, "selective")
    with fsdptag.disable_active_parametrization():
        # parameters are the stored shards here: run a forward on them directly
        w = model.head.weight
        assert isinstance(w, torch.distributed.tensor.DTensor)
        seen = []

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                seen.append(isinstance(model.head.weight, torch.distributed.tensor.DTensor))
                return g

        _backward_on_another_thread(Probe.apply(torch.ones(2, requires_grad=True)).sum())
    assert seen == [True]
