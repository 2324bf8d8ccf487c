"""``fsdptag.parametrize``: SimpleFSDP-style data parallelism with tagged gathers.

Note [Parametrization]
----------------------
Each parameter is stored as a sharded ``DTensor`` (``Shard(shard_dim)`` for
FSDP, ``Replicate`` for DDP, ``(Replicate, Shard)`` for HSDP; with TP the
data-parallel placements are prepended to the TP placements, using
``_StridedShard`` when TP shards the same dim). The module's class is swapped
for a subclass whose property for each parameter name returns
``_ParamAccess(stored)``: the shard, tagged at this boundary (see Note [Tag
life cycle] in ``_tag.py``), redistributed to ``Replicate`` over the data-parallel
mesh only (cast to ``param_dtype`` first) and handed to compute as a plain
tensor, or as a DTensor on the TP mesh. The gradient path is DTensor's:
``to_local(grad_placements=Partial("avg"))`` makes backward reduce-scatter
(FSDP), all-reduce (DDP) or both (HSDP) in ``reduce_dtype``.

Because ``state_dict()`` and optimizers read ``module._parameters`` directly,
they see only the stored DTensors: no collective, no tagged tensor.
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ._bucket import Bucket, _contiguous_stride, scoped
from ._tag import FSDPTag, tag_shard

__all__ = [
    "DataParallelMode",
    "MixedPrecisionPolicy",
    "ReshardPolicy",
    "disable_active_parametrization",
    "parametrize",
    "is_parametrized",
]


class DataParallelMode(enum.Enum):
    """How parameters are laid out over the data-parallel mesh."""

    REPLICATE = "replicate"  # DDP: all-reduce gradients
    FULLY_SHARD = "fully_shard"  # FSDP: gather params, reduce-scatter grads
    HYBRID_SHARD = "hybrid_shard"  # HSDP: replicate over mesh dim 0, shard over dim 1

    @property
    def mesh_ndim(self) -> int:
        return 2 if self is DataParallelMode.HYBRID_SHARD else 1


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the gathered parameter and of the gradient reduction.

    ``param_dtype``: gathered parameters (and, with ``cast_forward_inputs``, the
    floating-point inputs of the root module) are cast to it; the cast happens on
    the shard, before the all-gather, as in FSDP2. ``reduce_dtype``: gradients are
    reduced in it (default: ``param_dtype``) and stored in the parameter's dtype.

    Example::

        >>> fsdptag.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(
                    f"MixedPrecisionPolicy.{name}={dtype!r} is not a floating-point torch.dtype; "
                    "use e.g. torch.bfloat16, torch.float16 or torch.float32 (or None for no cast)"
                )


# A per-module reshard choice: one bool, ``fn(module_fqn, module) -> bool``, or a
# mapping from module-FQN prefixes to bools (longest prefix wins, "" = default).
ReshardPolicy = Union[bool, Callable[[str, nn.Module], bool], Mapping[str, bool]]


class _ParametrizationState(threading.local):
    active = True
    tagging = True


_state = _ParametrizationState()


@contextlib.contextmanager
def disable_active_parametrization() -> Iterator[None]:
    """Within this context, parameter access returns the stored sharded DTensor.

    Use it to initialize weights after meta-device construction, or to inspect or
    modify the stored shards.

    Example::

        >>> with torch.device("meta"):
        ...     model = Model()
        >>> fsdptag.parametrize(model, mesh, mode="fully_shard")
        >>> model.to_empty(device="cpu")
        >>> with fsdptag.disable_active_parametrization():
        ...     model.reset_parameters()
    """
    previous = _state.active
    _state.active = False
    try:
        yield
    finally:
        _state.active = previous


@contextlib.contextmanager
def disable_tagging() -> Iterator[None]:
    """Gather parameters without the provenance tag (to measure the tag's overhead).

    Without tags the checkpoint policy cannot see FSDP results and zero3 keeps
    gathered parameters like zero2; use it for measurements only.
    """
    previous = _state.tagging
    _state.tagging = False
    try:
        yield
    finally:
        _state.tagging = previous


class _ParamAccess:
    """Turns one stored (sharded) parameter into the gathered tensor compute uses."""

    def __init__(
        self,
        tag: FSDPTag,
        dp_mesh: DeviceMesh,
        dp_placements: tuple[Placement, ...],
        dp_shape: torch.Size,
        mp: MixedPrecisionPolicy,
        tp_mesh: DeviceMesh | None,
        tp_placements: tuple[Placement, ...],
        shape: torch.Size,
    ) -> None:
        self.tag = tag
        self.dp_mesh = dp_mesh
        self.dp_placements = dp_placements
        self.dp_shape = dp_shape  # shape of the tensor the dp mesh shards (TP-local for TP params)
        self.dp_stride = _contiguous_stride(dp_shape)
        self.compute_placements = (Replicate(),) * dp_mesh.ndim
        self.grad_placements = (Partial("avg"),) * dp_mesh.ndim
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype
        self.tp_mesh = tp_mesh
        self.tp_placements = tp_placements
        self.shape = shape
        self.stride = _contiguous_stride(shape)
        self.bucket = None  # a _bucket.Bucket when gathered with others (Note [Buckets])

    def __call__(self, stored: DTensor) -> torch.Tensor:
        if not _state.active:
            return stored
        if self.bucket is not None:
            gathered = self.bucket.lookup(self, _state.tagging)
            if gathered is not None:
                return gathered
        return self.gather(stored, tagged=_state.tagging)

    def gather(self, stored: DTensor, *, tagged: bool) -> torch.Tensor:
        """All-gather ``stored`` over the dp mesh; differentiable."""
        local = stored.to_local()
        if tagged:
            local = tag_shard(local, self.tag)
        sharded = DTensor.from_local(
            local, self.dp_mesh, self.dp_placements, run_check=False,
            shape=self.dp_shape, stride=self.dp_stride,
        )
        full = sharded.redistribute(
            self.dp_mesh, self.compute_placements,
            forward_dtype=self.param_dtype, backward_dtype=self.reduce_dtype,
        ).to_local(grad_placements=self.grad_placements)
        return self.on_tp_mesh(full)

    def on_tp_mesh(self, full: torch.Tensor) -> torch.Tensor:
        """The gathered (TP-local) tensor as compute sees it: a DTensor on the TP mesh
        for TP parameters, else as is."""
        if self.tp_mesh is None:
            return full
        return DTensor.from_local(
            full, self.tp_mesh, self.tp_placements, run_check=False,
            shape=self.shape, stride=self.stride,
        )


# ---------------------------------------------------------------- entry point


def parametrize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mode: str | DataParallelMode,
    reshard_after_forward: ReshardPolicy = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_dim: int = 0,
    bucket: BucketPolicy = "blocks",
) -> nn.Module:
    """Make ``model`` data parallel over ``mesh``, SimpleFSDP style, in place.

    Every parameter becomes a sharded DTensor; every access to it (``module.weight``)
    returns the all-gathered, cast tensor whose FSDP data path carries an
    :class:`~fsdptag.FSDPTag`. ``reshard_after_forward=True`` (zero3) frees gathered
    parameters after forward and re-gathers them in backward; ``False`` (zero2)
    keeps them. Pass a callable ``(module_fqn, module) -> bool`` or a dict of
    module-FQN prefixes to choose per module. Parameters already on a TP mesh
    (after ``parallelize_module``) gain the data-parallel mesh dims in front.

    ``bucket`` groups parameters into one all-gather / reduce-scatter each (Note
    [Buckets]): ``"blocks"`` (default: each child of an ``nn.ModuleList``, e.g. each
    transformer block, is a bucket root and the model root takes the rest, like
    torchtitan's ``fully_shard`` per block + root), ``"param"`` (one per parameter),
    ``"module"`` (the direct parameters of each module), or ``fn(module_fqn, module)
    -> bool`` marking bucket roots. A bucket is gathered at the first access inside
    its root's ``forward`` and kept until that ``forward`` returns; accesses outside
    it gather per parameter. Buckets apply to ``fully_shard`` and ``hybrid_shard``
    parameters (with or without TP) sharded on dim 0; ``replicate`` parameters and
    ``shard_dim > 0`` gather per parameter. Parameters of one root with different dtypes or
    reshard decisions form separate buckets (one gather each).
    Tied parameters (one tensor registered in several modules) stay one stored
    parameter; a bucket whose root's ``forward`` covers every use gathers it once.

    ``mesh`` is either the data-parallel mesh (1 dim for ``"replicate"`` /
    ``"fully_shard"``, 2 for ``"hybrid_shard"``) or a mesh that also holds the TP
    dims named by the TP parameters' meshes.

    Example::

        >>> mesh = init_device_mesh("cpu", (world_size,))
        >>> fsdptag.parametrize(model, mesh, mode="fully_shard", reshard_after_forward=False)
        >>> model(x).sum().backward(); optim.step()
    """
    from ._reshard import Zero3SavedTensorHooks

    plan = _plan(model, mesh, mode, reshard_after_forward, mp_policy, shard_dim, bucket)
    # Everything above only validated; from here on the model changes.
    for module, names, accesses, sharded in plan.modules:
        for name, param in zip(names, sharded):
            module.register_parameter(name, param)
        _swap_class(module, names, accesses)
    for root, buckets in plan.buckets:
        for b in buckets:
            for _, _, access in b.entries:
                access.bucket = b
        root.__dict__["_fsdptag_buckets"] = buckets
        root.__class__ = _bucket_scope_class(type(root))
        root.register_load_state_dict_post_hook(_rebind_after_load)
    Zero3SavedTensorHooks.install(model, plan.accesses)
    if plan.mp.param_dtype is not None and plan.mp.cast_forward_inputs:
        model.register_forward_pre_hook(_input_caster(plan.mp.param_dtype), with_kwargs=True)
    return model


def _input_caster(dtype: torch.dtype):
    """Root pre-hook casting floating-point inputs to ``param_dtype`` (as FSDP2 does)."""

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(module, args, kwargs):
        return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}

    return hook


def is_parametrized(module: nn.Module) -> bool:
    """True when ``module`` (or any submodule) went through ``fsdptag.parametrize``."""
    return any(hasattr(type(m), "_fsdptag_param_names") for m in module.modules())


@dataclass
class _Plan:
    mp: MixedPrecisionPolicy
    modules: list  # (module, param names, accesses, new sharded parameters)
    accesses: dict  # fqn -> (module, name, _ParamAccess)
    buckets: list  # (root module, tuple of Buckets: one per parameter dtype)


# "param" | "module" | fn(module_fqn, module) -> bool marking bucket roots
BucketPolicy = Union[str, Callable[[str, nn.Module], bool]]


def _plan(model, mesh, mode, reshard_after_forward, mp_policy, shard_dim, bucket) -> _Plan:
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
            b = Bucket(name, FSDPTag(name, reshard), [m[:3] for m in members], dp_mesh, mp)
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


# ---------------------------------------------------------------- class swap

_CLASS_CACHE: dict[tuple[type, tuple[str, ...]], type] = {}


_SCOPE_CLASS_CACHE: dict[type, type] = {}


def _bucket_scope_class(cls: type) -> type:
    """A subclass whose ``forward`` runs in a fresh gather scope of the module's buckets
    and whose ``_apply`` (``to_empty``, ``to``) rebinds their storage (Note [Bound storage])."""
    scope_cls = _SCOPE_CLASS_CACHE.get(cls)
    if scope_cls is None:

        def forward(self, *args, **kwargs):
            return scoped(self._fsdptag_buckets, super(scope_cls, self).forward)(*args, **kwargs)

        def _apply(self, fn, *args, **kwargs):
            out = super(scope_cls, self)._apply(fn, *args, **kwargs)
            for b in self._fsdptag_buckets:
                b.bind()
            return out

        scope_cls = type(f"Bucketed{cls.__name__}", (cls,), {"forward": forward, "_apply": _apply, "_fsdptag_generated": True})
        _SCOPE_CLASS_CACHE[cls] = scope_cls
    return scope_cls


def _rebind_after_load(module: nn.Module, incompatible_keys) -> None:
    for b in module._fsdptag_buckets:  # load_state_dict(assign=True) replaces parameters
        b.bind()


def _swap_class(module: nn.Module, names: list[str], accesses: list[_ParamAccess]) -> None:
    """Give ``module`` a subclass with a gathering property per parameter name."""
    module.__dict__["_fsdptag_access"] = dict(zip(names, accesses))
    key = (type(module), tuple(names))
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        props = {
            name: property(lambda self, n=name: self._fsdptag_access[n](self._parameters[n]))
            for name in names
        }
        props["_fsdptag_param_names"] = tuple(names)
        props["_fsdptag_generated"] = True
        cls = type(f"FSDPTag{type(module).__name__}", (type(module),), props)
        _CLASS_CACHE[key] = cls
    module.__class__ = cls
