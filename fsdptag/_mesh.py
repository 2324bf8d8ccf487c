"""The data-parallel mesh and mode, decided once at ``parametrize`` from the user's mesh
(or meshes, Note [Meshes per module]) and the parameters' TP meshes: which dims shard
(FSDP), replicate (DDP) or both (HSDP), and how a TP parameter's mesh joins the
data-parallel one.

Note [Meshes per module]
------------------------
``parametrize(model, {"": mesh, "layers.0.moe.experts": expert_mesh, ...})`` gives the
parameters under a module (longest prefix wins) their own mesh, as FSDP2 users call
``fully_shard(experts, mesh=edp_mesh)`` before ``fully_shard(block, mesh=dp_mesh)``.
This is expert parallelism's layout (torchtitan's ``efsdp`` x ``ep``): experts are
sharded over EP by ``parallelize_module`` and over the data-parallel dims EP leaves
by fsdptag, dense parameters over all of data parallel. Each mesh is resolved as a
single one is (its parameters' TP / EP dims are not data parallel; the rest is) into
a :class:`MeshGroup`; every group must span as many ranks (its data-parallel size
times its parameters' other dims), or some ranks would average apart. A bucket holds
one group's parameters (one collective, one process group). Gradients are averaged
over the *model's* data-parallel ranks, the ``""`` mesh's: an expert's gradient
already sums its EP ranks' tokens through the all-to-all's backward, so its own
reduce-scatter sums over fewer ranks than it is averaged over (``divide``, Note
[Gradient reduction] in ``_collectives.py``), as torchtitan sets FSDP2's
``gradient_divide_factor``. ``gradient_divide_factor`` overrides the divisor for
every group (torchtitan divides its loss by the global token count and wants 1.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from ._api import DataParallelMode
from ._compat import StridedShard, concatenate_meshes

__all__ = ["MeshGroup", "check_devices", "concatenate_dp_tp", "dp_mesh_of", "mesh_groups", "mode_for", "parse_mode",
           "strided_if_needed", "tp_dim_names"]


@dataclass(frozen=True)
class MeshGroup:
    """The data-parallel part of one mesh ``parametrize`` was given (Note [Meshes per module])."""

    prefix: str  # the module FQN prefix it was given for ("": the model's)
    dp_mesh: DeviceMesh
    divide: float | None  # what its gradients' sum is divided by, where not its own size

    @property
    def variant(self) -> str:
        """What tells its buckets from another group's under one bucket root."""
        return f"[{','.join(self.dp_mesh.mesh_dim_names or ('mesh',))}]" if self.prefix else ""


def mesh_groups(model, mesh, params, mode, gradient_divide_factor):
    """``(mode, group_of(module_fqn) -> MeshGroup)`` for one mesh or a dict of
    module-FQN prefixes to meshes (``""``: the rest), checked (Note [Meshes per module])."""
    meshes = _meshes(model, mesh)
    ordered = sorted(meshes, key=len, reverse=True)

    def prefix_of(fqn: str) -> str:
        return next(p for p in ordered if p == "" or fqn == p or fqn.startswith(p + "."))

    check_devices(params, meshes[""])
    modes, groups, spans = {}, {}, {}
    for prefix, m in meshes.items():
        own = [p for p in params if prefix_of(p[0]) == prefix]
        if not own:
            raise ValueError(f"mesh[{prefix!r}] has no parameters to shard (nearer prefixes take them all); "
                             "drop it from the dict")
        tp_names = tp_dim_names(own)
        dp = dp_mesh_of(m, tp_names)
        modes[prefix] = mode_for(dp, mode, tp_names)
        tp_size = math.prod(_dim_size(own, n) for n in tp_names)
        spans[prefix] = dp.size() * tp_size
        groups[prefix] = dp
    if len(set(modes.values())) > 1:
        raise ValueError(
            f"the meshes give different data-parallel modes { {p or '<root>': m.value for p, m in modes.items()} }; "
            "give every mesh as many data-parallel dims, or pass mode=")
    if len(set(spans.values())) > 1:
        raise ValueError(
            f"the meshes span different numbers of ranks (data-parallel x TP / EP dims) "
            f"{ {p or '<root>': s for p, s in spans.items()} }; each module's mesh must cover the model's ranks, "
            "e.g. experts over mesh[('efsdp', 'ep')] with 'ep' on the expert parameters (parallelize_module first)")
    world = groups[""].size()
    out = {prefix: MeshGroup(prefix, dp, gradient_divide_factor if gradient_divide_factor is not None
                             else float(world) if dp.size() != world else None)
           for prefix, dp in groups.items()}
    return modes[""], lambda fqn: out[prefix_of(fqn)]


def _meshes(model, mesh) -> dict[str, DeviceMesh]:
    if isinstance(mesh, DeviceMesh):
        return {"": mesh}
    if not isinstance(mesh, Mapping):
        raise TypeError(f"mesh must be a DeviceMesh or a dict of module-FQN prefixes to DeviceMeshes, got "
                        f"{type(mesh).__name__}; use init_device_mesh")
    names = {fqn for fqn, _ in model.named_modules()}
    for prefix, m in mesh.items():
        if not isinstance(m, DeviceMesh):
            raise TypeError(f"mesh[{prefix!r}] must be a DeviceMesh, got {type(m).__name__}")
        if prefix != "" and prefix not in names:
            raise ValueError(f"mesh names module {prefix!r}, which is not in the model; use module FQNs "
                             "from model.named_modules() (\"\" for the rest of the model)")
    if "" not in mesh:
        raise ValueError("a dict of meshes needs the model's own under \"\" (the data-parallel mesh of "
                         "every parameter no other prefix names)")
    if len({m.device_type for m in mesh.values()}) > 1:
        raise ValueError(f"the meshes are on several device types { {p: m.device_type for p, m in mesh.items()} }; "
                         "build them all on the parameters' device")
    return dict(mesh)


def _dim_size(params, name: str) -> int:
    for *_, p in params:
        if isinstance(p, DTensor) and name in (p.device_mesh.mesh_dim_names or ()):
            return p.device_mesh.size(p.device_mesh.mesh_dim_names.index(name))
    return 1


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
            "init_device_mesh, e.g. mesh = init_device_mesh(..., mesh_dim_names=('dp', 'tp')); for "
            f"expert parallelism give its module a mesh of its own that holds {tp_mesh.mesh_dim_names}: "
            "mesh={'': dp_mesh, '<experts module>': sparse_mesh[('efsdp', 'ep')]} (Note [Meshes per module])"
        ) from None


def strided_if_needed(dp: Placement, tp_mesh: DeviceMesh, tp_placements) -> Placement:
    """FSDP shards the TP-local tensor; when TP already shards that dim, say so."""
    if not isinstance(dp, Shard):
        return dp
    split = math.prod(
        tp_mesh.size(i) for i, p in enumerate(tp_placements) if isinstance(p, Shard) and p.dim == dp.dim
    )
    return StridedShard(dp.dim, split_factor=split) if split > 1 else dp
