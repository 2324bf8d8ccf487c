"""Where a gather runs: the ambient state fsdptag reads, decided in one place, and
what zero2 and zero3 do there.

Note [When what applies]
------------------------
Every eager gather of a parameter or bucket runs in one :class:`GatherContext`,
computed from torch's ambient state by :func:`gather_context` (nothing else in the
runtime asks torch whether it is in backward, in a selective-checkpoint region, in
inference mode, or whose saved-tensor hooks are on top). The tables ``ZERO2`` and
``ZERO3`` say what becomes of the gathered parameter in each (the forms of zero2 are
Note [zero2 kept until backward] in ``_keep.py``; zero3's, Note [zero3 by saved-tensor
hooks] in ``_reshard.py``); ``tests/unit/test_context.py`` pins both tables and
produces every context for real:

=============  ====================================  ========================================  ======================================
context        when                                  zero2                                     zero3
=============  ====================================  ========================================  ======================================
inference      ``torch.inference_mode``              nothing is saved                          nothing is saved
no grad        grad off outside a training forward   nothing is saved                          nothing is saved
reentrant      grad off inside a training forward    kept by the bucket until the recompute    the recompute gathers again
               (a reentrant checkpoint's forward)    takes it over (pin)
forward        a training forward, nobody else's     autograd saves the handout                fsdptag's hooks save a re-gather handle
               saved-tensor hooks on top
checkpoint     a non-reentrant checkpoint region     kept by the gather's node until its       the recompute gathers again
                                                     backward (node)
sac            a selective-checkpoint region whose   the policy saves the all-gather           the policy recomputes it
               policy decides FSDP ops (fsdptag's)   (Note [Tagged checkpoint policy])
foreign sac    a selective-checkpoint region of      kept by the gather's node, unseen by the  the recompute gathers again, unseen
               anyone else's policy                  policy (Note [Whose selective policy])    by the policy
other hooks    someone else's saved-tensor hooks     kept by the gather's node (it may be a    fsdptag's hooks save a re-gather handle
               (save_on_cpu, a profiler)             checkpoint), and fsdptag's hooks keep     (composed over them)
                                                     it on the device
recompute      in backward, outside SAC regions      served from the kept gather               gathered, once per bucket
sac recompute  in backward, in a SAC region          the policy replays the saved all-gather   gathered, once per bucket
foreign sac    in backward, in a foreign SAC region  served from the kept gather, unseen by    gathered, once per bucket, unseen
recompute                                            the policy                                by the policy
=============  ====================================  ========================================  ======================================

Note [Whose selective policy]
-----------------------------
A selective-checkpoint policy sees op names, and FSDP's all-gather is named as TP's
(the mission's first fact). fsdptag's tagged policy tells them apart by tag; any other
policy (torchtitan's op list, ``create_selective_checkpoint_contexts`` with a user's
function) would save the FSDP all-gathers with the TP ones (zero3 kept gathered) or
recompute them (zero2 re-gathered in backward). So in a region whose policy does not
carry ``DECIDES_FSDP_OPS`` (``fsdptag.checkpoint_policy`` and everything built on it
do), fsdptag's gathers run unseen by the region (``sac_hidden``), in its forward and
its recompute alike, so the policy's per-op replay stays in step: zero2 keeps the
gather on its node and serves it in the recompute (Note [zero2 kept until backward]),
zero3 gathers again there, and the policy decides every other op (TP collectives,
activation casts) as its author meant. A policy that wants FSDP ops for itself (the
baselines in ``fsdptag/tools/baselines.py``) sets the marker.

Note [Whose saved-tensor hooks]
-------------------------------
Autograd hands every tensor it saves to the innermost active ``saved_tensors_hooks``.
Which those are decides what fsdptag does with a gathered parameter that an op saves:

===============  =========================================  ============================================
innermost hooks  who pushed them                            zero3 / zero2 gathered parameters
===============  =========================================  ============================================
none             nobody (a plain forward)                   zero3: the root pushes fsdptag's (a re-gather
                                                            handle, Note [zero3 by saved-tensor hooks]);
                                                            zero2: saved as they are
fsdptag          fsdptag (root or bucket-root forward)      handled by them; everything else goes on to
                                                            the hooks they were pushed over, if any
checkpoint       a non-reentrant checkpoint region          the region's policy or recompute decides
                 (``torch.utils.checkpoint``)               (Note [Tagged checkpoint policy]); zero2
                                                            gathers are kept for the recompute (Note
                                                            [zero2 kept until backward])
other            anyone else: ``save_on_cpu``, a memory     fsdptag pushes its hooks over them, composed:
                 profiler, Hugging Face's ``offload=True``  zero3 -> the re-gather handle, zero2 -> kept
                                                            as is (on the device), every other tensor ->
                                                            the other hooks, unchanged
===============  =========================================  ============================================

So someone else's hooks see activations only: under ``save_on_cpu`` zero3 still
re-gathers once per bucket in backward and zero2 keeps its gathers on the device,
instead of copying gathered weights to host and back. fsdptag's hooks go on top
where the root's ``forward`` starts and where each bucket root's ``forward`` starts
(for hooks opened around a block, as Hugging Face's offload does).
``tests/unit/test_saved_tensor_hooks.py`` pins the table.
"""

from __future__ import annotations

import enum

import torch

from ._compat import (current_sac_region, in_backward, is_checkpoint_hook, sac_policy_decides_fsdp_ops,
                      top_saved_tensor_hooks)

__all__ = ["FSDPTAG_HOOK", "GatherContext", "Hooks", "RootForward", "ZERO2", "ZERO3", "Zero2", "Zero3", "gather_context",
           "grad_mode_trains", "in_inference", "running_backward", "sac_region", "saved_tensor_hooks"]

running_backward = in_backward  # the autograd engine runs this code (backward, or a recompute in it)
sac_region = current_sac_region  # the innermost selective-checkpoint region now (its mode), or None
in_inference = torch.is_inference_mode_enabled


def grad_mode_trains() -> bool:
    """Grad on and no inference mode: what a training forward starts in."""
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

FSDPTAG_HOOK = "_fsdptag_hook"  # marks fsdptag's own pack function


class Hooks(enum.Enum):
    """Whose saved-tensor hooks are innermost (Note [Whose saved-tensor hooks])."""

    NONE = "none"
    FSDPTAG = "fsdptag"
    CHECKPOINT = "checkpoint"
    OTHER = "other"


def saved_tensor_hooks() -> tuple[Hooks, tuple | None]:
    """Whose saved-tensor hooks are innermost now, and their ``(pack, unpack)``."""
    top = top_saved_tensor_hooks()
    if top is None:
        return Hooks.NONE, None
    if getattr(top[0], FSDPTAG_HOOK, False):
        return Hooks.FSDPTAG, top
    if is_checkpoint_hook(top[0]):
        return Hooks.CHECKPOINT, top
    return Hooks.OTHER, top


class GatherContext(enum.Enum):
    """Where an eager gather runs (Note [When what applies])."""

    INFERENCE = "inference"
    NO_GRAD = "no grad"
    REENTRANT = "reentrant"
    FORWARD = "forward"
    CHECKPOINT = "checkpoint"
    SAC = "sac"
    FOREIGN_SAC = "foreign sac"
    OTHER_HOOKS = "other hooks"
    RECOMPUTE = "recompute"
    SAC_RECOMPUTE = "sac recompute"
    FOREIGN_SAC_RECOMPUTE = "foreign sac recompute"

    @property
    def in_backward(self) -> bool:
        return self in (GatherContext.RECOMPUTE, GatherContext.SAC_RECOMPUTE, GatherContext.FOREIGN_SAC_RECOMPUTE)

    @property
    def hides_fsdp_ops(self) -> bool:
        """Whether fsdptag's gathers run unseen by the region's policy (Note [Whose
        selective policy])."""
        return self in (GatherContext.FOREIGN_SAC, GatherContext.FOREIGN_SAC_RECOMPUTE)


def gather_context(training_forward: bool = False) -> GatherContext:
    """The context of a gather running now; ``training_forward``: the innermost open root
    forward began with grad on (tells a reentrant checkpoint's forward from ``no_grad``)."""
    if torch.is_inference_mode_enabled():
        return GatherContext.INFERENCE
    sac = current_sac_region()
    if sac is not None and not sac_policy_decides_fsdp_ops(sac):  # Note [Whose selective policy]
        return GatherContext.FOREIGN_SAC_RECOMPUTE if in_backward() else GatherContext.FOREIGN_SAC
    if in_backward():
        return GatherContext.SAC_RECOMPUTE if sac is not None else GatherContext.RECOMPUTE
    if sac is not None:
        return GatherContext.SAC
    if not torch.is_grad_enabled():
        return GatherContext.REENTRANT if training_forward else GatherContext.NO_GRAD
    whose, _ = saved_tensor_hooks()
    if whose is Hooks.CHECKPOINT:
        return GatherContext.CHECKPOINT
    if whose is Hooks.OTHER:
        return GatherContext.OTHER_HOOKS
    return GatherContext.FORWARD


class Zero2(enum.Enum):
    """How a zero2 gather stays gathered until backward (Note [zero2 kept until backward])."""

    NOTHING = "nothing is saved"
    AUTOGRAD = "autograd saves the handout"
    KEEP_ON_NODE = "kept by the gather's node until its backward"
    PIN = "kept by the bucket until the recompute takes it over"
    POLICY = "the checkpoint policy saves or replays the all-gather"
    SERVE_KEPT = "served from the kept gather"


class Zero3(enum.Enum):
    """How a zero3 gather is freed after forward and gathered again in backward."""

    NOTHING = "nothing is saved"
    REGATHER_HANDLE = "fsdptag's hooks save a re-gather handle"
    RECOMPUTE = "the recompute gathers again"
    POLICY = "the policy recomputes it"
    GATHER = "gathered, once per bucket"


_C = GatherContext
ZERO2: dict[GatherContext, Zero2] = {
    _C.INFERENCE: Zero2.NOTHING, _C.NO_GRAD: Zero2.NOTHING, _C.REENTRANT: Zero2.PIN,
    _C.FORWARD: Zero2.AUTOGRAD, _C.CHECKPOINT: Zero2.KEEP_ON_NODE, _C.SAC: Zero2.POLICY,
    _C.OTHER_HOOKS: Zero2.KEEP_ON_NODE, _C.RECOMPUTE: Zero2.SERVE_KEPT, _C.SAC_RECOMPUTE: Zero2.POLICY,
    _C.FOREIGN_SAC: Zero2.KEEP_ON_NODE, _C.FOREIGN_SAC_RECOMPUTE: Zero2.SERVE_KEPT,
}
ZERO3: dict[GatherContext, Zero3] = {
    _C.INFERENCE: Zero3.NOTHING, _C.NO_GRAD: Zero3.NOTHING, _C.REENTRANT: Zero3.RECOMPUTE,
    _C.FORWARD: Zero3.REGATHER_HANDLE, _C.CHECKPOINT: Zero3.RECOMPUTE, _C.SAC: Zero3.POLICY,
    _C.OTHER_HOOKS: Zero3.REGATHER_HANDLE, _C.RECOMPUTE: Zero3.GATHER, _C.SAC_RECOMPUTE: Zero3.GATHER,
    _C.FOREIGN_SAC: Zero3.RECOMPUTE, _C.FOREIGN_SAC_RECOMPUTE: Zero3.GATHER,
}


class RootForward:
    """The open root ``forward`` calls of one parametrized model: whether the innermost
    began with grad on (tells a reentrant checkpoint's forward from ``no_grad``) and
    whether dynamo is tracing one (Note [Compiled gathers] in ``_param.py``). The root
    (``RootState`` in ``_state.py``) opens and closes them; its parameters and buckets
    are handed this record, not the root."""

    def __init__(self) -> None:
        self._training: list[bool] = []  # per open root forward: began with grad on
        self.traced = False

    def training(self) -> bool:
        return bool(self._training) and self._training[-1]

    def open(self, training: bool) -> None:
        self._training.append(training)

    def close(self) -> None:
        self._training.pop()
