"""The tests' config registry: ``--module tests.torchtitan.configs --config NAME``.

Both configs are torchtitan's ``llama3_debugmodel`` on the offline assets in
``$FSDPTAG_TT_ASSETS`` (``assets.make_assets``); they differ only in the data
parallelism: torchtitan's own ``parallelize_llama`` (FSDP2) or fsdptag's.
"""

from __future__ import annotations

import dataclasses
import os

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from fsdptag.torchtitan import with_fsdptag


def llama3_stock() -> Trainer.Config:
    """FSDP2 (torchtitan's ``fully_shard`` per block + root), on the same SPMD backend."""
    config = _offline(llama3_debugmodel())
    return dataclasses.replace(
        config, parallelism=dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor"))


def llama3_fsdptag() -> Trainer.Config:
    """What a user writes: ``with_fsdptag`` around torchtitan's config."""
    return with_fsdptag(_offline(llama3_debugmodel()))


def _offline(config: Trainer.Config) -> Trainer.Config:
    assets = os.environ["FSDPTAG_TT_ASSETS"]
    config.hf_assets_path = os.path.join(assets, "tokenizer")
    config.dataloader.dataset = "c4_test"
    config.dataloader.dataset_path = os.path.join(assets, "c4_test")
    config.validator.enable = False
    config.training.disable_cuda_graphs = True  # a CPU run: nothing to capture
    return config
