"""Bucketed gathers: one all-gather (and one reduce-scatter) per bucket of parameters.

Note [Buckets]
--------------
With ``parametrize(..., bucket="blocks" | "module" | fn)`` the parameters under
a bucket root module (sharded on dim 0 or replicated, of one dtype and one
reshard decision) are gathered together, in the layout FSDP2 uses for a
parameter group. A TP
parameter takes part with its TP-local tensor (what the dp mesh shards) and is
wrapped back into a DTensor on its TP mesh after the copy-out; with HSDP the
gather runs over the shard dim only; with DDP nothing is gathered (``world`` is 1)
and gradients are all-reduced.

* Storage: the bucket owns one flat per-rank buffer; slot ``i`` holds parameter
  ``i``'s shard padded to ``ceil(rows / world)`` rows, and each stored DTensor's
  local tensor is a view into its slot (Note [Bound storage]). The pad stays
  zero: optimizers and ``state_dict`` only see the unpadded views.
* Forward: ``flat.to(param_dtype)`` -> one ``all_gather_into_tensor`` -> one
  ``split_with_sizes_copy`` of the ``(world, numel)`` result into each
  parameter -> one ``view`` (+ ``narrow`` for uneven rows) per parameter. About
  ``5 + n`` ops per bucket, whatever the padding, and the same ops on every rank;
  only the first five are tagged-tensor dispatches. DDP without a cast copies
  nothing: compute gets aliases of the stored shards.
* Backward: one ``_chunk_cat`` packs the gradients (padding included) into the
  reduce-scatter input in ``reduce_dtype``, one ``reduce_scatter_tensor``
  (HSDP then one ``all_reduce`` over the replicate dim, DDP only that), averaging
  as FSDP2 does (Note [Gradient reduction] in ``_collectives.py``);
  each gradient is a view into the result, wrapped as a DTensor like its parameter.
  Only the slots of parameters that require grad are packed: frozen weights beside
  trainable adapters (LoRA) are gathered with the bucket but send no gradient, as
  FSDP2 reduce-scatters only parameters with gradients (compiled buckets too:
  Note [Compiled buckets]).

The gather runs at the first access to any of the bucket's parameters inside the
bucket root's ``forward`` and is reused by the rest of that call. The scope is
opened *inside* ``forward`` (below any checkpoint wrapper), so a checkpointed
block issues the same ops in forward and in its recompute, which SAC's per-op
replay requires; an access outside the root's ``forward`` falls back to the
per-parameter gather. The all-gather input and output carry the bucket's tag
(FQN = the root module's), so the checkpoint policy saves the all-gather output
for zero2 and recomputes the copy-outs; each copied-out parameter is handed to
compute plain, its storage marked with its own parameter's tag (Note [Marked
handout] in ``_tag.py``), which the zero3 hooks use to re-gather the bucket (once per
backward) and take that parameter from it.

A scope also remembers the selective-checkpoint region it was opened in (the
innermost SAC dispatch mode) and serves only accesses from that same region. When
a region inside a bucket root (say each block's feed-forward) is checkpointed, the
block's scope was opened outside that region and is closed by the time backward
recomputes it; serving the region's forward from it would make forward and
recompute issue different ops. Such accesses gather per parameter instead, in
forward and recompute alike. ``apply_ac`` avoids this altogether:

Note [Checkpointed bucket roots]
--------------------------------
A module checkpointed by ``apply_ac`` (or ``checkpoint_blocks``) is its own bucket
root, so a checkpointed region never makes a bucket gather twice in one forward
(once for the enclosing root, once per parameter inside the region). Applied before
``parametrize``, the module is simply one more root; applied after, each bucket
rooted above it splits in two (``make_bucket_root`` in ``_state.py``): the
module's parameters form a new bucket named after it, the rest stay with the old
root, and both are bound afresh (the stored parameters stay the same objects, so an
optimizer built before keeps working). Tied parameters also used outside the module
stay put. With ``bucket="blocks"`` and AC on each block's feed-forward, a 2-block
Llama gathers 5 buckets in forward (root, and per block the rest and its
feed-forward) where it gathered 3 buckets plus 6 feed-forward weights alone.
A user's own ``context_fn`` checkpoint inside a bucket root is not seen at
``parametrize`` time and keeps the per-parameter rule above.

Note [Bound storage]
--------------------
"Bound" means every stored parameter's ``_local_tensor`` is still the view
``bind`` made. ``parametrize`` binds; the bucket root's ``_apply`` (``to_empty``,
``to``) and ``load_state_dict`` rebind, since they may replace local tensors. A
bucket found unbound at gather time (a parameter replaced some other way) packs
the shards with ``cat`` instead: slower, same result. Rebinding never happens
during a gather, so a checkpoint region's forward and recompute see the same state.

torch 2.13's ``torch.compile`` cannot take DTensor parameters whose local tensors
share one storage (fakeifying the second fails: docs/compile.md has the
reproduction). So when dynamo starts compiling anything in the process, every live
bucket unbinds for good (``unbind_for_compile``): each shard gets its own storage
and the eager path packs with ``cat``. Eager-only programs never pay this.

Buckets inside ``torch.compile``: Note [Compiled buckets] in ``_compiled.py``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate

from ._api import MixedPrecisionPolicy
from ._compat import (OncePerBackward, allow_checkpoint_side_effects, local_of, on_compile_start, replace_local,
                      sac_hidden)
from ._context import RootForward, running_backward
from ._float8 import Float8Cast
from ._collectives import GradientReduction, Reducer, gradient_reduction
from ._keep import Keeper
from ._layout import layout, pack, unpad
from ._param import ParamGather, makes_copy
from ._partial import PartialReshard
from ._prefetch import Prefetched, Prefetcher, ServedInput
from ._tag import FSDPTag, FSDPTaggedTensor

__all__ = ["Bucket", "BucketShared", "Scope", "watch_compiles"]

c10d = torch.ops._c10d_functional


@dataclass
class Scope:
    """One open bucket-root ``forward`` (``_scopes.py``): its checkpoint region (Note
    [Buckets]), the gathered parameters it serves and their version counters when gathered."""

    region: object
    gathered: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)


class ServedRecompute:
    """The gathered parameters of the latest scope-less recompute (``_access.py``), keyed
    by (graph task, bucket, kept gather): recomputes run one region at a time, so one
    entry, held until the next replaces it or the backward ends."""

    def __init__(self) -> None:
        self.entry: tuple | None = None
        self._drop_at_end = OncePerBackward()

    def get(self, key: tuple) -> dict | None:
        return self.entry[1] if self.entry is not None and self.entry[0] == key else None

    def serve(self, key: tuple, gathered: dict) -> dict:
        self._drop_at_end.queue(self._drop)
        self.entry = (key, gathered)
        return gathered

    def _drop(self) -> None:
        self.entry = None


@dataclass(eq=False)
class BucketShared:
    """What the buckets of one parametrized model share, handed to each (the model's
    ``RootState`` owns it): no bucket holds the root."""

    forward: RootForward
    reducer: Reducer  # Note [Reductions in flight] in _collectives.py
    prefetcher: Prefetcher | None  # Note [Prefetch]; set later by an explicit schedule
    served: ServedRecompute = field(default_factory=ServedRecompute)


class Bucket:
    """The parameters of one bucket root that share a dtype and a reshard decision;
    see Note [Buckets]. ``root_fqn``: the bucket root's module FQN; ``variant``: what
    tells it from the root's other buckets (``"[bfloat16]"``, ``"[zero2]"``, ... or "")."""

    def __init__(self, root_fqn: str, variant: str, reshard: bool, params: list[ParamGather], dp_mesh,
                 mp: MixedPrecisionPolicy, shared: BucketShared, partial: int | None = None,
                 divide: float | None = None) -> None:
        self.root_fqn, self.variant = root_fqn, variant
        self.name = (root_fqn or "<root>") + variant
        self.params = params  # in slot order
        self.dp_mesh, self.mp = dp_mesh, mp  # to build its parts (``part``)
        self.owner: weakref.ref[torch.nn.Module] | None = None  # the bucket root module
        self.tag = FSDPTag(self.name, reshard, parts=tuple(p.tag for p in params))
        # Gather and reduce-scatter over the sharding dim (FSDP: the mesh; HSDP: dim 1),
        # all-reduce gradients over the replicate dim (HSDP: dim 0; DDP: the mesh, with
        # nothing to gather: ``world == 1``).
        ddp = isinstance(params[0].dp_placements[-1], Replicate)
        self.world = 1 if ddp else dp_mesh.size(dp_mesh.ndim - 1)
        self.group_name = None if ddp else dp_mesh.get_group(dp_mesh.ndim - 1).group_name
        replicate_dim = 0 if ddp or dp_mesh.ndim == 2 else None
        self.replicas = 1 if replicate_dim is None else dp_mesh.size(replicate_dim)
        self.replicate_group = (
            None if replicate_dim is None else dp_mesh.get_group(replicate_dim).group_name)
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype
        self.divide = divide  # averaged over other ranks than its own (Note [Gradient reduction])
        # a TP parameter's slot holds its TP-local tensor
        self.slots, self.numel = layout([p.dp_shape for p in params], self.world)
        self.split_sizes = [slot.numel for slot in self.slots]
        # torchao float8 weights gather as float8 bytes (Note [Float8 all-gather] in _float8.py)
        self.float8 = (Float8Cast([p.float8 for p in params], self.slots, self.world, self.group_name,
                                  self.param_dtype) if params[0].float8 is not None else None)
        self.flat: torch.Tensor | None = None  # bound storage (Note [Bound storage])
        self.locals: tuple[torch.Tensor, ...] = ()
        self.scopes: list[Scope] = []  # one per open root forward (_scopes.py)
        # zero2 gathers kept for a checkpoint's recompute (Note [zero2 kept until backward])
        self.keeper = Keeper(shared.forward.training) if not reshard and self.world > 1 else None
        self.shared = shared
        self.compiled = False  # torch.compile seen: stays unbound (Note [Bound storage])
        # Note [Accumulation without sync] in _sync.py
        self.requires_gradient_sync = True
        self.unsynced_grad: torch.Tensor | None = None  # (world, numel), in the reduce dtype
        self.unsynced_needs: tuple[bool, ...] = ()  # which slots it holds (those requiring grad)
        # reshard_after_forward=k: Note [Partial reshard] in _partial.py
        self.partial = PartialReshard(partial, self.world, self.group_name) if partial else None
        _LIVE.add(self)
        watch_compiles()

    def __getstate__(self) -> dict:
        """Pickled with its model (Note [Pickling generated classes] in _class_swap.py):
        its owner strongly (the pickle holds the module anyway), no open scopes."""
        state = dict(self.__dict__, scopes=[])
        state["owner"] = self.owner() if self.owner is not None else None
        return state

    def __setstate__(self, state: dict) -> None:
        owner = state.pop("owner")
        self.__dict__.update(state)
        self.owner = weakref.ref(owner) if owner is not None else None
        _LIVE.add(self)
        watch_compiles()

    # ------------------------------------------------------------ storage

    def bind(self, params: list[DTensor] | None = None) -> None:
        """Move the shards of ``params`` (default: the stored ones) into one fresh flat
        buffer and point each parameter's local tensor at its slot."""
        if params is None:
            params = self.stored()
        if self.compiled:
            return
        shards = [local_of(p) for p in params]
        if len({(s.dtype, s.device) for s in shards}) != 1:
            self.flat, self.locals = None, ()  # mixed after a user's .to(): stay unbound
            return
        with torch.no_grad():
            flat = shards[0].new_zeros(self.numel)
            views = []
            for slot, shard in zip(self.slots, shards):
                view = flat.narrow(0, slot.offset, shard.numel()).view(shard.shape)
                view.copy_(shard)
                views.append(view)
        for p, view in zip(params, views):
            replace_local(p, view)
        self.flat, self.locals = flat, tuple(views)

    def part(self, root_fqn: str, params: list[ParamGather]) -> Bucket:
        """A new bucket of some of this one's ``params`` (in slot order), of the same
        variant, rooted at ``root_fqn`` and bound to their stored parameters (Note
        [Checkpointed bucket roots])."""
        b = Bucket(root_fqn, self.variant, self.tag.reshard_after_forward, params, self.dp_mesh, self.mp,
                   self.shared, partial=self.partial.k if self.partial is not None else None)
        b.compiled, b.owner = self.compiled, self.owner
        b.bind()
        return b

    def retire(self) -> None:
        """Its parameters went to other buckets: forget them and the flat buffer."""
        _LIVE.discard(self)
        self.params, self.slots, self.flat, self.locals = [], [], None, ()

    def unbind_for_compile(self) -> None:
        """Give each stored shard its own storage, from now on (Note [Bound storage])."""
        self.compiled = True
        if self.flat is None:
            return
        with torch.no_grad():
            for p in self.stored():
                if any(local_of(p) is v for v in self.locals):
                    replace_local(p, local_of(p).clone())
        self.flat, self.locals = None, ()

    def stored(self) -> list[DTensor]:
        """The stored parameters, in slot order."""
        return [p.module_info.stored for p in self.params]

    def _is_bound(self, params) -> bool:
        return self.flat is not None and all(local_of(p) is v for p, v in zip(params, self.locals))

    def _packed(self, shards: list[torch.Tensor], tagged: bool) -> torch.Tensor:
        """The flat per-rank buffer built from ``shards`` (the unbound path)."""
        dtypes = {s.dtype for s in shards}
        if len(dtypes) > 1:
            raise RuntimeError(
                f"fsdptag: the parameters of bucket {self.name!r} now have dtypes "
                f"{sorted(map(str, dtypes))}; a bucket gathers one dtype. Change parameter "
                "dtypes before fsdptag.parametrize (it splits buckets by dtype), or convert "
                "the whole bucket root module."
            )
        return pack([FSDPTaggedTensor(x, self.tag) if tagged else x for x in shards], self.slots)

    # ------------------------------------------------------------ gathering

    def reduction(self, dtype: torch.dtype) -> GradientReduction:
        """How its gradient, reduced in ``dtype``, is averaged (Note [Gradient reduction]
        in ``_collectives.py``)."""
        return gradient_reduction(self.world, self.group_name, self.replicas, self.replicate_group, dtype,
                                  self.divide)

    def copies(self) -> bool:
        """Whether a gather makes new tensors (a collective or a cast)."""
        return makes_copy(self.world > 1, self.param_dtype, self.params[0].module_info.stored.dtype)

    def can_prefetch(self) -> bool:
        """Whether its all-gather can be issued ahead (Note [Prefetch]): whether it
        all-gathers. Bound or not (an unbound bucket packs its shards, Note [Bound
        storage]): which buckets prefetch decides the order of collectives, so it must be
        the same on every rank, and a compile on some ranks only unbinds theirs."""
        return self.world > 1 and self.copies()

    def _gather_input(self, params, tagged: bool,
                      served: Prefetched | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The flat per-rank buffer to all-gather: the bound storage (or the shards
        packed), tagged, cast to ``param_dtype``; ``served``: answered by that prefetch
        (Note [Prefetch]). With it, a float8 bucket's scales (else None)."""
        if served is not None:  # its data is never read: a stand-in once unbound mid-forward
            stand_in = self.flat if self.flat is not None else local_of(params[0]).new_empty(self.numel)
            flat = ServedInput(stand_in, self.tag, served)
            if self.float8 is not None:  # cast when it was issued
                return flat, served.scales
        elif self._is_bound(params):
            flat = FSDPTaggedTensor(self.flat, self.tag) if tagged else self.flat
        else:
            flat = self._packed([local_of(p) for p in params], tagged)
        if self.float8 is not None:  # scales and cast hidden from checkpoint regions (Note [Float8 all-gather])
            plain = flat._elem if type(flat) is FSDPTaggedTensor else flat
            with torch.no_grad(), sac_hidden():
                scales = self.float8.scales(plain, running_backward())
                data = self.float8.cast(plain, scales)
            return (FSDPTaggedTensor(data, self.tag) if tagged else data), scales
        if self.param_dtype is not None and self.param_dtype != flat.dtype:
            flat = flat.to(self.param_dtype)
        return flat, None

    def hand_out(self, pieces, scales: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The copied-out pieces as the parameters compute gets: unpadded views (a float8
        bucket's as torchao's float8 tensors)."""
        outs = tuple(unpad(self.world, slot, p) for slot, p in zip(self.slots, pieces))
        if self.float8 is not None:
            outs = tuple(self.float8.hand_out(i, o, scales) for i, o in enumerate(outs))
        return outs

    # ------------------------------------------------------------ compiled

    def issue_all_gather(self, tagged: bool, by: str = "learned") -> Prefetched:
        """Start this bucket's all-gather without waiting (Note [Prefetch]); in backward
        with a partial reshard over its ``k``-group (Note [Partial reshard])."""
        kept = self.partial.take() if self.partial is not None and running_backward() else None
        if kept is not None:
            cast = FSDPTaggedTensor(kept, self.tag) if tagged else kept
            return Prefetched(tagged, cast, c10d.all_gather_into_tensor(cast, self.partial.k,
                                                                        self.partial.group_name), by)
        with torch.no_grad():
            cast, scales = self._gather_input(self.stored(), tagged)
            return Prefetched(tagged, cast, c10d.all_gather_into_tensor(cast, self.world, self.group_name), by,
                              scales)


# Every live bucket, so that the first compile anywhere unbinds them all (Note [Bound
# storage]): dynamo cannot fakeify DTensors whose locals share a storage.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _unbind_all(_args) -> None:
    for bucket in list(_LIVE):
        bucket.unbind_for_compile()
    if _LIVE:  # Note [Compiled buckets] in _compiled.py: a bucket root's gather inside someone's checkpoint
        allow_checkpoint_side_effects()


def watch_compiles() -> None:
    """Unbind every live bucket when dynamo starts compiling (Note [Bound storage]);
    idempotent, and cheap enough for every root forward (``torch._dynamo.reset``
    forgets the callback)."""
    on_compile_start(_unbind_all)
