"""What the estimator measures: a :class:`ModelSpec` (a built-in Llama 3 config, a
``pkg.module:factory``, a transformers config) and its TP plan (the model's own, or a
transformers config's ``base_model_tp_plan``)."""

from __future__ import annotations

import copy
import functools
import importlib
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from .llama import CONFIGS, Llama, apply_tp


__all__ = ["MAX_DEFAULT_SEQ", "ModelSpec", "builtin_model", "complete_spec", "factory_model", "hf_config_model",
           "hf_tp_plan", "import_object", "model_spec", "own_tp_plan"]

MAX_DEFAULT_SEQ = 8192  # default sequence length: the model's max, at most this


@dataclass(frozen=True)
class ModelSpec:
    """A model to estimate: ``build()`` makes it (on fake tensors when estimating; it
    takes token ids ``(batch, seq)`` and returns logits or an output with ``.logits``),
    ``tp_plan(model, tp_mesh)`` applies tensor parallelism (default: the model's own,
    see :func:`own_tp_plan`), ``init_weights(model)`` initializes a real one.
    ``vocab_size`` defaults to the input embedding's size, ``seq_len`` to the model's
    max (``config.max_position_embeddings`` or ``cfg.max_seq_len``), at most 8192.
    Its repeated blocks are found as ``apply_ac`` finds them (Note [Blocks]).
    ``depth`` (the number of blocks) and ``at_depth(n)`` (a ``build`` for the same
    model with ``n`` blocks) let an estimate measure two shallow copies and compose
    the rest (Note [Composed depth]); without them every block runs."""

    name: str
    build: Callable[[], nn.Module]
    vocab_size: int | None = None
    seq_len: int | None = None
    tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None
    init_weights: Callable[[nn.Module], None] | None = None
    depth: int | None = None
    at_depth: Callable[[int], Callable[[], nn.Module]] | None = None


def builtin_model(name: str, seq_len: int | None = None) -> ModelSpec:
    """One of the built-in Llama 3 configs (``llama3-debug``, ``llama3-8b``, ``llama3-70b``, ``llama3-405b``)
    at ``seq_len`` (default: its max, at most 8192)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; built-in models are {sorted(CONFIGS)}, or pass a factory "
                         "as 'pkg.module:function' (or --hf-config path/to/config.json)")
    cfg = CONFIGS[name]
    seq_len = seq_len or min(cfg.max_seq_len, MAX_DEFAULT_SEQ)
    cfg = cfg.with_(max_seq_len=max(seq_len, 1))
    return ModelSpec(name, functools.partial(Llama, cfg), cfg.vocab_size, seq_len, apply_tp, Llama.init_weights,
                     cfg.n_layers, functools.partial(_llama_at_depth, cfg))


def _llama_at_depth(cfg, n_layers: int) -> Callable[[], nn.Module]:
    return functools.partial(Llama, cfg.with_(n_layers=n_layers))


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
    depth = _hf_uniform_depth(config)
    return ModelSpec(f"{config.model_type} ({path})", functools.partial(_hf_build, config), None, seq_len, tp_plan,
                     depth=depth, at_depth=functools.partial(_hf_at_depth, config) if depth else None)


# transformers model types whose decoder layers are all alike when ``layer_types`` (if
# the config has it) names one kind: their depth composes (Note [Composed depth]). Others
# (MoE configs with dense first layers or sparse steps, ...) run every block.
HF_UNIFORM_TYPES = frozenset(("llama", "mistral", "qwen2", "qwen3"))


def _hf_uniform_depth(config) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if config.model_type not in HF_UNIFORM_TYPES or (layer_types and len(set(layer_types)) > 1):
        return None
    return getattr(config, "num_hidden_layers", None)


def _hf_at_depth(config, n_layers: int) -> Callable[[], nn.Module]:
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = n_layers
    if getattr(shallow, "layer_types", None):
        shallow.layer_types = shallow.layer_types[:n_layers]
    return functools.partial(_hf_build, shallow)


def _hf_build(config) -> nn.Module:
    return _optional("transformers").AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def model_spec(model: str | ModelSpec | Callable[[], nn.Module], *, seq_len: int | None = None,
               tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None) -> ModelSpec:
    """``model`` as a :class:`ModelSpec`: a built-in name, ``"pkg.module:factory"``, a
    callable or a spec; ``seq_len`` and ``tp_plan``, when given, override the spec's."""
    if isinstance(model, ModelSpec):
        spec = model
    elif isinstance(model, str) and ":" in model:
        spec = factory_model(import_object(model), name=model)
    elif isinstance(model, str):
        spec = builtin_model(model, seq_len)
    elif callable(model):
        spec = factory_model(model)
    else:
        raise TypeError(f"model={model!r}; pass a built-in name, 'pkg.module:factory', a callable or a ModelSpec")
    return replace(spec, seq_len=seq_len or spec.seq_len, tp_plan=tp_plan or spec.tp_plan)


def import_object(target: str):
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
