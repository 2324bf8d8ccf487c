"""The live-storage tracker (see :mod:`fsdptag.debug`)."""

from __future__ import annotations

import collections
import gc
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._compat import StorageWeakRef, storage_expired, storage_from_weak, storage_use_count
from .._prefetch import is_served
from .._tag import first_tag, innermost
from .counter import COLLECTIVE_OPS, WAIT_OP, WRAP_OP

__all__ = ["LiveStorageTracker"]

_f = torch.ops._c10d_functional


def _plain_tensors(x, out: list) -> list:
    if isinstance(x, torch.Tensor):
        if type(x) is torch.Tensor or type(x) is torch.nn.Parameter:
            out.append(x)
        elif hasattr(x, "__tensor_flatten__"):
            names, _ = x.__tensor_flatten__()
            for n in names:
                _plain_tensors(getattr(x, n), out)
        else:
            out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _plain_tensors(y, out)
    return out


_CAST = torch.ops.aten._to_copy.default


def _storage_kind(func, out) -> str:
    """Who made a storage: an FSDP gather (tag, or FSDP2's own ops), a TP/other
    collective, an activation cast, or anything else."""
    if func.namespace == "fsdp" or first_tag(out) is not None:
        return "fsdp"
    if func in COLLECTIVE_OPS or func.namespace == "_c10d_functional":
        return "collective"
    if func is _CAST:
        return "cast"
    return "other"




class _CollectiveSettler:
    """Makes the collective layer's late frees invisible to the tracker.

    gloo completes a collective's future on its worker thread and drops the work a
    moment later; the work and its helpers hold the input and views of the output, so
    right after the wait a buffer the program no longer holds can still be alive: a
    real run's live bytes then count it or not, run to run. Two measures:

    - The input: the collective gets a copy the tracker never sees (made inside the
      mode, so untracked); the program's input lives exactly as long as the program
      holds it.
    - The output: the layer's references are counted at issue, by storage (each
      tensor or view on a storage holds one). The process group's work registry keeps
      the work, and so those views, alive until the wait: just before the real wait
      the program's own references are the current count minus the layer's. After the
      wait we poll until the count is down to the program's.

    A fake process group takes none. ``timeouts`` counts settles that gave up after
    ``timeout_s``: a broken assumption, not a loaded machine (the tests pin it at 0).
    """

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.pending: dict[int, int] = {}  # id(output) -> storage references the layer took
        self.timeouts = 0
        self._one = storage_use_count(torch.empty(0))  # a storage only its tensor holds

    def issue(self, func, args, kwargs):
        if args and isinstance(args[0], torch.Tensor) and (innermost(args[0]).is_cuda or is_served(args[0])):
            return func(*args, **kwargs)  # NCCL: nothing to settle (LiveStorageTracker's docstring);
            # a prefetched all-gather answered: settled at its issue
        if args and isinstance(args[0], torch.Tensor) and not func._schema.is_mutable:
            args = (_detached_copy(args[0]),) + tuple(args[1:])  # (in-place ones write it)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            inner = innermost(out)
            # The program holds one new tensor on the output's storage; the rest is the layer's.
            self.pending[id(inner)] = storage_use_count(inner) - self._one
        return out

    def wait(self, func, args, kwargs):
        t = innermost(args[0])
        taken = self.pending.pop(id(t), None)
        if taken is None:
            return func(*args, **kwargs)
        own = storage_use_count(t) - taken
        out = func(*args, **kwargs)  # (returns t itself, wrapped as args[0] was: no new reference)
        deadline = time.perf_counter() + self.timeout_s
        while storage_use_count(t) > own:
            if time.perf_counter() > deadline:
                self.timeouts += 1
                break
            time.sleep(0)
        return out


def _detached_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its own storage, rebuilt through tensor-subclass wrappers
    (``__tensor_flatten__``) so the op dispatches to them as it would have."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t.detach().clone()
    names, ctx = t.__tensor_flatten__()
    inner = {name: _detached_copy(getattr(t, name)) for name in names}
    return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())


class LiveStorageTracker(TorchDispatchMode):
    """Track the storages that ops under this mode create (and, optionally, read).

    ``live_bytes()`` is the current size of those still alive; ``snapshot()`` and
    ``kept()`` split what forward keeps for backward by who made each storage
    (see :func:`_storage_kind`). Run a forward
    under the tracker and read it before backward for the bytes allocated in
    forward and kept for backward. With ``track_inputs=True`` storages that
    already existed (parameters, FSDP2's resizable unsharded buffers) count too:
    then take the difference between the end of forward and after backward.
    ``track_peak=True`` keeps ``peak_bytes``, the most live bytes after any op
    (O(live storages) per op). ``settle_collectives=True`` (for gloo process groups)
    waits after each functional collective's wait until the collective layer has
    released its buffers, so that peaks do not depend on its thread's timing. On CUDA
    a wait returns before the GPU is done and NCCL frees on its own thread, so CUDA
    tensors are not settled; there ``allocator_peak_bytes`` is the CUDA caching
    allocator's peak while the tracker was entered, above what was allocated at entry
    (``torch.cuda.max_memory_allocated``), the figure FSDP2 users compare (None on CPU).

    Works on real and fake tensors (``FakeTensorMode``).

    Example::

        >>> with LiveStorageTracker() as mem:
        ...     loss = model(x).sum()
        >>> mem.live_bytes()
    """

    def __init__(self, track_inputs: bool = False, track_peak: bool = False,
                 settle_collectives: bool = False) -> None:
        super().__init__()
        self.track_inputs = track_inputs
        self.track_peak = track_peak
        self._settler = _CollectiveSettler() if settle_collectives else None
        self.peak_bytes = 0
        # storage key -> [weak ref, bytes when last looked, kind]; FSDP2 resizes its
        # buffers in place, so storages FSDP2's ops touch are re-measured each time.
        self._storages: dict[int, list] = {}
        self._resizable: set[int] = set()
        self._cuda_base: int | None = None

    def __enter__(self):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_base = torch.cuda.memory_allocated()
        return super().__enter__()

    @property
    def allocator_peak_bytes(self) -> int | None:
        """The CUDA caching allocator's peak since entering, above its entry (None on CPU)."""
        if self._cuda_base is None:
            return None
        return torch.cuda.max_memory_allocated() - self._cuda_base

    def _track(self, x, kind: str) -> bool:
        """Register the storages in ``x``; True if any was new."""
        added = False
        for t in _plain_tensors(x, []):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            known = self._storages.get(key)
            if known is None or known[0].expired():  # addresses are reused after frees
                self._storages[key] = [StorageWeakRef(storage), storage.nbytes(), kind]
                added = True
            elif kind == "fsdp":
                known[2] = "fsdp"
            if kind == "fsdp":
                self._resizable.add(key)
        return added

    def track_existing(self, tensors) -> None:
        """Count storages that already exist (parameters, optimizer state) from now on."""
        self._track(list(tensors), "input")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._settler is not None and func.namespace == "_c10d_functional" and func is not WRAP_OP:
            out = (self._settler.wait if func is WAIT_OP else self._settler.issue)(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        kind = _storage_kind(func, out)
        # Views and in-place ops return storages that already existed: not allocations.
        fresh = not (func.is_view or func._schema.is_mutable)
        added = self._track(out, kind) if fresh else False
        if self.track_inputs or func.namespace == "fsdp":
            self._track((args, tuple(kwargs.values())), kind if func.namespace == "fsdp" else "input")
            added = added or func.namespace == "fsdp"  # FSDP2 grows its buffers in place
        if self.track_peak and added:  # the live total only rises when something is allocated
            self.peak_bytes = max(self.peak_bytes, self._total())
        return out

    def _total(self) -> int:
        # The hot loop of peak tracking: call the C expiry check directly, drop the dead.
        total, dead, expired = 0, [], storage_expired
        for key, entry in self._storages.items():
            if expired(entry[0].cdata):
                dead.append(key)
                continue
            if key in self._resizable:
                entry[1] = storage_from_weak(entry[0].cdata).nbytes()
            total += entry[1]
        for key in dead:
            del self._storages[key]
            self._resizable.discard(key)
        return total

    def snapshot(self) -> dict[int, tuple]:
        """The live tracked storages now: {identity: (bytes, kind, entry)}, for :meth:`kept`.

        Holding the entry keeps its identity from being reused by a later storage.
        """
        gc.collect()
        self._total()  # drops the dead, refreshes resizable sizes
        return {id(entry): (entry[1], entry[2], entry) for entry in self._storages.values()}

    @staticmethod
    def kept(before: dict, after: dict) -> dict[str, int]:
        """Bytes, by kind, that storages alive in ``before`` released by ``after``.

        With ``before`` taken at the end of forward and ``after`` after backward, this
        is what forward kept for backward; storages created in between (gradients)
        do not count.
        """
        out: dict[str, int] = collections.Counter()
        for ident, (nbytes, kind, _) in before.items():
            out[kind] += nbytes - after.get(ident, (0,))[0]
        return dict(out)

    @property
    def settle_timeouts(self) -> int:
        """Collective settles that gave up (0 unless an assumption of the settle broke)."""
        return self._settler.timeouts if self._settler is not None else 0

    def live_bytes(self) -> int:
        """Bytes of the tracked storages still alive (after a ``gc.collect``)."""
        gc.collect()
        return self._total()
