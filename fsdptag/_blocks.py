"""What a "block" is: one definition for ``bucket="blocks"`` and ``apply_ac``.

Note [Blocks]
-------------
A block is a child of an ``nn.ModuleList`` or ``nn.ModuleDict`` that is not itself
inside another block. That finds, at any depth:

=======================================  ==================================
model                                    blocks
=======================================  ==================================
fsdptag's Llama, torchtitan (older)      ``layers.0``, ``layers.1`` (ModuleList)
torchtitan (current)                     ``layers.0``, ... (ModuleDict)
Hugging Face Llama-style                 ``model.layers.0``, ... (ModuleList)
Hugging Face GPT-2                       ``transformer.h.0``, ...
a block holding a ModuleList (experts)   the block only: its experts are inside it
a block in ``checkpoint_wrapper``        the wrapped block (``layers.0._checkpoint_wrapped_module``)
(torchtitan's AC, FSDP1-era code)
=======================================  ==================================

A checkpoint wrapper runs its block in the checkpoint region, so the block, not the
wrapper, is the bucket root: the gather scope opens inside the region, and a
selective region gathers its bucket once (Note [Buckets] in ``_bucket.py``) where the
wrapper as root made every parameter gather alone.

FSDP2 users wrap the same modules (``fully_shard`` per block, then the root), and
torchtitan and Hugging Face checkpoint the same modules, so a bucket and a
checkpointed region coincide: the region gathers its bucket once in forward.
Any other module ``apply_ac`` checkpoints becomes a bucket root of its own (Note
[Checkpointed bucket roots] in ``_bucket.py``).
Pass ``blocks=`` to ``apply_ac`` or a callable ``bucket=`` to ``parametrize`` for
another choice.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["AC_CONTEXT_FN", "WRAPPED", "find_blocks", "is_checkpointed"]

AC_CONTEXT_FN = "_fsdptag_ac_context_fn"  # a block checkpointed by apply_ac: its context_fn, in its __dict__


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``fsdptag.apply_ac`` checkpointed ``module``: it is then a bucket root
    (Note [Checkpointed bucket roots] in ``_bucket.py``)."""
    return AC_CONTEXT_FN in module.__dict__


WRAPPED = "_checkpoint_wrapped_module"  # torch's CheckpointWrapper (torchtitan's AC): the block it wraps


def _unwrapped(fqn: str, module: nn.Module) -> tuple[str, nn.Module]:
    """The block itself, inside any checkpoint wrappers around it."""
    while isinstance(getattr(module, WRAPPED, None), nn.Module):
        fqn, module = f"{fqn}.{WRAPPED}", getattr(module, WRAPPED)
    return fqn, module


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` of every block of ``model`` (Note [Blocks]), in module order."""
    blocks: list[tuple[str, nn.Module]] = []

    def visit(fqn: str, module: nn.Module) -> None:
        is_container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
        for name, child in module.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            if is_container:  # its own children are inside a block
                blocks.append(_unwrapped(child_fqn, child))
            else:
                visit(child_fqn, child)

    visit("", model)
    return blocks
