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

import functools

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from ._tag import get_fsdp_tag, innermost as _innermost


class _Regather:
    """One re-gather (a parameter, or a whole bucket: Note [Buckets]), shared by every
    handle packed in one forward; dropped when the last handle is unpacked."""

    __slots__ = ("gather", "pending", "buffers")

    def __init__(self, gather) -> None:
        self.gather = gather  # () -> {access: gathered tensor}
        self.pending = 0
        self.buffers: dict | None = None

    def take(self, access) -> torch.Tensor:
        if self.buffers is None:
            with torch.no_grad():
                # Tagged so collective traces attribute it; the tags are stripped here.
                self.buffers = {a: _innermost(t) for a, t in self.gather().items()}
        buffer = self.buffers[access]
        self.pending -= 1
        if self.pending == 0:
            self.buffers = None
        return buffer


class _PackedView:
    """What autograd stores instead of a zero3 gathered tensor."""

    __slots__ = ("regather", "access", "size", "stride", "offset", "nbytes", "spec")

    def __init__(self, regather: _Regather, access, t: torch.Tensor) -> None:
        inner = _innermost(t)
        self.regather, self.access = regather, access
        self.size, self.stride, self.offset = inner.size(), inner.stride(), inner.storage_offset()
        self.nbytes = inner.untyped_storage().nbytes()
        self.spec = t._spec if isinstance(t, DTensor) else None
        regather.pending += 1

    def unpack(self) -> torch.Tensor:
        buffer = self.regather.take(self.access)
        if buffer.untyped_storage().nbytes() != self.nbytes:
            raise RuntimeError(
                f"fsdptag: re-gathered {self.access.tag.fqn!r} has a "
                f"{buffer.untyped_storage().nbytes()}-byte buffer but the saved view needs "
                f"{self.nbytes}; autograd saved a tensor that is not a view of the gathered "
                "parameter. Please report this with the op that saved it."
            )
        view = buffer.as_strided(self.size, self.stride, self.offset)
        if self.spec is None:
            return view
        return DTensor(view, self.spec, requires_grad=False)


class Zero3SavedTensorHooks:
    """Root-module forward hooks that push the zero3 pack/unpack hooks."""

    def __init__(self, accesses: dict) -> None:
        self.accesses = accesses  # fqn -> (module, name, _ParamAccess)
        self._stack: list = []
        self._regathers: dict[str, _Regather] | None = None

    @classmethod
    def install(cls, model: nn.Module, accesses: dict) -> None:
        if not any(access.tag.reshard_after_forward for _, _, access in accesses.values()):
            return
        hooks = cls(accesses)
        model.register_forward_pre_hook(hooks._enter)
        model.register_forward_hook(hooks._exit, always_call=True)

    def _enter(self, module, args) -> None:
        usable = (
            torch.is_grad_enabled()
            and torch._C._current_graph_task_id() == -1  # not a recompute inside backward
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        )
        if not usable:
            self._stack.append(None)
            return
        ctx = saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._stack.append((ctx, self._regathers))
        self._regathers = {}

    def _exit(self, module, args, output) -> None:
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
        module, name, access = self.accesses[tag.fqn]  # (a handout that is no copy has no tag)
        bucket = access.bucket
        key = bucket.name if bucket is not None else tag.fqn
        regather = self._regathers.get(key)
        if regather is None:
            if bucket is not None:
                gather = functools.partial(bucket.gather, tagged=True)
            else:
                def gather(module=module, name=name, access=access):
                    return {access: access.gather(module._parameters[name], tagged=True)}
            regather = self._regathers[key] = _Regather(gather)
        return _PackedView(regather, access, t)

    @staticmethod
    def _unpack(x):
        return x.unpack() if isinstance(x, _PackedView) else x
