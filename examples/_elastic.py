"""Start the default process group so that torchrun's restarts (``--max-restarts``) work.

Note [Restarted process groups]: torchrun's c10d rendezvous shares its TCPStore
with the workers (unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and the store
outlives a failed attempt. A restarted worker then reads the keys the previous
attempt's ranks left in it: gloo looks up a dead peer's address and fails with
"connectFullMesh failed ... Connection refused" (pytorch/pytorch#135712; seen
with torch 2.13 on gloo). Every worker of a single-node torchrun restarts together,
so ``TORCHELASTIC_RESTART_COUNT`` is the same on all of them: a store prefixed with
it gives each attempt its own keys, and every process group (all are created
through the default group's store) inherits the prefix. Across nodes the agents'
restart counts can differ; there, run torchrun with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per attempt) instead.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["init_distributed"]


def init_distributed(backend: str, timeout_s: float) -> None:
    """``dist.init_process_group(backend)`` from torchrun's environment, one store
    namespace per restart on a single node (Note [Restarted process groups])."""
    timeout = datetime.timedelta(seconds=timeout_s)
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    single_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    if not (shared and single_node):
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"/fsdptag/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout)
