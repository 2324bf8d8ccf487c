"""One training step measured (as ``estimate.py``'s docstring says): bytes by
``LiveStorageTracker``, collectives by ``CollectiveCounter``, FLOPs by
``FlopCounterMode``'s formulas; on fake tensors for estimates, for real in the
validation tests."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .._compat import AsyncCollectiveTensor, gqa_sdpa_flop_formulas, in_backward
from .._parametrize import is_parametrized
from .._sync import set_requires_gradient_sync
from ..debug import CollectiveCounter, LiveStorageTracker
from ..debug.counter import WRAP_OP
from .overlap import TimelineCounter


__all__ = ["COLLECTIVE_FIELDS", "EagerAliasingWait", "OptimizerReuse", "measure_step"]


class EagerAliasingWait(TorchDispatchMode):
    """Eager ``wait_tensor`` returns its input, and eager ``_wrap_tensor_autograd`` wraps
    it in an AsyncCollectiveTensor; their fake kernels allocate a new tensor, which would
    double-count every saved collective output. Restore eager aliasing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]
        if func is WRAP_OP:
            return AsyncCollectiveTensor(args[0])
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


COLLECTIVE_FIELDS = ("fsdp_all_gather_bytes", "fsdp_partial_all_gather_bytes", "fsdp_reduce_scatter_bytes", "fsdp_all_reduce_bytes",
                      "tp_all_gather_bytes", "tp_reduce_scatter_bytes", "tp_all_reduce_bytes",
                      "other_collective_bytes")


def _collective_bytes(counter: CollectiveCounter) -> dict[str, int]:
    out = dict.fromkeys(COLLECTIVE_FIELDS, 0)
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
    in steady-state training, and counts towards the peak. ``phase_peaks``: the peak
    of each forward, each backward and the optimizer step, in that order
    (``peak_bytes`` is their max; Note [Composed depth] composes them one by one).
    ``timeline``: the collectives' issues and waits in dispatch order, with the FLOPs
    between them (Note [Exposed communication] in ``overlap.py``).
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
    flops = _StepFlops()
    counter = TimelineCounter(mesh if mesh is not None else
                              list({p.device_mesh: None for p in stored if isinstance(p, DTensor)}),
                              lambda: sum(flops.counts.values()))
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
            phases = []  # the peak of each forward, each backward and the optimizer step

            def phase_ends() -> None:  # the next phase's peak starts from its first allocation
                phases.append(tracker.peak_bytes)
                tracker.peak_bytes = 0
                counter.end_phase()

            for i in range(microbatches):
                last = i == microbatches - 1
                if microbatches > 1:
                    _set_gradient_sync(model, last)
                logits = _logits(model(tokens[:, :-1]))
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                del logits
                at_forward_end = tracker.snapshot()
                phase_ends()
                loss.backward()
                del loss
                after_backward = tracker.snapshot()
                phase_ends()
                if i == 0:  # what forward keeps for backward: no accumulator is alive yet
                    kept = LiveStorageTracker.kept(at_forward_end, after_backward)
                if not last:
                    unsynced = _total(after_backward) - before
            grad_bytes = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
            phases.append(_optimizer_step(optim, params, tracker, after_backward, reuse, key, known))
            optim.zero_grad(set_to_none=True)
    finally:
        gc.unfreeze()
        gc.enable()
    return {
        "peak_bytes": max(phases),
        "phase_peaks": tuple(phases),
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
        "timeline": tuple(counter.records),
    }


def _total(snapshot: dict) -> int:
    return sum(nbytes for nbytes, _, _ in snapshot.values())


def _set_gradient_sync(model: nn.Module, sync: bool) -> None:
    if is_parametrized(model):
        set_requires_gradient_sync(model, sync)
    else:  # FSDP2's FSDPModule
        model.set_requires_gradient_sync(sync)


def _optimizer_step(optim, params, tracker: LiveStorageTracker, after_backward: dict,
                    reuse: OptimizerReuse | None, key: tuple | None, known) -> int:
    """The optimizer step's peak: run (and recorded for ``reuse``), or recorded before
    (Note [Optimizer reuse]). Nothing is freed between the snapshot and the step."""
    start = _total(after_backward)
    if known is not None:
        return start + known[1]
    tracker.peak_bytes = 0
    optim.step()
    rise = max(tracker.peak_bytes - start, 0)
    if reuse is not None:
        reuse.known[key] = (OptimizerReuse.layout(optim, params), rise)
    return start + rise
