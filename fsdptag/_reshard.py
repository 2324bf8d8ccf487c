"""zero3 without user AC: saved-tensor hooks that re-gather instead of keeping.

Note [zero3 by saved-tensor hooks]
----------------------------------
With ``reshard_after_forward=True`` a gathered parameter must not stay alive
between forward and backward. In eager mode the only things that keep it alive
are autograd's saved tensors (``mm`` saves ``w.t()``, ``layer_norm`` saves
``weight``). Checkpointing just the gather frees nothing: the consumer op
saves the gathered tensor outside the checkpointed region.

So while the root module's forward runs we push ``saved_tensors_hooks``:

* pack: a saved tensor whose tag says zero3 is replaced by a small handle
  (the parameter's FQN, and the size/stride/offset of the saved view inside the
  gathered buffer); every other tensor is kept as is. No per-op dispatch cost:
  the hook only runs for tensors autograd saves.
* unpack: the first handle of a parameter re-gathers it (one all-gather, no
  autograd graph; what backward gets is untagged) and rebuilds the view with ``as_strided``; further
  handles of the same parameter in the same backward reuse it, and the buffer
  is dropped when the last handle of that forward is unpacked.

The re-gather reproduces the forward gather exactly (same collective, same
padding and unpadding), so the buffer layout matches and ``as_strided`` is the
same view. Parameters whose gathered value backward never needs (embedding
tables, biases) are never packed, so never re-gathered. A tensor subclass around a
gathered parameter (torchao's ``Float8TrainingTensor``, Note [Float8 all-gather] in
``_float8.py``) is packed through ``__tensor_flatten__``: its gathered inner tensor
becomes a handle, the rest (the scale) is kept, and unpack rebuilds it with
``__tensor_unflatten__``.

Hooks are not pushed inside backward, nor over a checkpoint region's: inside an
activation-checkpointed region ``torch.utils.checkpoint`` owns the saved tensors
(its hooks are innermost), and there fsdptag's checkpoint policy decides; the
region's recompute runs in backward, so the root's hooks are never pushed a second
time. This is what keeps a checkpointed zero3 block at one re-gather per
parameter. Over anyone else's hooks (``save_on_cpu``) they are pushed, composed
with them: Note [Whose saved-tensor hooks] in ``_context.py``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from ._access import regather as regather_bucket
from ._bucket import Bucket
from ._compat import dtensor_of
from ._context import FSDPTAG_HOOK, GatherContext, Hooks, gather_context, saved_tensor_hooks
from ._param import ParamGather
from ._tag import get_fsdp_tag, innermost as _innermost

__all__ = ["SavedTensorHooks"]


class _Regather:
    """One re-gather (a parameter, or a whole bucket: Note [Buckets]), shared by every
    handle packed in one forward; dropped when the last handle is unpacked."""

    __slots__ = ("gather", "pending", "buffers")

    def __init__(self, gather) -> None:
        self.gather = gather  # () -> {ParamGather: gathered tensor}
        self.pending = 0
        self.buffers: dict | None = None

    def take(self, param: ParamGather) -> torch.Tensor:
        if self.buffers is None:
            with torch.no_grad():
                # Tagged so collective traces attribute it; the tags are stripped here.
                self.buffers = {a: _gathered_inner(t) for a, t in self.gather().items()}
        buffer = self.buffers[param]
        self.pending -= 1
        if self.pending == 0:
            self.buffers = None
        return buffer


class _PackedView:
    """What autograd stores instead of a zero3 gathered tensor."""

    __slots__ = ("regather", "param", "size", "stride", "offset", "nbytes", "spec")

    def __init__(self, regather: _Regather, param: ParamGather, t: torch.Tensor) -> None:
        inner = _innermost(t)
        self.regather, self.param = regather, param
        self.size, self.stride, self.offset = inner.size(), inner.stride(), inner.storage_offset()
        self.nbytes = inner.untyped_storage().nbytes()
        self.spec = t._spec if isinstance(t, DTensor) else None
        regather.pending += 1

    def unpack(self) -> torch.Tensor:
        buffer = self.regather.take(self.param)
        if buffer.untyped_storage().nbytes() != self.nbytes:
            raise RuntimeError(
                f"fsdptag: re-gathered {self.param.fqn!r} has a "
                f"{buffer.untyped_storage().nbytes()}-byte buffer but the saved view needs "
                f"{self.nbytes}; autograd saved a tensor that is not a view of the gathered "
                "parameter. Please report this with the op that saved it."
            )
        view = buffer.as_strided(self.size, self.stride, self.offset)
        if self.spec is None:
            return view
        return dtensor_of(view, self.spec)


class _PackedWrapper:
    """A tensor subclass around a zero3 gathered tensor (torchao's float8 weight): its
    gathered inner tensor as a :class:`_PackedView`, the others as they are."""

    __slots__ = ("cls", "ctx", "inner", "size", "stride")

    def __init__(self, t: torch.Tensor, inner: dict) -> None:
        self.cls, self.ctx = type(t), t.__tensor_flatten__()[1]
        self.inner, self.size, self.stride = inner, t.size(), t.stride()

    def unpack(self) -> torch.Tensor:
        inner = {n: v.unpack() if isinstance(v, _PackedView) else v for n, v in self.inner.items()}
        return self.cls.__tensor_unflatten__(inner, self.ctx, self.size, self.stride)


def _tagged_inner(t: torch.Tensor) -> tuple[str, torch.Tensor, object] | None:
    """For a traceable tensor subclass (not fsdptag's, DTensor or a collective's) whose
    inner tensor is a gathered parameter: that tensor's name, itself and its tag."""
    if type(t) in (torch.Tensor, nn.Parameter) or isinstance(t, DTensor) or not hasattr(t, "__tensor_flatten__"):
        return None
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        tag = get_fsdp_tag(inner)
        if tag is not None:
            return name, inner, tag
    return None


def _gathered_inner(t: torch.Tensor) -> torch.Tensor:
    """The tensor of a (re-)gather that holds the parameter's gathered bytes."""
    found = _tagged_inner(t)
    return found[1] if found is not None else _innermost(t)


class _Theirs:
    """A tensor packed by someone else's hooks under fsdptag's (Note [Whose saved-tensor
    hooks] in ``_context.py``), and their unpack."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed, unpack) -> None:
        self.packed, self.unpack = packed, unpack


class SavedTensorHooks:
    """fsdptag's pack/unpack hooks (Note [zero3 by saved-tensor hooks]), pushed for the
    root's forward where nobody has hooks and the model has zero3 parameters, and over
    someone else's hooks at the root's or a bucket root's forward (Note [Whose
    saved-tensor hooks] in ``_context.py``)."""

    def __init__(self, params: dict[str, ParamGather], bucket_of: dict[ParamGather, Bucket]) -> None:
        self.params = params  # fqn -> its gather
        self.bucket_of = bucket_of  # a bucketed parameter's bucket (the root's, kept up to date)
        self.zero3 = any(p.tag.reshard_after_forward for p in params.values())
        self._stack: list = []
        self._regathers: dict[str, _Regather] | None = None
        self._theirs: tuple | None = None  # (pack, unpack) fsdptag's hooks were pushed over

    def pre_forward(self) -> None:
        """The root's forward starts."""
        self._stack.append(self._push(self.zero3))

    def post_forward(self) -> None:  # also when forward raised
        self._pop(self._stack.pop())

    @contextlib.contextmanager
    def over_others(self) -> Iterator[None]:
        """A bucket root's forward: on top of someone else's hooks opened inside the
        root's forward (Hugging Face's per-layer offload), if any."""
        entry = self._push(False)
        try:
            yield
        finally:
            self._pop(entry)

    def _push(self, when_none: bool):
        context = gather_context()  # Note [When what applies] in _context.py
        if context is not GatherContext.OTHER_HOOKS and not (context is GatherContext.FORWARD and when_none):
            return None  # no saving, a recompute, a checkpoint region's own hooks
        whose, top = saved_tensor_hooks()
        if whose is Hooks.OTHER or whose is Hooks.NONE:
            ctx = saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            entry = (ctx, self._regathers, self._theirs)
            if self._regathers is None:
                self._regathers = {}
            self._theirs = top
            return entry
        return None

    def _pop(self, entry) -> None:
        if entry is not None:
            ctx, self._regathers, self._theirs = entry
            ctx.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor):
        tag = None if type(t) is nn.Parameter else get_fsdp_tag(t)  # views of a gathered parameter: by its mark
        wrapped = _tagged_inner(t) if tag is None else None  # a float8 weight around one
        if wrapped is not None:
            name, inner, tag = wrapped
            if not tag.reshard_after_forward:
                return t
            names = t.__tensor_flatten__()[0]
            return _PackedWrapper(t, {n: self._pack(inner) if n == name else getattr(t, n) for n in names})
        if tag is None:  # an activation (or a handout that is no copy: it has no tag)
            if self._theirs is None:
                return t
            return _Theirs(self._theirs[0](t), self._theirs[1])
        if not tag.reshard_after_forward:
            return t  # zero2: gathered until backward, where it is
        param = self.params[tag.fqn]
        bucket = self.bucket_of.get(param)
        key = (bucket or param).tag.fqn
        regather = self._regathers.get(key)
        if regather is None:
            if bucket is None:
                regather = self._regathers[key] = _Regather(param.regather)
            else:
                regather = self._regathers[key] = _Regather(functools.partial(regather_bucket, bucket))
                if bucket.shared.prefetcher is not None:
                    bucket.shared.prefetcher.regather_packed(bucket)  # Note [Prefetch] in _prefetch.py
        return _PackedView(regather, param, t)

    setattr(_pack, FSDPTAG_HOOK, True)  # Note [Whose saved-tensor hooks]

    @staticmethod
    def _unpack(x):
        if isinstance(x, (_PackedView, _PackedWrapper)):
            return x.unpack()
        if isinstance(x, _Theirs):
            return x.unpack(x.packed)
        return x
