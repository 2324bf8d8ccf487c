"""Debug tools: a collective counter with provenance and a live-storage tracker.

Both are ``TorchDispatchMode``s, so they see ops above every tensor subclass:
what ``torch.utils.checkpoint``'s policy sees, including ops run by a
checkpoint recompute inside backward (where ``CommDebugMode`` can fail).
"""

from __future__ import annotations

import collections
import gc
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ._tag import is_fsdp_tagged

__all__ = ["CollectiveCounter", "CollectiveEvent", "LiveStorageTracker"]

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
    fsdp_tagged: bool  # the input carried an FSDP tag
    nbytes: int  # bytes of the collective's input


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _group_name(arg) -> str:
    if isinstance(arg, str):
        return arg
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
        self.events: list[CollectiveEvent] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _COLLECTIVES.get(func)
        if spec is not None:
            kind, group_idx = spec
            group = _group_name(args[group_idx] if len(args) > group_idx else kwargs.get("group_name"))
            self.events.append(CollectiveEvent(
                "backward" if torch._C._current_graph_task_id() != -1 else "forward",
                kind,
                self.labels.get(group, group),
                is_fsdp_tagged(args[0]) or (
                    isinstance(args[0], (list, tuple)) and any(map(is_fsdp_tagged, args[0]))
                ),
                _tensor_bytes(args[0] if kind != "all_gather" or func.namespace == "_c10d_functional"
                              else args[1]),
            ))
        return func(*args, **kwargs)

    def count(self, phase: str | None = None, kind: str | None = None,
              group: str | None = None, fsdp_tagged: bool | None = None) -> int:
        """Number of recorded collectives matching every given field."""
        return sum(
            1 for e in self.events
            if (phase is None or e.phase == phase) and (kind is None or e.kind == kind)
            and (group is None or e.group == group)
            and (fsdp_tagged is None or e.fsdp_tagged == fsdp_tagged)
        )

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

    def reset(self) -> None:
        self.events.clear()


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


class LiveStorageTracker(TorchDispatchMode):
    """Track the storages created by ops run under this mode (through subclasses).

    ``live_bytes()`` is the total size of those still alive: run a forward under
    the tracker and read it before backward to get the bytes kept for backward.

    Example::

        >>> with LiveStorageTracker() as mem:
        ...     loss = model(x).sum()
        >>> mem.live_bytes()
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _plain_tensors(out, []):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            known = self._storages.get(key)
            if known is None or known[0].expired():  # addresses are reused after frees
                self._storages[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        """Bytes of tracked storages that are still alive (after a ``gc.collect``)."""
        gc.collect()
        alive = {k: v for k, v in self._storages.items() if not v[0].expired()}
        self._storages = alive
        return sum(nbytes for _, nbytes in alive.values())
