"""The gradient reduction of a bucket: pure functions, shared by the eager autograd
Function (Note [Buckets] in ``_bucket.py``) and the compiled path (Note [Compiled
buckets] in ``_compiled.py``).

Note [Gradient reduction]
-------------------------
A bucket's gradients are averaged over the data-parallel ranks exactly as FSDP2
averages them (``_get_gradient_divide_factors`` in its ``_fsdp_collectives.py``), so
the two agree bitwise on NCCL as on gloo:

================================  ===============================================
reduce dtype, data-parallel size  reduce-scatter (and HSDP all-reduce)
================================  ===============================================
fp32 / bf16, size > 1             ``avg`` (NCCL divides in the collective; gloo
                                  sums, then divides: bitwise sum-then-divide)
fp16 (overflow risk), size > 1    divide by ``pre`` ~ sqrt(size) before, ``sum``,
                                  divide by ``size / pre`` after
size 1                            ``sum`` (NCCL's ``avg`` is wrong at size 1)
================================  ===============================================

HSDP reduce-scatters over the shard dim and all-reduces over the replicate dim, each
with the op above (``avg`` twice for fp32 / bf16), as FSDP2 does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GradientReduction", "gradient_reduction", "reduce_gradient"]

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class GradientReduction:
    """How one bucket's gradient is averaged (Note [Gradient reduction])."""

    world: int  # ranks of the reduce-scatter (1: nothing to scatter, DDP)
    group: str | None  # its process group's name
    replicas: int  # ranks of the HSDP / DDP all-reduce (1: none)
    replicate_group: str | None
    op: str  # "avg" or "sum", for both collectives
    pre_divide: float | None
    post_divide: float | None


def gradient_reduction(world: int, group: str | None, replicas: int, replicate_group: str | None,
                       reduce_dtype: torch.dtype) -> GradientReduction:
    """FSDP2's choice of reduce op and divide factors for this bucket."""
    size = world * replicas
    if size == 1:
        return GradientReduction(world, group, replicas, replicate_group, "sum", None, None)
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return GradientReduction(world, group, replicas, replicate_group, "avg", None, None)
    pre = 1
    while size % pre == 0 and size / pre > pre:
        pre *= 2
    return GradientReduction(world, group, replicas, replicate_group, "sum", float(pre), size / pre)


def reduce_gradient(flat: torch.Tensor, r: GradientReduction) -> torch.Tensor:
    """The averaged gradient shard of the flat (world, numel) gradient ``flat``, in
    ``flat``'s dtype; ``flat`` may be divided in place."""
    if r.pre_divide is not None:
        flat.div_(r.pre_divide)
    if r.world > 1:
        flat = c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, r.op, r.world, r.group))
    if r.replicate_group is not None:
        flat = c10d.wait_tensor(c10d.all_reduce(flat, r.op, r.replicate_group))
    if r.post_divide is not None:
        flat.div_(r.post_divide)
    return flat
