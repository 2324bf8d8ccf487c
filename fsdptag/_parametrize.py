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
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from ._bucket import Prefetcher, _contiguous_stride, scoped
from ._tag import FSDPTag, alias, in_place_error, refuse_in_place, tag_shard, untag

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

# "blocks" | "param" | "module" | fn(module_fqn, module) -> bool marking bucket roots
BucketPolicy = Union[str, Callable[[str, nn.Module], bool]]


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
        # Whether the gather runs a collective: not for DDP, nor over a size-1 shard dim.
        self.collective = any(not isinstance(p, Replicate) and dp_mesh.size(i) > 1
                              for i, p in enumerate(dp_placements))
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
        self.handouts: _Handouts | None = None  # the model's, set by parametrize

    def __call__(self, stored: DTensor) -> torch.Tensor:
        if not _state.active:
            return stored
        if self.bucket is not None:
            gathered = self.bucket.lookup(self, _state.tagging)
            if gathered is not None:
                return gathered
        copies = self.copies(stored)
        gathered = self.gather(stored, tagged=_state.tagging, copies=copies)
        if copies:  # otherwise the handout is the stored parameter itself
            self.handouts.record(gathered, self.tag.fqn)
        return gathered

    def copies(self, stored: DTensor) -> bool:
        """Whether a gather makes a new tensor (a collective or a cast); DDP without a
        cast hands out the stored parameter itself, as plain DDP does."""
        return self.collective or self.param_dtype not in (None, stored.dtype)

    def gather(self, stored: DTensor, *, tagged: bool, copies: bool | None = None) -> torch.Tensor:
        """All-gather ``stored`` over the dp mesh; differentiable."""
        if copies is None:
            copies = self.copies(stored)
        # No FSDP op, or nothing to checkpoint (inference_mode): no tag (Note [Marked
        # handout] in _tag.py).
        tagged = tagged and copies and not torch.is_inference_mode_enabled()
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
        if not copies:
            return self.on_tp_mesh(alias(full))
        out = self.on_tp_mesh(untag(full) if tagged else full)
        return refuse_in_place(out) if self.tp_mesh is not None else out

    def on_tp_mesh(self, full: torch.Tensor) -> torch.Tensor:
        """The gathered (TP-local) tensor as compute sees it: a DTensor on the TP mesh
        for TP parameters, else as is."""
        if self.tp_mesh is None:
            return full
        return DTensor.from_local(
            full, self.tp_mesh, self.tp_placements, run_check=False,
            shape=self.shape, stride=self.stride,
        )


class _Handouts:
    """Root-module forward hooks that reject in-place changes to parameters gathered
    alone (a bucket's are checked when its root's ``forward`` returns).

    A gathered parameter is a temporary copy (or, zero2 under AC, recomputed in
    backward), so an in-place op on it inside ``forward`` would be lost or make
    forward and backward disagree. Compute gets plain tensors (Note [Marked
    handout] in ``_tag.py``), which cannot refuse the op themselves; with grad on,
    autograd refuses it (the handout is a view returned by a custom Function).
    Otherwise each handout is recorded with its version counter and checked when
    the root's ``forward`` returns, if still alive: held by a weak reference, so
    zero3 still frees it, and a modified copy that nobody keeps is just lost.
    """

    def __init__(self) -> None:
        self._frame: list | None = None  # this forward's handouts; None outside forward

    def record(self, t: torch.Tensor, fqn: str) -> None:
        if self._frame is not None and not torch.is_inference_mode_enabled():  # no versions there
            self._frame.append((weakref.ref(t), t._version, fqn))

    def enter(self, module, args) -> None:
        # One frame: a forward that raised leaves it, replaced here; a nested call of the
        # root's forward would start afresh (and its caller's handouts go unchecked).
        self._frame = []

    def exit(self, module, args, output) -> None:  # not called when forward raised
        handed, self._frame = self._frame, None
        for ref, version, fqn in handed or ():
            t = ref()
            if t is not None and t._version != version:
                raise in_place_error(fqn, "an in-place op during forward")


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
    prefetch: bool = False,
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
    it gather per parameter. Buckets apply in every mode, with or without TP
    (``replicate``: one cast and one gradient all-reduce per bucket); with
    ``shard_dim > 0`` parameters gather per parameter. Parameters of one root with
    different dtypes or reshard decisions form separate buckets (one gather each).
    Tied parameters (one tensor registered in several modules) stay one stored
    parameter; a bucket whose root's ``forward`` covers every use gathers it once.

    ``prefetch=True`` issues the next bucket's all-gather (in the previous forward's
    order) as soon as a bucket has gathered, so it overlaps this bucket's compute;
    it costs one more gathered bucket alive. It applies to gathers outside
    activation-checkpointed regions only (Note [Prefetch]).

    ``mesh`` is either the data-parallel mesh (1 dim for ``"replicate"`` /
    ``"fully_shard"``, 2 for ``"hybrid_shard"``) or a mesh that also holds the TP
    dims named by the TP parameters' meshes.

    Example::

        >>> mesh = init_device_mesh("cpu", (world_size,))
        >>> fsdptag.parametrize(model, mesh, mode="fully_shard", reshard_after_forward=False)
        >>> model(x).sum().backward(); optim.step()
    """
    from ._plan import plan_parametrization
    from ._reshard import Zero3SavedTensorHooks

    if not isinstance(prefetch, bool):
        raise TypeError(f"prefetch={prefetch!r} must be True (issue the next bucket's all-gather early) or False")
    plan = plan_parametrization(model, mesh, mode, reshard_after_forward, mp_policy, shard_dim, bucket)
    # Everything above only validated; from here on the model changes.
    handouts = _Handouts()
    model.register_forward_pre_hook(handouts.enter)
    model.register_forward_hook(handouts.exit)
    for _, _, access in plan.accesses.values():
        access.handouts = handouts
    for module, names, accesses, sharded in plan.modules:
        for name, param in zip(names, sharded):
            module.register_parameter(name, param)
        _swap_class(module, names, accesses)
    prefetcher = Prefetcher() if prefetch and plan.buckets else None
    if prefetcher is not None:
        model.register_forward_pre_hook(prefetcher.enter)
        model.register_forward_hook(prefetcher.exit, always_call=True)
    for root, buckets in plan.buckets:
        for b in buckets:
            b.prefetcher = prefetcher
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


def _access(module: nn.Module, name: str) -> torch.Tensor:
    try:
        return module._fsdptag_access[name](module._parameters[name])
    except AttributeError as e:
        # nn.Module.__getattr__ would swallow it and hand out the stored shard instead.
        raise RuntimeError(f"fsdptag: gathering {name!r} of {type(module).__name__} failed: {e!r}") from e


def _swap_class(module: nn.Module, names: list[str], accesses: list[_ParamAccess]) -> None:
    """Give ``module`` a subclass with a gathering property per parameter name."""
    module.__dict__["_fsdptag_access"] = dict(zip(names, accesses))
    key = (type(module), tuple(names))
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        props = {
            name: property(functools.partial(_access, name=name))
            for name in names
        }
        props["_fsdptag_param_names"] = tuple(names)
        props["_fsdptag_generated"] = True
        cls = type(f"FSDPTag{type(module).__name__}", (type(module),), props)
        _CLASS_CACHE[key] = cls
    module.__class__ = cls
