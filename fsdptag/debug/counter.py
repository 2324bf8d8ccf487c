"""The collective counter (see :mod:`fsdptag.debug`)."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .._compat import AsyncCollectiveTensor, in_backward, local_of
from .._partial import partial_groups
from .._prefetch import is_served
from .._tag import first_tag, innermost

__all__ = ["CollectiveCounter", "CollectiveEvent"]

_f = torch.ops._c10d_functional
_c = torch.ops.c10d

# op -> (kind, index of the group argument). Functional collectives (DTensor,
# fsdptag) and the in-place c10d ops FSDP2 and DDP use.
COLLECTIVE_OPS = {
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
WAIT_OP = _f.wait_tensor.default
WRAP_OP = _f._wrap_tensor_autograd.default  # wraps an issued output: not a collective


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
        spec = COLLECTIVE_OPS.get(func)
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
            self._issued(len(self.events) - 1)
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
        if func is WAIT_OP:
            self._waited(args[0])
            return
        if func.is_view or func is WRAP_OP:  # an AsyncCollectiveTensor's views do not wait
            return
        for x in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(x, DTensor):
                x = local_of(x)
            if isinstance(x, AsyncCollectiveTensor):
                self._waited(x.elem)

    def _waited(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        entry = self._in_flight.pop(_storage_key(t), None)
        if entry is not None:
            self._close(*entry)

    def _issued(self, index: int) -> None:
        """Called when ``events[index]`` is issued, before it runs (a subclass's hook)."""

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
