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

__all__ = ["ACMode", "BucketPolicy", "DataParallelMode", "MixedPrecisionPolicy", "OverlapPolicy", "ReshardPolicy"]


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


@dataclass(frozen=True)
class OverlapPolicy:
    """How many collectives fsdptag leaves in flight so that compute hides them
    (Note [Prefetch] in ``_prefetch.py``, Note [Reductions in flight] in
    ``_collectives.py``).

    ``all_gathers``: buckets whose all-gather is issued ahead of their use, per
    direction (forward; zero3 backward re-gathers). Each costs one more gathered
    bucket alive; 0 waits every gather right after its issue.
    ``reductions``: gradient reductions (reduce-scatters, all-reduces) left in flight
    while the rest of backward runs. Each keeps one bucket's gradient input and output
    alive; 0 waits each at once.

    ``parametrize(prefetch=True)`` is ``OverlapPolicy()``, ``prefetch=False`` is
    ``OverlapPolicy(all_gathers=0)`` and ``prefetch=k`` is ``OverlapPolicy(all_gathers=k)``.

    Example::

        >>> fsdptag.parametrize(model, mesh, prefetch=fsdptag.OverlapPolicy(all_gathers=2))
    """

    all_gathers: int = 1
    reductions: int = 1

    def __post_init__(self) -> None:
        for name in ("all_gathers", "reductions"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(
                    f"OverlapPolicy.{name}={n!r} must be an int >= 0 (collectives left in flight; "
                    "0 waits each at once, 1 is the default)"
                )

    @staticmethod
    def of(prefetch: bool | int | OverlapPolicy) -> OverlapPolicy:
        """The policy ``parametrize(prefetch=...)`` means."""
        if isinstance(prefetch, OverlapPolicy):
            return prefetch
        if isinstance(prefetch, bool):
            return OverlapPolicy(all_gathers=int(prefetch))
        if isinstance(prefetch, int) and prefetch >= 0:
            return OverlapPolicy(all_gathers=prefetch)
        raise TypeError(
            f"prefetch={prefetch!r} must be True (issue the next bucket's all-gather early), False, "
            "an int >= 0 (buckets gathered ahead) or a fsdptag.OverlapPolicy"
        )


class ACMode(enum.Enum):
    """What ``fsdptag.apply_ac`` checkpoints."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


# A per-module reshard choice: one bool (True = zero3) or int k (partial reshard: kept
# sharded over k ranks, Note [Partial reshard] in _partial.py), ``fn(module_fqn, module)``
# returning one, or a mapping from module-FQN prefixes to them (longest prefix wins, "" = default).
ReshardPolicy = Union[bool, int, Callable[[str, nn.Module], Union[bool, int]], Mapping[str, Union[bool, int]]]

# "blocks" | "param" | "module" | fn(module_fqn, module) -> bool marking bucket roots
BucketPolicy = Union[str, Callable[[str, nn.Module], bool]]
