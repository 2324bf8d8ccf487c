"""Byte-level text data for ``train_llama.py``: a corpus, a held-out split, and batches
that are a pure function of ``(seed, step)``.

Every byte is a token (vocabulary 256), so any text file works and nothing is
downloaded. The default corpus is the source of a fixed list of Python standard
library modules, which ship with every Python (the text, and so the losses, change
only with the Python version).

Note [Data order is a function of (seed, step)]: the global batch of step ``s`` is
drawn by a generator seeded with ``(seed, s)``, and data-parallel rank ``r`` takes
rows ``r * batch : (r + 1) * batch`` of it. So the data position saved in a
checkpoint is just the step: a resumed run reads the same batches as an
uninterrupted one, and a run on a different number of ranks reads the same global
batch as long as ``batch x dp`` is unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

__all__ = ["Corpus", "DEFAULT_MODULES", "load_corpus", "train_batch", "val_batches"]

# Prose-heavy modules (long docstrings), about 0.9 MB on Python 3.11.
DEFAULT_MODULES = (
    "argparse", "textwrap", "difflib", "statistics", "fractions", "dataclasses", "enum",
    "functools", "heapq", "calendar", "string", "shlex", "tempfile", "random", "pathlib",
    "typing", "logging", "email.message",
)


@dataclass(frozen=True)
class Corpus:
    """Token streams (int64 bytes) of the training and held-out parts, and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    description: str
    sha256: str


def _default_text() -> tuple[bytes, str]:
    parts, names = [], []
    for name in DEFAULT_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py") and os.path.exists(origin):
            with open(origin, "rb") as f:
                parts.append(f.read())
            names.append(name)
    if len(names) < len(DEFAULT_MODULES) // 2:
        raise ValueError(
            f"this Python ships the sources of only {len(names)} of the {len(DEFAULT_MODULES)} standard "
            f"library modules the default corpus is made of ({', '.join(names) or 'none'}); "
            f"pass a text file with --data PATH"
        )
    return b"\n".join(parts), f"{len(names)} Python {sys.version.split()[0]} standard-library sources"


def load_corpus(path: str | None, val_fraction: float, seq_len: int) -> Corpus:
    """Read ``path`` (or build the default corpus) and hold out its last ``val_fraction``.

    Example::

        >>> c = load_corpus(None, 0.1, seq_len=32)
        >>> c.train.dtype, int(c.train.max()) < 256
        (torch.int64, True)
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must be between 0 and 1, e.g. 0.1")
    if path is None:
        text, description = _default_text()
    else:
        if not os.path.isfile(path):
            raise ValueError(f"--data {path!r} is not a file; pass a text file, or omit --data for the default corpus")
        with open(path, "rb") as f:
            text = f.read()
        description = os.path.abspath(path)
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n_val = int(tokens.numel() * val_fraction)
    train, val = tokens[: tokens.numel() - n_val], tokens[tokens.numel() - n_val:]
    for part, name in ((train, "training"), (val, "held-out")):
        if part.numel() < seq_len + 2:
            raise ValueError(
                f"the {name} part of {description} has {part.numel()} bytes but a sequence needs "
                f"{seq_len + 1}; use a larger --data file, a smaller --seq-len or another --val-fraction"
            )
    return Corpus(train, val, description, hashlib.sha256(text).hexdigest())


def _windows(tokens: torch.Tensor, n: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (n,), generator=g)
    return torch.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()])


def train_batch(corpus: Corpus, seed: int, step: int, dp_rank: int, batch: int, dp: int,
                seq_len: int) -> torch.Tensor:
    """This rank's ``(batch, seq_len + 1)`` rows of step ``step``'s global batch
    (Note [Data order is a function of (seed, step)])."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = _windows(corpus.train, batch * dp, seq_len, g)
    return rows[dp_rank * batch: (dp_rank + 1) * batch]


def val_batches(corpus: Corpus, seed: int, n_batches: int, dp_rank: int, batch: int, dp: int,
                seq_len: int) -> list[torch.Tensor]:
    """The same held-out windows at every evaluation: ``n_batches`` of this rank's rows."""
    g = torch.Generator().manual_seed(seed * 1_000_003 - 1)
    rows = _windows(corpus.val, n_batches * batch * dp, seq_len, g)
    per_batch = rows.view(n_batches, batch * dp, seq_len + 1)
    return [b[dp_rank * batch: (dp_rank + 1) * batch] for b in per_batch]
