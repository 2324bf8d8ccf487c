"""Launch a function on several gloo ranks (spawned processes) and collect rank 0's result.

Starting ranks costs seconds, so tests run many cases per launch: the worker
returns a dict of results and the pytest functions assert on its entries.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, out_file: str, fn: Callable) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        result = fn()
        if rank == 0:
            with open(out_file, "wb") as f:
                pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(world_size: int, fn: Callable[[], Any]) -> Any:
    """Run ``fn()`` on ``world_size`` gloo ranks; return rank 0's (picklable) result.

    ``fn`` must be a module-level function (it is pickled into spawned processes).
    An exception on any rank fails the launch with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.pkl")
        mp.start_processes(
            _worker, args=(world_size, init_file, out_file, fn), nprocs=world_size,
            start_method="spawn",
        )
        with open(out_file, "rb") as f:
            return pickle.load(f)
