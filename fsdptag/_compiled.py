"""Buckets inside ``torch.compile``: one all-gather per bucket in the graph, with
eager's ops and layout (the process-wide watch that unbinds bucket storage before
dynamo fakeifies parameters is ``watch_compiles`` in ``_bucket.py``, Note [Bound storage]).

Note [Compiled buckets]
-----------------------
Inside ``torch.compile`` a bucket is gathered as in eager, one all-gather for its
parameters, but traced: ``gather_in_graph`` pads and concatenates the local shards,
then ``_BucketCollectives`` casts and all-gathers (backward: the gradient in
``reduce_dtype``, reduced by the same ``reduce_gradient`` as eager's), and one
``split_with_sizes_copy`` copies the parameters out; the same ops in the same order
as eager, so ``aot_eager`` is bitwise equal to eager. There are no scopes in compiled
code: a bucket root's ``forward`` gathers its buckets up front and hands each
parameter its piece through ``ParamGather.pregathered`` (a Python attribute, set
and cleared in the traced code). Where the gather runs:

* a block checkpointed by ``apply_ac`` (a bucket root, Note [Checkpointed bucket
  roots]): before its checkpoint region opens (``pregather``), zero2 plainly (the
  region takes the parameters as inputs), zero3 in a recompute-everything region
  of its own, so the compiled backward re-gathers the bucket once;
* any other bucket root's ``forward``: in a checkpoint region of the bucket's own,
  recompute-everything for zero3, save-everything for zero2, which keeps zero2
  gathered inside someone else's checkpoint region (a plain ``checkpoint``, Hugging
  Face's). Writing ``pregathered`` inside such a region is a side effect dynamo
  refuses by default, so the compile-start callback sets
  ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` (as
  torchtitan's compile path does): the write is set and cleared within the traced
  forward, so not replaying it in the recompute loses nothing.

The compiled backward reduces only the slots of parameters that require grad, as
eager does: frozen weights beside trainable ones (LoRA) send nothing. Their columns
of the gathered gradient (one ``(world, numel)`` row per rank, slots side by side)
are left out of the reduce-scatter input, so it holds what eager's ``_chunk_cat`` of
the trainable gradients packs, and the frozen slots of the returned shard gradient
are zeros (autograd drops them: those parameters need no gradient).

Per compiled block graph: 1 all-gather in forward, zero2 0 and zero3 1 in backward,
with AC none, selective, full or a plain checkpoint (``tests/test_compile.py`` pins
five of those settings), where per-parameter gathers made 9.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ._collectives import gradient_reduction, reduce_gradient
from ._bucket import Bucket
from ._layout import copy_out, pack, unpad
from ._param import recompute_everything, save_everything

__all__ = ["traced_gather"]

c10d = torch.ops._c10d_functional


def traced_gather(bucket: Bucket) -> tuple[torch.Tensor, ...]:
    """``bucket`` gathered in the graph, in a checkpoint region of its own: zero3's
    recomputes it, zero2's saves it."""
    if bucket.float8 is not None:
        raise NotImplementedError(
            f"fsdptag: bucket {bucket.name!r} all-gathers torchao float8 weights, which runs in eager "
            "only (Note [Float8 all-gather]); compile without it: "
            "Float8LinearConfig(enable_fsdp_float8_all_gather=False)")
    context_fn = recompute_everything if bucket.tag.reshard_after_forward else save_everything
    return checkpoint(_gather_in_graph, bucket, *bucket.stored(), use_reentrant=False, context_fn=context_fn)


def _gather_in_graph(bucket: Bucket, *params: DTensor) -> tuple[torch.Tensor, ...]:
    """One untagged gather of the bucket in the graph, with eager's ops and layout."""
    for g in bucket.params:
        g.check_compilable()
    flat = pack([p.to_local() for p in params], bucket.slots)  # to_local's backward makes the DTensor grad
    gathered = _BucketCollectives.apply(flat, bucket.world, bucket.group_name, bucket.replicas,
                                        bucket.replicate_group, bucket.param_dtype, bucket.reduce_dtype,
                                        _runs(bucket, [p.requires_grad for p in params]), bucket.divide)
    split = copy_out(gathered, bucket.world, bucket.numel, bucket.split_sizes)
    return tuple(g.on_tp_mesh(unpad(bucket.world, slot, piece))
                 for g, slot, piece in zip(bucket.params, bucket.slots, split))


def _runs(bucket: Bucket, needs: list[bool]) -> tuple[tuple[int, int, bool], ...] | None:
    """The bucket's per-rank buffer as runs ``(offset, numel, requires grad)`` of
    neighbouring slots alike; None when every slot requires grad."""
    if all(needs):
        return None
    runs: list[list] = []
    for slot, need in zip(bucket.slots, needs):
        if runs and runs[-1][2] == need:
            runs[-1][1] += slot.numel
        else:
            runs.append([slot.offset, slot.numel, need])
    return tuple(tuple(r) for r in runs)


class _BucketCollectives(torch.autograd.Function):
    """Compiled buckets' collectives: cast + all-gather in forward; in backward the
    gradient of the trainable slots in ``reduce_dtype``, reduced by eager's
    ``reduce_gradient`` (Note [Compiled buckets])."""

    @staticmethod
    def forward(ctx, flat, world, group, replicas, replicate_group, param_dtype, reduce_dtype, runs, divide):
        ctx.world, ctx.group, ctx.replicas, ctx.replicate_group = world, group, replicas, replicate_group
        ctx.divide = divide
        ctx.in_dtype = flat.dtype
        ctx.reduce_dtype = reduce_dtype
        ctx.runs = runs
        if param_dtype is not None and param_dtype != flat.dtype:
            flat = flat.to(param_dtype)
        if world > 1:
            flat = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, world, group))
        return flat

    @staticmethod
    def backward(ctx, grad):
        runs = ctx.runs
        if runs is not None:  # the trainable columns alone (a copy)
            rows = grad.reshape(ctx.world, -1)
            grad = torch.cat([rows[:, at:at + n] for at, n, need in runs if need], dim=1).view(-1)
        if ctx.reduce_dtype is not None and grad.dtype != ctx.reduce_dtype:
            grad = grad.to(ctx.reduce_dtype)
        elif runs is None:
            grad = grad.clone()  # averaged in place below
        grad = reduce_gradient(grad, gradient_reduction(ctx.world, ctx.group, ctx.replicas, ctx.replicate_group,
                                                        grad.dtype, ctx.divide))
        if runs is not None:  # the frozen slots' zeros back in place
            pieces, at = [], 0
            for _, n, need in runs:
                pieces.append(grad[at:at + n] if need else grad.new_zeros(n))
                at += n if need else 0
            grad = torch.cat(pieces)
        if grad.dtype != ctx.in_dtype:
            grad = grad.to(ctx.in_dtype)
        return grad, None, None, None, None, None, None, None, None
