"""Opt-in prefetch: a bucket's gather issues the next bucket's all-gather.

Note [Prefetch]
---------------
With ``parametrize(..., prefetch=True)`` a bucket's gather also issues, without
waiting, the all-gather of the bucket that gathered right after it in the
previous forward (the root's forward hooks record that order); that bucket's
gather then only waits and copies out. On gloo the wait blocks the CPU, so this
lets gloo's thread move the next block's parameters during this block's compute.
On NCCL a functional collective runs on the communicator's stream from its issue
until the compute stream waits for it (``wait_tensor``), and only compute queued in
between can hide it: without prefetch every gather is waited right after its issue,
so nothing overlaps there either (not measured on a GPU).
It costs one more gathered bucket alive, as in FSDP2.

Only gathers outside activation-checkpointed regions take part. SAC replays a
region op by op: a region whose forward only waited for an all-gather issued
elsewhere could not issue the same ops in its recompute (it would have to
gather), and an all-gather issued inside region i for block i+1 would belong to
region i's replay. So under AC on every block prefetch does nothing. Nor does a
plain checkpoint's recompute in backward prefetch: nobody would claim it before
the optimizer changes the parameters. An issued all-gather nobody claims (the
order changed) is waited out at the end of the root's forward.
"""

from __future__ import annotations

import torch

from ._bucket import Bucket
from ._context import running_backward

__all__ = ["Prefetcher"]

c10d = torch.ops._c10d_functional


class Prefetcher:
    """Issues the next bucket's all-gather when a bucket gathers; see Note [Prefetch].

    The order is the previous forward's. Only gathers during the root's forward take
    part, not a checkpoint's recompute in backward (whose prefetch nobody would
    claim before the optimizer changes the parameters)."""

    def __init__(self) -> None:
        self.active = False  # inside the root's forward
        self.order: list[tuple[Bucket, bool]] = []  # (bucket, gathered outside AC) this forward
        self.next: dict[Bucket, Bucket] = {}  # from the last forward
        self.pending: dict[Bucket, tuple[bool, torch.Tensor]] = {}  # bucket -> (tagged, all-gather)

    def _in_forward(self) -> bool:
        return self.active and not running_backward()

    def take(self, bucket: Bucket, region, tagged: bool) -> torch.Tensor | None:
        entry = self.pending.pop(bucket, None)
        if entry is None:
            return None
        if self._in_forward() and region is None and entry[0] == tagged:
            return entry[1]
        c10d.wait_tensor(entry[1])  # not usable here: finish it and gather afresh
        return None

    def gathered(self, bucket: Bucket, region, tagged: bool) -> None:
        if not self._in_forward():
            return
        self.order.append((bucket, region is None))
        following = self.next.get(bucket)
        if region is None and following is not None and following not in self.pending:
            self.pending[following] = (tagged, following.issue_all_gather(tagged))

    def pre_forward(self) -> None:
        self._drain()
        self.active, self.order = True, []

    def post_forward(self) -> None:  # also when forward raised
        self.active = False
        self.next = {a: b for (a, a_free), (b, b_free) in zip(self.order, self.order[1:])
                     if a_free and b_free and b.world > 1}
        self._drain()

    def _drain(self) -> None:
        for _, unclaimed in self.pending.values():
            c10d.wait_tensor(unclaimed)
        self.pending.clear()
