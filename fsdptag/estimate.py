"""Memory estimate for one rank at real scale, on one CPU: ``python -m fsdptag.estimate``.

    python -m fsdptag.estimate --model llama3-8b --world-size 64 --tp 8 \\
        --reshard-after-forward false --ac selective --mp bf16 [--policy tagged] [--json out.json]

It runs rank 0's training step (forward, backward, optimizer step) of a model
(built-in: the Llama 3 configs; or any :class:`ModelSpec`) at full size on fake tensors (``FakeTensorMode``) with the ``fake`` process
group, so nothing is allocated and nothing is sent, and counts bytes with
:class:`fsdptag.debug.LiveStorageTracker`. The same :func:`measure_step` runs for
real in the validation test, which checks that the estimate matches a real gloo
run at small scale.

Reported per policy (``tagged`` = fsdptag, ``op-name`` = save FSDP-looking ops by
name, ``fsdp2`` = FSDP2 ``fully_shard`` with the same AC): the peak of the step,
sharded parameters, gradients, AdamW state, and the bytes forward keeps for
backward, split into FSDP-gathered parameters, TP/other collective outputs,
activation casts and the rest.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from ._api import MixedPrecisionPolicy
from ._checkpoint import apply_ac
from ._compat import FakeStore
from ._parametrize import parametrize
from .debug import LiveStorageTracker
from .testing.baselines import apply_baseline_ac
from .testing.llama import CONFIGS, Llama, apply_tp

__all__ = ["POLICIES", "MemoryEstimate", "ModelSpec", "build_mesh", "build_model", "builtin_model",
           "measure_step", "estimate"]

POLICIES = ("tagged", "op-name", "fsdp2")


@dataclass
class MemoryEstimate:
    policy: str
    model: str
    world_size: int
    tp: int
    hsdp_replicas: int
    reshard_after_forward: bool
    ac: str
    mp: str
    seq_len: int
    batch: int
    peak_bytes: int
    param_bytes: int  # this rank's shards of the stored parameters
    gathered_param_bytes: int  # FSDP-gathered parameters kept for backward
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # everything forward keeps for backward (gathered params included)
    kept_collective_bytes: int  # of which: outputs of TP (non-FSDP) collectives
    kept_cast_bytes: int  # of which: activation casts (_to_copy)


@dataclass(frozen=True)
class ModelSpec:
    """A model to estimate: ``build()`` makes it (on fake tensors when estimating; it
    takes token ids ``(batch, seq)`` and returns logits), ``tp_plan(model, tp_mesh)``
    applies tensor parallelism (needed for ``tp > 1``), ``init_weights(model)``
    initializes a real one. Its repeated blocks are the children of ``model.layers``."""

    name: str
    build: Callable[[], nn.Module]
    vocab_size: int
    seq_len: int
    tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None
    init_weights: Callable[[nn.Module], None] | None = None


def builtin_model(name: str, seq_len: int | None = None) -> ModelSpec:
    """One of the built-in Llama 3 configs (``llama3-debug``, ``llama3-8b``, ``llama3-70b``)
    at ``seq_len`` (default: its max, at most 8192)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; built-in models are {sorted(CONFIGS)}")
    cfg = CONFIGS[name]
    seq_len = seq_len or min(cfg.max_seq_len, 8192)
    cfg = cfg.with_(max_seq_len=max(seq_len, 1))
    return ModelSpec(name, lambda: Llama(cfg), cfg.vocab_size, seq_len, apply_tp, Llama.init_weights)


class _EagerAliasingWait(TorchDispatchMode):
    """Eager ``wait_tensor`` returns its input; the fake kernel allocates a new tensor,
    which would double-count every saved collective output. Restore eager aliasing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]
        return func(*args, **(kwargs or {}))


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


def build_model(spec: ModelSpec, mesh: DeviceMesh, *, policy: str, reshard: bool, ac: str,
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
        if spec.tp_plan is None:
            raise ValueError(f"model {spec.name!r} has no TP plan; pass ModelSpec(tp_plan=...) or use tp=1")
        spec.tp_plan(model, mesh["tp"])
    mode, every = ("selective", 2) if ac == "layer" else (ac, None)
    dtype = torch.bfloat16 if mp == "bf16" else None
    if policy == "fsdp2":
        apply_ac(model, mode, layer_every=every)
        dp_names = tuple(n for n in names if n != "tp")
        dp_mesh = mesh[dp_names] if "tp" in names else mesh
        mp2 = FSDP2MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp2, reshard_after_forward=reshard)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp2, reshard_after_forward=reshard)
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


def measure_step(model, tokens: torch.Tensor) -> dict:
    """One training step under a LiveStorageTracker; returns the byte counts.

    Persistent state (parameters, a warm AdamW state) exists before the step, as
    in steady-state training, and counts towards the peak.
    """
    params = list(model.parameters())
    optim = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    for p in params:  # materialize AdamW's state without a forward
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    state = [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    # A real process group's thread releases collective buffers on its own time: settle.
    tracker = LiveStorageTracker(track_inputs=True, track_peak=True,
                                 settle_collectives=not isinstance(tokens, FakeTensor))
    tracker.track_existing(params + state)
    # Cyclic GC would free some buffers at times that vary from run to run (it runs on
    # allocation counts, and the collectives' threads allocate too); paused, frees
    # follow reference counts only, the same in a real run and in an estimate.
    gc.collect()
    gc.disable()
    try:
        with tracker:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            del logits
            at_forward_end = tracker.snapshot()
            loss.backward()
            del loss
            after_backward = tracker.snapshot()
            grad_bytes = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
            optim.step()
            optim.zero_grad(set_to_none=True)
    finally:
        gc.enable()
    kept = LiveStorageTracker.kept(at_forward_end, after_backward)
    return {
        "peak_bytes": tracker.peak_bytes,
        "param_bytes": sum(_local_bytes(p) for p in params),
        "gathered_param_bytes": kept.get("fsdp", 0),
        "grad_bytes": grad_bytes,
        "optimizer_bytes": sum(_local_bytes(t) for t in state),
        "activation_bytes": sum(kept.values()),
        "kept_collective_bytes": kept.get("collective", 0),
        "kept_cast_bytes": kept.get("cast", 0),
    }


def estimate(model: str | ModelSpec, world_size: int, *, tp: int = 1, hsdp_replicas: int = 1,
             reshard_after_forward: bool, ac: str, mp: str = "bf16", seq_len: int | None = None,
             batch: int = 1, policies=POLICIES) -> list[MemoryEstimate]:
    """Estimate rank 0's memory for each policy on fake tensors (no real allocation).

    ``model``: a built-in model's name or a :class:`ModelSpec`.

    Example::

        >>> [r.peak_bytes for r in estimate("llama3-8b", 64, tp=8, reshard_after_forward=False, ac="full")]
    """
    spec = builtin_model(model, seq_len) if isinstance(model, str) else model
    seq_len = seq_len or spec.seq_len
    if dist.is_initialized():
        raise RuntimeError("fsdptag.estimate needs to own the process group; call it in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    results = []
    try:
        mesh = build_mesh("cpu", world_size, tp, hsdp_replicas)
        for policy in policies:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            m = build_model(spec, mesh, policy=policy, reshard=reshard_after_forward, ac=ac, mp=mp,
                            fake_mode=fake_mode)
            with fake_mode, _EagerAliasingWait():
                tokens = torch.randint(0, spec.vocab_size, (batch, seq_len + 1))
                numbers = measure_step(m, tokens)
            results.append(MemoryEstimate(
                policy=policy, model=spec.name, world_size=world_size, tp=tp, hsdp_replicas=hsdp_replicas,
                reshard_after_forward=reshard_after_forward, ac=ac, mp=mp, seq_len=seq_len,
                batch=batch, **numbers,
            ))
    finally:
        dist.destroy_process_group()
    return results


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def format_table(results: list[MemoryEstimate]) -> str:
    head = ("| policy | peak GiB | params GiB | grads GiB | optim GiB | kept for bwd GiB | "
            "of which gathered params | TP collectives | casts |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.policy} | {_gib(r.peak_bytes)} | {_gib(r.param_bytes)} | {_gib(r.grad_bytes)} | "
            f"{_gib(r.optimizer_bytes)} | {_gib(r.activation_bytes)} | "
            f"{_gib(r.gathered_param_bytes)} | {_gib(r.kept_collective_bytes)} | "
            f"{_gib(r.kept_cast_bytes)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fsdptag.estimate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", choices=sorted(CONFIGS))
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hsdp-replicas", type=int, default=1)
    p.add_argument("--reshard-after-forward", required=True, choices=["true", "false"])
    p.add_argument("--ac", required=True, choices=["none", "full", "selective", "layer"])
    p.add_argument("--mp", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max (8192 for 8B/70B)")
    p.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank")
    p.add_argument("--policy", default="all", choices=("all",) + POLICIES)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = estimate(
        args.model, args.world_size, tp=args.tp, hsdp_replicas=args.hsdp_replicas,
        reshard_after_forward=args.reshard_after_forward == "true", ac=args.ac, mp=args.mp,
        seq_len=args.seq_len, batch=args.batch,
        policies=POLICIES if args.policy == "all" else (args.policy,),
    )
    r0 = results[0]
    print(f"{r0.model}: world {r0.world_size}, tp {r0.tp}, hsdp replicas {r0.hsdp_replicas}, "
          f"reshard_after_forward={r0.reshard_after_forward}, ac={r0.ac}, mp={r0.mp}, "
          f"seq {r0.seq_len} x batch {r0.batch} per rank; rank 0, estimated in "
          f"{time.perf_counter() - t0:.0f} s\n")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
