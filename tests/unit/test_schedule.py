"""An explicit gather schedule (Note [Explicit schedule] in ``fsdptag/_schedule.py``):
collective order and overlap on the fake process group; numerics on two gloo ranks in
``tests/test_parametrize.py`` (``schedule`` case)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag._state import module_state
from fsdptag.debug import CollectiveCounter
from tests.models import make_net


def _model(zero: int, ac: str = "none", **kw):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = make_net(n_layers=4)
    fsdptag.parametrize(model, mesh, reshard_after_forward=zero == 3, **kw)
    fsdptag.apply_ac(model, ac)
    return model, mesh


def _schedule_like_default(model) -> None:
    """The order the default prefetch learns: forward root, layers 0..3; backward (zero3
    re-gathers) root (the head's weight), layers 3..0."""
    layers = list(model.layers)
    fsdptag.set_modules_to_forward_prefetch(model, [layers[0]])
    fsdptag.set_modules_to_backward_prefetch(model, [layers[-1]])
    for a, b in zip(layers, layers[1:]):
        fsdptag.set_modules_to_forward_prefetch(a, [b])
        fsdptag.set_modules_to_backward_prefetch(b, [a])


def _events(model, mesh, steps: int = 2) -> list[list[tuple]]:
    out = []
    tokens = torch.randint(0, 34, (2, 6))
    for _ in range(steps):
        with CollectiveCounter(mesh) as cc:
            model(tokens).sum().backward()
        model.zero_grad()
        out.append([(e.phase, e.kind, e.fqn, e.nbytes, e.compute_in_flight, e.in_flight_at_issue)
                    for e in cc.events])
    return out


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_explicit_schedule_issues_what_the_default_does(fake_pg, zero, ac):
    """``prefetch=False`` plus lists naming the default's order issue the same
    collectives, in the same order, with the same compute in flight, as the default's
    second step (which runs in the order its first step learned); from the first step on."""
    default = _events(*_model(zero, ac))
    model, mesh = _model(zero, ac, prefetch=False)
    _schedule_like_default(model)
    explicit = _events(model, mesh)
    assert explicit[0] == explicit[1] == default[1]
    overlapped = sum(1 for e in explicit[1] if e[4])
    assert overlapped == len(explicit[1]) - (2 if zero == 2 else 3), explicit[1]


def test_lists_override_the_learned_order(fake_pg):
    """A list replaces the learned next bucket for its module only; an empty list issues
    nothing; a target gathered already in this forward is not issued again."""
    model, mesh = _model(3, prefetch=False)
    layers = list(model.layers)
    fsdptag.set_modules_to_forward_prefetch(model, [layers[2], layers[0]])
    fsdptag.set_modules_to_forward_prefetch(layers[0], [])
    fsdptag.set_modules_to_forward_prefetch(layers[2], [layers[0], layers[3]])  # 0 gathered by then
    with CollectiveCounter(mesh) as cc:
        model(torch.randint(0, 34, (2, 6))).sum()
    assert_expected_inline("\n".join(cc.timeline()), """\
forward all_gather <root>: 0
forward all_gather layers.2: 5
forward all_gather layers.0: 1
forward all_gather layers.1: 0
forward all_gather layers.3: 2""")


def test_unshard_and_reshard_in_a_custom_loop(fake_pg):
    """``unshard`` issues now and the next gather claims it (no extra all-gather, in
    forward or in zero3's backward); ``reshard`` releases one nobody claimed."""
    model, mesh = _model(3, prefetch=False)
    tokens = torch.randint(0, 34, (2, 6))
    with CollectiveCounter(mesh) as cc:
        handle = fsdptag.unshard(model.layers[1], async_op=True)
        assert isinstance(handle, fsdptag.UnshardHandle)
        loss = model(tokens).sum()
        handle.wait()
        assert fsdptag.unshard(model.layers[3]) is None  # for its backward re-gather
        loss.backward()
    claimed = "\n".join(cc.timeline())
    with CollectiveCounter(mesh) as cc:
        fsdptag.unshard(model.layers[2])
        fsdptag.reshard(model.layers[2])
        model(tokens).sum().backward()
    released = cc.summary()
    assert_expected_inline(claimed + "\n--\n" + released, """\
forward all_gather layers.1: 3
forward all_gather <root>: 0
forward all_gather layers.0: 0
forward all_gather layers.2: 0
forward all_gather layers.3: 0
forward all_gather layers.3: 0
backward all_gather <root>: 0
backward reduce_scatter dp: 4
backward all_gather layers.2: 0
backward reduce_scatter dp: 4
backward all_gather layers.1: 0
backward reduce_scatter dp: 4
backward all_gather layers.0: 0
backward reduce_scatter dp: 1
backward reduce_scatter dp: 0
--
forward  all_gather dp [fsdp] x6
backward all_gather dp [fsdp] x5
backward reduce_scatter dp x5""")
    assert not module_state(model).root.prefetcher.pending


def test_unshard_of_a_bucket_in_flight_or_in_use(fake_pg):
    """``unshard`` of a bucket whose all-gather is in flight (the default prefetch issued
    it) or that is gathered in an open forward of its root issues nothing."""
    model, mesh = _model(2)
    seen = []

    def hook(module, args):
        with CollectiveCounter(mesh) as cc:
            fsdptag.unshard(module)  # prefetched by the bucket before it: in flight
        seen.append(len(cc.events))

    def inside(module, args):
        with CollectiveCounter(mesh) as cc:
            fsdptag.unshard(model.layers[1])  # gathered in this forward: in use already
        seen.append(len(cc.events))

    model.layers[1].register_forward_pre_hook(hook)
    model.layers[1].fc2.register_forward_pre_hook(inside)
    with CollectiveCounter(mesh) as cc:
        model(torch.randint(0, 34, (2, 6))).sum().backward()
    assert seen == [0, 0], seen  # the default prefetch issued layers.1's already
    assert sum(1 for e in cc.events if e.kind == "all_gather") == 5


def test_bad_input(fake_pg):
    model, _ = _model(3)
    other, _ = _model(3)
    cases = [
        (lambda: fsdptag.unshard(nn.Linear(2, 2)), ValueError, "call fsdptag.parametrize"),
        (lambda: fsdptag.unshard(model.layers[0].fc1), ValueError, "not a bucket root"),
        (lambda: fsdptag.unshard("layers.0"), TypeError, "takes an nn.Module"),
        (lambda: fsdptag.unshard(model, async_op=1), TypeError, "must be True or False"),
        (lambda: fsdptag.set_modules_to_forward_prefetch(model, model.layers[0]), TypeError, "a list of modules"),
        (lambda: fsdptag.set_modules_to_forward_prefetch(model, [model.layers[0], other.layers[1]]),
         ValueError, "another parametrized model"),
        (lambda: fsdptag.set_modules_to_backward_prefetch(model, [model.layers[0].norm]), ValueError,
         "not a bucket root"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text):
            call()
    prefetcher = module_state(model).root.prefetcher
    assert prefetcher.schedule == {"forward": {}, "backward": {}} and not prefetcher.pending
