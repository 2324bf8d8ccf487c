"""Float8 all-gather of torchao's float8 training weights (Note [Float8 all-gather]).

Note [Float8 all-gather]
------------------------
torchao's float8 training (``convert_to_float8_training``) with
``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` makes each ``Float8Linear``
weight a ``WeightWithDynamicFloat8CastTensor``, which FSDP2 asks, through its
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks, for float8 bytes to gather
and for the gathered ``Float8TrainingTensor``: half the bytes of bf16 on the wire, and
the matmul takes the gathered float8 weight as it is. ``parametrize`` keeps the
weight's high-precision tensor as the stored parameter (a plain DTensor, as every
stored parameter: the optimizer, gradients and state dicts never see a subclass) and
remembers its float8 dtype and matmul config here. A bucket root's float8 weights
form a bucket of their own (one flat buffer, one dtype on the wire: a block gathers its
float8 bucket and the rest of its parameters in two all-gathers; FSDP2 copies both into
one byte buffer). Its gather:

* scales: one ``abs().max()`` per weight over this rank's shard (``_foreach_norm``,
  padding included: zeros), one all-reduce (max) of them over the shard group, then
  torchao's ``amax_to_scale``: the scale of the whole weight, as torchao computes it on
  one device. A backward re-gather (zero3) reuses its forward's scales: the weights
  have not changed since, and every rank re-gathers the same buckets;
* cast: each weight's slot times its scale, saturated to float8 (torchao's
  ``to_fp8_saturated``: bitwise the bytes torchao casts), all-gathered as ``uint8``
  (gloo and NCCL move bytes), copied out like any bucket;
* each piece, viewed as float8 and unpadded, becomes torchao's ``Float8TrainingTensor``
  (the weight role, the original dtype), which ``Float8Linear`` uses without casting.
  Its gradient arrives in the original dtype and is reduce-scattered as usual.

The scale all-reduce and the cast run hidden from checkpoint regions (``sac_hidden``):
a region records the bucket's all-gather and wait, the tagged ops its replay serves
(zero2 keeps the gathered float8 bytes for the recompute, Note [zero2 kept until
backward]). Eager only: a compiled float8 bucket, TP-sharded float8 weights and
``reshard_after_forward=k`` are refused with the way out, and a float8 weight must be
in a bucket (not ``bucket="param"``). torchao is not a dependency: its classes and
functions are read from its loaded modules (a float8 weight exists only if torchao is
imported).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ._compat import foreach_amax, local_of

__all__ = ["Float8Cast", "Float8Weight", "check_bucketed", "check_float8", "float8_weight"]

c10d = torch.ops._c10d_functional

_WEIGHT_CLASS = "WeightWithDynamicFloat8CastTensor"


@dataclass(frozen=True)
class Float8Weight:
    """A torchao float8 weight: its high-precision tensor, float8 dtype and matmul config."""

    hp: torch.Tensor
    dtype: torch.dtype
    mm_config: object
    module: str  # the torchao module that defines its class


def float8_weight(param: torch.Tensor) -> Float8Weight | None:
    """The float8 weight ``param`` is (torchao's ``WeightWithDynamicFloat8CastTensor``, as
    ``enable_fsdp_float8_all_gather=True`` makes it), or None."""
    data = param.data if isinstance(param, torch.nn.Parameter) else param
    local = local_of(data) if isinstance(data, DTensor) else data  # TP: refused by the caller
    cls = type(local)
    if cls.__name__ != _WEIGHT_CLASS or not cls.__module__.startswith("torchao."):
        return None
    hp = data if isinstance(data, DTensor) else local._tensor
    return Float8Weight(hp, local._dtype, local._linear_mm_config, cls.__module__)


_NO = ("Float8LinearConfig(enable_fsdp_float8_all_gather=False) gathers it in high precision, and torchao "
       "casts it for the matmul")


def check_float8(fqn: str, weight: Float8Weight, reshard) -> None:
    """What the float8 all-gather covers (Note [Float8 all-gather]): refused before
    ``parametrize`` changes anything."""
    if isinstance(weight.hp, DTensor):
        raise ValueError(f"torchao float8 weight {fqn!r} is TP-sharded; fsdptag's float8 all-gather covers "
                         f"data parallelism alone: {_NO}")
    if reshard is not True and reshard is not False:
        raise ValueError(f"torchao float8 weight {fqn!r}: reshard_after_forward={reshard} (partial reshard) "
                         f"does not take float8 all-gathers; use True or False for its module, or {_NO}")


def check_bucketed(buckets: dict) -> None:
    """Every float8 weight (fqn -> its bucket or None) is in a bucket."""
    alone = [fqn for fqn, bucket in buckets.items() if bucket is None]
    if alone:
        raise ValueError(
            f"torchao float8 weights {alone[:3]} are in no bucket; their float8 all-gather runs per bucket "
            "(Note [Float8 all-gather]): use bucket='blocks' (the default) or a bucket policy that covers "
            f"them, or {_NO}")


class Float8Cast:
    """A float8 bucket's cast and hand-out (Note [Float8 all-gather])."""

    def __init__(self, weights: list[Float8Weight], slots, world: int, group_name: str | None,
                 param_dtype: torch.dtype | None) -> None:
        dtypes = {w.dtype for w in weights}
        if len(dtypes) != 1:
            raise ValueError(f"float8 weights of one bucket have dtypes {sorted(map(str, dtypes))}; use one "
                             "float8 dtype for the weights (Float8LinearConfig.cast_config_weight)")
        self.dtype = dtypes.pop()
        self.max = torch.finfo(self.dtype).max
        self.mm_configs = [w.mm_config for w in weights]
        self.orig_dtypes = [param_dtype or w.hp.dtype for w in weights]  # what compute gets, as FSDP2
        self.slots, self.world, self.group_name = slots, world, group_name
        fsdp_utils = sys.modules[weights[0].module]  # loaded: it defines the weights' class
        self._tensor_class = fsdp_utils.Float8TrainingTensor
        self._weight_role = fsdp_utils.GemmInputRole.WEIGHT
        utils = sys.modules["torchao.float8.float8_utils"]  # loaded with it
        self._amax_to_scale, self._saturate = utils.amax_to_scale, utils.to_fp8_saturated
        self._numels = torch.tensor([s.numel for s in slots])
        self.forward_scales: torch.Tensor | None = None  # the last forward gather's, for backward

    def scales(self, flat: torch.Tensor, backward: bool) -> torch.Tensor:
        """Each weight's scale (float32), from the whole weight's amax."""
        if backward and self.forward_scales is not None:
            return self.forward_scales
        pieces = [flat.narrow(0, s.offset, s.numel) for s in self.slots]
        amax = torch.stack(foreach_amax(pieces)).float()
        if self.world > 1:
            amax = c10d.wait_tensor(c10d.all_reduce(amax, "max", self.group_name))
        scales = self._amax_to_scale(amax, self.dtype)
        if not backward:
            self.forward_scales = scales
        return scales

    def cast(self, flat: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The bucket's flat shard as float8 bytes (``uint8``), each slot by its scale."""
        per_element = torch.repeat_interleave(scales, self._numels.to(scales.device), output_size=flat.numel())
        return self._saturate(flat.to(torch.float32) * per_element, self.dtype).view(torch.uint8)

    def hand_out(self, i: int, piece: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Weight ``i``'s gathered piece (float8 bytes, unpadded) as torchao's tensor."""
        return self._tensor_class(piece.view(self.dtype), scales[i], self.orig_dtypes[i], self.mm_configs[i],
                                  gemm_input_role=self._weight_role)
