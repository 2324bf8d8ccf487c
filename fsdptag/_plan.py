"""Validation and planning for ``fsdptag.parametrize``: everything before the model changes.

``plan_parametrization`` checks every argument, resolves the per-module reshard and
bucket choices, and computes the new sharded parameters (and buckets bound to
them) without touching the model, so a bad call raises with the model unchanged.
``parametrize`` then applies the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ._bucket import Bucket
from ._parametrize import DataParallelMode, MixedPrecisionPolicy, ReshardPolicy, _ParamAccess, is_parametrized
from ._tag import FSDPTag


@dataclass
class _Plan:
    mp: MixedPrecisionPolicy
    modules: list  # (module, param names, accesses, new sharded parameters)
    accesses: dict  # fqn -> (module, name, _ParamAccess)
    buckets: list  # (root module, tuple of Buckets: one per parameter dtype)


def plan_parametrization(model, mesh, mode, reshard_after_forward, mp_policy, shard_dim, bucket) -> _Plan:
    """Validate everything and compute the sharded parameters, without touching ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"parametrize expects an nn.Module, got {type(model).__name__}")
    if is_parametrized(model):
        user_cls = next(c for c in type(model).__mro__ if "_fsdptag_generated" not in c.__dict__)
        raise ValueError(
            f"{user_cls.__name__} is already parametrized by fsdptag; call "
            "fsdptag.parametrize once, on the root module"
        )
    mode = _parse_mode(mode)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}; use init_device_mesh")
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be fsdptag.MixedPrecisionPolicy, got {type(mp).__name__}")
    if not isinstance(shard_dim, int) or isinstance(shard_dim, bool) or shard_dim < 0:
        raise ValueError(f"shard_dim={shard_dim!r} must be a non-negative int")
    reshard_of = _reshard_resolver(model, reshard_after_forward)
    is_root = _bucket_roots(bucket, model)

    params = [(mfqn, m, n, p) for mfqn, m in model.named_modules()
              for n, p in m.named_parameters(recurse=False)]
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters to parametrize")
    _check_devices(params, mesh)
    tp_names = _tp_dim_names(params)
    dp_mesh = _dp_mesh(mesh, mode, tp_names)

    dp_placements: tuple[Placement, ...] = {
        DataParallelMode.REPLICATE: (Replicate(),),
        DataParallelMode.FULLY_SHARD: (Shard(shard_dim),),
        DataParallelMode.HYBRID_SHARD: (Replicate(), Shard(shard_dim)),
    }[mode]

    modules: dict[int, tuple] = {}
    accesses: dict[str, tuple] = {}
    seen: dict[int, str] = {}  # id(param) -> its first FQN
    sharded_of: dict[str, nn.Parameter] = {}
    roots = {fqn: m for fqn, m in model.named_modules() if is_root(fqn, m)}
    bucket_entries: dict[str, list] = {}
    for mfqn, module, name, param in params:
        fqn = f"{mfqn}.{name}" if mfqn else name
        if id(param) in seen:  # tied weights: one stored parameter, one access, one tag
            first = seen[id(param)]
            entry = modules.setdefault(id(module), (module, [], [], []))
            entry[1].append(name)
            entry[2].append(accesses[first][2])
            entry[3].append(sharded_of[first])
            continue
        seen[id(param)] = fqn
        if mode is not DataParallelMode.REPLICATE and param.dim() <= shard_dim:
            raise ValueError(
                f"parameter {fqn!r} has shape {tuple(param.shape)}, which has no dim {shard_dim} "
                f"to shard; reshape it to at least {shard_dim + 1} dims or use mode='replicate'"
            )
        if not param.dtype.is_floating_point:
            raise ValueError(
                f"parameter {fqn!r} has dtype {param.dtype}; fsdptag shards floating-point "
                "parameters only: register it as a buffer instead"
            )
        root = None
        if shard_dim == 0 or mode is DataParallelMode.REPLICATE:
            root = next((r for r in _ancestors(mfqn) if r in roots), None)
        reshard = reshard_of(mfqn, module) and mode is not DataParallelMode.REPLICATE
        access, sharded = _shard_param(param, FSDPTag(fqn, reshard), dp_mesh, dp_placements, mp)
        if root is not None:
            bucket_entries.setdefault(root, []).append((module, name, access, sharded))
        entry = modules.setdefault(id(module), (module, [], [], []))
        entry[1].append(name)
        entry[2].append(access)
        entry[3].append(sharded)
        accesses[fqn] = (module, name, access)
        sharded_of[fqn] = sharded
    buckets = []
    for root, entries in bucket_entries.items():
        # One flat buffer needs one dtype, and one gather one reshard decision.
        groups: dict[tuple[torch.dtype, bool], list] = {}
        for entry in entries:
            groups.setdefault((entry[3].dtype, entry[2].tag.reshard_after_forward), []).append(entry)
        dtypes, reshards = {k[0] for k in groups}, {k[1] for k in groups}
        group = []
        for (dtype, reshard), members in groups.items():
            name = root or "<root>"
            if len(dtypes) > 1:
                name += f"[{str(dtype).removeprefix('torch.')}]"
            if len(reshards) > 1:
                name += f"[zero{3 if reshard else 2}]"
            b = Bucket(name, reshard, [m[:3] for m in members], dp_mesh, mp)
            b.bind([m[3] for m in members])  # the new parameters only: the model is untouched
            group.append(b)
        buckets.append((roots[root], tuple(group)))
    return _Plan(mp, list(modules.values()), accesses, buckets)


def _ancestors(fqn: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b.c", "a.b", "a", ""]``: nearest first."""
    parts = fqn.split(".") if fqn else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _bucket_roots(bucket, model: nn.Module) -> Callable[[str, nn.Module], bool]:
    if bucket == "blocks":  # torchtitan's wrapping: each repeated block, the root for the rest
        blocks = {id(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m}
        return lambda fqn, module: fqn == "" or id(module) in blocks
    if bucket == "param":
        return lambda fqn, module: False
    if bucket == "module":
        return lambda fqn, module: any(True for _ in module.parameters(recurse=False))
    if callable(bucket) and not isinstance(bucket, str):
        def checked(fqn: str, module: nn.Module) -> bool:
            value = bucket(fqn, module)
            if not isinstance(value, bool):
                raise TypeError(f"bucket callable returned {value!r} for module {fqn!r}; return a bool")
            return value

        return checked
    raise ValueError(
        f"bucket={bucket!r}; use 'blocks', 'param', 'module', or a callable (module_fqn, module) -> bool "
        "marking bucket roots, e.g. lambda fqn, m: isinstance(m, TransformerBlock)"
    )


def _parse_mode(mode) -> DataParallelMode:
    if isinstance(mode, DataParallelMode):
        return mode
    try:
        return DataParallelMode(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in DataParallelMode)
        raise ValueError(f"unknown mode={mode!r}; use one of {choices}") from None


def _reshard_resolver(model: nn.Module, policy: ReshardPolicy) -> Callable[[str, nn.Module], bool]:
    if isinstance(policy, bool):
        return lambda fqn, module: policy
    if isinstance(policy, Mapping):
        names = {fqn for fqn, _ in model.named_modules()}
        for prefix, value in policy.items():
            if not isinstance(value, bool):
                raise TypeError(
                    f"reshard_after_forward[{prefix!r}]={value!r} must be a bool (True = zero3)"
                )
            if prefix != "" and prefix not in names:
                raise ValueError(
                    f"reshard_after_forward names module {prefix!r}, which is not in the model; "
                    "use module FQNs from model.named_modules() (\"\" sets the default)"
                )
        ordered = sorted(policy.items(), key=lambda kv: -len(kv[0]))

        def from_prefix(fqn: str, module: nn.Module) -> bool:
            for prefix, value in ordered:
                if prefix == "" or fqn == prefix or fqn.startswith(prefix + "."):
                    return value
            return True

        return from_prefix
    if callable(policy):
        def from_callable(fqn: str, module: nn.Module) -> bool:
            value = policy(fqn, module)
            if not isinstance(value, bool):
                raise TypeError(
                    f"reshard_after_forward callable returned {value!r} for module {fqn!r}; "
                    "it must return a bool (True = zero3)"
                )
            return value

        return from_callable
    raise TypeError(
        f"reshard_after_forward={policy!r} must be a bool, a callable (module_fqn, module) -> bool, "
        "or a dict of module-FQN prefixes to bools"
    )


def _check_devices(params, mesh: DeviceMesh) -> None:
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


def _tp_dim_names(params) -> tuple[str, ...]:
    meshes = {p.device_mesh for *_, p in params if isinstance(p, DTensor)}
    names: list[str] = []
    for m in meshes:
        if m.mesh_dim_names is None:
            raise ValueError("TP parameters live on a mesh without dim names; name its dims")
        names += [n for n in m.mesh_dim_names if n not in names]
    return tuple(names)


def _dp_mesh(mesh: DeviceMesh, mode: DataParallelMode, tp_names: tuple[str, ...]) -> DeviceMesh:
    names = mesh.mesh_dim_names or ()
    overlap = [n for n in tp_names if n in names]
    dp_mesh = mesh
    if overlap:
        dp_names = tuple(n for n in names if n not in tp_names)
        if not dp_names:
            raise ValueError(
                f"mesh dims {names} are all TP dims; pass a mesh that also has the data-parallel dim(s)"
            )
        dp_mesh = mesh[dp_names]
    if dp_mesh.ndim != mode.mesh_ndim:
        fix = (
            f"use mode='hybrid_shard' or pass one dim, e.g. mesh[{dp_mesh.mesh_dim_names[-1]!r}]"
            if dp_mesh.ndim > mode.mesh_ndim and dp_mesh.mesh_dim_names
            else "use mode='hybrid_shard' or pass a 1D sub-mesh"
            if dp_mesh.ndim > mode.mesh_ndim
            else "pass a 2D mesh (replicate, shard) or use mode='fully_shard'"
        )
        raise ValueError(
            f"data-parallel mesh has {dp_mesh.ndim} dim(s) {dp_mesh.mesh_dim_names or ''} but "
            f"mode={mode.value!r} needs {mode.mesh_ndim}; {fix}"
        )
    return dp_mesh


def _shard_param(param, tag, dp_mesh, dp_placements, mp) -> tuple[_ParamAccess, nn.Parameter]:
    if not isinstance(param, DTensor):
        sharded = distribute_tensor(param.detach(), dp_mesh, dp_placements, src_data_rank=None)
        access = _ParamAccess(tag, dp_mesh, dp_placements, param.shape, mp, None, (), param.shape)
        return access, nn.Parameter(sharded, requires_grad=param.requires_grad)

    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    spanned = _concatenate_meshes(dp_mesh, tp_mesh, tag.fqn)
    tp_local = param.to_local().detach()
    local = distribute_tensor(tp_local, dp_mesh, dp_placements, src_data_rank=None).to_local()
    placements = tuple(_strided_if_needed(p, tp_mesh, tp_placements) for p in dp_placements)
    sharded = DTensor.from_local(
        local, spanned, placements + tp_placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )
    access = _ParamAccess(
        tag, dp_mesh, dp_placements, tp_local.shape, mp, tp_mesh, tp_placements, param.shape
    )
    return access, nn.Parameter(sharded, requires_grad=param.requires_grad)


def _concatenate_meshes(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # mesh bookkeeping is real even when estimating on fake tensors
        try:
            return DeviceMesh._concatenate([dp_mesh, tp_mesh])
        except RuntimeError as e:
            if "different device mesh" not in str(e) and "overlapping" not in str(e):
                raise
            raise ValueError(
                f"TP parameter {fqn!r} lives on mesh {tp_mesh}, which is not a sub-mesh of the "
                f"device mesh the data-parallel mesh {dp_mesh} comes from; build both from one "
                "init_device_mesh, e.g. mesh = init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
            ) from None


def _strided_if_needed(dp: Placement, tp_mesh: DeviceMesh, tp_placements) -> Placement:
    """FSDP shards the TP-local tensor; when TP already shards that dim, say so."""
    if not isinstance(dp, Shard):
        return dp
    split = math.prod(
        tp_mesh.size(i) for i, p in enumerate(tp_placements) if isinstance(p, Shard) and p.dim == dp.dim
    )
    return _StridedShard(dp.dim, split_factor=split) if split > 1 else dp
