"""The access boundary: the stored shard tagged on its way in, the gathered tensor
handed to compute on its way out (Note [Tag life cycle] in ``_tag.py``).

Note [Marked handout]
---------------------
The subclass follows the FSDP ops, which make new storage (cast, pad, gather,
copy-out). What the parametrization hands to compute is the plain tensor inside
the last of them, *marked*: the tag is an attribute of its storage
(:func:`mark_gathered`; torch keeps one Python object per storage), which every
view of it shares: ``w.t()``, ``w.view(...)``, and the views DTensor takes on TP
local tensors inside its dispatch, where ``_base`` is not tracked. So
:func:`get_fsdp_tag` and the checkpoint policy see every view of a gathered
parameter as tagged, while compute on it (``t()``, ``mm``, their
backward, SAC's ``detach`` of saved tensors) runs without subclass dispatch: at
dim 128 that was ~130 of ~195 tagged dispatches per step. Compute outputs have
new, unmarked storage. Marks are rank-independent like tags (set on the same
tensor on every rank) and die with the gathered storage, which is never the
stored shard's: a parameter that needs no copy (DDP without a cast, or a shard
dim of size 1) is handed out unmarked, as the stored tensor itself, since no
FSDP op ran and there is nothing to save or recompute.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ._tag import FSDPTag, FSDPTaggedTensor, in_place_error, mark_gathered

__all__ = ["alias", "check_unchanged", "refuse_in_place", "tag_shard", "untag"]


def check_unchanged(handouts: Iterable[tuple[torch.Tensor | None, int, str]]) -> None:
    """Raise :func:`in_place_error` for the first ``(tensor, version when handed out,
    fqn)`` whose tensor is alive and changed since: compute's plain handouts cannot
    refuse in-place ops themselves (Note [Marked handout])."""
    for t, version, fqn in handouts:
        if t is not None and t._version != version:
            raise in_place_error(fqn, "an in-place op during forward")


class _TagShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, tag: FSDPTag) -> torch.Tensor:
        return FSDPTaggedTensor(shard.detach(), tag)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if isinstance(grad, FSDPTaggedTensor):
            grad = grad._elem
        return grad, None


def tag_shard(shard: torch.Tensor, tag: FSDPTag) -> torch.Tensor:
    """Differentiably wrap a parameter's local shard in an ``FSDPTaggedTensor``.

    Gradients flow through unchanged and come back plain.
    """
    return _TagShard.apply(shard, tag)


class _Handout(torch.autograd.Function):
    """Identity for autograd (gradients pass through) that turns a gather's result into
    what compute gets: a tagged tensor becomes its marked plain inner tensor (Note
    [Marked handout]); the result is a view made here, which autograd refuses to change
    in place while grad is on, or, with ``view=False``, an alias that is no view."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, view: bool) -> torch.Tensor:
        if type(t) is FSDPTaggedTensor:
            t = mark_gathered(t._elem, t.tag)
        return t.view_as(t) if view else t.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        kept = getattr(ctx, "kept", None)  # a zero2 gather kept for a recompute (_keep.py)
        if kept is not None:
            kept.release()
            ctx.kept = None
        return grad, None


def untag(gathered: FSDPTaggedTensor) -> torch.Tensor:
    """Differentiably unwrap the last tagged tensor of a gather into the marked plain
    tensor compute receives (Note [Marked handout])."""
    return _Handout.apply(gathered, True)


def refuse_in_place(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a view returned by a custom Function: autograd refuses in-place ops on
    it while grad is on (for handouts that are not such a view already, e.g. DTensors)."""
    return _Handout.apply(t, True)


def alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an alias that autograd does not treat as a view, so an in-place op on it
    (a stored DDP parameter handed out without a copy) reaches the stored parameter, as
    ``with torch.no_grad(): module.weight.clamp_(...)`` does in plain DDP."""
    return _Handout.apply(t, False)
