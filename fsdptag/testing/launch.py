"""Run a function on several local ranks (spawned processes): gloo on CPU, or NCCL
with one GPU per rank (``device="cuda"``).

Used by the tests, the benchmarks and the estimator's validation; also handy for
trying fsdptag without torchrun. Every rank's result comes back (``all_ranks=True``),
and collectives time out after ``timeout_s`` so a rank out of step fails in seconds.
Inside ``fn``, :func:`rank_device` is the device this rank computes on.
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

__all__ = ["rank_device", "spawn"]

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def rank_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, timeout_s: float,
            device: str, fn: Callable, args) -> None:
    fault_dir = os.environ.get("FSDPTAG_FAULT_DIR")  # a crash (SIGSEGV) writes every thread's stack
    faulthandler.enable(open(os.path.join(fault_dir, f"fault{rank}"), "w") if fault_dir else sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        _BACKENDS[device], init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": torch.device("cuda", rank)} if device == "cuda" else {}),
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
          timeout_s: float = 300.0, device: str = "cpu") -> Any:
    """Run ``fn(*args)`` on ``world_size`` ranks (``device="cpu"``: gloo; ``"cuda"``:
    NCCL, rank ``r`` on GPU ``r``); return rank 0's (picklable) result, or with
    ``all_ranks=True`` the list of every rank's.

    ``fn`` must be importable (a module-level function): it is pickled into
    spawned processes. An exception escaping ``fn`` on any rank fails with that
    rank's traceback; ``timeout_s`` bounds each collective.

    Example::

        >>> def work():
        ...     return torch.distributed.get_rank()
        >>> fsdptag.testing.launch.spawn(2, work, all_ranks=True)
        [0, 1]
    """
    if device not in _BACKENDS:
        raise ValueError(f"device={device!r}; use 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank)")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} ranks need {world_size} GPUs, {torch.cuda.device_count()} visible; "
                         "use fewer ranks or device='cpu'")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(
            _worker, args=(world_size, init_file, tmp, timeout_s, device, fn, args), nprocs=world_size,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results if all_ranks else results[0]
