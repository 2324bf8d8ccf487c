"""The data-parallel mesh and mode, decided once at ``parametrize`` from the user's mesh
and the parameters' TP meshes: which dims shard (FSDP), replicate (DDP) or both (HSDP),
and how a TP parameter's mesh joins the data-parallel one."""

from __future__ import annotations

import math

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from ._api import DataParallelMode
from ._compat import StridedShard, concatenate_meshes

__all__ = ["check_devices", "concatenate_dp_tp", "dp_mesh_of", "mode_for", "parse_mode", "strided_if_needed",
           "tp_dim_names"]


def parse_mode(mode) -> DataParallelMode:
    if isinstance(mode, DataParallelMode):
        return mode
    try:
        return DataParallelMode(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in DataParallelMode)
        raise ValueError(f"unknown mode={mode!r}; use one of {choices}") from None


def check_devices(params, mesh: DeviceMesh) -> None:
    devices = sorted({p.device.type for *_, p in params})
    if len(devices) > 1:
        where = {d: next(f"{m}.{n}".lstrip(".") for m, _, n, p in params if p.device.type == d)
                 for d in devices}
        raise ValueError(
            f"parameters are on several device types {where}; move the whole model to one device "
            f"(model.to({mesh.device_type!r}), or build it all under torch.device('meta')) before parametrize"
        )
    if devices[0] not in ("meta", mesh.device_type):
        raise ValueError(
            f"parameters are on {devices[0]!r} but the mesh is on {mesh.device_type!r}; move the "
            f"model with model.to({mesh.device_type!r}) or build the mesh on the parameters' device"
        )


def tp_dim_names(params) -> tuple[str, ...]:
    meshes = {p.device_mesh for *_, p in params if isinstance(p, DTensor)}
    names: list[str] = []
    for m in meshes:
        if m.mesh_dim_names is None:
            raise ValueError("TP parameters live on a mesh without dim names; name its dims")
        names += [n for n in m.mesh_dim_names if n not in names]
    return tuple(names)


def dp_mesh_of(mesh: DeviceMesh, tp_names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` without the dims TP parameters use."""
    names = mesh.mesh_dim_names or ()
    if not any(n in names for n in tp_names):
        return mesh
    dp_names = tuple(n for n in names if n not in tp_names)
    if not dp_names:
        raise ValueError(
            f"mesh dims {names} are all TP dims; pass a mesh that also has the data-parallel dim(s)"
        )
    return mesh[dp_names]


def mode_for(dp_mesh: DeviceMesh, mode: DataParallelMode | None, tp_names: tuple[str, ...]) -> DataParallelMode:
    """The explicit ``mode`` checked against the data-parallel mesh, or the default:
    one dim -> fully_shard, two -> hybrid_shard (replicate over dim 0, shard over dim 1)."""
    names = dp_mesh.mesh_dim_names
    if mode is None:
        unused_tp = [n for n in names or () if "tp" in n.lower().split("_")]
        if unused_tp:
            raise ValueError(
                f"mesh dim {unused_tp[0]!r} looks like a TP dim but no parameter is on it; "
                "call parallelize_module on the TP sub-mesh first, or pass mode='fully_shard' / "
                "'hybrid_shard' / 'replicate' to data-parallelize over it"
            )
        if dp_mesh.ndim in (1, 2):
            return DataParallelMode.FULLY_SHARD if dp_mesh.ndim == 1 else DataParallelMode.HYBRID_SHARD
        raise ValueError(
            f"data-parallel mesh has {dp_mesh.ndim} dims {names or ''}; pass a 1D mesh "
            "(mode='fully_shard' or 'replicate') or a 2D (replicate, shard) mesh (mode='hybrid_shard')"
            + (f", e.g. mesh[{names[-2:]!r}]" if names else "")
        )
    if dp_mesh.ndim != mode.mesh_ndim:
        fix = (
            f"use mode='hybrid_shard' or pass one dim, e.g. mesh[{names[-1]!r}]"
            if dp_mesh.ndim > mode.mesh_ndim and names
            else "use mode='hybrid_shard' or pass a 1D sub-mesh"
            if dp_mesh.ndim > mode.mesh_ndim
            else "pass a 2D mesh (replicate, shard) or use mode='fully_shard'"
        )
        raise ValueError(
            f"data-parallel mesh has {dp_mesh.ndim} dim(s) {names or ''} but "
            f"mode={mode.value!r} needs {mode.mesh_ndim}; {fix}"
        )
    return mode


def concatenate_dp_tp(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    try:
        return concatenate_meshes([dp_mesh, tp_mesh])
    except RuntimeError as e:
        if "different device mesh" not in str(e) and "overlapping" not in str(e):
            raise
        raise ValueError(
            f"TP parameter {fqn!r} lives on mesh {tp_mesh}, which is not a sub-mesh of the "
            f"device mesh the data-parallel mesh {dp_mesh} comes from; build both from one "
            "init_device_mesh, e.g. mesh = init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        ) from None


def strided_if_needed(dp: Placement, tp_mesh: DeviceMesh, tp_placements) -> Placement:
    """FSDP shards the TP-local tensor; when TP already shards that dim, say so."""
    if not isinstance(dp, Shard):
        return dp
    split = math.prod(
        tp_mesh.size(i) for i, p in enumerate(tp_placements) if isinstance(p, Shard) and p.dim == dp.dim
    )
    return StridedShard(dp.dim, split_factor=split) if split > 1 else dp
