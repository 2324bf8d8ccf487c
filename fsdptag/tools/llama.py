"""A Llama-3-style decoder, its configs and its tensor-parallel plan.

A test fixture shared by ``examples/train_llama.py``, the tests, the benchmark
and the memory estimator's built-in models. Token embedding, RMSNorm, RoPE, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU MLP, output head. Attention runs on
local tensors with per-rank head counts (as torchtitan does): DTensor has no
sharding rule for the CPU flash-attention kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["LlamaConfig", "CONFIGS", "Llama", "apply_tp"]


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    ffn_hidden: int = 176
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048

    def with_(self, **changes) -> "LlamaConfig":
        return replace(self, **changes)


CONFIGS = {
    "llama3-debug": LlamaConfig(),
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                             ffn_hidden=14336, max_seq_len=8192),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                              ffn_hidden=28672, max_seq_len=8192),
    "llama3-405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                               ffn_hidden=53248, max_seq_len=8192),
}


def _rope_cache(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # (seq, head_dim/2, 2)


def _apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); rotate pairs (x0, x1) by the cached angles.
    x2 = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[: x.shape[1], None, :, 0], rope[: x.shape[1], None, :, 1]
    out = torch.stack([x2[..., 0] * cos - x2[..., 1] * sin, x2[..., 0] * sin + x2[..., 1] * cos], -1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under TP the projections are local shards with n_heads / tp heads.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = _apply_rope(q, rope), _apply_rope(k, rope)
        k = k.repeat_interleave(self.n_rep, dim=2)
        v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama 3 decoder: ``Llama(cfg)(tokens) -> logits``; blocks live in ``model.layers``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer(
            "rope", _rope_cache(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta),
            persistent=False,
        )

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init (call under ``fsdptag.disable_active_parametrization()``)."""

        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                full = torch.ones(p.shape)
            else:
                std = 0.02 if "output" not in name else 1 / math.sqrt(self.cfg.dim)
                full = torch.randn(p.shape, generator=g) * std
            with torch.no_grad():
                if isinstance(p, DTensor):  # sharded: copy this rank's piece
                    piece = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(piece.to_local())
                else:
                    p.copy_(full)
        self.rope = _rope_cache(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len,
                                self.cfg.rope_theta).to(self.rope.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def apply_tp(model: Llama, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism (torchtitan's plan), before ``parametrize``.

    Norms are sequence parallel; q/k/v/w1/w3 column-wise, wo/w2 row-wise; the
    activations between blocks are sequence shards. Head counts must divide the
    TP degree.
    """

    tp = tp_mesh.size()
    cfg = model.cfg
    if cfg.n_heads % tp or cfg.n_kv_heads % tp:
        raise ValueError(
            f"TP degree {tp} must divide n_heads={cfg.n_heads} and n_kv_heads={cfg.n_kv_heads}"
        )
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
