"""Debug tools: a collective counter with provenance and a live-storage tracker.

Both are ``TorchDispatchMode``s, so they see ops above every tensor subclass:
what ``torch.utils.checkpoint``'s policy sees, including ops run by a
checkpoint recompute inside backward. Unlike ``CommDebugMode`` (which counts per
module), the counter attributes each collective to the FSDP parameter or bucket
whose tag its input carries, and tells forward from backward by the autograd
engine, not by module hooks.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ._compat import (AsyncCollectiveTensor, StorageWeakRef, in_backward, storage_expired, storage_from_weak,
                      storage_use_count)
from ._param import disable_tagging
from ._partial import partial_groups
from ._prefetch import is_served
from ._tag import first_tag, innermost

__all__ = ["CollectiveCounter", "CollectiveEvent", "LiveStorageTracker", "disable_tagging"]

_f = torch.ops._c10d_functional
_c = torch.ops.c10d

# op -> (kind, index of the group argument). Functional collectives (DTensor,
# fsdptag) and the in-place c10d ops FSDP2 and DDP use.
_COLLECTIVES = {
    _f.all_gather_into_tensor.default: ("all_gather", 2),
    _f.all_gather_into_tensor_coalesced.default: ("all_gather", 2),
    _f.reduce_scatter_tensor.default: ("reduce_scatter", 3),
    _f.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", 3),
    _f.all_reduce.default: ("all_reduce", 2),
    _f.all_reduce_coalesced.default: ("all_reduce", 2),
    _f.all_to_all_single.default: ("all_to_all", 3),
    _f.broadcast.default: ("broadcast", 2),
    _c._allgather_base_.default: ("all_gather", 2),
    _c.allgather_into_tensor_coalesced_.default: ("all_gather", 2),
    _c._reduce_scatter_base_.default: ("reduce_scatter", 2),
    _c.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 2),
    _c.allreduce_.default: ("all_reduce", 1),
}


@dataclass(frozen=True)
class CollectiveEvent:
    phase: str  # "forward" or "backward" (anything run by the autograd engine)
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | broadcast
    group: str  # the mesh dim name(s) of the process group, or its group name
    fqn: str | None  # the FSDP parameter whose tag the input carried, else None
    nbytes: int  # bytes moved: the output of an all-gather, the input of anything else
    # compute ops dispatched between its issue and its wait (Note [Compute in flight]);
    # None: not waited under the counter
    compute_in_flight: int | None = None
    # collectives of its phase and kind in flight when it was issued, itself included
    in_flight_at_issue: int = 1

    @property
    def fsdp_tagged(self) -> bool:
        return self.fqn is not None

    @property
    def overlapped(self) -> bool:
        """Whether compute was queued while it was in flight (Note [Compute in flight])."""
        return bool(self.compute_in_flight)


# Note [Compute in flight]
# ------------------------
# On NCCL a functional collective runs on the communicator's stream from its issue
# until the compute stream waits for it (``wait_tensor``, or the first use of the
# AsyncCollectiveTensor DTensor wraps it in): only the compute queued in between
# hides it. The counter records, in dispatch order, each collective's issue, its
# wait, and the compute ops dispatched in between (``CollectiveEvent.
# compute_in_flight``). On CPU this is the measure that means something: gloo's
# wait blocks either way. Compute = the ops that do a model's work: matmuls,
# attention kernels, convolutions, embedding lookups, and their backward ops; not
# copies, casts, views or other collectives.
_COMPUTE_NAMES = frozenset((
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_grouped_mm", "_scaled_mm",
    "convolution", "convolution_backward", "embedding", "embedding_dense_backward",
))


def _storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, through wrappers (a collective's output is
    re-wrapped on its way to the wait)."""
    return innermost(t).untyped_storage()._cdata


def _is_compute(func) -> bool:
    name = func._opname
    return func.namespace == "aten" and (name in _COMPUTE_NAMES or "attention" in name)


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _group_name(arg) -> str:
    if isinstance(arg, str):
        return arg
    if isinstance(arg, torch.ScriptObject):  # c10d ops take a boxed ProcessGroup
        arg = torch.distributed.ProcessGroup.unbox(arg)
    return getattr(arg, "group_name", str(arg))


class CollectiveCounter(TorchDispatchMode):
    """Record every collective with its phase, process group and FSDP provenance.

    Groups are named by the mesh dims passed in ``meshes`` (``"dp"``, ``"tp"``...).

    Example::

        >>> with CollectiveCounter(mesh) as cc:
        ...     model(x).sum().backward()
        >>> print(cc.summary())
        forward  all_gather dp x4
        backward reduce_scatter dp x4
    """

    def __init__(self, meshes: DeviceMesh | Iterable[DeviceMesh] = ()) -> None:
        super().__init__()
        self.labels: dict[str, str] = {}
        for mesh in [meshes] if isinstance(meshes, DeviceMesh) else meshes:
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            for i, name in enumerate(names):
                self.labels.setdefault(mesh.get_group(i).group_name, name)
        for sub, (parent, k) in partial_groups().items():  # Note [Partial reshard]: "dp/2"
            if parent in self.labels:
                self.labels.setdefault(sub, f"{self.labels[parent]}/{k}")
        self.events: list[CollectiveEvent] = []
        self._compute = 0  # compute ops dispatched so far
        self._in_flight: dict[int, tuple[int, int]] = {}  # output's storage -> (event index, compute at issue)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_flight:
            self._note_waits(func, args, kwargs)
        if _is_compute(func):
            self._compute += 1
        spec = _COLLECTIVES.get(func)
        if spec is not None and not (args and is_served(args[0])):  # a prefetch, counted at its issue
            kind, group_idx = spec
            group = _group_name(args[group_idx] if len(args) > group_idx else kwargs.get("group_name"))
            # c10d's all-gathers and reduce-scatters take (output, input); the rest input first.
            data = args[1] if func.namespace == "c10d" and kind != "all_reduce" else args[0]
            tag = first_tag(data)
            nbytes = _tensor_bytes(data)
            if kind == "all_gather":
                nbytes = _tensor_bytes(args[0]) if func.namespace == "c10d" else nbytes * args[1]
            phase = "backward" if in_backward() else "forward"
            alongside = sum(1 for i, _ in self._in_flight.values()
                            if self.events[i].phase == phase and self.events[i].kind == kind)
            self.events.append(CollectiveEvent(
                phase,
                kind,
                self.labels.get(group, group),
                tag.fqn if tag is not None else None,
                nbytes,
                in_flight_at_issue=alongside + 1,
            ))
            out = func(*args, **kwargs)
            if func.namespace == "_c10d_functional" and isinstance(out, torch.Tensor):
                self._in_flight[_storage_key(out)] = (len(self.events) - 1, self._compute)
            elif func.namespace == "c10d":  # in-place c10d ops return a work: waited by the caller
                self._close(len(self.events) - 1, self._compute)
            return out
        return func(*args, **kwargs)

    def _note_waits(self, func, args, kwargs) -> None:
        """Close the collectives this op waits for: ``wait_tensor`` of their output, or
        any op on the AsyncCollectiveTensor that wraps it (Note [Compute in flight])."""
        if func is _WAIT:
            self._waited(args[0])
            return
        if func.is_view or func is _WRAP:  # an AsyncCollectiveTensor's views do not wait
            return
        for x in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(x, DTensor):
                x = x._local_tensor
            if isinstance(x, AsyncCollectiveTensor):
                self._waited(x.elem)

    def _waited(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        entry = self._in_flight.pop(_storage_key(t), None)
        if entry is not None:
            self._close(*entry)

    def _close(self, index: int, compute_at_issue: int) -> None:
        self.events[index] = dataclasses.replace(self.events[index],
                                                 compute_in_flight=self._compute - compute_at_issue)

    def count(self, phase: str | None = None, kind: str | None = None,
              group: str | None = None, fsdp_tagged: bool | None = None) -> int:
        """Number of recorded collectives matching every given field."""
        return sum(
            1 for e in self.events
            if (phase is None or e.phase == phase) and (kind is None or e.kind == kind)
            and (group is None or e.group == group)
            and (fsdp_tagged is None or e.fsdp_tagged == fsdp_tagged)
        )

    def max_in_flight(self, phase: str, kind: str) -> int:
        """The most collectives of ``phase`` and ``kind`` in flight at once (issued,
        not yet waited), 0 if none ran: with ``fsdptag.OverlapPolicy`` k >= 1 for all-gathers
        or reductions, k for that kind in each phase."""
        return max((e.in_flight_at_issue for e in self.events if e.phase == phase and e.kind == kind),
                   default=0)

    def summary(self) -> str:
        """One line per (phase, kind, group, tagged): stable text for expect tests."""
        counts = collections.Counter(
            (e.phase, e.kind, e.group, e.fsdp_tagged) for e in self.events
        )
        order = {"forward": 0, "backward": 1}
        lines = [
            f"{phase:<8} {kind} {group}{' [fsdp]' if tagged else ''} x{n}"
            for (phase, kind, group, tagged), n in sorted(
                counts.items(), key=lambda kv: (order[kv[0][0]], kv[0][1:])
            )
        ]
        return "\n".join(lines)

    def overlap_summary(self, fsdp_only: bool = False) -> str:
        """Per line of :meth:`summary`: how many of them had compute in flight (Note
        [Compute in flight]), e.g. ``forward  all_gather dp [fsdp] 6 of 7``; stable
        text for expect tests. ``fsdp_only``: only FSDP-tagged collectives (gradient
        reductions carry no tag: they are the ``reduce_scatter`` / ``all_reduce``
        lines of the dp groups)."""
        total, hidden = collections.Counter(), collections.Counter()
        for e in self.events:
            if fsdp_only and not e.fsdp_tagged:
                continue
            key = (e.phase, e.kind, e.group, e.fsdp_tagged)
            total[key] += 1
            hidden[key] += e.overlapped
        order = {"forward": 0, "backward": 1}
        return "\n".join(
            f"{phase:<8} {kind} {group}{' [fsdp]' if tagged else ''} {hidden[key]} of {n}"
            for key, n in sorted(total.items(), key=lambda kv: (order[kv[0][0]], kv[0][1:]))
            for phase, kind, group, tagged in [key])

    def timeline(self) -> list[str]:
        """Each collective in issue order as ``"<phase> <kind> <fqn>: <compute ops in
        flight>"`` (``-``: not waited under the counter)."""
        return [f"{e.phase} {e.kind} {e.fqn or e.group}: "
                f"{'-' if e.compute_in_flight is None else e.compute_in_flight}" for e in self.events]

    def reset(self) -> None:
        self.events.clear()
        self._in_flight.clear()


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
    if func in _COLLECTIVES or func.namespace == "_c10d_functional":
        return "collective"
    if func is _CAST:
        return "cast"
    return "other"


_WAIT = _f.wait_tensor.default
_WRAP = _f._wrap_tensor_autograd.default  # wraps an issued output: not a collective


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
        if self._settler is not None and func.namespace == "_c10d_functional" and func is not _WRAP:
            out = (self._settler.wait if func is _WAIT else self._settler.issue)(func, args, kwargs)
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
