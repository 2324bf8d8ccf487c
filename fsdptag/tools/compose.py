"""An estimate at any depth from two shallow copies of the model (Note [Composed depth])."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .._blocks import find_blocks
from .overlap import splice

__all__ = ["COMPOSE_FROM", "KEEP_LAST", "compose", "compose_depths", "keep_last_of", "keep_last_policy", "resolve_reshard"]

COMPOSE_FROM = 2  # the shallower copy's blocks, at least; 3 for FSDP2 and keep-last (Note [Composed depth])
KEEP_LAST = "keep-last"  # an estimate's reshard_after_forward: keep_last_policy of the model built


def keep_last_policy(model: nn.Module) -> dict[str, bool]:
    """zero3-keep-last's ``reshard_after_forward``: zero3, but the last block (backward
    starts with it) and the modules outside blocks (the output projection: backward's
    first gather) stay gathered, as FSDP2 and torchtitan do by default."""
    blocks = find_blocks(model)
    inside = {fqn for fqn, _ in blocks}
    outside = [fqn for fqn, m in model.named_modules()
               if fqn and any(True for _ in m.parameters(recurse=False))
               and not any(fqn == b or fqn.startswith(b + ".") for b in inside)]
    return {"": True, **({blocks[-1][0]: False} if blocks else {}), **dict.fromkeys(outside, False)}


@functools.lru_cache(maxsize=8)
def keep_last_of(build: Callable[[], nn.Module]) -> dict[str, bool]:
    """:func:`keep_last_policy` of the model ``build`` makes (on fake tensors)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        return keep_last_policy(build())


def resolve_reshard(reshard: Any, model: nn.Module) -> Any:
    """``reshard_after_forward`` for ``model``: :data:`KEEP_LAST` names its last block."""
    return keep_last_policy(model) if reshard == KEEP_LAST else reshard


def compose_depths(depth: int | None, reshard_after_forward: Any, ac: str,
                   policy: str = "tagged") -> tuple[int, int] | None:
    """The two depths to measure for a ``depth``-block model, or None to run every block.

    Note [Composed depth]
    ---------------------
    A model of identical blocks costs an affine function of its depth: each block
    adds the same sharded parameters, gradients and AdamW state, keeps the same
    bytes for backward, sends the same collectives and runs the same FLOPs. So do
    the peaks, phase by phase: the forward's peak sits at its end (one more block's
    saved activations per block), the backward's at its first blocks (one more
    block's activations and gradients behind them), the optimizer step's on top of
    one more block's state. The step's peak is the max of its phases' peaks, which
    is not affine (which phase peaks changes with depth), so each phase is composed
    on its own and the max taken after.

    The estimator measures the model at depths ``a`` and ``a + p`` (``p``: the
    period of the AC pattern, 2 for ``ac="layer"``, which checkpoints every second
    block, else 1) and extends every count by ``(depth - a) / p`` times the
    difference. The first and last blocks are not like the middle ones (the
    embedding and head beside them, the prefetch that has no next block, FSDP2's
    root which leaves the last block gathered under zero3), so ``a`` >= 2, and >= 3
    for FSDP2 and for keep-last, whose last block stays gathered: at depth 2 their
    peaks are off the line (measured: FSDP2 zero3, keep-last with selective AC).
    From there on every count of the built-in Llama is on the line, byte for byte:
    ``benchmarks/compose_check.py`` (45 configurations at depths 7 and 8),
    tests/test_estimate.py (5 of them, and a transformers Llama config: configs of
    the dense types in ``models.HF_UNIFORM_TYPES`` compose by ``num_hidden_layers``).
    The step's timeline (Note [Exposed communication] in ``overlap.py``) composes
    the same way, phase by phase: depth ``a + p`` repeats a run of records depth
    ``a`` lacks (``overlap.splice``). Per-module settings (``reshard_after_forward``
    as a dict or a function) name blocks by position, so those run every block, as
    do models without ``ModelSpec.at_depth`` (factories, other transformers types)
    and models not deeper than ``a + p``; :data:`KEEP_LAST` (the planner's
    zero3-keep-last) names the last block of whichever copy is built, so it composes.
    """
    if depth is None or not (isinstance(reshard_after_forward, (bool, int)) or reshard_after_forward == KEEP_LAST):
        return None
    period = 2 if ac == "layer" else 1
    start = COMPOSE_FROM + (policy == "fsdp2" or reshard_after_forward == KEEP_LAST)
    a = start + (depth - start) % period
    return (a, a + period) if depth > a + period else None


def compose(at_a: dict, at_b: dict, a: int, b: int, depth: int) -> dict:
    """``measure_step``'s numbers at ``depth`` from those at depths ``a`` and ``b``."""
    if (depth - a) % (b - a) or at_a.keys() != at_b.keys() or len(at_a["phase_peaks"]) != len(at_b["phase_peaks"]):
        raise ValueError(f"cannot compose depth {depth} from depths {a} and {b}")
    steps = (depth - a) // (b - a)
    out = {k: v + steps * (at_b[k] - v) for k, v in at_a.items() if k not in ("phase_peaks", "timeline")}
    out["timeline"] = splice(at_a["timeline"], at_b["timeline"], a, b, depth)
    out["phase_peaks"] = tuple(x + steps * (y - x) for x, y in zip(at_a["phase_peaks"], at_b["phase_peaks"]))
    out["peak_bytes"] = max(out["phase_peaks"])
    return out
