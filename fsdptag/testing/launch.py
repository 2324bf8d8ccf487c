"""Run a function on several local ranks (spawned processes, gloo on CPU).

Used by the tests, the benchmark and the estimator's validation; also handy for
trying fsdptag without torchrun.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _worker(rank: int, world_size: int, init_file: str, out_file: str, fn: Callable, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        result = fn(*args)
        if rank == 0:
            with open(out_file, "wb") as f:
                pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: C++ threads still owned by objects that outlive the
    # process group (autograd, gloo) are sometimes destroyed while joinable there,
    # which aborts the process ("terminate called without an active exception")
    # after its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return rank 0's (picklable) result.

    ``fn`` must be importable (a module-level function): it is pickled into
    spawned processes. An exception on any rank fails with that rank's traceback.

    Example::

        >>> def work():
        ...     return torch.distributed.get_world_size()
        >>> fsdptag.launch.spawn(2, work)
        2
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.pkl")
        mp.start_processes(
            _worker, args=(world_size, init_file, out_file, fn, args), nprocs=world_size,
            start_method="spawn",
        )
        with open(out_file, "rb") as f:
            return pickle.load(f)
