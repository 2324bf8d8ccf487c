"""torchtitan's own trainer with fsdptag as its data parallelism.

A config registry (the module torchtitan's ``--module`` names) returns a torchtitan
config whose ``parallelize_fn`` is :func:`parallelize`::

    # my_configs.py
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from fsdptag.torchtitan import with_fsdptag

    def llama3_fsdptag():
        return with_fsdptag(llama3_debugmodel())

and ``torchrun --nproc-per-node 8 -m torchtitan.train --module my_configs --config
llama3_fsdptag`` trains it (docs/torchtitan.md). This module imports torchtitan;
``import fsdptag`` does not import it.

Note [torchtitan recipe]
------------------------
torchtitan's trainer builds the model on the meta device, calls
``model_spec.parallelize_fn(model, parallel_dims=..., training=..., parallelism=...,
compile_config=..., ac_config=..., dump_folder=...)``, then ``model.to_empty()`` and
``model.init_weights()`` under ``no_grad``, then trains: the loss of each rank is
its token loss summed and divided by the *global* token count, so the gradients must
be summed over the data-parallel ranks, not averaged (its FSDP2 path calls
``disable_fsdp_gradient_division``). :func:`parallelize` does what torchtitan's
``parallelize_llama`` does, in its order, with one call replacing ``fully_shard``:

1. TP and EP: ``model.parallelize(parallel_dims)``, the model's own plan;
2. AC: ``ac_config.build(...).apply(model)``, torchtitan's AC as it ships (fsdptag
   looks through its checkpoint wrappers: zero2 keeps the blocks' gathers for the
   recompute, docs/usage.md "With torchtitan");
3. per-block compile: torchtitan's ``apply_compile``;
4. data parallelism: ``fsdptag.parametrize`` over the ``fsdp`` mesh (with
   ``dp_replicate`` in front for HSDP and ``tp`` behind for TP), torchtitan's
   mixed-precision dtypes, ``fsdp_reshard_after_forward`` mapped as torchtitan maps
   it, and ``gradient_divide_factor=1.0``: summed gradients. With expert parallelism
   each module whose parameters EP sharded (the grouped experts) gets the sparse
   mesh, ``efsdp`` (with ``dp_replicate`` in front for HSDP) and its parameters' EP
   dims, as torchtitan's ``apply_fsdp_to_decoder`` gives experts its ``edp_mesh``
   (Note [Meshes per module] in ``fsdptag/_mesh.py``); each MoE block then gathers
   two buckets, its dense parameters and its experts.

Only the ``partial_dtensor`` SPMD backend fits: DTensor for the TP dims alone, plain
parameters everywhere else, which ``parametrize`` then shards (``spmd_types`` and
``full_dtensor`` make every parameter a DTensor on the whole mesh first);
:func:`with_fsdptag` selects it. Context and pipeline parallelism are refused.
"""

from __future__ import annotations

import dataclasses
import functools

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
from torchtitan.trainer import Trainer

import fsdptag

__all__ = ["parallelize", "with_fsdptag"]


def parallelize(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config: ActivationCheckpointingConfig | None,
    dump_folder: str,
    gradient_divide_factor: float | None = 1.0,
    **kwargs,
) -> nn.Module:
    """torchtitan's ``parallelize_fn`` with fsdptag instead of FSDP2 (Note [torchtitan recipe]).

    Called by torchtitan's trainer on the meta-device model with the keyword
    arguments above (``kwargs``: any a later trainer adds, unused;
    ``gradient_divide_factor``: 1.0, summed gradients, as torchtitan's loss wants; None
    averages over the data-parallel ranks, fsdptag's default). Returns the same
    model, parametrized in place: TP by the model's own plan, torchtitan's AC and
    compile, then ``fsdptag.parametrize``. Use it through :func:`with_fsdptag`, or
    set it yourself::

        >>> config.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=parallelize)
    """
    _check_supported(parallel_dims, training, parallelism)
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)

    fsdptag.parametrize(
        model,
        _meshes(model, parallel_dims),
        reshard_after_forward=get_fsdp_reshard_after_forward_policy(
            parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled),
        mp_policy=fsdptag.MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            cast_forward_inputs=False,  # as torchtitan's FSDP2 policy: its inputs are token ids
        ),
        gradient_divide_factor=gradient_divide_factor,  # 1.0: the loss is divided by the global token count
    )
    _init_on_stored_parameters(model)
    return model


def _meshes(model: nn.Module, parallel_dims: ParallelDims) -> DeviceMesh | dict[str, DeviceMesh]:
    """The dense data-parallel mesh (``tp`` behind it for TP), and with expert
    parallelism the sparse one for each module whose parameters EP sharded."""
    replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
    dense = parallel_dims.get_mesh(replicate + ["fsdp"] + (["tp"] if parallel_dims.tp_enabled else []))
    if not parallel_dims.ep_enabled:
        return dense
    meshes: dict[str, DeviceMesh] = {"": dense}
    for fqn, module in model.named_modules():
        ep = {p.device_mesh.mesh_dim_names for p in module.parameters(recurse=False)
              if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())}
        if ep:
            meshes[fqn] = parallel_dims.get_mesh(replicate + ["efsdp"] + list(ep.pop()))
    return meshes


def with_fsdptag(config: Trainer.Config) -> Trainer.Config:
    """``config`` with fsdptag as its data parallelism: a new ``Trainer.Config``.

    Its ``model_spec.parallelize_fn`` is :func:`parallelize` and its
    ``parallelism.spmd_backend`` is ``"partial_dtensor"`` (Note [torchtitan recipe]);
    everything else, command-line overrides included, stays torchtitan's::

        >>> def llama3_fsdptag():      # in the module passed to --module
        ...     return with_fsdptag(llama3_debugmodel())
    """
    if config.model_spec is None:
        raise ValueError("with_fsdptag(config): config.model_spec is None; pass a config from a "
                         "torchtitan config registry (e.g. llama3_debugmodel()), which sets it")
    return dataclasses.replace(
        config,
        model_spec=dataclasses.replace(config.model_spec, parallelize_fn=parallelize),
        parallelism=dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor"),
    )


def _check_supported(parallel_dims: ParallelDims, training: TrainingConfig,
                     parallelism: ParallelismConfig) -> None:
    """Refuse, before the model changes, what fsdptag's torchtitan path does not do."""
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"fsdptag.torchtitan.parallelize needs parallelism.spmd_backend='partial_dtensor', "
            f"got {parallelism.spmd_backend!r}: build the config with with_fsdptag(...) or pass "
            "--parallelism.spmd_backend partial_dtensor")
    refused = {
        "context parallelism": (parallel_dims.cp_enabled,
                                "--parallelism.context_parallel_degree 1"),
        "pipeline parallelism": (parallel_dims.pp_enabled,
                                 "--parallelism.pipeline_parallel_degree 1"),
        "CPU offload": (training.enable_cpu_offload, "drop --training.enable_cpu_offload"),
        "FSDP symmetric memory": (parallelism.enable_fsdp_symm_mem,
                                  "drop --parallelism.enable_fsdp_symm_mem"),
    }
    for what, (enabled, fix) in refused.items():
        if enabled:
            raise ValueError(f"fsdptag.torchtitan.parallelize does not support {what}; "
                             f"use torchtitan's own parallelize_fn for it, or {fix}")


def _init_on_stored_parameters(model: nn.Module) -> None:
    """Run the model's ``init_states`` (``init_weights`` calls it) on the stored shards.

    The trainer initializes in place (``nn.init.normal_(module.weight)``) after
    ``to_empty``. While fsdptag's parametrization is active, ``module.weight`` is a
    gathered temporary copy: the init would fill the copy (or raise) and leave the
    stored shard with ``to_empty``'s garbage. Under
    ``disable_active_parametrization`` the same code reaches the stored sharded
    DTensors, and DTensor's random ops initialize each shard as FSDP2's sharded
    parameters are.
    """
    init_states = model.init_states

    @functools.wraps(init_states)
    def init_stored(*args, **kwargs):
        with fsdptag.disable_active_parametrization():
            return init_states(*args, **kwargs)

    model.init_states = init_stored
