"""Hugging Face's ``Trainer`` and ``save_pretrained`` on a parametrized model.

Note [Hugging Face Trainer]
---------------------------
``Trainer`` (transformers 5.x) treats a model that holds its own sharding as one
``from_pretrained(distributed_config=...)`` sharded: when the model's
``is_distributed_loading_by_transformers`` is true it neither moves it (``.to``) nor
wraps it in DDP (whose broadcast mixes DTensor and plain tensors and fails), it
accumulates gradients under the model's own ``no_sync()``, and every rank calls
``save_pretrained(..., is_main_process=should_save)`` so that the ranks can gather
together. A parametrized Hugging Face model's root class therefore answers true, has
FSDP2's ``no_sync`` / ``set_requires_gradient_sync`` (``_sync.py``), and a
``save_pretrained`` that every rank calls: without a ``state_dict`` it gathers the full
one (every rank takes part, only rank 0 keeps it, on CPU) and rank 0, the one rank
Hugging Face writes from, saves it through the model's own ``save_pretrained``. A
state dict of the stored shards could not be saved as is: one bucket's shards share
a buffer, which ``save_pretrained`` takes for tied weights. ``Trainer`` cannot save a
self-sharded model's optimizer state (it asks for ``save_only_model=True``); resume
with DCP (``examples/finetune_hf.py``).
"""

from __future__ import annotations

import inspect

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ._param import disable_active_parametrization
from ._sync import no_sync, set_requires_gradient_sync

__all__ = ["hf_root_methods"]


def hf_root_methods(cls: type) -> dict:
    """What a parametrized Hugging Face model's root needs for ``Trainer`` and
    ``save_pretrained`` (Note [Hugging Face Trainer]); nothing for other classes."""
    if not hasattr(cls, "is_distributed_loading_by_transformers"):  # not a transformers 5 model
        return {}
    methods = {"is_distributed_loading_by_transformers": property(lambda self: True),
               "save_pretrained": _save_pretrained(cls)}
    if not hasattr(cls, "no_sync"):  # both take the module first, as a method's self
        methods["no_sync"] = no_sync
    if not hasattr(cls, "set_requires_gradient_sync"):
        methods["set_requires_gradient_sync"] = set_requires_gradient_sync
    return methods


def _save_pretrained(cls: type):
    signature = inspect.signature(cls.save_pretrained)

    def save_pretrained(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("state_dict") is not None:  # the caller's own state dict
            return cls.save_pretrained(self, *args, **kwargs)
        if bound.arguments.get("distributed_checkpoint"):  # DCP of the stored shards, every rank writes
            with disable_active_parametrization():
                return cls.save_pretrained(self, *args, **kwargs)
        with disable_active_parametrization():  # every rank gathers; rank 0 holds the result
            full = get_model_state_dict(self, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out = None
        if self.should_save_on_this_rank(bound.arguments.get("is_main_process", True)):  # rank 0
            bound.arguments["state_dict"] = full
            out = cls.save_pretrained(*bound.args, **bound.kwargs)
        if dist.is_initialized():
            dist.barrier()  # the files exist on every rank's return
        return out

    save_pretrained.__doc__ = (
        "Gathers the full state dict (every rank must call this) and saves it from rank 0 "
        "through Hugging Face's ``save_pretrained`` (Note [Hugging Face Trainer] in fsdptag/_hf.py).")
    save_pretrained.__signature__ = signature
    return save_pretrained
