"""Bucketed gathers: one all-gather (and one reduce-scatter) per bucket of parameters.

Note [Buckets]
--------------
With ``parametrize(..., bucket="module" | fn)`` the parameters under a bucket
root module (fully_shard, non-TP parameters) are gathered together: each rank
packs its shards (cast to ``param_dtype``, padded to ``ceil(rows / world)`` rows)
into one flat buffer, one ``all_gather_into_tensor`` gathers it, and each
parameter is copied out of the gathered buffer. Backward packs the gradients the
same way for one ``reduce_scatter_tensor`` (in ``reduce_dtype``, averaged).

The gather runs at the first access to any of the bucket's parameters inside the
bucket root's ``forward`` and is reused by the rest of that call. The scope is
opened *inside* ``forward`` (below any checkpoint wrapper), so a checkpointed
block issues the same ops in forward and in its recompute, which SAC's per-op
replay requires; an access outside the root's ``forward`` falls back to the
per-parameter gather. The flat buffer, the all-gather and its views carry the
bucket's tag (FQN = the root module's), so the checkpoint policy saves the
all-gather output for zero2 and recomputes the copy-outs; each copied-out
parameter carries its own parameter's tag, which the zero3 hooks use to
re-gather the bucket (once per backward) and take that parameter from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._tag import FSDPTag, FSDPTaggedTensor

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class _Slot:
    """Where one parameter lives in the bucket's flat per-rank buffer."""

    offset: int  # in elements, within one rank's buffer
    rows: int  # global dim-0 size
    padded_rows: int  # ceil(rows / world): every rank's chunk, padded
    row_numel: int  # elements per row
    tag: FSDPTag

    @property
    def numel(self) -> int:
        return self.padded_rows * self.row_numel


class Bucket:
    """The parameters of one bucket root; see Note [Buckets]."""

    def __init__(self, name: str, tag: FSDPTag, entries: list, dp_mesh, mp) -> None:
        self.name, self.tag = name, tag
        self.entries = entries  # [(module, param name, _ParamAccess)]
        self.world = dp_mesh.size()
        self.group_name = dp_mesh.get_group().group_name
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype
        self.slots: list[_Slot] = []
        offset = 0
        for _, _, access in entries:
            rows, rest = access.shape[0], math.prod(access.shape[1:])
            slot = _Slot(offset, rows, -(-rows // self.world), rest, access.tag)
            self.slots.append(slot)
            offset += slot.numel
        self.numel = offset
        self.scopes: list[dict] = []  # one per open bucket-root forward

    def scoped(self, fn):
        """``fn`` run inside a fresh gather scope of this bucket."""

        def run(*args, **kwargs):
            self.scopes.append({})
            try:
                return fn(*args, **kwargs)
            finally:
                self.scopes.pop()

        return run

    def lookup(self, access, tagged: bool) -> torch.Tensor | None:
        """The gathered parameter for ``access`` in the current scope (gathering the
        bucket at the scope's first access), or None outside the root's forward."""
        if not self.scopes:
            return None
        scope = self.scopes[-1]
        if not scope:
            scope.update(self.gather(tagged=tagged))
        return scope[access]

    def gather(self, *, tagged: bool) -> dict:
        shards = [module._parameters[name].to_local() for module, name, _ in self.entries]
        outs = _GatherBucket.apply(self, tagged, *shards)
        return {access: out for (_, _, access), out in zip(self.entries, outs)}


class _GatherBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bucket: Bucket, tagged: bool, *shards: torch.Tensor):
        ctx.bucket = bucket
        ctx.shard_meta = [(s.shape, s.dtype) for s in shards]
        pieces = []
        for slot, shard in zip(bucket.slots, shards):
            x = FSDPTaggedTensor(shard.detach(), bucket.tag) if tagged else shard.detach()
            if bucket.param_dtype is not None:
                x = x.to(bucket.param_dtype)
            x = x.reshape(-1)
            if x.numel() < slot.numel:  # uneven shards: pad every rank's chunk alike
                x = F.pad(x, (0, slot.numel - x.numel()))
            pieces.append(x)
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, bucket.world, bucket.group_name))
        per_rank = gathered.view(bucket.world, bucket.numel)
        outs = []
        for slot, (module, name, access) in zip(bucket.slots, bucket.entries):
            p = per_rank.narrow(1, slot.offset, slot.numel)
            p = p.reshape(bucket.world * slot.padded_rows, *access.shape[1:])  # the copy-out
            if p.shape[0] != slot.rows:
                p = p.narrow(0, 0, slot.rows)
            outs.append(FSDPTaggedTensor(p._elem, slot.tag) if tagged else p)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        bucket = ctx.bucket
        pieces = []
        for slot, grad, (shape, dtype) in zip(bucket.slots, grads, ctx.shard_meta):
            if grad is None:  # a parameter of the bucket that this forward did not use
                grad = torch.zeros(slot.rows * slot.row_numel, dtype=bucket.reduce_dtype or dtype)
            g = grad.to(bucket.reduce_dtype or grad.dtype).reshape(-1)
            pad = bucket.world * slot.numel - g.numel()
            if pad:
                g = F.pad(g, (0, pad))
            pieces.append(g.view(bucket.world, slot.numel))
        flat = torch.cat(pieces, dim=1).reshape(-1) if len(pieces) > 1 else pieces[0].reshape(-1)
        local = c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", bucket.world, bucket.group_name))
        local = local / bucket.world
        out = []
        for slot, (shape, dtype) in zip(bucket.slots, ctx.shard_meta):
            g = local.narrow(0, slot.offset, slot.numel)[: math.prod(shape)]
            out.append(g.view(shape).to(dtype))
        return (None, None, *out)
