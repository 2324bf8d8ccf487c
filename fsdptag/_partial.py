"""Partial reshard: ``reshard_after_forward=k`` keeps a copy sharded over k ranks.

Note [Partial reshard]
----------------------
FSDP2's ``reshard_after_forward=int``: after forward the gathered parameters are freed
(as zero3), but each rank keeps ``k / world`` of the gathered bucket, so backward
re-gathers over ``k`` ranks only (one node, say, on its fast links) instead of the
whole data-parallel group. The shard dim's ranks split into contiguous groups of ``k``
(FSDP2's ``mesh.view(-1, k)`` rows); the rank at position ``j`` of its group keeps
rows ``[j * world/k, (j + 1) * world/k)`` of the ``(world, numel)`` gathered buffer, so
one all-gather over its group rebuilds the whole buffer, byte for byte the forward's:
gradients are zero3's, bitwise.

Everything else is zero3 (the tag says ``reshard_after_forward=True``): the checkpoint
policy recomputes the gathers, fsdptag's saved-tensor hooks pack re-gather handles.
Only the all-gather in backward differs: a bucket's re-gather (the hooks', a
recompute's, a prefetch's) is issued over the ``k``-group from the kept rows and then
served through the usual ops (:class:`~fsdptag._prefetch.ServedInput`), so a
checkpointed region's recompute still dispatches a cast, an all-gather and a wait, as
SAC's per-op replay requires. The rows are taken in each training forward (grad on,
not in backward) and dropped when the backward has re-gathered once per such forward
(in the usual step, right after its one re-gather), else at that backward's end. A
bucket backward never re-gathers (an embedding table alone) keeps its rows until then.

One process group per distinct (shard group, k), created once per process, only the
``k``-groups (FSDP2 builds a 2-D mesh per call, both dims' groups). Bucketed gathers
only (``bucket="param"`` is refused); compiled code (``torch.compile``) re-gathers over
the whole group, as zero3.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._compat import OncePerBackward, resolve_group

__all__ = ["PartialReshard", "check_partial", "partial_groups"]

_GROUPS: dict[tuple[str, int], tuple] = {}  # (shard group, k) -> (its group object, k-group name, position)


def check_partial(k: int, dp_mesh, fqn: str) -> None:
    world = dp_mesh.size(dp_mesh.ndim - 1)
    if not 1 < k < world or world % k:
        raise ValueError(
            f"reshard_after_forward={k} for {fqn!r}: k must divide the data-parallel shard group's size "
            f"{world} and lie strictly between 1 and it (k={world} keeps everything: use False; True "
            "reshards fully)")


def _k_group(group_name: str, k: int) -> tuple[str, int]:
    """This rank's group of ``k`` contiguous ranks of ``group_name`` and its position in it."""
    key = (group_name, k)
    group = resolve_group(group_name)
    cached = _GROUPS.get(key)
    if cached is None or cached[0] is not group:  # none yet, or a process group since re-created
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        mine = None
        for start in range(0, len(ranks), k):  # every rank creates every group, in one order
            g = dist.new_group(ranks[start:start + k])
            if start <= me < start + k:
                mine = g
        cached = _GROUPS[key] = (group, mine.group_name, me % k)
    return cached[1], cached[2]


def partial_groups() -> dict[str, tuple[str, int]]:
    """Each ``k``-group of a live process group: its name -> (the shard group's name, k)."""
    out = {}
    for key, (group, sub, _) in _GROUPS.items():
        try:
            alive = resolve_group(key[0]) is group
        except RuntimeError:  # destroyed: its name resolves to nothing
            alive = False
        if alive:
            out[sub] = key
    return out


class PartialReshard:
    """A bucket's ``k``-group and the rows it keeps (Note [Partial reshard])."""

    def __init__(self, k: int, world: int, group_name: str) -> None:
        self.k = k
        self.group_name, position = _k_group(group_name, k)
        self.rows = slice(position * world // k, (position + 1) * world // k)
        self.world = world
        self.kept: torch.Tensor | None = None
        self.uses = 0  # training forwards that gathered since, less backward re-gathers
        self._drop = OncePerBackward()

    def __getstate__(self) -> dict:
        return dict(self.__dict__, kept=None, uses=0)

    def keep(self, gathered: torch.Tensor) -> None:
        """After a training forward's gather: this rank's rows of it (the same rows
        again for a second forward before backward: the parameters did not change)."""
        if self.kept is None:
            with torch.no_grad():
                self.kept = gathered.view(self.world, -1)[self.rows].reshape(-1).clone()
        self.uses += 1

    def available(self) -> bool:
        return self.kept is not None

    def take(self) -> torch.Tensor | None:
        """In backward, for one re-gather: the kept rows, or None. Dropped once every
        forward that kept them has re-gathered, else at this backward's end."""
        kept = self.kept
        if kept is not None:
            self.uses -= 1
            if self.uses <= 0:
                self._release()
            else:
                self._drop.queue(self._release)
        return kept

    def _release(self) -> None:
        self.kept, self.uses = None, 0
