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
self-sharded model's optimizer state (it asks for ``save_only_model=True``):
``TrainerCheckpointMixin`` (Note [Trainer checkpoints]) gives it that.

PEFT's ``PeftModel`` around a transformers model (LoRA) gets the same: ``Trainer``
reads the flag from the model it is handed, and PEFT's own ``save_pretrained`` writes
the adapters alone, so only the entries PEFT picks from the state dict are gathered
(the frozen base model stays sharded).
"""

from __future__ import annotations

import inspect
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from ._param import disable_active_parametrization
from ._state import is_parametrized
from ._sync import no_sync, set_requires_gradient_sync

__all__ = ["TrainerCheckpointMixin", "hf_root_methods"]


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


# Note [Trainer checkpoints]
# --------------------------
# ``Trainer`` saves a checkpoint (``checkpoint-N/``) as the model's ``save_pretrained``,
# then, unless ``save_only_model``, the optimizer and scheduler, the per-rank RNG states
# and ``trainer_state.json``; ``train(resume_from_checkpoint=...)`` reads them back. Its
# optimizer file is ``torch.save`` of rank 0's ``state_dict()``: rank 0's shards only, so
# for a model that holds its own sharding ``Trainer.__init__`` refuses (``save_only_model
# =True`` or ``save_strategy="no"``). The mixin saves what resuming needs as a DCP
# checkpoint instead (``checkpoint-N/fsdptag_dcp/``: the model's and the optimizer's
# sharded state dicts, every rank writing its own shards, as FSDP2 under accelerate's
# SHARDED_STATE_DICT), and reads the model and the optimizer from it on resume; the
# scheduler, scaler, RNG states and trainer state stay Trainer's own files. For the one
# check that refuses, ``Trainer.__init__`` runs with ``save_only_model`` set and the
# user's value is restored when it returns. ``save_pretrained``'s files stay in the
# checkpoint (``from_pretrained(checkpoint-N)`` reads them) and the best model
# (``load_best_model_at_end``) is read from the DCP checkpoint too. A model that is not
# parametrized gets Trainer's own behaviour.

DCP_DIR = "fsdptag_dcp"
SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer's name for it


class TrainerCheckpointMixin:
    """Mix in before ``transformers.Trainer`` (or any subclass, e.g. TRL's) to checkpoint
    and resume a parametrized model with its optimizer state (Note [Trainer checkpoints])::

        class Trainer(fsdptag.TrainerCheckpointMixin, transformers.Trainer):
            pass
    """

    def __init__(self, *args, **kwargs):
        init = super().__init__
        bound = inspect.signature(init).bind_partial(*args, **kwargs)
        training_args = bound.arguments.get("args")
        model = bound.arguments.get("model")
        refused = (training_args is not None and model is not None and is_parametrized(model)
                   and not training_args.save_only_model)
        if refused:
            training_args.save_only_model = True
        try:
            init(*args, **kwargs)
        finally:
            if refused:
                training_args.save_only_model = False

    def _sharded(self) -> bool:
        return is_parametrized(self.model)

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's wrapper

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        with disable_active_parametrization():
            state = {"model": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, self._torch_optimizer())}
        dcp.save(state, checkpoint_id=os.path.join(output_dir, DCP_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_dcp_model(self, checkpoint: str) -> None:
        with disable_active_parametrization():
            state = {"model": get_model_state_dict(self.model)}
            dcp.load(state, checkpoint_id=os.path.join(checkpoint, DCP_DIR))
            set_model_state_dict(self.model, state["model"])

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._sharded() or not os.path.isdir(os.path.join(resume_from_checkpoint, DCP_DIR)):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_dcp_model(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._sharded() or not os.path.isdir(os.path.join(checkpoint, DCP_DIR)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        optimizer = self._torch_optimizer()
        with disable_active_parametrization():
            state = {"optim": get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(state, checkpoint_id=os.path.join(checkpoint, DCP_DIR))
            set_optimizer_state_dict(self.model, optimizer, state["optim"])
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not self._sharded() or not os.path.isdir(os.path.join(best, DCP_DIR)):
            return super()._load_best_model()
        self._load_dcp_model(best)
