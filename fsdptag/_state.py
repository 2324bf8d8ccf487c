"""Per-model state: one :class:`RootState` per parametrized model, and the module
records that point at it.

Note [Root forward]
-------------------
The root module gets one forward pre-hook and one forward post-hook (the post-hook
runs also when ``forward`` raises), both owned by the root state, which keeps their
handles. In order:

pre-forward
  0. note whether this forward trains (grad on); unpin kept zero2 gathers nobody
     backwarded (Note [zero2 kept until backward] in ``_keep.py``)
  1. open the frame of per-parameter handouts (their in-place check)
  2. prefetch: forget the last forward's unclaimed all-gathers, start recording
     this forward's bucket order (Note [Prefetch] in ``_prefetch.py``)
  3. push fsdptag's saved-tensor hooks: zero3 (Note [zero3 by saved-tensor hooks]),
     or over someone else's (Note [Whose saved-tensor hooks] in ``_context.py``)
  4. cast floating-point inputs, nested ones too, to ``param_dtype``

post-forward
  1. pop fsdptag's saved-tensor hooks, if pushed
  2. prefetch: wait out unclaimed all-gathers, keep the order for the next forward
  3. check the per-parameter handouts for in-place changes, unless ``forward``
     raised (that error is the one to see)

A bucket root's own gather scope is opened by its generated ``forward``, not by a
hook: it must open inside any checkpoint wrapper (Note [Buckets]).
"""

from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ._api import MixedPrecisionPolicy, OverlapPolicy
from ._access import read
from ._bucket import Bucket, BucketShared, watch_compiles
from ._scopes import scoped
from ._compiled import traced_gather
from ._class_swap import register_kind, swap_class
from ._collectives import Reducer
from ._compat import apply_to_tensors, is_compiling
from ._context import RootForward, grad_mode_trains, running_backward
from ._keep import Keeper
from ._param import Handouts, ParamGather, flags
from ._prefetch import Prefetcher
from ._reshard import SavedTensorHooks

__all__ = ["ModuleState", "RootState", "drop_pregathered", "is_parametrized", "make_bucket_root", "module_state",
           "pregather"]

_STATE = "_fsdptag"  # a parametrized module's ModuleState, in its __dict__


class RootState:
    """What fsdptag keeps for one parametrized model; see Note [Root forward]."""

    def __init__(self, mp: MixedPrecisionPolicy, overlap: OverlapPolicy) -> None:
        self.handouts = Handouts()
        self.forward = RootForward()  # handed to its parameters and buckets
        # what its buckets share, handed to each
        self.shared = BucketShared(self.forward, Reducer(overlap.reductions),
                                   Prefetcher(overlap.all_gathers) if overlap.all_gathers else None)
        self.bucket_of: dict[ParamGather, Bucket] = {}  # a bucketed parameter's bucket
        self.saved_hooks: SavedTensorHooks | None = None
        self.cast_dtype = mp.param_dtype if mp.cast_forward_inputs else None
        self.handles: list[RemovableHandle] = []  # every hook fsdptag registered on the model
        self.buckets: list[Bucket] = []
        self.keepers: list[Keeper] = []
        self._errors_at_entry: list = []  # the exception being handled when forward began
        self.model: weakref.ref[nn.Module] | None = None  # the parametrized model (``install``)

    def __getstate__(self) -> dict:
        """Pickled with its model (Note [Pickling generated classes] in _class_swap.py)."""
        return dict(self.__dict__, model=self.model() if self.model is not None else None)

    def __setstate__(self, state: dict) -> None:
        model = state.pop("model")
        self.__dict__.update(state)
        self.model = weakref.ref(model) if model is not None else None

    @property
    def prefetcher(self) -> Prefetcher | None:  # Note [Prefetch] in _prefetch.py
        return self.shared.prefetcher

    @prefetcher.setter
    def prefetcher(self, prefetcher: Prefetcher | None) -> None:
        self.shared.prefetcher = prefetcher

    def install(self, root: nn.Module, params: dict[str, ParamGather], buckets: list[Bucket]) -> None:
        """Register the root's hooks (``params``: every stored parameter by FQN)."""
        self.buckets = buckets
        self.model = weakref.ref(root)  # to name a module apply_ac makes a bucket root
        self.keepers = [k for k in [b.keeper for b in buckets] + [g.keeper for g in params.values()]
                        if k is not None]  # zero2 gathers kept for recomputes, unpinned per forward
        if self.prefetcher is not None and not buckets:
            self.prefetcher = None  # nothing to prefetch
        if self.prefetcher is not None:
            self.connect(self.prefetcher, root)
        self.saved_hooks = SavedTensorHooks(params, self.bucket_of)
        self.handles += [
            root.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            root.register_forward_hook(self._post_forward, always_call=True),
        ]

    def connect(self, prefetcher: Prefetcher, root: nn.Module) -> None:
        """Tell ``prefetcher`` the model's buckets (Note [Prefetch] in ``_prefetch.py``)."""
        prefetcher.default_order = functools.partial(_module_order, weakref.ref(root), self)
        prefetcher.buckets_of = _buckets_of

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if is_compiling():  # Note [Compiled gathers]: the compiler runs the gathers
            self.forward.traced = True
            return apply_to_tensors(self._cast, (args, kwargs)) if self.cast_dtype is not None else None
        watch_compiles()  # after a torch._dynamo.reset (Note [Bound storage])
        self._errors_at_entry.append(sys.exc_info()[1])
        self.forward.open(grad_mode_trains())
        if not running_backward():
            for keeper in self.keepers:
                keeper.unpin()
        self.handouts.open()
        if self.prefetcher is not None:
            self.prefetcher.pre_forward()
        self.saved_hooks.pre_forward()
        if self.cast_dtype is not None:
            return apply_to_tensors(self._cast, (args, kwargs))
        return None

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.cast_dtype) if x.is_floating_point() else x

    def _post_forward(self, module: nn.Module, args: tuple, output) -> None:
        if is_compiling():
            self.forward.traced = False
            return
        # nn.Module runs an always-called hook from its `except` clause when forward
        # raised: then the exception being handled is a new one.
        raised = sys.exc_info()[1] is not self._errors_at_entry.pop()
        self.forward.close()
        self.saved_hooks.post_forward()
        if self.prefetcher is not None:
            self.prefetcher.post_forward()
        self.handouts.close(check=not raised)


def _buckets_of(module: nn.Module) -> tuple[Bucket, ...]:
    state = module_state(module)
    return state.buckets if state is not None else ()


def _module_order(model_ref, root: RootState) -> list[Bucket]:
    """The model's buckets in the order of their root modules (the first forward's guess
    of the gather order, Note [Prefetch] in ``_prefetch.py``)."""
    model = model_ref()
    if model is None:
        return []
    mine = {id(b) for b in root.buckets}
    order = []
    for m in model.modules():
        state = module_state(m)
        if state is not None:
            order += [b for b in state.buckets if id(b) in mine]
    return order


@dataclass(eq=False)
class ModuleState:
    """A parametrized module's part: its parameters' gathers by name and, for a bucket
    root, its buckets (one per dtype and reshard decision)."""

    root: RootState
    params: dict[str, ParamGather] = field(default_factory=dict)
    buckets: tuple[Bucket, ...] = ()
    alone: tuple[str, ...] = ()  # its parameters gathered alone (in no bucket), by name
    is_root: bool = False


def module_state(module: nn.Module) -> ModuleState | None:
    """``module``'s fsdptag state, or None when parametrize did not touch it."""
    return module.__dict__.get(_STATE)


def is_parametrized(module: nn.Module) -> bool:
    """True when ``module`` (or any submodule) went through ``fsdptag.parametrize``."""
    return any(module_state(m) is not None for m in module.modules())


def pregather(block: nn.Module) -> list[ParamGather]:
    """In compiled code, gather ``block``'s buckets and its zero2 parameters gathered
    alone now, before the caller opens its checkpoint region (Note [Compiled buckets]
    in ``_compiled.py``); the caller hands the list to :func:`drop_pregathered` after it
    (Note [Compiled gathers]). Plain loops: dynamo traces them."""
    gathers = []
    if not flags.active:  # disable_active_parametrization: accesses return the stored shards
        return gathers
    for m in block.modules():
        state = module_state(m)
        if state is None:
            continue
        # Each in a checkpoint region of its own (zero3 recomputed, zero2 saved), outside
        # the caller's; a bucket an enclosing root already gathered is not gathered again.
        gathers += pregather_buckets(state.buckets)
        for name in state.alone:  # names, not a lookup by gather: the same guards for every block
            g = state.params[name]
            if (g.pregathered is None and not g.tag.reshard_after_forward
                    and g.copies(g.module_info.stored)):
                g.pregathered = g.traced(g.module_info.stored)
                gathers.append(g)
    return gathers


def pregather_buckets(buckets) -> list[ParamGather]:
    """In compiled code, a bucket root's ``forward`` gathers its buckets not gathered
    yet (Note [Compiled buckets] in ``_compiled.py``), each in its own checkpoint region."""
    gathers = []
    if not flags.active:
        return gathers
    for b in buckets:
        if b.copies() and b.params[0].pregathered is None:
            gathers += _set_pregathered(traced_gather(b), b.params)
    return gathers


def _set_pregathered(outs, params) -> list[ParamGather]:
    for g, out in zip(params, outs):
        g.pregathered = out
    return list(params)


def drop_pregathered(gathers: list[ParamGather]) -> None:
    for g in gathers:
        g.pregathered = None


def attach(module: nn.Module, state: ModuleState) -> None:
    """Record ``state`` on ``module`` and give it the generated class its parts need:
    a gathering property per parameter name, and a bucket scope for a bucket root."""
    module.__dict__[_STATE] = state
    if state.is_root:
        swap_class(module, "Parametrized")
    if state.params:
        names = tuple(state.params)
        swap_class(module, "FSDPTag", key=names)
    if state.buckets:
        _make_bucket_root_class(module)


def _make_bucket_root_class(module: nn.Module) -> None:
    swap_class(module, "Bucketed")
    module_state(module).root.handles.append(module.register_load_state_dict_post_hook(_rebind_after_load))


def make_bucket_root(module: nn.Module) -> None:
    """Make ``module`` the bucket root of its parameters that a bucket rooted above it
    gathers (Note [Checkpointed bucket roots] in ``_bucket.py``): each such bucket splits
    in two, both bound afresh. Parameters also registered outside ``module`` (tied)
    stay where they are; buckets rooted in or below ``module`` are untouched."""
    states = [s for s in map(module_state, module.modules()) if s is not None]
    if not states:
        return
    root = states[0].root
    inside_modules = {id(m) for m in module.modules()}
    inside_buckets = {b for s in states for b in s.buckets}
    moving: dict[Bucket, set[ParamGather]] = {}
    for s in states:
        for g in s.params.values():
            bucket = root.bucket_of.get(g)
            if bucket is None or bucket in inside_buckets:
                continue
            if all(id(m) in inside_modules for m, _ in g.module_info.registrations()):
                moving.setdefault(bucket, set()).add(g)
    if not moving:
        return
    model = root.model() if root.model is not None else None
    fqn = next(n for n, m in model.named_modules() if m is module)
    new: list[Bucket] = []
    for old, moved in moving.items():
        owner = old.owner() if old.owner is not None else None
        rest = [g for g in old.params if g not in moved]
        sub = old.part(fqn, [g for g in old.params if g in moved])
        replaced = (old.part(old.root_fqn, rest),) if rest else ()
        old.retire()
        for b in (sub, *replaced):
            root.bucket_of.update(dict.fromkeys(b.params, b))
        if owner is not None:
            owner_state = module_state(owner)
            owner_state.buckets = tuple(
                b for o in owner_state.buckets for b in (replaced if o is old else (o,)))
        root.buckets = [b for o in root.buckets for b in (replaced if o is old else (o,))] + [sub]
        sub.owner = weakref.ref(module)
        new.append(sub)
    if root.prefetcher is not None:
        root.prefetcher.forget_order()  # it names the old buckets
    state = module_state(module)
    if state is None:
        attach(module, ModuleState(root, buckets=tuple(new)))
    else:
        had = bool(state.buckets)
        state.buckets += tuple(new)
        if not had:
            _make_bucket_root_class(module)


def _access(module: nn.Module, name: str) -> torch.Tensor:
    try:
        state = module.__dict__[_STATE]
        gather = state.params[name]  # Note [Parameter read] in _access.py
        return read(gather, module._parameters[name], state.root.bucket_of, state.root.handouts)
    except AttributeError as e:
        # nn.Module.__getattr__ would swallow it and hand out the stored shard instead.
        raise RuntimeError(f"fsdptag: gathering {name!r} of {type(module).__name__} failed: {e!r}") from e


def _param_properties(names: tuple[str, ...]) -> dict:
    props: dict = {name: property(functools.partial(_access, name=name)) for name in names}
    props["_fsdptag_param_names"] = names
    return props


def _get_parameter(self, target: str) -> nn.Parameter:
    """The stored (sharded) parameter at ``target``: what ``named_parameters()`` lists,
    as under FSDP2 (attribute access would gather it)."""
    module_path, _, name = target.rpartition(".")
    module = self.get_submodule(module_path)
    if name in module._parameters and module_state(module) is not None:
        return module._parameters[name]
    return nn.Module.get_parameter(self, target)


def _refuse_resize(self, *args, **kwargs):
    raise RuntimeError(
        "fsdptag: resize_token_embeddings replaces parameters with new shapes, which a "
        "parametrized model cannot take; call it before fsdptag.parametrize"
    )


def root_methods(cls: type) -> dict:
    """The root's ``get_parameter`` returns stored parameters (Hugging Face's ``tie_weights``
    reads them that way); Hugging Face's ``resize_token_embeddings`` is refused."""
    methods = {"get_parameter": _get_parameter}
    if hasattr(cls, "resize_token_embeddings"):
        methods["resize_token_embeddings"] = _refuse_resize
    return methods


def _bucket_root_methods(cls: type) -> dict:
    """A ``forward`` run in a fresh gather scope of the module's buckets and an
    ``_apply`` (``to_empty``, ``to``) that rebinds their storage (Note [Bound storage])."""

    @functools.wraps(cls.forward)  # the user's signature: Trainer picks dataset columns by it
    def forward(self, *args, **kwargs):
        if is_compiling():  # Note [Compiled buckets]: the buckets gathered up front, no scopes
            gathers = pregather_buckets(self.__dict__[_STATE].buckets)
            try:
                return cls.forward(self, *args, **kwargs)
            finally:
                drop_pregathered(gathers)
        state = self.__dict__[_STATE]
        with state.root.saved_hooks.over_others():  # Note [Whose saved-tensor hooks] in _context.py
            return scoped(state.buckets, functools.partial(cls.forward, self))(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        out = cls._apply(self, fn, *args, **kwargs)
        for b in self.__dict__[_STATE].buckets:
            b.bind()
        return out

    return {"forward": forward, "_apply": _apply}


register_kind("FSDPTag", lambda cls, names: _param_properties(names))
register_kind("Bucketed", lambda cls, key: _bucket_root_methods(cls))


def _rebind_after_load(module: nn.Module, incompatible_keys) -> None:
    for b in module.__dict__[_STATE].buckets:  # load_state_dict(assign=True) replaces parameters
        b.bind()
