"""Validation and planning for ``fsdptag.parametrize``: everything before the model changes.

``plan_parametrization`` checks every argument, resolves the per-module reshard and
bucket choices, and computes the new sharded parameters (and buckets bound to
them) without touching the model, so a bad call raises with the model unchanged.
``parametrize`` then applies the plan.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from ._api import BucketPolicy, DataParallelMode, MixedPrecisionPolicy, OverlapPolicy, ReshardPolicy
from ._blocks import find_blocks, is_checkpointed
from ._bucket import Bucket
from ._class_swap import user_class
from ._float8 import check_bucketed, check_float8, float8_weight
from ._mesh import MeshGroup, concatenate_dp_tp, mesh_groups, parse_mode, strided_if_needed
from ._param import ParamGather, ParamModuleInfo
from ._partial import check_partial
from ._state import ModuleState, RootState, module_state
from ._tag import FSDPTag

__all__ = ["ModuleChange", "ParametrizePlan", "plan_parametrization"]


@dataclass
class _Setting:
    """The validated arguments of one ``parametrize`` call."""

    mode: DataParallelMode
    group_of: Callable[[str], MeshGroup]  # a module FQN's mesh (Note [Meshes per module] in _mesh.py)
    dp_placements: tuple[Placement, ...]
    mp: MixedPrecisionPolicy
    shard_dim: int
    reshard_of: Callable[[str, nn.Module], bool | int]
    bucket_roots: dict[str, nn.Module]  # by FQN
    overlap: OverlapPolicy


@dataclass
class ParametrizePlan:
    """What ``parametrize`` will do to the model: nothing of it has happened yet."""

    root: RootState
    params: dict[str, ParamGather]  # one per stored parameter, by its first FQN
    sharded: dict[str, nn.Parameter]  # the new stored parameters, by the same FQN
    partial: dict[str, int] = field(default_factory=dict)  # FQN -> k (Note [Partial reshard])
    modules: dict[int, ModuleChange] = field(default_factory=dict)  # by id(module)

    def state_of(self, module: nn.Module) -> ModuleState:
        change = self.modules.get(id(module))
        if change is None:
            change = self.modules[id(module)] = ModuleChange(module, ModuleState(self.root))
        return change.state


@dataclass
class ModuleChange:
    """A module ``parametrize`` will change, and the state it will attach to it."""

    module: nn.Module
    state: ModuleState


def plan_parametrization(model: nn.Module, mesh, mode, reshard_after_forward, mp_policy,
                         shard_dim, bucket, prefetch, gradient_divide_factor=None) -> ParametrizePlan:
    """Validate everything and compute the sharded parameters and buckets, without
    touching ``model``."""
    setting, params = _validate(model, mesh, mode, reshard_after_forward, mp_policy, shard_dim,
                                bucket, prefetch, gradient_divide_factor)
    plan = ParametrizePlan(RootState(setting.mp, setting.overlap), {}, {})
    plan.state_of(model).is_root = True
    plan_parameters(plan, setting, params)
    if setting.shard_dim == 0 or setting.mode is DataParallelMode.REPLICATE:
        plan_buckets(plan, setting)
    for change in plan.modules.values():
        change.state.alone = tuple(n for n, g in change.state.params.items() if g not in plan.root.bucket_of)
    alone = [fqn for fqn in plan.partial if plan.params[fqn] not in plan.root.bucket_of]
    if alone:
        raise NotImplementedError(
            f"reshard_after_forward=k (partial reshard) needs bucketed gathers, but {alone[0]!r} is gathered "
            "alone (bucket='param', shard_dim > 0, or no bucket root above it); use bucket='blocks' (the "
            "default) or reshard_after_forward=True for it")
    return plan


def _validate(model, mesh, mode, reshard_after_forward, mp_policy, shard_dim, bucket, prefetch, divide):
    overlap = OverlapPolicy.of(prefetch)
    if not isinstance(model, nn.Module):
        raise TypeError(f"parametrize expects an nn.Module, got {type(model).__name__}")
    if any(module_state(m) is not None for m in model.modules()):
        raise ValueError(
            f"{user_class(type(model)).__name__} is already parametrized by fsdptag; call "
            "fsdptag.parametrize once, on the root module"
        )
    if mode is not None:
        mode = parse_mode(mode)
    if divide is not None and (isinstance(divide, bool) or not isinstance(divide, (int, float)) or divide <= 0):
        raise ValueError(f"gradient_divide_factor={divide!r} must be a positive number (or None: the "
                         "data-parallel size)")
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be fsdptag.MixedPrecisionPolicy, got {type(mp).__name__}")
    if not isinstance(shard_dim, int) or isinstance(shard_dim, bool) or shard_dim < 0:
        raise ValueError(f"shard_dim={shard_dim!r} must be a non-negative int")
    reshard_of = reshard_resolver(model, reshard_after_forward)
    is_root = _bucket_roots(bucket, model)
    # A module apply_ac checkpointed is a bucket root too (Note [Checkpointed bucket roots]).
    roots = {fqn: m for fqn, m in model.named_modules()
             if is_root(fqn, m) or (bucket != "param" and is_checkpointed(m))}

    params = [(mfqn, m, n, p) for mfqn, m in model.named_modules()
              for n, p in m.named_parameters(recurse=False)]
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters to parametrize")
    mode, group_of = mesh_groups(model, mesh, params, mode, None if divide is None else float(divide))
    dp_placements: tuple[Placement, ...] = {
        DataParallelMode.REPLICATE: (Replicate(),),
        DataParallelMode.FULLY_SHARD: (Shard(shard_dim),),
        DataParallelMode.HYBRID_SHARD: (Replicate(), Shard(shard_dim)),
    }[mode]
    return _Setting(mode, group_of, dp_placements, mp, shard_dim, reshard_of, roots, overlap), params


def plan_parameters(plan: ParametrizePlan, setting: _Setting, params: list) -> None:
    """A gather and a new sharded parameter per stored parameter (tied weights: one)."""
    seen: dict[int, ParamGather] = {}  # id(param) -> its gather
    for mfqn, module, name, param in params:
        fqn = f"{mfqn}.{name}" if mfqn else name
        gather = seen.get(id(param))
        if gather is not None:  # tied weights: one stored parameter, one gather, one tag
            gather.module_info.shared_modules.append(module)
            gather.module_info.shared_names.append(name)
            plan.state_of(module).params[name] = gather
            continue
        _check_param(fqn, param, setting)
        reshard = setting.reshard_of(mfqn, module)
        if setting.mode is DataParallelMode.REPLICATE:
            reshard = False  # nothing to reshard
        float8 = float8_weight(param)  # torchao's: the stored parameter is its plain tensor
        if float8 is not None:
            check_float8(fqn, float8, reshard)
            param = nn.Parameter(float8.hp, requires_grad=param.requires_grad)
        if reshard is not True and reshard is not False:  # an int k: Note [Partial reshard]
            check_partial(reshard, setting.group_of(mfqn).dp_mesh, fqn)
            plan.partial[fqn] = reshard
            reshard = True
        gather, sharded = _shard_param(
            param, FSDPTag(fqn, reshard), ParamModuleInfo(module, name), setting, plan.root)
        if setting.mode is not DataParallelMode.REPLICATE:  # DDP gathers nothing
            gather.float8 = float8
        seen[id(param)] = plan.params[fqn] = gather
        plan.sharded[fqn] = sharded
        plan.state_of(module).params[name] = gather


def plan_buckets(plan: ParametrizePlan, setting: _Setting) -> None:
    """Give each bucket root the parameters under it that no nearer root takes, in
    buckets (one flat buffer needs one dtype, one gather one reshard decision), bound
    to the new parameters."""
    by_root: dict[str, list[ParamGather]] = {}
    for fqn, gather in plan.params.items():
        mfqn = fqn.rpartition(".")[0]  # the module it was first registered in
        root = next((r for r in _ancestors(mfqn) if r in setting.bucket_roots), None)
        if root is not None:
            by_root.setdefault(root, []).append(gather)
    for root, gathers in by_root.items():
        groups: dict[tuple[MeshGroup, torch.dtype, bool, bool, int | None], list[ParamGather]] = {}
        for g in gathers:  # torchao float8 weights: a bucket of their own (Note [Float8 all-gather])
            key = (setting.group_of(g.fqn.rpartition(".")[0]), plan.sharded[g.fqn].dtype, g.float8 is not None,
                   g.tag.reshard_after_forward, plan.partial.get(g.fqn))
            groups.setdefault(key, []).append(g)
        dtypes, reshards = {k[1] for k in groups}, {k[3:] for k in groups}
        buckets = []
        for (mesh, dtype, float8, reshard, k), group in groups.items():
            variant = mesh.variant  # what tells the root's buckets apart
            if len(dtypes) > 1:
                variant += f"[{str(dtype).removeprefix('torch.')}]"
            if float8:
                variant += "[float8]"
            if len(reshards) > 1:
                variant += f"[zero{3 if reshard else 2}{'' if k is None else f'@{k}'}]"
            b = Bucket(root, variant, reshard, group, mesh.dp_mesh, setting.mp, plan.root.shared, partial=k,
                       divide=mesh.divide)
            b.bind([plan.sharded[g.fqn] for g in group])  # the new parameters only: the model is untouched
            b.owner = weakref.ref(setting.bucket_roots[root])
            plan.root.bucket_of.update(dict.fromkeys(group, b))
            buckets.append(b)
        plan.state_of(setting.bucket_roots[root]).buckets = tuple(buckets)
    check_bucketed({fqn: plan.root.bucket_of.get(g) for fqn, g in plan.params.items() if g.float8 is not None})


def _check_param(fqn: str, param: nn.Parameter, setting: _Setting) -> None:
    if setting.mode is not DataParallelMode.REPLICATE and param.dim() <= setting.shard_dim:
        raise ValueError(
            f"parameter {fqn!r} has shape {tuple(param.shape)}, which has no dim {setting.shard_dim} "
            f"to shard; reshape it to at least {setting.shard_dim + 1} dims or use mode='replicate'"
        )
    if not param.dtype.is_floating_point:
        raise ValueError(
            f"parameter {fqn!r} has dtype {param.dtype}; fsdptag shards floating-point "
            "parameters only: register it as a buffer instead"
        )


def _ancestors(fqn: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b.c", "a.b", "a", ""]``: nearest first."""
    parts = fqn.split(".") if fqn else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _bucket_roots(bucket: BucketPolicy, model: nn.Module) -> Callable[[str, nn.Module], bool]:
    if bucket == "blocks":  # torchtitan's wrapping: each block (Note [Blocks]), the root for the rest
        blocks = {id(block) for _, block in find_blocks(model)}
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


def _reshard_value(value, where: str):
    """A bool, or an int k > 1 (partial reshard, checked against the mesh later)."""
    if isinstance(value, bool) or (isinstance(value, int) and value > 1):
        return value
    raise TypeError(f"{where}={value!r} must be a bool (True = zero3) or an int k > 1 (kept sharded over k ranks "
                    "after forward)")


def reshard_resolver(model: nn.Module, policy: ReshardPolicy) -> Callable[[str, nn.Module], bool | int]:
    if isinstance(policy, (bool, int)):
        policy = _reshard_value(policy, "reshard_after_forward")
        return lambda fqn, module: policy
    if isinstance(policy, Mapping):
        names = {fqn for fqn, _ in model.named_modules()}
        for prefix, value in policy.items():
            _reshard_value(value, f"reshard_after_forward[{prefix!r}]")
            if prefix != "" and prefix not in names:
                raise ValueError(
                    f"reshard_after_forward names module {prefix!r}, which is not in the model; "
                    "use module FQNs from model.named_modules() (\"\" sets the default)"
                )
        ordered = sorted(policy.items(), key=lambda kv: -len(kv[0]))

        def from_prefix(fqn: str, module: nn.Module) -> bool | int:
            for prefix, value in ordered:
                if prefix == "" or fqn == prefix or fqn.startswith(prefix + "."):
                    return value
            return True

        return from_prefix
    if callable(policy):
        def from_callable(fqn: str, module: nn.Module) -> bool | int:
            return _reshard_value(policy(fqn, module), f"reshard_after_forward callable's value for module {fqn!r}")

        return from_callable
    raise TypeError(
        f"reshard_after_forward={policy!r} must be a bool, an int k > 1, a callable (module_fqn, module) -> "
        "one of them, or a dict of module-FQN prefixes to them"
    )


def _shard_param(param: nn.Parameter, tag: FSDPTag, module_info: ParamModuleInfo, setting: _Setting,
                 root: RootState) -> tuple[ParamGather, nn.Parameter]:
    group = setting.group_of(tag.fqn.rpartition(".")[0])
    dp_mesh, dp_placements = group.dp_mesh, setting.dp_placements
    if not isinstance(param, DTensor):
        sharded = distribute_tensor(param.detach(), dp_mesh, dp_placements, src_data_rank=None)
        gather = ParamGather(tag, module_info, dp_mesh, dp_placements, param.shape, setting.mp,
                             None, (), param.shape, root.forward, group.divide)
        return gather, nn.Parameter(sharded, requires_grad=param.requires_grad)

    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    spanned = concatenate_dp_tp(dp_mesh, tp_mesh, tag.fqn)
    tp_local = param.to_local().detach()
    local = distribute_tensor(tp_local, dp_mesh, dp_placements, src_data_rank=None).to_local()
    placements = tuple(strided_if_needed(p, tp_mesh, tp_placements) for p in dp_placements)
    sharded = DTensor.from_local(
        local, spanned, placements + tp_placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )
    gather = ParamGather(tag, module_info, dp_mesh, dp_placements, tp_local.shape, setting.mp,
                         tp_mesh, tp_placements, param.shape, root.forward, group.divide)
    return gather, nn.Parameter(sharded, requires_grad=param.requires_grad)
