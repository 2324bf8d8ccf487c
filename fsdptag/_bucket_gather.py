"""A bucket's eager gather as an autograd Function (Note [Buckets] in ``_bucket.py``):
forward all-gathers the bucket (or serves a prefetch or a kept gather) and copies
its parameters out, backward reduce-scatters the gradients of those that need one."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ._bucket import Bucket
from ._compat import chunk_cat, contiguous_strides, dtensor_of, local_of, sac_hidden
from ._context import Zero2, in_inference, running_backward
from ._keep import KeptGather
from ._layout import copy_out
from ._prefetch import Prefetched
from ._tag import FSDPTaggedTensor, mark_gathered

__all__ = ["GatherBucket"]

c10d = torch.ops._c10d_functional


class _GatherBucket(torch.autograd.Function):
    """Gather a bucket (Note [Buckets]); the inputs are the stored DTensor parameters.
    (Its name is in autograd's errors, e.g. an in-place op on a handout.)"""

    @staticmethod
    def forward(ctx, bucket: Bucket, tagged: bool, prefetched: Prefetched | None,
                reuse: KeptGather | None, keep: Zero2 | None, *params: DTensor):
        ctx.bucket = bucket
        ctx.specs = [p._spec for p in params]
        ctx.local_shapes = [local_of(p).shape for p in params]
        ctx.kept = None
        node = ctx if any(p.requires_grad for p in params) else None  # frozen weights: no backward
        if reuse is not None:  # a recompute served from the forward's gather
            bucket.keeper.adopt(reuse, node)
            return bucket.hand_out(reuse.pieces, reuse.scales)
        if not bucket.copies():  # DDP without a cast: aliases of the stored shards, no views,
            return tuple(local_of(p).detach() for p in params)  # so in place is as in DDP
        # No FSDP op to checkpoint under inference_mode (which would also turn the cast
        # into aten.to.dtype, outside the tag table).
        tagged = tagged and not in_inference()
        if prefetched is None and bucket.partial is not None and running_backward():
            # a re-gather over the k-group, served through the usual ops (Note [Partial reshard])
            if bucket.partial.available():
                with sac_hidden():  # no region records it: the served ops below are what it sees
                    prefetched = bucket.issue_all_gather(tagged)
        if prefetched is not None and tagged:  # issued ahead: the same ops, served (Note [Prefetch])
            flat, scales = bucket._gather_input(params, tagged, served=prefetched)
            gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, bucket.world, bucket.group_name))
        elif prefetched is not None:
            gathered, scales = c10d.wait_tensor(prefetched.output), prefetched.scales
        elif bucket.world > 1:
            flat, scales = bucket._gather_input(params, tagged)
            gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, bucket.world, bucket.group_name))
        else:  # DDP with a cast: the cast shard is the whole parameter
            gathered, scales = bucket._gather_input(params, tagged)
        if bucket.partial is not None and not running_backward() and bucket.shared.forward.training():
            bucket.partial.keep(gathered._elem if type(gathered) is FSDPTaggedTensor else gathered)
        pieces = copy_out(gathered, bucket.world, bucket.numel, bucket.split_sizes)  # tagged by FSDPTag.parts
        if tagged:  # compute gets plain tensors (Note [Marked handout] in _handout.py)
            pieces = [mark_gathered(p._elem, tag) for p, tag in zip(pieces, bucket.tag.parts)]
        if keep is not None:
            bucket.keeper.keep(KeptGather(pieces, params, bucket.keeper, scales), keep, node)
        # views made here: autograd refuses in-place ops on them (grad on)
        return bucket.hand_out(pieces, scales)

    @staticmethod
    def backward(ctx, *grads):
        bucket = ctx.bucket
        if ctx.kept is not None:  # this bucket's backward: its kept gather is done with
            ctx.kept.release()
            ctx.kept = None
        # Only parameters that require grad are reduced (frozen weights beside adapters
        # send nothing, as in FSDP2): the reduce-scatter packs their slots alone.
        needs = ctx.needs_input_grad[5:]
        some = next(g for g in grads if g is not None)
        grads = [  # a parameter of the bucket that this forward did not use gets zeros
            g if g is not None else some.new_zeros(slot.rows, *slot.rest)
            for g, slot, need in zip(grads, bucket.slots, needs) if need
        ]
        numel = bucket.numel if all(needs) else sum(s.numel for s, need in zip(bucket.slots, needs) if need)
        packed = grads[0].new_empty(bucket.world, numel, dtype=bucket.reduce_dtype or grads[0].dtype)
        chunk_cat(grads, bucket.world, packed)
        if bucket.unsynced_grad is not None:  # Note [Accumulation without sync] in _sync.py
            if bucket.unsynced_needs != needs:
                bucket.unsynced_grad = None
                raise RuntimeError(
                    f"bucket {bucket.name!r}: which of its parameters require grad changed while "
                    "gradients accumulated without sync; change requires_grad only after a backward "
                    "that syncs (fsdptag.set_requires_gradient_sync(model, True))")
            packed = bucket.unsynced_grad.add_(packed)
            bucket.unsynced_grad = None
        if not bucket.requires_gradient_sync:
            bucket.unsynced_grad, bucket.unsynced_needs = packed, needs
            return (None,) * (5 + len(needs))
        # in flight until first read (Note [Reductions in flight] in _collectives.py) unless
        # the cast to the parameters' dtype reads it now
        reduced = [(slot, spec, shape, p) for slot, spec, shape, p, need
                   in zip(bucket.slots, ctx.specs, ctx.local_shapes, bucket.stored(), needs) if need]
        lazy = all(spec.tensor_meta.dtype == packed.dtype for _, spec, _, _ in reduced)
        local = bucket.shared.reducer.reduce(packed.view(-1), bucket.reduction(packed.dtype),
                                           [p for *_, p in reduced], lazy)
        out, offset = [], 0
        for slot, spec, shape, _ in reduced:
            g = local.as_strided(shape, contiguous_strides(shape), offset)
            offset += slot.numel
            if g.dtype != spec.tensor_meta.dtype:
                g = g.to(spec.tensor_meta.dtype)
            out.append(dtensor_of(g, spec))
        out.reverse()
        out = [out.pop() if need else None for need in needs]
        return (None, None, None, None, None, *out)


GatherBucket = _GatherBucket
