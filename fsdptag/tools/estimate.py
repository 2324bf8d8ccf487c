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

Models: a built-in Llama 3 config (``llama3-debug``, ``llama3-8b``, ``llama3-70b``, ``llama3-405b``);
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
import json
import sys
import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision, fully_shard

from .._api import MixedPrecisionPolicy, ReshardPolicy
from .._blocks import find_blocks
from .._ac import apply_ac
from .._compat import fake_store, fakes_run_eager
from .._parametrize import parametrize
from .._plan import reshard_resolver
from .baselines import apply_baseline_ac
from .records import MemoryEstimate, StepConfig
from .report import format_cost_table, format_table
from .compose import KEEP_LAST, compose, compose_depths, keep_last_of, resolve_reshard
from .llama import CONFIGS
from .measure import EagerAliasingWait, OptimizerReuse, measure_step
from .models import (ModelSpec, builtin_model, complete_spec, factory_model, hf_config_model, hf_tp_plan,
                     import_object, model_spec, own_tp_plan)


__all__ = ["AC_MODES", "POLICIES", "MemoryEstimate", "ModelSpec", "StepConfig", "build_mesh", "build_model",
           "builtin_model", "complete_spec", "estimate", "estimate_each", "factory_model", "hf_config_model",
           "hf_tp_plan", "measure_step", "model_spec", "own_tp_plan", "OptimizerReuse"]

POLICIES = ("tagged", "op-name", "fsdp2")
AC_MODES = ("none", "full", "selective", "layer")  # layer: full AC on every second block


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
    reshard = resolve_reshard(reshard, model)
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
        reshard_of = reshard_resolver(model, reshard)
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


def estimate(model: str | ModelSpec | Callable[[], nn.Module], world_size: int, *, tp: int = 1,
             hsdp_replicas: int = 1, reshard_after_forward: ReshardPolicy, ac: str, mp: str = "bf16",
             seq_len: int | None = None, batch: int = 1, microbatches: int = 1, policies=POLICIES,
             tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None,
             compose: bool = True) -> list[MemoryEstimate]:
    """Estimate rank 0's memory and cost for each policy on fake tensors (no real allocation).

    ``model``: a built-in model's name, ``"pkg.module:factory"``, a callable that builds
    the model, or a :class:`ModelSpec`. ``reshard_after_forward``: True (zero3), False
    (zero2) or a dict of module-FQN prefixes to bools (as ``fsdptag.parametrize``).
    ``ac``: one of :data:`AC_MODES`; ``mp``: ``"bf16"`` (bf16 parameters, fp32
    reduction) or ``"fp32"``; ``batch``: sequences per data-parallel rank and microbatch;
    ``microbatches``: forward+backward passes per optimizer step, all but the last
    without gradient sync (each runs: the estimate's time grows with it);
    ``tp_plan(model, tp_mesh)``: for ``tp > 1`` when the model has no plan of its own;
    ``compose``: measure two shallow copies and compose the other blocks (Note
    [Composed depth]; the same numbers in a time that does not grow with depth),
    False runs every block.

    Example::

        >>> [r.peak_bytes for r in estimate("llama3-8b", 64, tp=8, reshard_after_forward=False, ac="full")]
        >>> estimate(lambda: MyLM(), world_size=8, reshard_after_forward=True, ac="selective", seq_len=2048)
    """
    configs = [StepConfig(tp, hsdp_replicas, reshard_after_forward, ac, mp, batch, p, microbatches)
               for p in policies]
    return list(estimate_each(model, world_size, configs, seq_len=seq_len, tp_plan=tp_plan, compose=compose))


def estimate_each(model: str | ModelSpec | Callable[[], nn.Module], world_size: int,
                  configs: Iterable[StepConfig], *, seq_len: int | None = None,
                  tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None,
                  compose: bool = True) -> Iterator[MemoryEstimate]:
    """:func:`estimate` for several configurations in one fake process group, yielding
    each result as it is done. Everything is validated before the first one runs."""
    configs = list(configs)
    for c in configs:
        _check_config(c, world_size)
    spec = complete_spec(model_spec(model, seq_len=seq_len, tp_plan=tp_plan), any(c.tp > 1 for c in configs))
    if dist.is_initialized():
        raise RuntimeError("fsdptag.estimate needs to own the process group; call it in a fresh process")
    return _run(spec, world_size, configs, compose)


def _check_config(c: StepConfig, world_size: int) -> None:
    for name, value, choices in (("ac", c.ac, AC_MODES), ("mp", c.mp, ("bf16", "fp32")),
                                 ("policy", c.policy, POLICIES)):
        if value not in choices:
            raise ValueError(f"unknown {name}={value!r}; use one of {choices}")
    if world_size % (c.tp * c.hsdp_replicas):
        raise ValueError(f"world_size={world_size} is not divisible by tp={c.tp} x hsdp_replicas={c.hsdp_replicas}")
    if isinstance(c.reshard_after_forward, str) and c.reshard_after_forward != KEEP_LAST:
        raise ValueError(f"reshard_after_forward={c.reshard_after_forward!r}; use a bool, an int K, a dict, "
                         f"a function or {KEEP_LAST!r}")
    if c.batch < 1:
        raise ValueError(f"batch={c.batch} must be >= 1 (sequences per data-parallel rank)")
    if c.microbatches < 1:
        raise ValueError(f"microbatches={c.microbatches} must be >= 1 (forward+backward per optimizer step)")


def _run(spec: ModelSpec, world_size: int, configs: list[StepConfig], can_compose: bool) -> Iterator[MemoryEstimate]:
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    meshes: dict[tuple[int, int], DeviceMesh] = {}
    reuse = OptimizerReuse()
    try:
        for c in configs:
            key = (c.tp, c.hsdp_replicas)
            if key not in meshes:
                meshes[key] = build_mesh("cpu", world_size, c.tp, c.hsdp_replicas)
            yield _estimate_one(spec, meshes[key], world_size, c, reuse, can_compose)
    finally:
        dist.destroy_process_group()


def _estimate_one(spec: ModelSpec, mesh: DeviceMesh, world_size: int, c: StepConfig,
                  reuse: OptimizerReuse, can_compose: bool) -> MemoryEstimate:
    depths = compose_depths(spec.depth, c.reshard_after_forward, c.ac, c.policy) \
        if can_compose and spec.at_depth is not None else None
    if depths is None:
        numbers = _measure(spec, mesh, c, reuse)
    else:  # Note [Composed depth]
        a, b = depths
        numbers = compose(*(_measure(replace(spec, build=spec.at_depth(n), depth=n), mesh, c, reuse) for n in depths),
                          a, b, spec.depth)
    del numbers["phase_peaks"]
    batch, seq_len = c.batch, spec.seq_len
    reshard = c.reshard_after_forward
    if reshard == KEEP_LAST:  # reported for the model estimated
        reshard = keep_last_of(spec.build)
    return MemoryEstimate(
        policy=c.policy, model=spec.name, world_size=world_size, tp=c.tp, hsdp_replicas=c.hsdp_replicas,
        reshard_after_forward=reshard if isinstance(reshard, (bool, int)) else dict(reshard), ac=c.ac, mp=c.mp,
        seq_len=seq_len, batch=batch, microbatches=c.microbatches, **numbers,
    )


def _measure(spec: ModelSpec, mesh: DeviceMesh, c: StepConfig, reuse: OptimizerReuse) -> dict:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    m = build_model(spec, mesh, policy=c.policy, reshard=c.reshard_after_forward, ac=c.ac, mp=c.mp,
                    fake_mode=fake_mode)
    with fake_mode, EagerAliasingWait(), fakes_run_eager():
        tokens = torch.randint(0, spec.vocab_size, (c.batch, spec.seq_len + 1))
        return measure_step(m, tokens, mesh, reuse, c.microbatches)


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
    tp_plan = import_object(args.tp_plan) if args.tp_plan else None
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
    p.add_argument("--full-depth", action="store_true",
                   help="run every block instead of composing two shallow copies (the same numbers, slower)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = estimate(
        spec_from_args(args), args.world_size, tp=args.tp, hsdp_replicas=args.hsdp_replicas,
        reshard_after_forward=args.reshard_after_forward, ac=args.ac, mp=args.mp,
        seq_len=args.seq_len, batch=args.batch, microbatches=args.microbatches,
        policies=POLICIES if args.policy == "all" else (args.policy,), compose=not args.full_depth,
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
            json.dump([r.report() for r in results], f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
