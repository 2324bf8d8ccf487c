"""zero2 under anyone's activation checkpointing: a bucket's gather kept for the recompute.

Note [zero2 kept until backward]
--------------------------------
zero2 means "gathered until backward". fsdptag's own checkpoint policy gets that by
saving the all-gather output (Note [Tagged checkpoint policy]); but a region
checkpointed without it (plain ``torch.utils.checkpoint``, reentrant or not,
``checkpoint_wrapper``, Hugging Face's ``gradient_checkpointing_enable()``) saves
nothing, so its recompute in backward would all-gather every block again. FSDP2 does
not, since its zero2 keeps the unsharded parameters until the post-backward.

So a zero2 bucket whose gather runs inside such a region keeps the gathered pieces
(a :class:`KeptGather`), and the region's recompute, finding one for the same
stored shards (same objects, same versions), serves from it with no collective.
Who holds it, and until when:

================================  ==========================================  =================================
the forward's gather runs          detected by                                 held by, until
================================  ==========================================  =================================
in a non-reentrant checkpoint      saved-tensor hooks active (not fsdptag's:   the gather's autograd node, until
                                   Note [Whose saved-tensor hooks])            its backward (the reduce-scatter)
in a reentrant checkpoint          grad off inside a root forward that         the bucket ("pinned"), until the
                                   started with grad on                        recompute's node takes it over, or
                                                                               the next root forward
frozen weights (no parameter of    as above; the gather has no autograd        pinned, until the end of the
the gather requires grad), in      node                                        backward whose recompute used it,
either checkpoint                                                              or the next root forward
outside regions, or in fsdptag's   (not kept: autograd or the policy saves     -
selective-checkpoint policy        what backward needs)
================================  ==========================================  =================================

A parameter gathered alone (``bucket="param"``) keeps its all-gather output the
same way (held by its handout's node); its recompute runs the same DTensor gather
with the all-gather answered from it (:class:`ServeAllGather`). A TP parameter's
handout is a DTensor on the TP mesh whose local tensor is that all-gather output,
so it is kept the same way.

The recompute's gather still runs the bucket's autograd Function (returning views
of the kept pieces), so a reentrant recompute, whose graph is the one backward
runs, reduce-scatters the gradients exactly once; a non-reentrant one's graph is
discarded and the forward's node reduce-scatters. A recompute that finds no open
gather scope (a checkpoint wrapper that is itself the bucket root) is served one
gather per backward, shared by its accesses (zero2: the kept one). zero3 keeps
nothing: the recompute gathers each bucket once, as it should. The cost is the pieces that
backward itself does not read (say a block's biases), held until the bucket's
backward; FSDP2's zero2 holds those too. Without a checkpoint nothing is kept.
"""

from __future__ import annotations

import weakref

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from ._compat import OncePerBackward, contiguous_strides, local_of
from ._context import ZERO2, Zero2, gather_context
from ._tag import FSDPTaggedTensor, get_fsdp_tag

__all__ = ["KeptGather", "Keeper", "ServeAllGather"]

c10d = torch.ops._c10d_functional


class KeptGather:
    """A zero2 gather's pieces (a bucket's copied-out parameters, or one parameter's
    all-gather output) from one forward, and what they were gathered from."""

    __slots__ = ("pieces", "scales", "shards", "versions", "keeper", "__weakref__")

    def __init__(self, pieces, params, keeper: Keeper, scales=None) -> None:
        self.pieces = tuple(p.detach() for p in pieces)  # no autograd history: no cycle via grad_fn
        self.scales = scales  # a float8 bucket's (Note [Float8 all-gather] in _float8.py)
        self.shards = tuple(local_of(p) for p in params)
        self.versions = tuple(s._version for s in self.shards)
        self.keeper = keeper

    def matches(self, params) -> bool:
        return all(local_of(p) is s and s._version == v
                   for p, s, v in zip(params, self.shards, self.versions))

    def release(self) -> None:
        """The gather's backward ran: its gradients are reduced, the pieces can go."""
        self.pieces = ()
        self.keeper.forget(self)


class Keeper:
    """The kept gathers of one zero2 bucket; see Note [zero2 kept until backward]."""

    def __init__(self, training_forward) -> None:
        self.training_forward = training_forward  # () -> whether a root forward began with grad on
        self.owned: list[weakref.ref[KeptGather]] = []  # held by forward nodes
        self.pinned: list[KeptGather] = []  # held here (reentrant checkpoint's no-grad forward, frozen weights)
        self.served: list[KeptGather] = []  # pinned frozen gathers a recompute used in this backward
        self._at_end = OncePerBackward()

    def __getstate__(self) -> dict:
        """Kept gathers live from a forward to its backward: none are pickled."""
        return dict(self.__dict__, owned=[], pinned=[], served=[], _at_end=OncePerBackward())

    def how_to_keep(self) -> Zero2 | None:
        """In a forward gather: ``KEEP_ON_NODE``, ``PIN``, or None where nothing needs
        keeping here (Note [When what applies] in ``_context.py``)."""
        action = ZERO2[gather_context(self.training_forward())]
        return action if action in (Zero2.KEEP_ON_NODE, Zero2.PIN) else None

    def keep(self, entry: KeptGather, how: Zero2, node) -> None:
        """``node``: the gather's autograd node, whose backward calls ``entry.release()``."""
        if how is Zero2.KEEP_ON_NODE and node is not None:
            node.kept = entry
            self.owned.append(weakref.ref(entry))
        else:  # a reentrant checkpoint's no-grad forward, or frozen weights: no node to hold it
            self.pinned.append(entry)

    def find(self, params) -> KeptGather | None:
        """In a recompute (in backward, outside selective-checkpoint regions): the newest
        kept gather of these very shards."""
        if ZERO2[gather_context()] is not Zero2.SERVE_KEPT:
            return None
        self.owned = [r for r in self.owned if r() is not None]
        for entry in [r() for r in reversed(self.owned)] + self.pinned[::-1]:
            if entry is not None and entry.matches(params):
                return entry
        return None

    def adopt(self, entry: KeptGather, node) -> None:
        """The recompute's node holds ``entry`` now (a reentrant recompute's is backwarded)."""
        if node is None:  # frozen weights: nothing reduces them; gone at this backward's end
            self.served.append(entry)
            self._at_end.queue(self._drop_served)
            return
        node.kept = entry
        if any(e is entry for e in self.pinned):
            self.pinned = [e for e in self.pinned if e is not entry]
            self.owned.append(weakref.ref(entry))

    def _drop_served(self) -> None:
        for entry in self.served:
            self.forget(entry)
        self.served = []

    def forget(self, entry: KeptGather) -> None:
        self.owned = [r for r in self.owned if r() is not None and r() is not entry]
        self.pinned = [e for e in self.pinned if e is not entry]

    def unpin(self) -> None:
        """A new root forward: pinned gathers nobody backwarded are stale."""
        self.pinned = []


class ServeAllGather(TorchDispatchMode):
    """Answers one parameter's ``all_gather_into_tensor`` with the kept output of the
    forward's (``kept`` shares its storage), so a per-parameter recompute runs the very
    same DTensor gather, autograd included, without the collective."""

    def __init__(self, kept: torch.Tensor) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not c10d.all_gather_into_tensor.default:
            return func(*args, **(kwargs or {}))
        inp, world = args[0], args[1]
        shape = (inp.shape[0] * world, *inp.shape[1:])
        out = self.kept.as_strided(shape, contiguous_strides(shape), 0)
        tag = get_fsdp_tag(inp)
        return FSDPTaggedTensor(out, tag) if tag is not None else out
