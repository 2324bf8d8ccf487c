"""The public configuration types: a leaf module that imports nothing of fsdptag's.

Like FSDP2's ``_fsdp_api.py``: every module of the runtime may import these, and
they are validated once, at the entry points (``parametrize``, ``apply_ac``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Mapping, Union

import torch
import torch.nn as nn

__all__ = ["ACMode", "BucketPolicy", "DataParallelMode", "MixedPrecisionPolicy", "ReshardPolicy"]


class DataParallelMode(enum.Enum):
    """How parameters are laid out over the data-parallel mesh."""

    REPLICATE = "replicate"  # DDP: all-reduce gradients
    FULLY_SHARD = "fully_shard"  # FSDP: gather params, reduce-scatter grads
    HYBRID_SHARD = "hybrid_shard"  # HSDP: replicate over mesh dim 0, shard over dim 1

    @property
    def mesh_ndim(self) -> int:
        return 2 if self is DataParallelMode.HYBRID_SHARD else 1


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the gathered parameter and of the gradient reduction.

    ``param_dtype``: gathered parameters (and, with ``cast_forward_inputs``, the
    floating-point tensors among the root module's inputs, nested ones included) are
    cast to it; the cast happens on the shard, before the all-gather, as in FSDP2.
    ``reduce_dtype``: gradients are reduced in it (default: ``param_dtype``) and
    stored in the parameter's dtype.

    Example::

        >>> fsdptag.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(
                    f"MixedPrecisionPolicy.{name}={dtype!r} is not a floating-point torch.dtype; "
                    "use e.g. torch.bfloat16, torch.float16 or torch.float32 (or None for no cast)"
                )


class ACMode(enum.Enum):
    """What ``fsdptag.apply_ac`` checkpoints."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


# A per-module reshard choice: one bool, ``fn(module_fqn, module) -> bool``, or a
# mapping from module-FQN prefixes to bools (longest prefix wins, "" = default).
ReshardPolicy = Union[bool, Callable[[str, nn.Module], bool], Mapping[str, bool]]

# "blocks" | "param" | "module" | fn(module_fqn, module) -> bool marking bucket roots
BucketPolicy = Union[str, Callable[[str, nn.Module], bool]]
