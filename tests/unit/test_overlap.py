"""Collectives overlap compute: the dispatch-order timeline of ``CollectiveCounter``
(Note [Compute in flight] in ``fsdptag/debug.py``) on the fake process group, for
zero2 / zero3 under no AC, selective and full AC, with default arguments.

On NCCL only compute queued between a collective's issue and its wait hides it; these
tests pin, per phase, how many FSDP collectives have compute in flight. The first
all-gather of a forward (nothing runs before it), the first re-gather of a backward and
the last reduce-scatter (nothing runs after it) cannot; every other one must."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh

import fsdptag
from fsdptag.debug import CollectiveCounter
from tests.models import make_net


def _step_timeline(zero: int, ac: str, steps: int = 2, **kw) -> CollectiveCounter:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = make_net(n_layers=6)
    fsdptag.parametrize(model, mesh, reshard_after_forward=zero == 3, **kw)
    fsdptag.apply_ac(model, ac)
    for _ in range(steps):  # the second step runs in the order the first one learned
        with CollectiveCounter(mesh) as cc:
            model(torch.randint(0, 34, (2, 6))).sum().backward()
        model.zero_grad()
    return cc


def test_timeline_matrix(fake_pg):
    text = "\n".join(f"zero{zero} {ac}:\n  " + _step_timeline(zero, ac).overlap_summary().replace("\n", "\n  ")
                     for zero in (2, 3) for ac in ("none", "selective", "full"))
    assert_expected_inline(text, """\
zero2 none:
  forward  all_gather dp [fsdp] 6 of 7
  backward reduce_scatter dp 6 of 7
zero2 selective:
  forward  all_gather dp [fsdp] 6 of 7
  backward reduce_scatter dp 6 of 7
zero2 full:
  forward  all_gather dp [fsdp] 6 of 7
  backward reduce_scatter dp 6 of 7
zero3 none:
  forward  all_gather dp [fsdp] 6 of 7
  backward all_gather dp [fsdp] 6 of 7
  backward reduce_scatter dp 6 of 7
zero3 selective:
  forward  all_gather dp [fsdp] 6 of 7
  backward all_gather dp [fsdp] 6 of 7
  backward reduce_scatter dp 6 of 7
zero3 full:
  forward  all_gather dp [fsdp] 6 of 7
  backward all_gather dp [fsdp] 6 of 7
  backward reduce_scatter dp 6 of 7""")


def test_without_prefetch_gathers_hide_behind_nothing(fake_pg):
    """``prefetch=False``: each all-gather is waited right after its issue."""
    text = "\n".join(_step_timeline(zero, "selective", prefetch=False).overlap_summary() for zero in (2, 3))
    assert_expected_inline(text, """\
forward  all_gather dp [fsdp] 0 of 7
backward reduce_scatter dp 6 of 7
forward  all_gather dp [fsdp] 0 of 7
backward all_gather dp [fsdp] 0 of 7
backward reduce_scatter dp 6 of 7""")


def test_reductions_wait_at_the_latest_and_grads_are_plain(fake_pg):
    """Note [Reductions in flight] in ``fsdptag/_collectives.py``: each reduce-scatter
    is waited when the next one is issued, the last at the end of backward; gradients are
    plain DTensors when ``backward()`` returns."""
    cc = _step_timeline(2, "none", steps=1)
    rs = [e for e in cc.events if e.kind == "reduce_scatter"]
    assert [e.compute_in_flight is not None for e in rs] == [True] * 7
    assert [e.overlapped for e in rs] == [True] * 6 + [False]


def test_gradients_plain_after_backward(fake_pg):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    mesh = init_device_mesh("cpu", (2,))
    model = make_net()
    fsdptag.parametrize(model, mesh)
    model(torch.randint(0, 34, (2, 6))).sum().backward()
    kinds = {type(p.grad._local_tensor) for p in model.parameters()}
    assert kinds == {torch.Tensor}, kinds


def test_a_backward_that_raises_leaves_the_next_one_whole(fake_pg):
    """A backward that raises drops its end-of-backward callbacks: every later backward
    still waits for its reductions and hands plain gradients."""
    mesh = init_device_mesh("cpu", (2,))
    model = make_net()
    fsdptag.parametrize(model, mesh, reshard_after_forward=True)
    tokens = torch.randint(0, 34, (2, 6))
    fail = [True]

    def raise_once(module, args, out):
        def hook(grad):
            if fail.pop() if fail else False:
                raise RuntimeError("boom")
        out.register_hook(hook)  # the first block's: the later blocks have reduced

    model.layers[0].register_forward_hook(raise_once)
    with pytest.raises(RuntimeError, match="boom"):
        model(tokens).sum().backward()
    model.zero_grad()
    for _ in range(2):
        model(tokens).sum().backward()
        kinds = {type(p.grad._local_tensor) for p in model.parameters()}
        assert kinds == {torch.Tensor}, kinds
        model.zero_grad()


def test_unbound_between_prefetch_and_claim(fake_pg):
    """A compile that starts mid-forward (an eager block calling a compiled function)
    unbinds every bucket (Note [Bound storage]): a bucket prefetched while bound is still
    served, with the same collectives, forward and backward, as without the compile
    (an unbound bucket still prefetches: which buckets prefetch must not differ between
    ranks; the fake process group moves no data: values are not compared)."""
    from fsdptag._bucket import _unbind_all
    mesh = init_device_mesh("cpu", (2,))
    tokens = torch.randint(0, 34, (2, 6))
    runs = []
    for unbind in (False, True):
        model = make_net(n_layers=3)
        fsdptag.parametrize(model, mesh, reshard_after_forward=True)
        model(tokens).sum().backward()
        model.zero_grad()
        if unbind:  # what dynamo's compile-start callback does
            model.layers[0].register_forward_hook(lambda *a: _unbind_all(None))
        with CollectiveCounter(mesh) as cc:
            model(tokens).sum().backward()
        runs.append([(e.phase, e.kind, e.nbytes, e.overlapped) for e in cc.events])
        assert {type(p.grad._local_tensor) for p in model.parameters()} == {torch.Tensor}
    assert runs[0] == runs[1], runs


def test_overlap_policy_bounds_collectives_in_flight(fake_pg):
    """Note [Prefetch] / Note [Reductions in flight]: ``OverlapPolicy`` sets how many
    all-gathers (per direction) and gradient reductions are in flight at once; each
    bound also sets what compute can hide."""
    def peaks(**kw):
        cc = _step_timeline(3, "selective", **kw)
        return (f"{kw}: forward ag {cc.max_in_flight('forward', 'all_gather')}, "
                f"backward ag {cc.max_in_flight('backward', 'all_gather')}, "
                f"rs {cc.max_in_flight('backward', 'reduce_scatter')}; "
                + ", ".join(cc.overlap_summary().split("\n")).replace("dp [fsdp] ", "").replace("dp ", ""))
    text = "\n".join(peaks(**kw) for kw in (
        {}, {"prefetch": 2}, {"prefetch": fsdptag.OverlapPolicy(all_gathers=3, reductions=2)},
        {"prefetch": fsdptag.OverlapPolicy(reductions=0)}))
    assert_expected_inline(text, """\
{}: forward ag 1, backward ag 1, rs 1; forward  all_gather 6 of 7, backward all_gather 6 of 7, backward reduce_scatter 6 of 7
{'prefetch': 2}: forward ag 2, backward ag 2, rs 1; forward  all_gather 6 of 7, backward all_gather 6 of 7, backward reduce_scatter 6 of 7
{'prefetch': OverlapPolicy(all_gathers=3, reductions=2)}: forward ag 3, backward ag 3, rs 2; forward  all_gather 6 of 7, backward all_gather 6 of 7, backward reduce_scatter 6 of 7
{'prefetch': OverlapPolicy(all_gathers=1, reductions=0)}: forward ag 1, backward ag 1, rs 1; forward  all_gather 6 of 7, backward all_gather 6 of 7, backward reduce_scatter 0 of 7""")


@pytest.mark.parametrize("bad, error", [
    (dict(prefetch="x"), "prefetch='x' must be True"),
    (dict(prefetch=-1), "prefetch=-1 must be True"),
    (dict(prefetch=1.0), "prefetch=1.0 must be True"),
])
def test_bad_prefetch_is_refused_and_changes_nothing(fake_pg, bad, error):
    mesh = init_device_mesh("cpu", (2,))
    model = make_net(n_layers=2)
    before = {n: type(p) for n, p in model.named_parameters()}
    with pytest.raises(TypeError, match=error):
        fsdptag.parametrize(model, mesh, **bad)
    assert {n: type(p) for n, p in model.named_parameters()} == before
    fsdptag.parametrize(model, mesh, prefetch=0)  # and the model still parametrizes


@pytest.mark.parametrize("field", ["all_gathers", "reductions"])
@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_overlap_policy_validates(field, value):
    with pytest.raises(ValueError, match=f"OverlapPolicy.{field}={value!r} must be an int >= 0"):
        fsdptag.OverlapPolicy(**{field: value})
