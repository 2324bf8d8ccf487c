"""Single-process tests: one rank's code on the ``fake`` process group (real tensors,
collectives that move nothing), so no second rank is launched."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_pg(request):
    """A ``fake`` process group of ``world`` ranks (default 2) for the test's duration."""
    world = getattr(request, "param", 2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield world
    finally:
        dist.destroy_process_group()
