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
tables, biases) are never packed, so never re-gathered.

Hooks are installed only when no other saved-tensor hooks are active and we
are not inside backward. Inside an activation-checkpointed region
``torch.utils.checkpoint`` owns the saved tensors (its hooks are innermost), and
there fsdptag's checkpoint policy decides; the region's recompute runs in
backward, so the root's hooks are never pushed a second time. This is what keeps
a checkpointed zero3 block at one re-gather per parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from ._compat import in_backward, others_saved_tensor_hooks_active
from ._keep import FSDPTAG_HOOK
from ._param import ParamGather
from ._tag import get_fsdp_tag, innermost as _innermost

__all__ = ["Zero3SavedTensorHooks"]


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
                self.buffers = {a: _innermost(t) for a, t in self.gather().items()}
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
        return DTensor(view, self.spec, requires_grad=False)


class Zero3SavedTensorHooks:
    """The zero3 pack/unpack hooks, pushed for the root's forward by its state."""

    def __init__(self, params: dict[str, ParamGather]) -> None:
        self.params = params  # fqn -> its gather
        self._stack: list = []
        self._regathers: dict[str, _Regather] | None = None

    def pre_forward(self) -> None:
        usable = (
            torch.is_grad_enabled()
            and not in_backward()  # not a recompute inside backward
            and not others_saved_tensor_hooks_active()
        )
        if not usable:
            self._stack.append(None)
            return
        ctx = saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._stack.append((ctx, self._regathers))
        self._regathers = {}

    def post_forward(self) -> None:  # also when forward raised
        entry = self._stack.pop()
        if entry is not None:
            ctx, self._regathers = entry
            ctx.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor):
        if type(t) is nn.Parameter:
            return t
        tag = get_fsdp_tag(t)  # views of a gathered parameter: by its mark
        if tag is None or not tag.reshard_after_forward:
            return t
        param = self.params[tag.fqn]  # (a handout that is no copy has no tag)
        source = param.bucket if param.bucket is not None else param
        regather = self._regathers.get(source.tag.fqn)
        if regather is None:
            regather = self._regathers[source.tag.fqn] = _Regather(source.regather)
        return _PackedView(regather, param, t)

    setattr(_pack, FSDPTAG_HOOK, True)  # not a user's checkpoint (Note [zero2 kept until backward])

    @staticmethod
    def _unpack(x):
        return x.unpack() if isinstance(x, _PackedView) else x
