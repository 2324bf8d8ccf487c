"""fsdptag: SimpleFSDP-style eager data parallelism whose FSDP traffic carries a provenance tag."""

from ._api import ACMode, DataParallelMode, MixedPrecisionPolicy, OverlapPolicy, ReshardPolicy
from ._ac import apply_ac
from ._checkpoint import DEFAULT_SAVE_OPS, checkpoint_context_fn, checkpoint_policy
from ._hf import TrainerCheckpointMixin
from ._param import disable_active_parametrization
from ._parametrize import is_parametrized, parametrize
from ._schedule import (UnshardHandle, reshard, set_modules_to_backward_prefetch, set_modules_to_forward_prefetch,
                        unshard)
from ._sync import no_sync, set_requires_gradient_sync
from ._tag import FSDPTag, FSDPTaggedTensor, get_fsdp_tag, is_fsdp_tagged

__all__ = [
    "ACMode",
    "DEFAULT_SAVE_OPS",
    "apply_ac",
    "checkpoint_context_fn",
    "checkpoint_policy",
    "DataParallelMode",
    "FSDPTag",
    "FSDPTaggedTensor",
    "MixedPrecisionPolicy",
    "OverlapPolicy",
    "ReshardPolicy",
    "disable_active_parametrization",
    "get_fsdp_tag",
    "is_fsdp_tagged",
    "is_parametrized",
    "no_sync",
    "parametrize",
    "reshard",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "set_requires_gradient_sync",
    "TrainerCheckpointMixin",
    "unshard",
    "UnshardHandle",
]
