"""``apply_ac``: checkpoint a model's blocks with fsdptag's tagged policy, torchtitan style.

A checkpointed block gets a generated ``forward`` (kind ``"Checkpointed"``) that runs
the block's own under non-reentrant ``checkpoint``, with its bucket scope inside the
region (Note [Buckets] in ``_bucket.py``); in compiled code it gathers the block's
zero2 buckets before the region opens (Note [Compiled gathers] in ``_param.py``).
The policy itself is ``_checkpoint.py``'s.

``apply_ac(model, "full")`` needs no policy where fsdptag keeps the block's zero2
gathers for the recompute anyway (Note [zero2 kept until backward] in ``_keep.py``):
there it is a plain non-reentrant checkpoint, which skips SAC's per-op dispatch and
allows a second backward; elsewhere (a tied weight also used outside the block:
Note [Checkpointed bucket roots] makes every other checkpointed block a bucket
root) it is this policy with ``base=None``.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Sequence

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ._api import ACMode
from ._blocks import AC_CONTEXT_FN, WRAPPED, find_blocks, is_checkpointed
from ._scopes import scoped
from ._checkpoint import DEFAULT_SAVE_OPS, SaveOps, as_policy, checkpoint_context_fn
from ._class_swap import register_kind, swap_class, user_class
from ._compat import is_compiling
from ._state import drop_pregathered, make_bucket_root, module_state, pregather

__all__ = ["apply_ac", "checkpoint_blocks", "parse_ac"]

_AC_FULL = "_fsdptag_ac_full"  # full AC: plain checkpoint where that keeps zero2 gathered


def _checkpointed_forward(cls: type) -> dict:
    @functools.wraps(cls.forward)  # the user's signature: Trainer picks dataset columns by it
    def forward(self, *args, **kwargs):
        fn = functools.partial(cls.forward, self)
        if is_compiling():  # Note [Compiled gathers]
            gathers = pregather(self)
            try:
                return checkpoint(fn, *args, use_reentrant=False, context_fn=self.__dict__[AC_CONTEXT_FN],
                                  **kwargs)
            finally:
                drop_pregathered(gathers)
        state = module_state(self)
        if state is not None and state.buckets:  # the gather scope must be inside the region: Note [Buckets]
            fn = scoped(state.buckets, fn)
        if self.__dict__.get(_AC_FULL) and _zero2_gathers_kept(self):
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=self.__dict__[AC_CONTEXT_FN], **kwargs)

    return {"forward": forward}


register_kind("Checkpointed", lambda cls, key: _checkpointed_forward(cls))


def _zero2_gathers_kept(block: nn.Module) -> bool:
    """Whether plain checkpointing of ``block`` re-gathers nothing in its recompute: it is
    parametrized and each of its zero2 parameters that all-gathers is kept for the
    recompute, in a bucket rooted in the block or alone (Note [zero2 kept until
    backward]). Otherwise (a tied weight bucketed outside the block)
    full AC runs as a selective checkpoint whose policy saves the zero2 all-gathers."""
    states = [s for s in map(module_state, block.modules()) if s is not None]
    own = {id(b) for s in states for b in s.buckets}
    bucket_of = states[0].root.bucket_of if states else {}
    return bool(states) and all(
        id(bucket_of[g]) in own if g in bucket_of
        else g.keeper is not None or g.tag.reshard_after_forward or not g.collective
        for s in states for g in s.params.values())


def apply_ac(
    model: nn.Module,
    mode: str | ACMode,
    *,
    blocks: Sequence[nn.Module] | None = None,
    save_ops: Iterable | None = None,
    layer_every: int | None = None,
) -> nn.Module:
    """Checkpoint ``model``'s blocks with fsdptag's tagged policy, torchtitan style.

    ``mode``: ``"none"``, ``"full"`` (recompute everything but zero2 gathered
    parameters: plain non-reentrant checkpointing where fsdptag keeps the block's zero2
    gathers for the recompute, Note [zero2 kept until backward]; else a selective
    checkpoint that saves them) or ``"selective"``: without ``layer_every``, op-level SAC saving
    ``save_ops`` (default :data:`DEFAULT_SAVE_OPS`, every second ``mm``
    recomputed); with ``layer_every=N``, full AC on every Nth block (blocks
    N-1, 2N-1, ...), torchtitan's layer-selective AC. ``blocks`` defaults to the
    model's blocks (Note [Blocks]: children of ``nn.ModuleList`` / ``nn.ModuleDict``,
    e.g. ``model.model.layers`` of a Hugging Face model), the same modules
    ``bucket="blocks"`` gathers together. Works before or after ``fsdptag.parametrize``.

    Example::

        >>> fsdptag.parametrize(model, mesh, mode="fully_shard", reshard_after_forward=False)
        >>> fsdptag.apply_ac(model, "selective")
    """
    mode, base, blocks = parse_ac(model, mode, blocks, save_ops, layer_every)
    if mode is not ACMode.NONE:
        checkpoint_blocks(blocks, lambda: checkpoint_context_fn(base), layer_every,
                          full=mode is ACMode.FULL or layer_every is not None)
    return model


def parse_ac(model, mode, blocks, save_ops, layer_every):
    """Validate ``apply_ac``'s arguments; return (mode, base policy, blocks)."""
    try:
        mode = ACMode(mode)
    except ValueError:
        raise ValueError(
            f"unknown AC mode={mode!r}; use one of {', '.join(repr(m.value) for m in ACMode)}"
        ) from None
    if layer_every is not None and (isinstance(layer_every, bool) or not isinstance(layer_every, int)
                                    or layer_every < 1):
        raise ValueError(f"layer_every={layer_every!r} must be a positive int (1 = every block)")
    if save_ops is not None:
        if mode is not ACMode.SELECTIVE:
            raise ValueError(f"save_ops only applies to mode='selective', not {mode.value!r}")
        save_ops = list(save_ops)
        as_policy(save_ops)
    if blocks is None:
        blocks = [block for _, block in find_blocks(model)]
        if not blocks:
            raise ValueError(
                f"{user_class(type(model)).__name__} has no blocks (children of an nn.ModuleList or "
                "nn.ModuleDict); pass blocks=[...] explicitly"
            )
    blocks = list(blocks)
    wrapped = {id(getattr(m, WRAPPED)) for m in model.modules() if isinstance(getattr(m, WRAPPED, None), nn.Module)}
    for block in blocks:
        if is_checkpointed(block) or id(block) in wrapped:
            raise ValueError(f"{type(block).__name__} already has activation checkpointing applied"
                             + (" (a checkpoint wrapper around it): use that, or unwrap it first"
                                if id(block) in wrapped else ""))
    if save_ops is not None:
        base = SaveOps(save_ops, every_other_mm=False)
    elif mode is ACMode.SELECTIVE and layer_every is None:
        base = SaveOps(DEFAULT_SAVE_OPS)
    else:
        base = None
    return mode, base, blocks


def checkpoint_blocks(
    blocks: Sequence[nn.Module], make_context_fn: Callable[[], Callable], layer_every: int | None = None,
    full: bool = False,
) -> None:
    """Checkpoint every ``layer_every``-th of ``blocks`` (all by default) with ``make_context_fn()``.

    The block keeps its FQN and parameters: its class gains a ``forward`` that runs
    the original one under non-reentrant ``checkpoint``.
    """
    every = layer_every or 1
    for i, block in enumerate(blocks):
        if (i + 1) % every:
            continue
        make_bucket_root(block)  # Note [Checkpointed bucket roots]
        block.__dict__[AC_CONTEXT_FN] = make_context_fn()
        block.__dict__[_AC_FULL] = full
        swap_class(block, "Checkpointed")
