"""One parameter's gather: from the stored shard to the tensor compute uses.

Note [Parametrization]
----------------------
Each parameter is stored as a sharded ``DTensor`` (``Shard(shard_dim)`` for
FSDP, ``Replicate`` for DDP, ``(Replicate, Shard)`` for HSDP; with TP the
data-parallel placements are prepended to the TP placements, using
``_StridedShard`` when TP shards the same dim). The module's class is swapped
for a subclass whose property for each parameter name reads it (Note [Parameter
read] in ``_access.py``), through its :class:`ParamGather` when alone: the shard,
tagged at this boundary (see Note [Tag life cycle] in ``_tag.py``), redistributed
to ``Replicate`` over the data-parallel mesh only (cast to ``param_dtype`` first)
and handed to compute as a plain tensor, or as a DTensor on the TP mesh. The gradient path is DTensor's:
``to_local(grad_placements=Partial("avg"))`` makes backward reduce-scatter
(FSDP), all-reduce (DDP) or both (HSDP) in ``reduce_dtype``. A parameter in a
bucket is served by the bucket instead while its root's ``forward`` runs (Note
[Buckets] in ``_bucket.py``).

Because ``state_dict()`` and optimizers read ``module._parameters`` directly,
they see only the stored DTensors: no collective, no tagged tensor.

Note [Compiled gathers]
-----------------------
Inside ``torch.compile`` (``torch.compiler.is_compiling()``) the eager runtime
steps aside: no scopes, prefetch, zero3 saved-tensor hooks or tags; the root's
hooks only cast inputs. A bucket is gathered in the graph as one all-gather (Note
[Compiled buckets] in ``_compiled.py``); a parameter gathered alone, untagged
(``gather_in_graph``: the same ``redistribute`` with the dtype cast, so the values
are bitwise those of eager), SimpleFSDP style:

* zero3: the gather runs in a checkpoint region whose policy recomputes
  everything, so the compiled backward re-gathers (in eager this frees nothing,
  see the README; compiled, the partitioner honours it).
* zero2: the gather runs in a checkpoint region whose policy saves everything, so
  inside someone else's checkpoint (a plain ``checkpoint``, Hugging Face's
  ``gradient_checkpointing_enable()``) the compiled backward still re-gathers
  nothing: the partitioner honours the inner region's tags.
* zero2 under ``apply_ac``: a checkpointed block's zero2 parameters are gathered
  *before* its checkpoint region opens (``pregather`` in ``_state.py``) and read
  from ``ParamGather.pregathered`` inside it, so the region gets them as inputs and
  the user's policy sees only the region's own ops (TP collectives, activation
  casts), as in eager.
* Any compiled checkpoint of this DTensor code with attention needs fsdptag's fix
  of a torch 2.13 partitioner bug (Note [Compiled checkpoint, DeviceMesh saved] in
  ``_compat/compiled.py``), installed by ``parametrize``.
* TP compiles with the whole model (``torch.compile(model)``). A TP parameter
  gathered in a block compiled on its own is refused with a clear error: torch
  2.13 cannot compile a sequence-parallel block alone (the gradient of its DTensor
  input crosses the compiled boundary as a plain tensor; docs/compile.md), with or
  without fsdptag. ``RootForward.traced`` tells the two apart: the root's pre-forward
  hook sets it while dynamo traces it, so it is True only inside a compiled root.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ._api import MixedPrecisionPolicy
from ._collectives import DivideGradient
from ._compat import contiguous_strides, local_of, sac_hidden
from ._context import RootForward, gather_context, in_inference
from ._keep import KeptGather, Keeper, ServeAllGather
from ._handout import alias, check_unchanged, refuse_in_place, tag_shard, untag
from ._tag import FSDPTag

__all__ = [
    "Handouts",
    "ParamGather",
    "ParamModuleInfo",
    "disable_active_parametrization",
    "disable_tagging",
    "flags",
    "makes_copy",
]


class _Flags:
    """Process-wide switches, deliberately not thread-local: on CUDA the autograd
    engine runs backward (and so every checkpoint recompute) on a per-device thread of
    its own, which must see what the forward saw, or a recompute replays other ops
    than its forward ran (``tests/unit/test_threads.py``)."""

    active = True  # parameter access gathers (False: it returns the stored DTensor)
    tagging = True  # gathers carry the tag (False: for overhead measurements only)


flags = _Flags()


@contextlib.contextmanager
def _set_flag(name: str, value: bool) -> Iterator[None]:
    previous = getattr(flags, name)
    setattr(flags, name, value)
    try:
        yield
    finally:
        setattr(flags, name, previous)


def disable_active_parametrization() -> contextlib.AbstractContextManager[None]:
    """Within this context, parameter access returns the stored sharded DTensor.

    Use it to initialize weights after meta-device construction, or to inspect or
    modify the stored shards.

    Example::

        >>> with torch.device("meta"):
        ...     model = Model()
        >>> fsdptag.parametrize(model, mesh)
        >>> model.to_empty(device="cpu")
        >>> with fsdptag.disable_active_parametrization():
        ...     model.reset_parameters()
    """
    return _set_flag("active", False)


def disable_tagging() -> contextlib.AbstractContextManager[None]:
    """Gather parameters without the provenance tag (to measure the tag's overhead).

    Without tags the checkpoint policy cannot see FSDP results and zero3 keeps
    gathered parameters like zero2; use it for measurements only.
    """
    return _set_flag("tagging", False)


def makes_copy(collective: bool, param_dtype: torch.dtype | None, stored_dtype: torch.dtype) -> bool:
    """Whether a gather makes a new tensor (a collective or a cast); DDP without a
    cast hands out the stored parameter itself, as plain DDP does."""
    return collective or param_dtype not in (None, stored_dtype)


@dataclass(eq=False)
class ParamModuleInfo:
    """Where one stored parameter is registered (FSDP2's record of the same name):
    ``module.name``, and for tied weights every further ``(module, name)``."""

    module: nn.Module
    name: str
    shared_modules: list[nn.Module] = field(default_factory=list)
    shared_names: list[str] = field(default_factory=list)

    @property
    def stored(self) -> DTensor:
        """The stored (sharded) parameter."""
        return self.module._parameters[self.name]

    def registrations(self) -> Iterator[tuple[nn.Module, str]]:
        yield self.module, self.name
        yield from zip(self.shared_modules, self.shared_names)


def _recompute_all_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _save_all_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


def recompute_everything():
    """zero3 in compiled code: the compiler re-gathers in backward (SimpleFSDP's regional AC)."""
    return create_selective_checkpoint_contexts(_recompute_all_policy)


def save_everything():
    """zero2 in compiled code: saved even inside someone else's checkpoint region."""
    return create_selective_checkpoint_contexts(_save_all_policy)


@torch.compiler.disable  # runs (and raises) eagerly: a raise traced by dynamo would fall back to eager
def _refuse_compiled_tp(fqn: str) -> None:
    raise NotImplementedError(
        f"fsdptag: {fqn!r} is a TP parameter in a torch.compile'd block, but the model's root "
        "is not compiled with it. torch 2.13 cannot compile a sequence-parallel block on its "
        "own (the gradient of its DTensor input comes back as a plain tensor, without fsdptag "
        "too: docs/compile.md); compile the whole model instead: torch.compile(model)."
    )


class ParamGather:
    """Turns one stored (sharded) parameter into the gathered tensor compute uses;
    see Note [Parametrization]."""

    def __init__(
        self,
        tag: FSDPTag,
        module_info: ParamModuleInfo,
        dp_mesh: DeviceMesh,
        dp_placements: tuple[Placement, ...],
        dp_shape: torch.Size,
        mp: MixedPrecisionPolicy,
        tp_mesh: DeviceMesh | None,
        tp_placements: tuple[Placement, ...],
        shape: torch.Size,
        forward: RootForward,
        divide: float | None = None,
    ) -> None:
        self.tag = tag
        self.module_info = module_info
        self.dp_mesh = dp_mesh
        self.dp_placements = dp_placements
        # Whether the gather runs a collective: not for DDP, nor over a size-1 shard dim.
        self.collective = any(not isinstance(p, Replicate) and dp_mesh.size(i) > 1
                              for i, p in enumerate(dp_placements))
        self.dp_shape = dp_shape  # shape of the tensor the dp mesh shards (TP-local for TP params)
        self.dp_stride = contiguous_strides(dp_shape)
        self.compute_placements = (Replicate(),) * dp_mesh.ndim
        # averaged over its own mesh, or summed and divided by ``divide`` (Note [Meshes per module])
        self.divide = divide
        self.grad_placements = (Partial("avg" if divide is None else "sum"),) * dp_mesh.ndim
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype
        self.tp_mesh = tp_mesh
        self.tp_placements = tp_placements
        self.shape = shape
        self.stride = contiguous_strides(shape)
        self.forward = forward  # the model's open root forwards: training? traced?
        self.float8 = None  # a torchao float8 weight's Float8Weight (Note [Float8 all-gather])
        self.pregathered: torch.Tensor | None = None  # Note [Compiled gathers]
        # zero2 gathers kept for a checkpoint's recompute (Note [zero2 kept until backward])
        self.keeper = (Keeper(forward.training)
                       if not tag.reshard_after_forward and self.collective else None)

    @property
    def fqn(self) -> str:
        return self.tag.fqn

    def copies(self, stored: DTensor) -> bool:
        return makes_copy(self.collective, self.param_dtype, stored.dtype)

    def gather(self, stored: DTensor, *, tagged: bool, copies: bool | None = None) -> torch.Tensor:
        """All-gather ``stored`` over the dp mesh; differentiable."""
        if copies is None:
            copies = self.copies(stored)
        # No FSDP op, or nothing to checkpoint (inference_mode): no tag (Note [Marked
        # handout] in _tag.py).
        tagged = tagged and copies and not in_inference()
        with sac_hidden() if copies and gather_context().hides_fsdp_ops else contextlib.nullcontext():
            return self._gather_kept(stored, tagged, copies)  # Note [Whose selective policy] in _context.py

    def _gather_kept(self, stored: DTensor, tagged: bool, copies: bool) -> torch.Tensor:
        if self.keeper is None or not tagged:
            return self._gather(stored, tagged, copies)
        kept = self.keeper.find([stored])  # a recompute: serve the forward's all-gather
        if kept is not None:
            with ServeAllGather(kept.pieces[0]):
                out = self._gather(stored, tagged, copies)
            self.keeper.adopt(kept, out.grad_fn)
            return out
        how = self.keeper.how_to_keep()
        out = self._gather(stored, tagged, copies)
        if how is not None:  # the handout's storage is the all-gather output (TP: its local tensor's)
            local = local_of(out) if isinstance(out, DTensor) else out
            self.keeper.keep(KeptGather((local,), [stored], self.keeper), how, out.grad_fn)
        return out

    def _gather(self, stored: DTensor, tagged: bool, copies: bool) -> torch.Tensor:
        local = stored.to_local()
        if self.divide is not None:
            local = DivideGradient.apply(local, self.divide)
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

    def traced(self, stored: DTensor) -> torch.Tensor:
        """The gather inside ``torch.compile``d code (Note [Compiled gathers])."""
        if not self.copies(stored):
            return self.gather_in_graph(stored)
        return checkpoint(self.gather_in_graph, stored, use_reentrant=False,
                          context_fn=recompute_everything if self.tag.reshard_after_forward else save_everything)

    def gather_in_graph(self, stored: DTensor) -> torch.Tensor:
        """The untagged gather compiled code runs (Note [Compiled gathers])."""
        self.check_compilable()
        return self._gather(stored, False, self.copies(stored))

    def check_compilable(self) -> None:
        """A TP parameter compiles only inside a compiled root (Note [Compiled gathers])."""
        if self.tp_mesh is not None and not self.forward.traced:
            _refuse_compiled_tp(self.fqn)

    def regather(self) -> dict[ParamGather, torch.Tensor]:
        """A fresh tagged gather, as the zero3 hooks re-gather (Note [zero3 by saved-tensor hooks])."""
        return {self: self.gather(self.module_info.stored, tagged=True)}

    def on_tp_mesh(self, full: torch.Tensor) -> torch.Tensor:
        """The gathered (TP-local) tensor as compute sees it: a DTensor on the TP mesh
        for TP parameters, else as is."""
        if self.tp_mesh is None:
            return full
        return DTensor.from_local(
            full, self.tp_mesh, self.tp_placements, run_check=False,
            shape=self.shape, stride=self.stride,
        )


class Handouts:
    """The check that rejects in-place changes to parameters gathered alone (a
    bucket's are checked when its root's ``forward`` returns).

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
        if self._frame is not None and not in_inference():  # no versions there
            self._frame.append((weakref.ref(t), t._version, fqn))

    def open(self) -> None:
        # One frame: a forward that raised leaves it, replaced here; a nested call of the
        # root's forward would start afresh (and its caller's handouts go unchecked).
        self._frame = []

    def close(self, check: bool) -> None:
        handed, self._frame = self._frame, None
        if check:
            check_unchanged((ref(), version, fqn) for ref, version, fqn in handed or ())
