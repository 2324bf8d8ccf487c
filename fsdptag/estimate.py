"""Memory and cost of one rank's training step at real scale, on one CPU: ``python -m fsdptag.estimate``.

    python -m fsdptag.estimate --model llama3-8b --world-size 64 --tp 8 \\
        --reshard-after-forward false --ac selective --mp bf16 [--policy tagged] [--json out.json]
    python -m fsdptag.estimate --model mypkg.models:build_model --seq-len 4096 ...  # any model factory
    python -m fsdptag.estimate --hf-config path/to/config.json ...                # a transformers config

It runs rank 0's training step (forward, backward, optimizer step) of a model at
full size on fake tensors (``FakeTensorMode``) with the ``fake`` process group, so
nothing is allocated and nothing is sent, and counts bytes with
:class:`fsdptag.debug.LiveStorageTracker`, collectives with
:class:`fsdptag.debug.CollectiveCounter` and FLOPs with ``FlopCounterMode``'s
formulas. The same :func:`measure_step` runs for real in the validation tests,
which check that the estimate matches a real gloo run at small scale.

Models: a built-in Llama 3 config (``llama3-debug``, ``llama3-8b``, ``llama3-70b``);
``pkg.module:factory``, a callable that builds the model (called under
``FakeTensorMode``, so its parameters are fake: build on the default device); a
transformers ``config.json`` (``AutoModelForCausalLM.from_config``, no weights, no KV
cache); from Python any such callable or a :class:`ModelSpec`. The model takes
token ids ``(batch, seq)`` and returns logits (or an output with ``.logits``).

TP (``--tp > 1``) needs a plan: the model's own (the built-in Llama's
``apply_tp``: Megatron-style with sequence parallelism; transformers models whose
config has a ``base_model_tp_plan``: :func:`hf_tp_plan`) or one passed in
(``tp_plan=fn(model, tp_mesh)``, CLI ``--tp-plan pkg.module:fn``).

Reported per policy (``tagged`` = fsdptag, ``op-name`` = save FSDP-looking ops by
name, ``fsdp2`` = FSDP2 ``fully_shard`` with the same AC):

* memory: the peak of the step, sharded parameters, gradients, AdamW state, and the
  bytes forward keeps for backward, split into FSDP-gathered parameters, TP/other
  collective outputs, activation casts and the rest;
* cost: bytes all-gathered, reduce-scattered and all-reduced in the step on the
  data-parallel mesh dims (``fsdp_*``) and on the TP dim (``tp_*``), as
  ``CollectiveCounter`` counts them (an all-gather's output, anything else's input);
  FLOPs of the forward, of the backward's gradients and of the forward ops the
  backward re-runs (activation checkpointing), on this rank's local shapes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ._api import MixedPrecisionPolicy, ReshardPolicy
from ._blocks import find_blocks
from ._ac import apply_ac
from ._compat import fake_store, gqa_sdpa_flop_formulas, in_backward
from ._parametrize import is_parametrized, parametrize
from ._sync import set_requires_gradient_sync
from ._plan import _reshard_resolver
from .debug import CollectiveCounter, LiveStorageTracker
from .testing.baselines import apply_baseline_ac
from .testing.llama import CONFIGS, Llama, apply_tp

__all__ = ["AC_MODES", "POLICIES", "MemoryEstimate", "ModelSpec", "StepConfig", "build_mesh", "build_model",
           "builtin_model", "complete_spec", "estimate", "estimate_each", "factory_model", "hf_config_model",
           "hf_tp_plan", "measure_step", "model_spec", "own_tp_plan", "OptimizerReuse"]

POLICIES = ("tagged", "op-name", "fsdp2")
AC_MODES = ("none", "full", "selective", "layer")  # layer: full AC on every second block
MAX_DEFAULT_SEQ = 8192  # default sequence length: the model's max, at most this


@dataclass
class MemoryEstimate:
    policy: str
    model: str
    world_size: int
    tp: int
    hsdp_replicas: int
    reshard_after_forward: bool | int | dict[str, bool | int]  # True = zero3, k: partial; a dict: per prefix
    ac: str
    mp: str
    seq_len: int
    batch: int
    microbatches: int  # forward+backward per optimizer step, all but the last without gradient sync
    peak_bytes: int
    param_bytes: int  # this rank's shards of the stored parameters
    gathered_param_bytes: int  # FSDP-gathered parameters kept for backward
    grad_bytes: int
    optimizer_bytes: int
    unsynced_grad_bytes: int  # microbatches > 1: gradients accumulated without sync, at the syncing backward
    activation_bytes: int  # everything forward keeps for backward (gathered params included)
    kept_collective_bytes: int  # of which: outputs of TP (non-FSDP) collectives
    kept_cast_bytes: int  # of which: activation casts (_to_copy)
    # The step's collectives: on the data-parallel mesh dims (fsdp_, all_reduce: HSDP's
    # replicate dim) and on the TP dim (tp_); an all-gather's output, anything else's input.
    fsdp_all_gather_bytes: int
    fsdp_partial_all_gather_bytes: int  # backward re-gathers over k-rank groups (reshard_after_forward=k)
    fsdp_reduce_scatter_bytes: int
    fsdp_all_reduce_bytes: int
    tp_all_gather_bytes: int
    tp_reduce_scatter_bytes: int
    tp_all_reduce_bytes: int
    other_collective_bytes: int  # all-to-all, broadcast
    forward_flops: int
    backward_flops: int  # the gradients (recompute excluded)
    recompute_flops: int  # forward ops the backward re-runs (activation checkpointing)


@dataclass(frozen=True)
class ModelSpec:
    """A model to estimate: ``build()`` makes it (on fake tensors when estimating; it
    takes token ids ``(batch, seq)`` and returns logits or an output with ``.logits``),
    ``tp_plan(model, tp_mesh)`` applies tensor parallelism (default: the model's own,
    see :func:`own_tp_plan`), ``init_weights(model)`` initializes a real one.
    ``vocab_size`` defaults to the input embedding's size, ``seq_len`` to the model's
    max (``config.max_position_embeddings`` or ``cfg.max_seq_len``), at most 8192.
    Its repeated blocks are found as ``apply_ac`` finds them (Note [Blocks])."""

    name: str
    build: Callable[[], nn.Module]
    vocab_size: int | None = None
    seq_len: int | None = None
    tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None
    init_weights: Callable[[nn.Module], None] | None = None


@dataclass(frozen=True)
class StepConfig:
    """One configuration to estimate (see :func:`estimate` for the fields)."""

    tp: int = 1
    hsdp_replicas: int = 1
    reshard_after_forward: ReshardPolicy = True
    ac: str = "none"
    mp: str = "bf16"
    batch: int = 1
    policy: str = "tagged"
    microbatches: int = 1


def builtin_model(name: str, seq_len: int | None = None) -> ModelSpec:
    """One of the built-in Llama 3 configs (``llama3-debug``, ``llama3-8b``, ``llama3-70b``)
    at ``seq_len`` (default: its max, at most 8192)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; built-in models are {sorted(CONFIGS)}, or pass a factory "
                         "as 'pkg.module:function' (or --hf-config path/to/config.json)")
    cfg = CONFIGS[name]
    seq_len = seq_len or min(cfg.max_seq_len, MAX_DEFAULT_SEQ)
    cfg = cfg.with_(max_seq_len=max(seq_len, 1))
    return ModelSpec(name, functools.partial(Llama, cfg), cfg.vocab_size, seq_len, apply_tp, Llama.init_weights)


def factory_model(factory: Callable[[], nn.Module], *, name: str | None = None, seq_len: int | None = None,
                  tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None) -> ModelSpec:
    """Any model: ``factory()`` builds it (on fake tensors when estimating).

    Example::

        >>> spec = factory_model(lambda: MyLM(vocab=32000, dim=2048), seq_len=4096)
    """
    if not callable(factory):
        raise TypeError(f"factory={factory!r} is not callable; pass a function that returns the model")
    return ModelSpec(name or getattr(factory, "__qualname__", repr(factory)), factory, None, seq_len, tp_plan)


def hf_config_model(path: str, *, seq_len: int | None = None,
                    tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None) -> ModelSpec:
    """A transformers causal LM from its ``config.json`` (a file or its directory):
    ``AutoModelForCausalLM.from_config`` in fp32, no weights, ``use_cache=False`` (a
    training step keeps no KV cache). TP: the config's ``base_model_tp_plan``."""
    transformers = _optional("transformers")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a transformers config from {path!r} ({e}); pass a config.json or "
                         "the directory holding it") from None
    config.use_cache = False
    return ModelSpec(f"{config.model_type} ({path})", functools.partial(_hf_build, config), None, seq_len, tp_plan)


def _hf_build(config) -> nn.Module:
    return _optional("transformers").AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def model_spec(model: str | ModelSpec | Callable[[], nn.Module], *, seq_len: int | None = None,
               tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None) -> ModelSpec:
    """``model`` as a :class:`ModelSpec`: a built-in name, ``"pkg.module:factory"``, a
    callable or a spec; ``seq_len`` and ``tp_plan``, when given, override the spec's."""
    if isinstance(model, ModelSpec):
        spec = model
    elif isinstance(model, str) and ":" in model:
        spec = factory_model(_import_object(model), name=model)
    elif isinstance(model, str):
        spec = builtin_model(model, seq_len)
    elif callable(model):
        spec = factory_model(model)
    else:
        raise TypeError(f"model={model!r}; pass a built-in name, 'pkg.module:factory', a callable or a ModelSpec")
    return replace(spec, seq_len=seq_len or spec.seq_len, tp_plan=tp_plan or spec.tp_plan)


def _import_object(target: str):
    """``"pkg.module:attr.path"`` -> the object."""
    module_name, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for {target!r} ({e}); make it importable "
                         "(installed, or on PYTHONPATH)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no {attr!r}; use 'pkg.module:function'")
        obj = getattr(obj, part)
    return obj


def _optional(module: str):
    """An optional dependency, imported when a feature needs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"this needs {module.split('.')[0]}: pip install transformers==5.23.0") from None


def hf_tp_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """transformers' own TP plan for ``model`` (``model.tp_plan``: the config's
    ``base_model_tp_plan``, e.g. q/k/v/gate/up column-wise, o/down row-wise,
    vocab-parallel embedding), applied with transformers'
    ``apply_tensor_parallelism``: DTensor parameters, attention on local heads, no
    sequence parallelism (activations between layers are replicated; row-wise
    outputs are all-reduced). Apply it before ``fsdptag.parametrize``."""
    tp_module = _optional("transformers.distributed.tensor_parallel")
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ValueError(f"{type(model).__name__} has no TP plan (its config has no base_model_tp_plan); "
                         "pass tp_plan=fn(model, tp_mesh) or use tp=1")
    text = model.config.get_text_config()
    heads = getattr(text, "num_attention_heads", 0)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    tp = tp_mesh.size()
    if heads % tp or kv_heads % tp:
        raise ValueError(f"TP degree {tp} must divide num_attention_heads={heads} and "
                         f"num_key_value_heads={kv_heads}")
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out_emb is not None and out_emb.weight is model.get_input_embeddings().weight:
        raise ValueError(f"{type(model).__name__} ties its input and output embeddings "
                         "(tie_word_embeddings=True): transformers' TP plan shards them as two modules, "
                         "fsdptag gathers one tied parameter; estimate it with tp=1")
    tp_module.apply_tensor_parallelism(model, tp_mesh, _expand_hf_plan(model, plan, tp_module))


def _expand_hf_plan(model: nn.Module, plan: dict[str, str], tp_module) -> dict[str, str]:
    """transformers' rule: ``layers.*.mlp.up_proj`` names every layer's module and its own
    parameters (a parameter may have its own rule); parameters first, then the module. A
    tied parameter is sharded once, under its first name (``named_parameters`` lists only it)."""
    generic = tp_module.replace_layer_number_by_wildcard
    names = {fqn for fqn, _ in model.named_parameters()}
    out: dict[str, str] = {}
    for mfqn, module in model.named_modules():
        style = plan.get(generic(mfqn))
        for pname, _ in module.named_parameters(recurse=False):
            fqn = f"{mfqn}.{pname}" if mfqn else pname
            pstyle = plan.get(generic(fqn), style)
            if pstyle is not None and fqn in names:
                out[fqn] = pstyle
        if style is not None:
            out[mfqn] = style
    return out


def own_tp_plan(model: nn.Module) -> Callable[[nn.Module, DeviceMesh], None] | None:
    """The TP plan a model brings: the built-in Llama's ``apply_tp``, a transformers
    model's ``base_model_tp_plan`` (:func:`hf_tp_plan`), else None."""
    if isinstance(model, Llama):
        return apply_tp
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan and hasattr(model, "config"):
        return hf_tp_plan
    return None


def complete_spec(spec: ModelSpec, needs_tp: bool = False) -> ModelSpec:
    """``spec`` with its vocabulary size, sequence length and (if ``needs_tp``) TP plan
    filled in from a fake copy of the model; errors name the fix before anything runs."""
    if spec.vocab_size is not None and spec.seq_len is not None and (spec.tp_plan or not needs_tp):
        return spec
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = spec.build()
    except TypeError as e:
        raise TypeError(f"model {spec.name!r}: building it failed ({e}); the factory is called with no "
                        "arguments and returns the model") from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {spec.name!r}: the factory returned {type(model).__name__}, not an nn.Module")
    vocab = spec.vocab_size or _vocab_size(model)
    seq_len = spec.seq_len or _max_seq_len(model)
    if vocab is None:
        raise ValueError(f"cannot tell the vocabulary size of model {spec.name!r} (no input embedding); "
                         "pass ModelSpec(vocab_size=...)")
    if seq_len is None:
        raise ValueError(f"cannot tell the sequence length of model {spec.name!r} (no max length in its "
                         "config); pass seq_len=... (CLI: --seq-len)")
    tp_plan = spec.tp_plan or own_tp_plan(model)
    if needs_tp and tp_plan is None:
        raise ValueError(f"model {spec.name!r} ({type(model).__name__}) has no TP plan; pass "
                         "tp_plan=fn(model, tp_mesh) (CLI: --tp-plan pkg.module:fn) or use tp=1")
    return replace(spec, vocab_size=vocab, seq_len=seq_len, tp_plan=tp_plan)


def _vocab_size(model: nn.Module) -> int | None:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return getattr(emb, "num_embeddings", None)


def _max_seq_len(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    longest = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "max_seq_len", None)
    return min(longest, MAX_DEFAULT_SEQ) if longest else None


class _EagerAliasingWait(TorchDispatchMode):
    """Eager ``wait_tensor`` returns its input; the fake kernel allocates a new tensor,
    which would double-count every saved collective output. Restore eager aliasing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]
        return func(*args, **(kwargs or {}))


_aten = torch.ops.aten
# FlopCounterMode's formulas; CPU's flash attention (what SDPA runs on CPU tensors,
# fake or real) counts as the GPU kernels do (causal masks counted as full, like them).
_FLOP_FORMULAS = gqa_sdpa_flop_formulas({
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[_aten._scaled_dot_product_flash_attention],
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[_aten._scaled_dot_product_flash_attention_backward],
})


def _local(t):
    return getattr(t, t.__tensor_flatten__()[0][0]) if isinstance(t, DTensor) else t


class _StepFlops(TorchDispatchMode):
    """FLOPs by ``FlopCounterMode``'s formulas on the shapes this rank computes (a
    DTensor op counts on its local tensors: a dispatch mode sees DTensor ops before
    DTensor runs them locally), split by phase: forward; backward; recompute, the
    ops the autograd engine runs with grad mode on (a checkpoint's recompute: the
    engine runs gradient formulas with grad mode off). Ops an SAC recompute takes
    from its cache never reach this mode, so they do not count."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"forward_flops": 0, "backward_flops": 0, "recompute_flops": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FLOP_FORMULAS.get(func._overloadpacket)
        if formula is not None:
            largs, lkwargs, lout = pytree.tree_map_only(DTensor, _local, (args, kwargs, out))
            phase = ("recompute" if torch.is_grad_enabled() else "backward") if in_backward() else "forward"
            self.counts[f"{phase}_flops"] += formula(*largs, **lkwargs, out_val=lout)
        return out


def build_mesh(device_type: str, world_size: int, tp: int, hsdp_replicas: int) -> DeviceMesh:
    """(dp) / (replicate, shard) mesh, with a trailing tp dim when tp > 1."""
    if world_size % (tp * hsdp_replicas):
        raise ValueError(
            f"world_size={world_size} is not divisible by tp={tp} x hsdp_replicas={hsdp_replicas}"
        )
    dp = world_size // tp
    shape, names = ((hsdp_replicas, dp // hsdp_replicas), ("replicate", "shard")) \
        if hsdp_replicas > 1 else ((dp,), ("dp",))
    if tp > 1:
        shape, names = shape + (tp,), names + ("tp",)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def build_model(spec: ModelSpec, mesh: DeviceMesh, *, policy: str, reshard: ReshardPolicy, ac: str,
                mp: str, fake_mode=None) -> nn.Module:
    """``spec``'s model with TP (if the mesh has "tp"), data parallelism by ``policy`` and AC.

    With ``fake_mode`` the model is built on fake tensors (no init); parallelism is
    applied outside the mode, as mesh bookkeeping (DeviceMesh) needs real tensors
    while fake parameters keep dispatching through their own mode.
    """
    if fake_mode is None:
        model = spec.build()
        if spec.init_weights is not None:
            spec.init_weights(model)
    else:
        with fake_mode:
            model = spec.build()
    names = mesh.mesh_dim_names
    if "tp" in names:
        tp_plan = spec.tp_plan or own_tp_plan(model)
        if tp_plan is None:
            raise ValueError(f"model {spec.name!r} has no TP plan; pass ModelSpec(tp_plan=...) or use tp=1")
        tp_plan(model, mesh["tp"])
    mode, every = ("selective", 2) if ac == "layer" else (ac, None)
    dtype = torch.bfloat16 if mp == "bf16" else None
    if policy == "fsdp2":
        apply_ac(model, mode, layer_every=every)
        dp_names = tuple(n for n in names if n != "tp")
        dp_mesh = mesh[dp_names] if "tp" in names else mesh
        mp2 = FSDP2MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        reshard_of = _reshard_resolver(model, reshard)
        for fqn, block in find_blocks(model):
            fully_shard(block, mesh=dp_mesh, mp_policy=mp2, reshard_after_forward=reshard_of(fqn, block))
        fully_shard(model, mesh=dp_mesh, mp_policy=mp2, reshard_after_forward=reshard_of("", model))
        return model
    hybrid = "replicate" in names
    parametrize(model, mesh, mode="hybrid_shard" if hybrid else "fully_shard",
                reshard_after_forward=reshard,
                mp_policy=MixedPrecisionPolicy(dtype, torch.float32) if dtype else None)
    if policy == "tagged":
        apply_ac(model, mode, layer_every=every)
    elif policy == "op-name":
        apply_baseline_ac(model, mode, layer_every=every, policy="op-name")
    else:
        raise ValueError(f"unknown policy={policy!r}; use one of {POLICIES}")
    return model


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _logits(out) -> torch.Tensor:
    """A model's logits: the tensor it returns, or its output's ``.logits`` (transformers)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}; return logits (batch, seq, vocab) "
                        "or an output with .logits")
    return logits


_COLLECTIVE_FIELDS = ("fsdp_all_gather_bytes", "fsdp_partial_all_gather_bytes", "fsdp_reduce_scatter_bytes", "fsdp_all_reduce_bytes",
                      "tp_all_gather_bytes", "tp_reduce_scatter_bytes", "tp_all_reduce_bytes",
                      "other_collective_bytes")


def _collective_bytes(counter: CollectiveCounter) -> dict[str, int]:
    out = dict.fromkeys(_COLLECTIVE_FIELDS, 0)
    for e in counter.events:
        partial = "/" in e.group  # a k-group, labelled "dp/k" (Note [Partial reshard])
        key = f"{'tp' if e.group == 'tp' else 'fsdp'}_{'partial_' if partial else ''}{e.kind}_bytes"
        out[key if key in out else "other_collective_bytes"] += e.nbytes
    return out


class OptimizerReuse:
    """What one estimate's optimizer did, for the next with the same parameters.

    Note [Optimizer reuse]
    ----------------------
    AdamW's state and the peak of its step (``foreach=False``: one parameter's
    temporaries at a time, on top of what is live when the step starts) depend only on
    the parameters' types, shapes, dtypes and placements, which estimates of one TP
    degree, mesh and mixed precision share whatever their zero or AC choice. The first
    such estimate runs the warm-up step and the measured step and records the state's
    layout and the step's rise above the live bytes at its start; the others build the
    state with ``zeros_like`` and add the recorded rise instead of dispatching two
    optimizer steps on fake tensors (~15% of an 8B estimate). Real runs never reuse.
    """

    def __init__(self) -> None:
        self.known: dict[tuple, tuple[list, int]] = {}  # signature -> (state layout, rise)

    @staticmethod
    def signature(params: list) -> tuple:
        return tuple((type(p), tuple(p.shape), p.dtype, tuple(_local(p).shape), str(getattr(p, "placements", "")))
                     for p in params)

    @staticmethod
    def layout(optim: torch.optim.Optimizer, params: list) -> list:
        """Per parameter: (name, shape, dtype, like the parameter) of each state tensor."""
        return [[(k, tuple(v.shape), v.dtype, type(v) is type(p) and v.shape == p.shape)
                 for k, v in optim.state[p].items()] for p in params]

    @staticmethod
    def fill(optim: torch.optim.Optimizer, params: list, layout: list) -> None:
        for p, entries in zip(params, layout):
            optim.state[p] = {k: torch.zeros_like(p, dtype=dtype) if like else torch.zeros(shape, dtype=dtype)
                              for k, shape, dtype, like in entries}


def measure_step(model, tokens: torch.Tensor, mesh: DeviceMesh | None = None,
                 reuse: OptimizerReuse | None = None, microbatches: int = 1) -> dict:
    """One training step under a LiveStorageTracker; returns the byte counts, the
    collective bytes (groups named by ``mesh``'s dims, default: the parameters'
    meshes) and the FLOPs. ``reuse``: Note [Optimizer reuse] (estimates only).
    ``microbatches``: forward+backward passes per optimizer step, every one but the
    last without gradient sync (``fsdptag.set_requires_gradient_sync``, FSDP2's
    ``set_requires_gradient_sync``); ``unsynced_grad_bytes`` is what they hold until
    the syncing backward (Note [Accumulation without sync]).

    Persistent state (parameters, a warm AdamW state) exists before the step, as
    in steady-state training, and counts towards the peak.
    """
    stored = list(model.parameters())
    params = [p for p in stored if p.requires_grad]  # frozen weights: no gradient, no AdamW state
    optim = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    key = OptimizerReuse.signature(params) if reuse is not None else None
    known = reuse.known.get(key) if reuse is not None else None
    if known is None:
        for p in params:  # materialize AdamW's state without a forward
            p.grad = torch.zeros_like(p)
        optim.step()
        optim.zero_grad(set_to_none=True)
    else:
        OptimizerReuse.fill(optim, params, known[0])
    state = [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    # A real process group's thread releases collective buffers on its own time: settle.
    tracker = LiveStorageTracker(track_inputs=True, track_peak=True,
                                 settle_collectives=not isinstance(tokens, FakeTensor))
    tracker.track_existing(stored + state)
    counter = CollectiveCounter(mesh if mesh is not None else
                                list({p.device_mesh: None for p in stored if isinstance(p, DTensor)}))
    flops = _StepFlops()
    # Cyclic GC would free some buffers at times that vary from run to run (it runs on
    # allocation counts, and the collectives' threads allocate too); paused, frees
    # follow reference counts only, the same in a real run and in an estimate. Frozen,
    # what exists now is left out of the tracker's collections: they stay cheap.
    gc.collect()
    gc.disable()
    gc.freeze()
    try:
        with counter, flops, tracker:
            before = _total(tracker.snapshot())
            unsynced = 0
            for i in range(microbatches):
                last = i == microbatches - 1
                if microbatches > 1:
                    _set_gradient_sync(model, last)
                logits = _logits(model(tokens[:, :-1]))
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                del logits
                at_forward_end = tracker.snapshot()
                loss.backward()
                del loss
                after_backward = tracker.snapshot()
                if i == 0:  # what forward keeps for backward: no accumulator is alive yet
                    kept = LiveStorageTracker.kept(at_forward_end, after_backward)
                if not last:
                    unsynced = _total(after_backward) - before
            grad_bytes = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
            if reuse is None:
                optim.step()
            else:
                _optimizer_step(optim, params, tracker, after_backward, reuse, key, known)
            optim.zero_grad(set_to_none=True)
    finally:
        gc.unfreeze()
        gc.enable()
    return {
        "peak_bytes": tracker.peak_bytes,
        "param_bytes": sum(_local_bytes(p) for p in stored),
        "gathered_param_bytes": kept.get("fsdp", 0),
        "grad_bytes": grad_bytes,
        "unsynced_grad_bytes": unsynced,
        "optimizer_bytes": sum(_local_bytes(t) for t in state),
        "activation_bytes": sum(kept.values()),
        "kept_collective_bytes": kept.get("collective", 0),
        "kept_cast_bytes": kept.get("cast", 0),
        **_collective_bytes(counter),
        **flops.counts,
    }


def _total(snapshot: dict) -> int:
    return sum(nbytes for nbytes, _, _ in snapshot.values())


def _set_gradient_sync(model: nn.Module, sync: bool) -> None:
    if is_parametrized(model):
        set_requires_gradient_sync(model, sync)
    else:  # FSDP2's FSDPModule
        model.set_requires_gradient_sync(sync)


def _optimizer_step(optim, params, tracker: LiveStorageTracker, after_backward: dict, reuse: OptimizerReuse,
                    key: tuple, known) -> None:
    """The optimizer step's effect on the peak: run and recorded, or recorded before
    (Note [Optimizer reuse]). Nothing is freed between the snapshot and the step."""
    start = _total(after_backward)
    if known is not None:
        tracker.peak_bytes = max(tracker.peak_bytes, start + known[1])
        return
    before, tracker.peak_bytes = tracker.peak_bytes, 0
    optim.step()
    rise = max(tracker.peak_bytes - start, 0)
    tracker.peak_bytes = max(before, tracker.peak_bytes)
    reuse.known[key] = (OptimizerReuse.layout(optim, params), rise)


def estimate(model: str | ModelSpec | Callable[[], nn.Module], world_size: int, *, tp: int = 1,
             hsdp_replicas: int = 1, reshard_after_forward: ReshardPolicy, ac: str, mp: str = "bf16",
             seq_len: int | None = None, batch: int = 1, microbatches: int = 1, policies=POLICIES,
             tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None) -> list[MemoryEstimate]:
    """Estimate rank 0's memory and cost for each policy on fake tensors (no real allocation).

    ``model``: a built-in model's name, ``"pkg.module:factory"``, a callable that builds
    the model, or a :class:`ModelSpec`. ``reshard_after_forward``: True (zero3), False
    (zero2) or a dict of module-FQN prefixes to bools (as ``fsdptag.parametrize``).
    ``ac``: one of :data:`AC_MODES`; ``mp``: ``"bf16"`` (bf16 parameters, fp32
    reduction) or ``"fp32"``; ``batch``: sequences per data-parallel rank and microbatch;
    ``microbatches``: forward+backward passes per optimizer step, all but the last
    without gradient sync (each runs: the estimate's time grows with it);
    ``tp_plan(model, tp_mesh)``: for ``tp > 1`` when the model has no plan of its own.

    Example::

        >>> [r.peak_bytes for r in estimate("llama3-8b", 64, tp=8, reshard_after_forward=False, ac="full")]
        >>> estimate(lambda: MyLM(), world_size=8, reshard_after_forward=True, ac="selective", seq_len=2048)
    """
    configs = [StepConfig(tp, hsdp_replicas, reshard_after_forward, ac, mp, batch, p, microbatches)
               for p in policies]
    return list(estimate_each(model, world_size, configs, seq_len=seq_len, tp_plan=tp_plan))


def estimate_each(model: str | ModelSpec | Callable[[], nn.Module], world_size: int,
                  configs: Iterable[StepConfig], *, seq_len: int | None = None,
                  tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None) -> Iterator[MemoryEstimate]:
    """:func:`estimate` for several configurations in one fake process group, yielding
    each result as it is done. Everything is validated before the first one runs."""
    configs = list(configs)
    for c in configs:
        _check_config(c, world_size)
    spec = complete_spec(model_spec(model, seq_len=seq_len, tp_plan=tp_plan), any(c.tp > 1 for c in configs))
    if dist.is_initialized():
        raise RuntimeError("fsdptag.estimate needs to own the process group; call it in a fresh process")
    return _run(spec, world_size, configs)


def _check_config(c: StepConfig, world_size: int) -> None:
    for name, value, choices in (("ac", c.ac, AC_MODES), ("mp", c.mp, ("bf16", "fp32")),
                                 ("policy", c.policy, POLICIES)):
        if value not in choices:
            raise ValueError(f"unknown {name}={value!r}; use one of {choices}")
    if world_size % (c.tp * c.hsdp_replicas):
        raise ValueError(f"world_size={world_size} is not divisible by tp={c.tp} x hsdp_replicas={c.hsdp_replicas}")
    if c.batch < 1:
        raise ValueError(f"batch={c.batch} must be >= 1 (sequences per data-parallel rank)")
    if c.microbatches < 1:
        raise ValueError(f"microbatches={c.microbatches} must be >= 1 (forward+backward per optimizer step)")


def _run(spec: ModelSpec, world_size: int, configs: list[StepConfig]) -> Iterator[MemoryEstimate]:
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    meshes: dict[tuple[int, int], DeviceMesh] = {}
    reuse = OptimizerReuse()
    try:
        for c in configs:
            key = (c.tp, c.hsdp_replicas)
            if key not in meshes:
                meshes[key] = build_mesh("cpu", world_size, c.tp, c.hsdp_replicas)
            yield _estimate_one(spec, meshes[key], world_size, c, reuse)
    finally:
        dist.destroy_process_group()


def _estimate_one(spec: ModelSpec, mesh: DeviceMesh, world_size: int, c: StepConfig,
                  reuse: OptimizerReuse) -> MemoryEstimate:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    m = build_model(spec, mesh, policy=c.policy, reshard=c.reshard_after_forward, ac=c.ac, mp=c.mp,
                    fake_mode=fake_mode)
    batch, seq_len = c.batch, spec.seq_len
    with fake_mode, _EagerAliasingWait():
        tokens = torch.randint(0, spec.vocab_size, (batch, seq_len + 1))
        numbers = measure_step(m, tokens, mesh, reuse, c.microbatches)
    reshard = c.reshard_after_forward
    return MemoryEstimate(
        policy=c.policy, model=spec.name, world_size=world_size, tp=c.tp, hsdp_replicas=c.hsdp_replicas,
        reshard_after_forward=reshard if isinstance(reshard, (bool, int)) else dict(reshard), ac=c.ac, mp=c.mp,
        seq_len=seq_len, batch=batch, microbatches=c.microbatches, **numbers,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def format_table(results: list[MemoryEstimate]) -> str:
    head = ("| policy | peak GiB | params GiB | grads GiB | unsynced grads GiB | optim GiB | kept for bwd GiB | "
            "of which gathered params | TP collectives | casts |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.policy} | {_gib(r.peak_bytes)} | {_gib(r.param_bytes)} | {_gib(r.grad_bytes)} | "
            f"{_gib(r.unsynced_grad_bytes)} | {_gib(r.optimizer_bytes)} | {_gib(r.activation_bytes)} | "
            f"{_gib(r.gathered_param_bytes)} | {_gib(r.kept_collective_bytes)} | "
            f"{_gib(r.kept_cast_bytes)} |"
        )
    return "\n".join(lines)


def format_cost_table(results: list[MemoryEstimate]) -> str:
    """Per policy: GiB moved by each kind of collective in the step, and TFLOPs."""
    head = ("| policy | FSDP all-gather GiB | of k-groups GiB | FSDP reduce-scatter GiB | FSDP all-reduce GiB | "
            "TP all-gather GiB | TP reduce-scatter GiB | TP all-reduce GiB | fwd TFLOP | bwd TFLOP | "
            "recompute TFLOP |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        moved = " | ".join(_gib(getattr(r, f)) for f in _COLLECTIVE_FIELDS[:-1])
        flops = " | ".join(f"{n / 1e12:.2f}" for n in (r.forward_flops, r.backward_flops, r.recompute_flops))
        lines.append(f"| {r.policy} | {moved} | {flops} |")
    return "\n".join(lines)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model flags shared with ``python -m fsdptag.plan``."""
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", default=None,
                       help=f"a built-in model ({', '.join(sorted(CONFIGS))}; default llama3-8b) or "
                            "pkg.module:factory, a function that builds the model")
    which.add_argument("--hf-config", default=None, metavar="PATH",
                       help="a transformers config.json (or its directory): AutoModelForCausalLM.from_config")
    p.add_argument("--tp-plan", default=None, metavar="pkg.module:fn",
                   help="fn(model, tp_mesh) applying TP, for a model without a plan of its own")
    p.add_argument("--seq-len", type=int, default=None,
                   help="default: the model's max, at most 8192 (8192 for 8B/70B)")


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    tp_plan = _import_object(args.tp_plan) if args.tp_plan else None
    if args.hf_config:
        return model_spec(hf_config_model(args.hf_config), seq_len=args.seq_len, tp_plan=tp_plan)
    return model_spec(args.model or "llama3-8b", seq_len=args.seq_len, tp_plan=tp_plan)


def _reshard_arg(text: str) -> bool | int:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write true, false or an int K > 1") from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fsdptag.estimate", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hsdp-replicas", type=int, default=1)
    p.add_argument("--reshard-after-forward", required=True, type=_reshard_arg, metavar="{true,false,K}",
                   help="true (zero3), false (zero2) or K: kept sharded over K ranks after forward")
    p.add_argument("--ac", required=True, choices=AC_MODES)
    p.add_argument("--mp", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank and microbatch")
    p.add_argument("--microbatches", type=int, default=1,
                   help="forward+backward passes per optimizer step, all but the last without gradient sync")
    p.add_argument("--policy", default="all", choices=("all",) + POLICIES)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = estimate(
        spec_from_args(args), args.world_size, tp=args.tp, hsdp_replicas=args.hsdp_replicas,
        reshard_after_forward=args.reshard_after_forward, ac=args.ac, mp=args.mp,
        seq_len=args.seq_len, batch=args.batch, microbatches=args.microbatches,
        policies=POLICIES if args.policy == "all" else (args.policy,),
    )
    r0 = results[0]
    print(f"{r0.model}: world {r0.world_size}, tp {r0.tp}, hsdp replicas {r0.hsdp_replicas}, "
          f"reshard_after_forward={r0.reshard_after_forward}, ac={r0.ac}, mp={r0.mp}, "
          f"seq {r0.seq_len} x batch {r0.batch} x {r0.microbatches} microbatches per rank; rank 0, estimated in "
          f"{time.perf_counter() - t0:.0f} s\n")
    print(format_table(results))
    print("\nCost of the step (rank 0):\n")
    print(format_cost_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
