"""Run torchtitan 0.3.0's own trainer (``torchtitan.train.main``) on CPU ranks over gloo.

``python -m torch.distributed.run --nproc-per-node 2 tests/torchtitan/launch_cpu.py
--module tests.torchtitan.configs --config llama3_fsdptag [torchtitan flags]``

torchtitan 0.3.0 has no CPU path; the shims below give it one and belong here, not
in ``fsdptag.torchtitan`` (on GPUs none is needed):

1. Device: on a CPU-only build torchtitan's ``device_type`` / ``device_module`` fall
   back to ``"cuda"`` / ``torch.cuda``. Set ``"cpu"`` and a ``torch.cpu`` module with
   what its memory monitor and ``set_device`` calls need, before the modules that
   import them by name load; ``init_distributed`` then picks gloo.
2. Attention: FlexAttention has no backward on CPU. Its compiled call becomes SDPA
   under the same mask (the BlockMask's ``mask_mod`` materialized), and BlockMasks are
   built eagerly.
3. FSDP2 only: torchtitan's summed gradients (``set_gradient_divide_factor(1.0)``)
   make FSDP2 reduce with ``ReduceOp.PREMUL_SUM``, which gloo lacks; force plain SUM.
4. ``torch.distributed.set_timeout``, which torchtitan calls after step 1, is not in
   torch 2.13: map it to ``c10d._set_pg_timeout``.

With ``FSDPTAG_TT_RECORD=path`` rank 0 also writes JSON there: each logged step's
loss and grad norm (``"steps"``), and fsdptag's ``CollectiveCounter`` over step 2's
forward and backward (``"collectives"``: its summary; ``"per_parameter"``: FSDP
all-gathers per phase and parameter).
"""

from __future__ import annotations

import collections
import json
import os
import types

import torch
import torch.distributed as dist
import torchtitan.tools.utils as tt_utils


def _cpu_device_module() -> types.ModuleType:
    class CpuModule(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch.cpu, name)

    mod = CpuModule("torchtitan_cpu_device")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name, fn in {
        "set_device": lambda *a, **k: None,
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "synchronize": lambda *a, **k: None,
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: types.SimpleNamespace(total_memory=total, name="cpu"),
        "memory_stats": lambda *a, **k: {},
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
    }.items():
        setattr(mod, name, fn)
    return mod


tt_utils.device_type, tt_utils.device_module = "cpu", _cpu_device_module()

import torch.nn.functional as F  # noqa: E402
import torchtitan.distributed.fsdp as tt_fsdp  # noqa: E402
import torchtitan.models.common.attention as tt_attention  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, create_mask  # noqa: E402
from torchtitan import train  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from fsdptag.debug import CollectiveCounter  # noqa: E402


def _sdpa_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                         kernel_options):
    if score_mod is not None or return_aux.lse:
        raise NotImplementedError("the CPU FlexAttention shim handles block masks only")
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=enable_gqa), None


tt_attention.FlexAttention.compiled_flex_attn = staticmethod(_sdpa_flex_attention)
tt_attention._compiled_create_block_mask = create_block_mask

_disable_division = tt_fsdp.disable_fsdp_gradient_division


def _disable_division_with_sum(model):
    _disable_division(model)
    for module in model.modules():
        if isinstance(module, tt_fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


tt_fsdp.disable_fsdp_gradient_division = _disable_division_with_sum

if not hasattr(dist, "set_timeout"):
    dist.set_timeout = lambda timeout, group=None: dist.distributed_c10d._set_pg_timeout(timeout, group)


class _Record:
    """What rank 0 writes to ``$FSDPTAG_TT_RECORD``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict = {"steps": {}}

    def install(self) -> None:
        log, body, record = MetricsProcessor.log, Trainer._forward_backward_body, self

        def logged(processor, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
            record.data["steps"][str(step)] = {"loss": global_avg_loss, "grad_norm": grad_norm}
            record.write()
            return log(processor, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

        def counted(trainer, *args, **kwargs):
            if trainer.step != 2:
                return body(trainer, *args, **kwargs)
            dims = trainer.parallel_dims
            meshes = [dims.get_mesh("fsdp")] + ([dims.get_mesh("tp")] if dims.tp_enabled else [])
            with CollectiveCounter(meshes) as counter:
                out = body(trainer, *args, **kwargs)
            record.collectives(counter)
            return out

        MetricsProcessor.log, Trainer._forward_backward_body = logged, counted

    def collectives(self, counter: CollectiveCounter) -> None:
        per_parameter = collections.Counter(
            f"{e.phase} {e.fqn}" for e in counter.events if e.kind == "all_gather" and e.fsdp_tagged)
        self.data["collectives"] = counter.summary()
        self.data["per_parameter"] = dict(sorted(per_parameter.items()))
        self.write()

    def write(self) -> None:
        if dist.get_rank() == 0:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)


if __name__ == "__main__":
    if os.environ.get("FSDPTAG_TT_RECORD"):
        _Record(os.environ["FSDPTAG_TT_RECORD"]).install()
    train.main()
