"""The policies fsdptag is compared against, for tests, the benchmark and the estimator.

* ``"op-name"``: save ``all_gather_into_tensor``, ``wait_tensor`` and ``_to_copy``
  by name (plus the usual base policy). Avoids re-gathers but also saves TP
  all-gathers and activation casts.
* ``"no-fix"``: the base policy alone: AC recomputes every FSDP all-gather.

Both keep :func:`fsdptag.apply_ac`'s block selection and base save lists, so the
only difference to fsdptag's policy is how FSDP results are decided.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .._compat import DECIDES_FSDP_OPS, SAC_POLICY_SEES_OUTPUT
from .._ac import checkpoint_blocks, parse_ac
from .._checkpoint import as_policy, fresh_base
from .._tag import innermost, is_fsdp_tagged, output_tag

__all__ = ["NAME_SAVED_OPS", "OpNamePolicy", "apply_baseline_ac"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_CAST = torch.ops.aten._to_copy.default

NAME_SAVED_OPS = frozenset({
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
    torch.ops.aten._to_copy.default,
})


class OpNamePolicy:
    """Save :data:`NAME_SAVED_OPS` by name, everything else by ``base``.

    ``untagged_saved`` maps storage -> bytes of what it saves that is *not* an
    FSDP result (TP all-gathers, activation casts): the cost of deciding by name.
    """

    def __init__(self, base, untagged_saved: dict | None = None) -> None:
        self.base = as_policy(base)
        self.untagged_saved = untagged_saved if untagged_saved is not None else {}

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in NAME_SAVED_OPS:
            if not ctx.is_recompute:
                self._count_untagged(ctx, func, args, kwargs)
            return CheckpointPolicy.MUST_SAVE
        return self.base(ctx, func, *args, **kwargs)

    def _count_untagged(self, ctx, func, args, kwargs) -> None:
        if SAC_POLICY_SEES_OUTPUT:
            if not is_fsdp_tagged(ctx.op_output):
                storage = innermost(ctx.op_output).untyped_storage()
                self.untagged_saved[storage._cdata] = storage.nbytes()
            return
        # torch 2.11 asks before the op (Note [Policy without the output] in _checkpoint.py):
        # an all-gather's output is counted at its wait, which takes it as its input; a
        # cast makes a new storage of the cast's size. (Casts of TP DTensors come out
        # 6144 B higher than 2.13's count in tests/test_checkpoint.py's memory case.)
        if output_tag(func, args) is not None:
            return
        if func is _WAIT:
            storage = innermost(args[0]).untyped_storage()
            self.untagged_saved[storage._cdata] = storage.nbytes()
        elif func is _CAST:
            dtype = kwargs.get("dtype") or args[0].dtype
            self.untagged_saved[("cast", len(self.untagged_saved))] = args[0].numel() * dtype.itemsize


def _deciding_fsdp_ops(policy):
    """``policy``, left to decide FSDP ops by name as well: what a baseline measures
    (Note [Whose selective policy] in ``_context.py``)."""
    def decide(ctx, func, *args, **kwargs):
        return policy(ctx, func, *args, **kwargs)

    setattr(decide, DECIDES_FSDP_OPS, True)
    return decide


def apply_baseline_ac(
    model: nn.Module,
    mode: str,
    *,
    policy: str,
    layer_every: int | None = None,
    save_ops: Iterable | None = None,
    untagged_saved: dict | None = None,
) -> nn.Module:
    """Like :func:`fsdptag.apply_ac` but with the ``"op-name"`` or ``"no-fix"`` policy."""
    if policy not in ("op-name", "no-fix"):
        raise ValueError(f"policy={policy!r}: use 'op-name' or 'no-fix'")
    mode, base, blocks = parse_ac(model, mode, None, save_ops, layer_every)
    if mode.value == "none":
        return model

    def make_context_fn():
        def context_fn():
            fresh = fresh_base(base)
            chosen = OpNamePolicy(fresh, untagged_saved) if policy == "op-name" else as_policy(fresh)
            return create_selective_checkpoint_contexts(_deciding_fsdp_ops(chosen))

        return context_fn

    checkpoint_blocks(blocks, make_context_fn, layer_every)
    return model
