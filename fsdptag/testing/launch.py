"""Run a function on several local ranks (spawned processes, gloo on CPU).

Used by the tests, the benchmark and the estimator's validation; also handy for
trying fsdptag without torchrun. Every rank's result comes back (``all_ranks=True``),
and collectives time out after ``timeout_s`` so a rank out of step fails in seconds.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, timeout_s: float,
            fn: Callable, args) -> None:
    fault_dir = os.environ.get("FSDPTAG_FAULT_DIR")  # a crash (SIGSEGV) writes every thread's stack
    faulthandler.enable(open(os.path.join(fault_dir, f"fault{rank}"), "w") if fault_dir else sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(*args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: C++ threads still owned by objects that outlive the
    # process group (autograd, gloo) are sometimes destroyed while joinable there,
    # which aborts the process ("terminate called without an active exception")
    # after its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world_size: int, fn: Callable[..., Any], *args: Any, all_ranks: bool = False,
          timeout_s: float = 300.0) -> Any:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return rank 0's (picklable)
    result, or with ``all_ranks=True`` the list of every rank's.

    ``fn`` must be importable (a module-level function): it is pickled into
    spawned processes. An exception escaping ``fn`` on any rank fails with that
    rank's traceback; ``timeout_s`` bounds each collective.

    Example::

        >>> def work():
        ...     return torch.distributed.get_rank()
        >>> fsdptag.testing.launch.spawn(2, work, all_ranks=True)
        [0, 1]
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(
            _worker, args=(world_size, init_file, tmp, timeout_s, fn, args), nprocs=world_size,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results if all_ranks else results[0]
