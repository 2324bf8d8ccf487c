"""Offline assets for torchtitan's llama3 debug model: a tokenizer and a jsonl corpus.

``make_assets(root)`` writes ``root/tokenizer/`` (a byte-level BPE with no merges:
256 byte tokens plus bos/eos, in Hugging Face ``tokenizer.json`` form, as
``hf_assets_path`` expects) and ``root/c4_test/data.json`` (a deterministic corpus in
the c4 format torchtitan's ``c4_test`` dataset reads). Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
WORDS = ("the a of to and in is it that for on with as was by at from model train data token "
         "layer shard gather reduce loss step mesh rank tensor gradient weight bias norm "
         "attention head block").split()


def make_assets(root: Path) -> Path:
    """Write the tokenizer and the corpus under ``root``; returns ``root``."""
    _tokenizer(root / "tokenizer")
    _corpus(root / "c4_test")
    return root


def _tokenizer(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True,
        "model_max_length": 2048}))


def _corpus(out: Path, n_docs: int = 256) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with open(out / "data.json", "w") as f:
        for _ in range(n_docs):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120)))
            f.write(json.dumps({"text": text.capitalize() + "."}) + "\n")
