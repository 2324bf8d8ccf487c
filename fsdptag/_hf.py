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

PEFT's ``PeftModel`` around a transformers model (LoRA) gets the same: ``Trainer``
reads the flag from the model it is handed, and PEFT's own ``save_pretrained`` writes
the adapters alone, so only the entries PEFT picks from the state dict are gathered
(the frozen base model stays sharded).
"""

from __future__ import annotations

import inspect
import sys

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from ._param import disable_active_parametrization
from ._sync import no_sync, set_requires_gradient_sync

__all__ = ["hf_root_methods"]


def _is_peft(cls: type) -> bool:
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in cls.__mro__)


def hf_root_methods(cls: type) -> dict:
    """What a parametrized Hugging Face model's root (a transformers model, or PEFT's
    ``PeftModel`` around one) needs for ``Trainer`` and ``save_pretrained`` (Note
    [Hugging Face Trainer]); nothing for other classes."""
    if _is_peft(cls):
        save = _save_adapters(cls)
    elif hasattr(cls, "is_distributed_loading_by_transformers"):  # a transformers 5 model
        save = _save_pretrained(cls)
    else:
        return {}
    methods = {"is_distributed_loading_by_transformers": property(lambda self: True), "save_pretrained": save}
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


def _save_adapters(cls: type):
    """PEFT's ``save_pretrained``, which writes the adapters alone: only the entries
    PEFT picks are gathered (not the frozen base model), in one order on every rank."""
    signature = inspect.signature(cls.save_pretrained)
    # the function PEFT's own save_pretrained calls, from the module that defines PeftModel
    # (peft is loaded: the model is one), so that fsdptag need not import peft
    peft_model = next(c for c in cls.__mro__ if c.__name__ == "PeftModel")
    get_peft_model_state_dict = sys.modules[peft_model.__module__].get_peft_model_state_dict

    def save_pretrained(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if kwargs.get("state_dict") is not None:  # the caller's own state dict
            return cls.save_pretrained(self, *args, **kwargs)
        with disable_active_parametrization():
            stored = self.state_dict()
            key_of = {id(v): k for k, v in stored.items()}
            picked = {}
            for adapter in bound.arguments.get("selected_adapters") or list(self.peft_config):
                for v in get_peft_model_state_dict(
                        self, state_dict=stored, adapter_name=adapter,
                        save_embedding_layers=bound.arguments.get("save_embedding_layers", "auto")).values():
                    picked[key_of.get(id(v))] = v
            if None in picked:  # PEFT made tensors of its own: gather everything instead
                full = get_model_state_dict(self, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            else:
                full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in sorted(picked.items())}
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if bound.arguments.get("is_main_process", True) and rank0:
            cls.save_pretrained(self, *args, **{**kwargs, "state_dict": full})
        if dist.is_initialized():
            dist.barrier()

    save_pretrained.__doc__ = (
        "Gathers the adapters PEFT saves (every rank must call this) and saves them from rank 0 "
        "through PEFT's ``save_pretrained`` (Note [Hugging Face Trainer] in fsdptag/_hf.py).")
    save_pretrained.__signature__ = signature
    return save_pretrained
