"""torchtitan 0.3.0's Qwen3-MoE (its ``debugmodel_moe``, shrunk) with expert parallelism 2
on 4 CPU ranks: torchtitan's FSDP2 path (``parallelize_qwen3``) side by side with
fsdptag (``fsdptag.torchtitan.parallelize``: experts over ``("efsdp", "ep")``, the rest
over ``"fsdp"``), under torchtitan's full and selective AC as it ships.

``python -m torch.distributed.run --nproc-per-node 4 tests/torchtitan/moe_worker.py OUT.json``

Every variant starts from the same weights (each parameter's full value seeded by its
name, then this rank's shard), trains 2 SGD steps on the same tokens, and rank 0
records both losses and, over step 2, the collectives (``CollectiveCounter``) and the
bytes forward kept for backward (``LiveStorageTracker``), as tests/test_integrations.py
measures them. Torchtitan sums gradients (its trainer divides the loss by the global
token count), so FSDP2 and fsdptag with ``gradient_divide_factor=1.0`` get their
gradients divided by the world size here; "fsdptag averaging" is fsdptag's default,
which averages over the data-parallel ranks itself (experts too: Note [Meshes per
module] in fsdptag/_mesh.py).

CPU-only shims (torchtitan has no CPU path; none of this is needed on GPUs): the
device type, SDPA for FlexAttention (no CPU backward), plain SUM reductions for FSDP2
(gloo has no PREMUL_SUM).
"""

from __future__ import annotations

import json
import sys
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchtitan.tools.utils as tt_utils

tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu  # before torchtitan's other modules

from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: E402
from torchtitan.models import qwen3  # noqa: E402
from torchtitan.models.common import CosSinRoPE, Embedding, Linear  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model  # noqa: E402

import fsdptag.torchtitan  # noqa: E402
from fsdptag.debug import CollectiveCounter, LiveStorageTracker  # noqa: E402


def _sdpa_flex(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
               return_aux=None, kernel_options=None):
    assert score_mod is None and not (return_aux is not None and return_aux.lse)
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None


FlexAttention._compiled_flex_attn = _sdpa_flex

SPMD = "partial_dtensor"  # torchtitan's DTensor path (its default spmd_types refuses FSDP2 here too)
VOCAB, DIM, HEAD_DIM, BATCH, SEQ = 256, 64, 16, 2, 32
VARIANTS = {  # name: (data parallelism, zero, AC)
    "fsdp2 zero2 full": ("fsdp2", 2, "full"),
    "fsdptag zero2 full": ("fsdptag", 2, "full"),
    "fsdptag averaging zero2 full": ("fsdptag averaging", 2, "full"),
    "fsdp2 zero2 selective": ("fsdp2", 2, "selective"),
    "fsdptag zero2 selective": ("fsdptag", 2, "selective"),
    "fsdp2 zero3 full": ("fsdp2", 3, "full"),
    "fsdptag zero3 full": ("fsdptag", 3, "full"),
}


def _build(pdims, parallelism):
    cfg = Qwen3Model.Config(  # debugmodel_moe, shrunk: 2 layers, dim 64, 4 experts, top 2
        vocab_size=VOCAB, dim=DIM, norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM, moe_hidden_dim=32,
            num_experts=4, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1000000.0)),
    )
    cfg.update_from_config(config=type("Config", (), {"parallelism": parallelism})())
    with torch.device("meta"):
        return cfg.build()


def _reinit(model) -> None:
    """Each parameter's full value seeded by its name, then this rank's shard of it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.replace("_checkpoint_wrapped_module.", "").encode()))
            full = torch.randn(tuple(p.shape), generator=gen) * (0.02 if p.dim() > 1 else 0.1) + (p.dim() == 1)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full)


def _variant(how: str, zero: int, ac: str, pdims, rank: int, world: int) -> dict:
    parallelism = ParallelismConfig(data_parallel_shard_degree=-1, expert_parallel_degree=2, spmd_backend=SPMD,
                                    fsdp_reshard_after_forward="always" if zero == 3 else "never")
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32",
                              mixed_precision_reduce="float32")
    kwargs = dict(parallel_dims=pdims, training=training, parallelism=parallelism, compile_config=CompileConfig(),
                  ac_config=FullAC.Config() if ac == "full" else SelectiveAC.Config(), dump_folder="/tmp")
    model = _build(pdims, parallelism)
    if how == "fsdp2":
        model = qwen3.parallelize_qwen3(model, **kwargs)
        for m in model.modules():  # gloo has no PREMUL_SUM (CPU only)
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    else:
        divide = None if how == "fsdptag averaging" else 1.0  # None: fsdptag's default, a mean
        model = fsdptag.torchtitan.parallelize(model, **kwargs, gradient_divide_factor=divide)
    model.to_empty(device="cpu")
    with torch.no_grad(), fsdptag.disable_active_parametrization():
        model.init_weights(buffer_device=None)
    _reinit(model)

    tokens = torch.randint(0, VOCAB, (world, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1234))[rank]
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    masks = model.get_attention_masks(positions)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meshes = [pdims.get_mesh("fsdp"), pdims.get_mesh("efsdp"), pdims.get_mesh("ep")]
    row: dict = {"losses": []}
    for step in range(2):
        opt.zero_grad()
        with CollectiveCounter(meshes) as cc:
            with LiveStorageTracker(track_inputs=True, settle_collectives=True) as mem:
                loss = F.cross_entropy(model(inp, positions, masks).float().flatten(0, 1), labels.flatten())
            at_forward_end = mem.live_bytes()
            loss.backward()
        if how != "fsdptag averaging":  # torchtitan's summed gradients, made a mean here
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(world)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        row["losses"].append(round(total.item() / world, 6))
    row["kept"] = at_forward_end - mem.live_bytes()  # bytes freed by backward: kept by forward
    for phase in ("forward", "backward"):
        row[f"{phase} FSDP all-gathers"] = cc.count(phase, "all_gather")
        row[f"{phase} all-to-alls"] = cc.count(phase, "all_to_all")
    row["reduce-scatters"] = cc.count("backward", "reduce_scatter")
    return row


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist_utils.set_spmd_backend(SPMD)
    pdims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=2, world_size=world, spmd_backend=SPMD)
    pdims.build_mesh()
    rows = {name: _variant(*spec, pdims, rank, world) for name, spec in VARIANTS.items()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
