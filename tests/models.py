"""Small models and training loops shared by the multi-rank tests."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

VOCAB, DIM, HIDDEN, SEQ = 34, 16, 34, 6  # 34 rows do not divide 4 ranks: uneven shards


class Block(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def make_net(seed: int = 0, n_layers: int = 2) -> Net:
    torch.manual_seed(seed)
    net = Net(n_layers)
    with torch.no_grad():  # non-trivial norm params so their grads and gathers matter
        for m in net.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return net


def batch(step: int, n_chunks: int, rows_per_chunk: int = 2):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (n_chunks * rows_per_chunk, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (n_chunks * rows_per_chunk, SEQ), generator=g)
    return tokens.chunk(n_chunks), targets.chunk(n_chunks)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_optim(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)


def train_reference(ref: nn.Module, steps: int, n_chunks: int, chunk: int):
    """Single-device reference: mean of the per-chunk losses; returns chunk ``chunk``'s losses."""
    optim = make_optim(ref)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, n_chunks)
        chunk_losses = [loss_fn(ref(t), y) for t, y in zip(tokens, targets)]
        torch.stack(chunk_losses).mean().backward()
        optim.step()
        optim.zero_grad()
        losses.append(chunk_losses[chunk].item())
    return losses


def train_parallel(model: nn.Module, steps: int, n_chunks: int, chunk: int):
    optim = make_optim(model)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, n_chunks)
        loss = loss_fn(model(tokens[chunk]), targets[chunk])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, optim


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in a)


def rank() -> int:
    return dist.get_rank()


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class DictNet(Net):
    """``Net`` with its blocks in an ``nn.ModuleDict``, as torchtitan's current Llama keeps them."""

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__(n_layers)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(self.layers)})

    def forward(self, tokens):
        h = self.tok(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h))


def make_dict_net(seed: int = 0) -> DictNet:
    net = DictNet()
    net.load_state_dict(make_net(seed).state_dict())
    return net
