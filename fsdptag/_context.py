"""Where a gather runs, as far as saved tensors go: whose saved-tensor hooks are active.

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

from ._compat import is_checkpoint_hook, top_saved_tensor_hooks

__all__ = ["FSDPTAG_HOOK", "Hooks", "saved_tensor_hooks"]

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
