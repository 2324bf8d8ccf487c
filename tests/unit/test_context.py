"""Note [When what applies] in ``fsdptag/_context.py``: the contexts a gather can run in,
each produced for real, and the zero2 / zero3 action tables, pinned."""

from __future__ import annotations

import torch
from expecttest import assert_expected_inline
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fsdptag
from fsdptag._context import ZERO2, ZERO3, GatherContext, gather_context


def _seen_in(run) -> list[GatherContext]:
    seen: list[GatherContext] = []

    def region(x):
        seen.append(gather_context())
        return x.sin().cos()

    run(region, torch.randn(3, requires_grad=True))
    return seen


def _foreign_sac():  # anyone's policy: Note [Whose selective policy]
    return create_selective_checkpoint_contexts(lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)


def _sac():  # fsdptag's tagged policy, through torch's own modes
    return create_selective_checkpoint_contexts(fsdptag.checkpoint_policy())


def test_every_context_for_real():
    with torch.inference_mode():
        assert gather_context() is GatherContext.INFERENCE
    with torch.no_grad():
        assert gather_context() is GatherContext.NO_GRAD
        assert gather_context(training_forward=True) is GatherContext.REENTRANT
    assert gather_context() is GatherContext.FORWARD
    with save_on_cpu(pin_memory=False):
        assert gather_context() is GatherContext.OTHER_HOOKS
    plain = _seen_in(lambda f, x: checkpoint(f, x, use_reentrant=False).sum().backward())
    assert plain == [GatherContext.CHECKPOINT, GatherContext.RECOMPUTE]
    sac = _seen_in(lambda f, x: checkpoint(f, x, use_reentrant=False, context_fn=_sac).sum().backward())
    assert sac == [GatherContext.SAC, GatherContext.SAC_RECOMPUTE]
    ours = _seen_in(lambda f, x: checkpoint(f, x, use_reentrant=False,
                                            context_fn=fsdptag.checkpoint_context_fn()).sum().backward())
    assert ours == [GatherContext.SAC, GatherContext.SAC_RECOMPUTE]
    foreign = _seen_in(lambda f, x: checkpoint(f, x, use_reentrant=False, context_fn=_foreign_sac).sum().backward())
    assert foreign == [GatherContext.FOREIGN_SAC, GatherContext.FOREIGN_SAC_RECOMPUTE]
    reentrant = _seen_in(lambda f, x: checkpoint(f, x, use_reentrant=True).sum().backward())
    assert reentrant == [GatherContext.NO_GRAD, GatherContext.RECOMPUTE]  # no root forward open here


def test_action_tables():
    assert set(ZERO2) == set(ZERO3) == set(GatherContext)
    table = "\n".join(f"{c.value:<22}| {ZERO2[c].value:<55}| {ZERO3[c].value}" for c in GatherContext)
    assert_expected_inline(table, """\
inference             | nothing is saved                                       | nothing is saved
no grad               | nothing is saved                                       | nothing is saved
reentrant             | kept by the bucket until the recompute takes it over   | the recompute gathers again
forward               | autograd saves the handout                             | fsdptag's hooks save a re-gather handle
checkpoint            | kept by the gather's node until its backward           | the recompute gathers again
sac                   | the checkpoint policy saves or replays the all-gather  | the policy recomputes it
foreign sac           | kept by the gather's node until its backward           | the recompute gathers again
other hooks           | kept by the gather's node until its backward           | fsdptag's hooks save a re-gather handle
recompute             | served from the kept gather                            | gathered, once per bucket
sac recompute         | the checkpoint policy saves or replays the all-gather  | gathered, once per bucket
foreign sac recompute | served from the kept gather                            | gathered, once per bucket""")
