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
averaged over ``divide`` ranks    fp32 / bf16: divide by ``divide`` before, ``sum``
that are not its own              (FSDP2's ``set_gradient_divide_factor``: its
                                  ``PREMUL_SUM``); fp16: as above with ``divide``
================================  ===============================================

The last row is expert parallelism (Note [Meshes per module] in ``_mesh.py``): an
expert's gradient already sums, through the all-to-all's backward, the tokens of the
EP ranks that are not in its own data-parallel mesh, so it is averaged over the
model's data-parallel ranks (``divide``), not over its mesh's.

HSDP reduce-scatters over the shard dim and all-reduces over the replicate dim, each
with the op above (``avg`` twice for fp32 / bf16), as FSDP2 does.

Note [Reductions in flight]
---------------------------
On NCCL a functional collective runs on the communicator's stream from its issue
until the compute stream waits for it, so a reduce-scatter waited right after its
issue hides behind nothing. In eager code a bucket's backward therefore only
*issues* its reduction (:class:`Reducer`) and hands autograd gradients that wait at
their first use (AsyncCollectiveTensor views, as DTensor hands out its results):
accumulating into ``.grad`` that is still ``None`` takes the gradient as it is, so
the wait moves on to

* the next bucket's reduction (at most ``limit`` in flight, ``OverlapPolicy.reductions``,
  default 1: their inputs and outputs stay alive until waited, as FSDP2 holds one
  reduce-scatter; 0 waits each at once), or
* the end of the backward (a callback on the running backward), which waits for
  every reduction still in flight and unwraps each stored parameter's gradient to a
  plain local tensor, so gradients are final and plain when ``backward()`` returns.

Meanwhile the backward of the blocks below runs. Waited at once, as before, where
the gradient is read right away: a ``.grad`` that already holds a gradient (it is
accumulated into, which reads it), a gradient cast from ``reduce_dtype`` to the
parameter's dtype, the fp16 post-divide, and HSDP's reduce-scatter (its all-reduce
is issued on the result; the all-reduce itself is in flight like the rest).
Fake tensors and traced code wait at once too (``lazy_wait``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ._compat import AsyncCollectiveTensor, OncePerBackward, lazy_wait, local_of, replace_local

__all__ = ["DivideGradient", "GradientReduction", "Reducer", "gradient_reduction", "reduce_gradient"]

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
                       reduce_dtype: torch.dtype, divide: float | None = None) -> GradientReduction:
    """FSDP2's choice of reduce op and divide factors for this bucket; ``divide``: the
    ranks it is averaged over where they are not its own (expert parallelism)."""
    size = world * replicas
    foreign = divide is not None and divide != size
    if foreign:
        size = divide
    if size == 1:
        return GradientReduction(world, group, replicas, replicate_group, "sum", None, None)
    if reduce_dtype in (torch.float32, torch.bfloat16):
        if foreign:
            return GradientReduction(world, group, replicas, replicate_group, "sum", float(size), None)
        return GradientReduction(world, group, replicas, replicate_group, "avg", None, None)
    pre = 1
    while size % pre == 0 and size / pre > pre:
        pre *= 2
    return GradientReduction(world, group, replicas, replicate_group, "sum", float(pre), size / pre)


def reduce_gradient(flat: torch.Tensor, r: GradientReduction) -> torch.Tensor:
    """The averaged gradient shard of the flat (world, numel) gradient ``flat``, in
    ``flat``'s dtype; ``flat`` may be divided in place."""
    return _finish(issue_reduction(flat, r), r)


def issue_reduction(flat: torch.Tensor, r: GradientReduction) -> torch.Tensor | _Done:
    """Start reducing ``flat``; the last collective's output, not waited (None: no
    collective, ``flat`` is the result)."""
    if r.pre_divide is not None:
        flat.div_(r.pre_divide)
    out = None
    if r.world > 1:
        out = c10d.reduce_scatter_tensor(flat, r.op, r.world, r.group)
    if r.replicate_group is not None:
        if out is not None:
            flat = c10d.wait_tensor(out)
        out = c10d.all_reduce(flat, r.op, r.replicate_group)
    return out if out is not None else _Done(flat)


class _Done:
    """A reduction that issued no collective."""

    __slots__ = ("flat",)

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat


def _finish(pending, r: GradientReduction) -> torch.Tensor:
    flat = pending.flat if isinstance(pending, _Done) else c10d.wait_tensor(pending)
    if r.post_divide is not None:
        flat.div_(r.post_divide)
    return flat


class DivideGradient(torch.autograd.Function):
    """Identity forward; backward divides the gradient by ``divide``. A parameter
    gathered alone is reduced by DTensor's redistribute (``Partial("sum")`` here, then
    this on its reduced shard), where a bucket divides in ``issue_reduction``."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, divide: float) -> torch.Tensor:
        ctx.divide = divide
        return shard.view_as(shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.divide, None


class Reducer:
    """The gradient reductions of one model still in flight (Note [Reductions in flight])."""

    def __init__(self, limit: int = 1) -> None:
        self.limit = limit
        self.in_flight: collections.deque = collections.deque()  # issued outputs, oldest first
        self.lazy_params: list[DTensor] = []  # whose gradients wait lazily, this backward
        self._at_end = OncePerBackward()  # the end-of-backward flush

    def __getstate__(self) -> dict:
        return dict(self.__dict__, in_flight=collections.deque(), lazy_params=[], _at_end=OncePerBackward())

    def reduce(self, flat: torch.Tensor, r: GradientReduction, params, lazy: bool) -> torch.Tensor:
        """The reduced gradient of ``flat``; with ``lazy`` still in flight, waited at its
        first use, the next reduction or the end of this backward (``params``: the stored
        parameters it is the gradient of)."""
        if not lazy or r.post_divide is not None or self.limit == 0:
            return reduce_gradient(flat, r)
        while len(self.in_flight) >= self.limit:
            c10d.wait_tensor(self.in_flight.popleft())
        pending = issue_reduction(flat, r)
        if isinstance(pending, _Done):
            return pending.flat
        self.in_flight.append(pending)
        self.lazy_params += params
        self._at_end.queue(self.flush)
        return lazy_wait(pending)

    def flush(self) -> None:
        """Wait for every reduction in flight; gradients become plain tensors."""
        while self.in_flight:
            c10d.wait_tensor(self.in_flight.popleft())
        params, self.lazy_params = self.lazy_params, []
        for p in params:
            g = p.grad
            if isinstance(g, DTensor) and isinstance(local_of(g), AsyncCollectiveTensor):
                replace_local(g, local_of(g).elem)
