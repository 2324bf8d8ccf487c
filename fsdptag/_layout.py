"""A bucket's flat layout (Note [Buckets] in ``_bucket.py``): where each parameter's shard
lives in the per-rank buffer, and the pure functions both gather paths use on it, so
eager and compiled buckets pad, pack and copy out with the very same ops."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Slot", "copy_out", "layout", "pack", "unpad"]


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the bucket's flat per-rank buffer."""

    offset: int  # in elements, within one rank's buffer
    rows: int  # global dim-0 size
    padded_rows: int  # ceil(rows / world): every rank's chunk, padded
    row_numel: int  # elements per row
    rest: tuple[int, ...]  # dims after 0

    @property
    def numel(self) -> int:
        return self.padded_rows * self.row_numel


def layout(shapes: list[torch.Size], world: int) -> tuple[list[Slot], int]:
    """The slots of tensors of ``shapes`` (what the dp mesh shards on dim 0) in one
    rank's buffer, and its size in elements."""
    slots, offset = [], 0
    for shape in shapes:
        rows, rest = shape[0], tuple(shape[1:])
        slot = Slot(offset, rows, -(-rows // world), math.prod(rest), rest)
        slots.append(slot)
        offset += slot.numel
    return slots, offset


def pack(shards: list[torch.Tensor], slots: list[Slot]) -> torch.Tensor:
    """One rank's flat buffer from its local shards: each padded to its slot (uneven
    shards pad every rank's chunk alike), concatenated."""
    pieces = []
    for slot, shard in zip(slots, shards):
        x = shard.reshape(-1)
        if x.numel() < slot.numel:
            x = F.pad(x, (0, slot.numel - x.numel()))
        pieces.append(x)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def copy_out(gathered: torch.Tensor, world: int, numel: int, split_sizes: list[int]) -> list[torch.Tensor]:
    """The all-gathered ``(world * numel)`` buffer split into each parameter's padded
    rows (one ``split_with_sizes_copy``; a bucket of one is laid out already)."""
    if len(split_sizes) == 1:
        return [gathered]
    return list(torch.split_with_sizes_copy(gathered.view(world, numel), split_sizes, dim=1))


def unpad(world: int, slot: Slot, piece: torch.Tensor) -> torch.Tensor:
    """A copied-out piece as its parameter: padded rows viewed, the padding cut off."""
    p = piece.view(world * slot.padded_rows, *slot.rest)
    return p.narrow(0, 0, slot.rows) if p.shape[0] != slot.rows else p
