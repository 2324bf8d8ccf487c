"""An emulated slow link: every collective completes no earlier than its bytes over a
bandwidth after its issue, so that on CPU ranks the communication a runtime leaves
exposed shows in its step time (``benchmarks/overlap.py``).

On gloo a wait blocks the CPU for as long as the transfer takes, and the transfer of
two ranks on one machine is a memory copy: a runtime that issues early and waits late
cannot be told from one that waits at once. :class:`SlowLink` adds what a network
would: the rank's link carries one collective at a time, each for ``latency_s +
bytes / bandwidth``, starting at its issue or when the previous one is done; a wait
for it returns no earlier than then (the emulated transfer is a deadline, not work, so
the CPU computes meanwhile). Bytes: an all-gather's output, anything else's input (as
``CollectiveCounter`` counts them). It serves both ways collectives are issued:

* functional collectives (fsdptag, DTensor): a dispatch mode sees the issue and the
  wait (``wait_tensor``, or the first use of the AsyncCollectiveTensor that wraps the
  output);
* ``torch.distributed``'s c10d calls (FSDP2, DDP): ``all_gather_into_tensor`` /
  ``all_gather_single``, ``reduce_scatter_tensor`` / ``reduce_scatter_single`` and
  ``all_reduce`` are wrapped while the link is entered: a synchronous call returns at
  the deadline, an ``async_op=True`` work's ``wait()`` does.

``stalled_s`` is the time waits spent past the real collective's completion: the
exposed communication as the link saw it. The link is a dispatch mode, which costs
Python time per op: compare step times with ``SlowLink(float("inf"))`` (no delay), not
with no link. Not a model of NCCL's streams: it measures
what the issue and wait order of a runtime leaves exposed on the CPU. FSDP2's overlap
on a GPU comes from CUDA streams (its "synchronous" collectives do not block the CPU
there); on CPU its collectives block at the call, so this link exposes them fully.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .._prefetch import is_served

__all__ = ["SlowLink"]

_f = torch.ops._c10d_functional
_ISSUES = {
    _f.all_gather_into_tensor.default: "all_gather",
    _f.reduce_scatter_tensor.default: "reduce_scatter",
    _f.all_reduce.default: "all_reduce",
    _f.all_to_all_single.default: "all_to_all",
}
_WAIT = _f.wait_tensor.default
_WRAP = _f._wrap_tensor_autograd.default
_C10D = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
         "all_reduce")


def _inner(t: torch.Tensor) -> torch.Tensor:
    while True:
        if isinstance(t, DTensor):
            t = t._local_tensor
        elif isinstance(t, AsyncCollectiveTensor):
            t = t.elem
        elif hasattr(t, "_elem"):  # fsdptag's tagged tensors
            t = t._elem
        else:
            return t


def _key(t: torch.Tensor) -> int:
    return _inner(t).untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _SlowWork:
    """An ``async_op=True`` work whose ``wait()`` returns at the link's deadline."""

    def __init__(self, work, link: SlowLink, deadline: float) -> None:
        self._work, self._link, self._deadline = work, link, deadline

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._link._stall_until(self._deadline)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


class SlowLink(TorchDispatchMode):
    """Collectives entered under it complete no earlier than ``latency_s + bytes /
    bandwidth`` after their issue, one at a time per rank (module docstring).

    Example::

        >>> with SlowLink(bandwidth=1e9) as link:
        ...     model(x).sum().backward()
        >>> link.stalled_s  # exposed communication
    """

    def __init__(self, bandwidth: float, latency_s: float = 0.0) -> None:
        super().__init__()
        if not bandwidth > 0:
            raise ValueError(f"bandwidth={bandwidth!r} must be positive (bytes per second; inf: no delay)")
        self.bandwidth, self.latency_s = bandwidth, latency_s
        self.busy_until = 0.0  # when the link is done with what it carries
        self.stalled_s = 0.0
        self.sent_bytes = 0
        self._deadlines: dict[int, float] = {}
        self._patched: dict = {}

    def _issue(self, nbytes: int) -> float:
        now = time.perf_counter()
        self.busy_until = max(now, self.busy_until) + self.latency_s + nbytes / self.bandwidth
        self.sent_bytes += nbytes
        return self.busy_until

    def _stall_until(self, deadline: float) -> None:
        left = deadline - time.perf_counter()
        if left > 0:
            self.stalled_s += left
            time.sleep(left)

    # ------------------------------------------------------------ functional collectives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._deadlines:
            self._before(func, args, kwargs)
        kind = _ISSUES.get(func)
        if kind is not None and args and is_served(args[0]):
            kind = None  # fsdptag's prefetched all-gather answering its bucket: sent at its issue
        out = func(*args, **kwargs)
        if kind is not None and isinstance(out, torch.Tensor):
            nbytes = _nbytes(out) if kind == "all_gather" else _nbytes(args[0])
            self._deadlines[_key(out)] = self._issue(nbytes)
        elif func is _WAIT:
            self._waited(args[0])
        return out

    def _before(self, func, args, kwargs) -> None:
        """An op that waits for an issued output (other than ``wait_tensor``, handled
        after it ran): the first use of its AsyncCollectiveTensor."""
        if func is _WAIT or func.is_view or func is _WRAP:
            return
        for x in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(x, DTensor):
                x = x._local_tensor
            if isinstance(x, AsyncCollectiveTensor):
                self._waited(x)

    def _waited(self, t) -> None:
        if isinstance(t, torch.Tensor):
            deadline = self._deadlines.pop(_key(t), None)
            if deadline is not None:
                self._stall_until(deadline)

    # ------------------------------------------------------------ c10d calls

    def __enter__(self):
        for name in _C10D:
            original = getattr(dist, name, None)
            if original is not None:
                self._patched[name] = original
                setattr(dist, name, self._wrap_c10d(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(dist, name, original)
        self._patched = {}
        return super().__exit__(*exc)

    def _wrap_c10d(self, name: str, original):
        gathers = name.startswith("all_gather")

        def call(*args, **kwargs):
            async_op = kwargs.get("async_op", False)
            tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
                v for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
            # (output, input) for gathers and scatters; all_reduce: the tensor
            data = tensors[0] if gathers or name == "all_reduce" else tensors[-1]
            deadline = self._issue(_nbytes(data))
            work = original(*args, **kwargs)
            if async_op and work is not None:
                return _SlowWork(work, self, deadline)
            self._stall_until(deadline)
            return work

        return call
