"""Reading a parameter: what ``module.<name>`` returns, decided here, top-down.

Note [Parameter read]
---------------------
``read`` is the whole decision; the caller (the generated property, ``_state.py``)
passes the parameter's gather, its stored DTensor, the root's map of bucketed gathers to
their buckets and its handout check, so no lower layer reaches back for its owner:

====================================  =================================================
when                                  ``module.<name>`` is
====================================  =================================================
compiled code pregathered it          that piece (Note [Compiled gathers] in _param.py)
``disable_active_parametrization``    the stored sharded DTensor
dynamo traces the access              the gather in the graph (``ParamGather.traced``)
a bucket's scope is open in this      the bucket's gather, at the scope's first access
checkpoint region                     (Note [Buckets] in ``_bucket.py``)
a recompute outside any scope         the bucket gathered once per recompute (zero2:
                                      served from the kept gather)
otherwise                             the parameter gathered alone, its handout checked
                                      for in-place changes when the root's forward returns
====================================  =================================================

Within each, the gather context (Note [When what applies] in ``_context.py``) decides
what zero2 and zero3 keep.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from ._bucket import Bucket
from ._bucket_gather import GatherBucket
from ._compat import graph_task_id, is_compiling, sac_hidden
from ._context import GatherContext, gather_context, in_inference, sac_region
from ._param import Handouts, ParamGather, flags
from ._prefetch import Prefetched

__all__ = ["gather", "read", "regather"]


def read(param: ParamGather, stored: DTensor, bucket_of: dict[ParamGather, Bucket],
         handouts: Handouts) -> torch.Tensor:
    """What ``module.<name>`` returns, given its stored parameter (Note [Parameter read])."""
    if param.pregathered is not None:  # compiled: not even the stored one (Note [Compiled gathers])
        return param.pregathered
    if not flags.active:
        return stored
    if is_compiling():  # before any lookup: compiled code traces nothing it need not
        return param.traced(stored)
    bucket = bucket_of.get(param)
    if bucket is not None:
        gathered = _lookup(bucket, param, flags.tagging)
        if gathered is not None:
            return gathered
    copies = param.copies(stored)
    gathered = param.gather(stored, tagged=flags.tagging, copies=copies)
    if copies:  # otherwise the handout is the stored parameter itself
        handouts.record(gathered, param.fqn)
    return gathered


def _lookup(bucket: Bucket, param: ParamGather, tagged: bool) -> torch.Tensor | None:
    """The gathered parameter ``param`` in the bucket's current scope (gathering the
    bucket at the scope's first access), or None outside the root's forward or from
    another checkpoint region than the scope's (Note [Buckets])."""
    if not bucket.scopes or bucket.scopes[-1].region is not sac_region():
        return _scopeless_recompute(bucket, param, tagged)
    scope = bucket.scopes[-1]
    if not scope.gathered:
        scope.gathered.update(_gather_prefetched(bucket, tagged))
        # DDP without a cast hands out the stored parameters themselves, as plain DDP
        # does; inference tensors have no version counter.
        if bucket.copies() and not in_inference():
            scope.versions = {p: t._version for p, t in scope.gathered.items()}
    return scope.gathered[param]


def _gather_prefetched(bucket: Bucket, tagged: bool) -> dict[ParamGather, torch.Tensor]:
    """``gather``, claiming the all-gather prefetched for it and issuing the next one
    (Note [Prefetch] in ``_prefetch.py``)."""
    prefetcher = bucket.shared.prefetcher
    if prefetcher is None:
        return gather(bucket, tagged=tagged)
    tagged = tagged and not in_inference()
    prefetched = prefetcher.take(bucket, tagged)
    gathered = gather(bucket, tagged=tagged, prefetched=prefetched)
    del prefetched  # the all-gather output: gone before the next one starts
    prefetcher.gathered(bucket, tagged)
    return gathered


def _handouts(bucket: Bucket, outs) -> dict[ParamGather, torch.Tensor]:
    return {p: p.on_tp_mesh(out) for p, out in zip(bucket.params, outs)}


def gather(bucket: Bucket, *, tagged: bool, prefetched: Prefetched | None = None) -> dict[ParamGather, torch.Tensor]:
    """The bucket's parameters gathered (one all-gather, or ``prefetched``), by gather."""
    params = bucket.stored()
    reuse = how = None
    if bucket.keeper is not None:  # Note [zero2 kept until backward] in _keep.py
        reuse = bucket.keeper.find(params)
        how = None if reuse is not None else bucket.keeper.how_to_keep()
    if reuse is not None and prefetched is not None:
        prefetched.wait()
        prefetched = None
    with sac_hidden() if gather_context().hides_fsdp_ops else contextlib.nullcontext():  # Note [Whose selective policy]
        return _handouts(bucket, GatherBucket.apply(bucket, tagged, prefetched, reuse, how, *params))


def _scopeless_recompute(bucket: Bucket, param: ParamGather, tagged: bool) -> torch.Tensor | None:
    """A checkpoint's recompute outside any gather scope of ``bucket`` (the checkpointed
    module is the bucket root itself, e.g. a checkpoint wrapper): one gather per
    backward, shared by the recompute's accesses while they hold it; zero2 serves it
    from the forward's kept gather (Note [zero2 kept until backward]). None (gather per
    parameter) outside a recompute."""
    if gather_context() is not GatherContext.RECOMPUTE or not bucket.copies():
        return None
    params = bucket.stored()
    entry = bucket.keeper.find(params) if bucket.keeper is not None else None
    key = (graph_task_id(), bucket, entry)
    served = bucket.shared.served.get(key)
    if served is None:
        if entry is None:  # zero3: a gather, prefetched like the hooks' re-gathers
            served = bucket.shared.served.serve(key, _gather_prefetched(bucket, tagged))
        else:
            served = bucket.shared.served.serve(
                key, _handouts(bucket, GatherBucket.apply(bucket, tagged, None, entry, None, *params)))
    return served[param]


def regather(bucket: Bucket) -> dict[ParamGather, torch.Tensor]:
    """A fresh tagged gather, as the zero3 hooks re-gather (Note [zero3 by saved-tensor
    hooks] in ``_reshard.py``), prefetched (Note [Prefetch])."""
    return _gather_prefetched(bucket, True)
