"""The selective-checkpoint policy that decides FSDP results by their tag (it depends
on the tag alone; ``apply_ac``, which checkpoints a model's blocks with it, is in
``_ac.py``).

Note [Tagged checkpoint policy]
-------------------------------
Under activation checkpointing the backward recompute re-runs the forward, so
every FSDP all-gather in the region runs again. Saving ops by name
(``all_gather_into_tensor``, ``wait_tensor``, ``_to_copy``) avoids that but also
saves the tensor-parallel all-gathers and every activation cast in the region.

fsdptag's policy looks at ``ctx.op_output`` instead:

* FSDP-tagged, zero2 (``reshard_after_forward=False``): ``MUST_SAVE`` the
  output of ``all_gather_into_tensor`` (the gathered buffer, once); everything
  else on the tag's path is ``MUST_RECOMPUTE``: the pre-gather cast and padding
  (local and cheap), the views after the gather (free: they alias the saved
  buffer) and ``wait_tensor``, which on the cached buffer has no pending work and
  returns it. Saving the wait's output as well would be harmless in eager (same
  storage) but double-counts under FakeTensorMode, where the wait allocates.
  The recompute then gets the gathered buffer from the cache: no collective.
* FSDP-tagged, zero3: ``MUST_RECOMPUTE`` everything, views included, so no
  saved alias keeps the gathered buffer alive; the recompute gathers each
  parameter of the region once.
* anything else: the user's ``base`` policy (an op list, a policy function, or
  ``None`` = recompute, i.e. full AC). ``_wrap_tensor_autograd`` is never saved
  (it would break checkpoint's saved-tensor count).

The SAC policy runs only in forward; the recompute replays decisions by per-op
index (torch 2.13+; see the next Note for 2.11). ``checkpoint_context_fn`` adds a check to that replay: each
``all_gather_into_tensor`` in the recompute must gather the same parameter (by
FQN) as the forward did at that index, or fsdptag raises naming both.

Note [Policy without the output]
--------------------------------
torch 2.11 asks the policy *before* the op runs (no ``ctx.op_output``) and asks it
again in the recompute (``ctx.is_recompute``), replaying saved outputs per op in
FIFO order. There the policy tells the output's tag from the op and its inputs by
the tag table (:func:`~fsdptag._tag.output_tag`: a tagged input keeps its tag
through the table's ops, a view of a marked handout shares its mark), which gives
the same decision for every op as 2.13's look at the output
(``tests/unit/test_policy_tags.py`` checks the two agree op by op). The recompute
mode gets a policy of its own, so a stateful base (every second ``mm``) counts
afresh in the recompute and decides as in forward.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ._compat import (
    DECIDES_FSDP_OPS,
    SAC_POLICY_SEES_OUTPUT,
    SACCachedMode,
    SACCachingMode,
    is_sac_replay_error,
    sac_cached_mode_args,
    sac_storage,
)
from ._tag import first_tag, get_fsdp_tag, output_tag

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

__all__ = ["DEFAULT_SAVE_OPS", "SaveOps", "as_policy", "checkpoint_context_fn", "checkpoint_policy", "fresh_base"]

Policy = Callable[..., CheckpointPolicy]
_ALL_GATHER = c10d.all_gather_into_tensor.default


DEFAULT_SAVE_OPS = frozenset(
    op for op in (
        aten.mm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        getattr(aten, "_scaled_dot_product_cudnn_attention", None)
        and aten._scaled_dot_product_cudnn_attention.default,
        c10d.reduce_scatter_tensor.default,
        aten.max.default,
    ) if op
)
"""The ops op-level selective AC saves (matmuls, attention kernels, reduce-scatters,
``max``), as torchtitan's op-level SAC does; every second ``mm`` is still recomputed."""


class SaveOps:
    """Save the outputs of ``ops``, except every second ``mm`` (torchtitan's rule).

    Holds a per-region ``mm`` counter: ``checkpoint_context_fn`` makes a fresh
    copy for each checkpointed call. Forward and recompute count apart, as
    torchtitan's policy does: torch 2.11 asks the policy in the recompute too, and
    torch's own ``create_selective_checkpoint_contexts`` hands both modes one object.
    """

    def __init__(self, ops: Iterable, every_other_mm: bool = True) -> None:
        self.ops = frozenset(ops)
        self.every_other_mm = every_other_mm
        self.mm_count = [0, 0]  # forward, recompute

    def fresh(self) -> "SaveOps":
        return SaveOps(self.ops, self.every_other_mm)

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func is aten.mm.default and self.every_other_mm:
            self.mm_count[ctx.is_recompute] += 1
            if self.mm_count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in self.ops else CheckpointPolicy.PREFER_RECOMPUTE


def _op_named(name: str):
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default``."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def fresh_base(base):
    """``base`` as one checkpointed call should get it: stateful save lists copied."""
    return base.fresh() if isinstance(base, SaveOps) else base


def as_policy(base) -> Policy:
    if base is None:
        return lambda ctx, func, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE
    if isinstance(base, (list, tuple, set, frozenset)):
        bad = [op for op in base if not isinstance(op, torch._ops.OpOverload)]
        if bad:
            raise TypeError(
                f"base op list holds {bad[0]!r}, which is not an OpOverload; name the overload, "
                "e.g. torch.ops.aten.mm.default rather than torch.ops.aten.mm"
            )
        return SaveOps(base, every_other_mm=False)
    if callable(base):
        return base
    raise TypeError(
        f"base={base!r} must be None (recompute everything), a list of ops to save, "
        "or a policy function (ctx, func, *args, **kwargs) -> CheckpointPolicy"
    )


def checkpoint_policy(base=None) -> Policy:
    """A selective-checkpoint policy: FSDP-tagged results by their tag, the rest by ``base``.

    See Note [Tagged checkpoint policy]. ``base`` is ``None`` (recompute all:
    full AC), a list of ops to save, or a policy function. On a model that was
    never parametrized nothing is tagged, so this is just ``base``.

    Example::

        >>> policy = fsdptag.checkpoint_policy([torch.ops.aten.mm.default])
        >>> ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    """
    base_fn = as_policy(base)
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        tag = first_tag(ctx.op_output) if SAC_POLICY_SEES_OUTPUT else output_tag(func, args)
        if tag is None:
            return base_fn(ctx, func, *args, **kwargs)
        if not tag.reshard_after_forward and func is _ALL_GATHER:
            return save
        return recompute

    setattr(policy, DECIDES_FSDP_OPS, True)  # Note [Whose selective policy] in _context.py
    return policy


def _gather_fqn(args) -> str | None:
    tag = get_fsdp_tag(args[0]) if args else None
    return tag.fqn if tag is not None else None


class _RecordingCachingMode(SACCachingMode):
    """SAC's forward mode, also recording which parameter each all-gather gathered."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps every subclass's __torch_dispatch__ in
        # torch._disable_dynamo (~2 µs per op). This override only does bookkeeping
        # and calls the base method, which keeps its own wrapper.
        return False

    def __init__(self, policy_fn, storage, gathered: list) -> None:
        super().__init__(policy_fn, storage)
        self.gathered = gathered

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is c10d.all_gather_into_tensor.default:
            self.gathered.append(_gather_fqn(args))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _CheckingCachedMode(SACCachedMode):
    """SAC's recompute mode, checking the all-gathers replay the forward's parameters."""

    _should_skip_dynamo = _RecordingCachingMode._should_skip_dynamo

    def __init__(self, policy_fn, storage, gathered: list) -> None:
        super().__init__(*sac_cached_mode_args(policy_fn, storage))
        self.gathered = gathered
        self.gather_idx = 0
        self.replays = 0

    def __enter__(self):
        # A second replay is a second backward through the region (retain_graph=True or
        # double backward). SAC fails there only if it cached something, so zero2 would
        # fail and zero3 silently recompute; fail the same way for both.
        self.replays += 1
        if self.replays > 1:
            raise RuntimeError(
                "fsdptag: activation-checkpoint replay failed: this checkpointed region was "
                "already backwarded once (a region can be backwarded once; retain_graph=True and "
                "double backward are not supported under fsdptag.apply_ac / checkpoint_context_fn)"
            )
        self.gather_idx = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is c10d.all_gather_into_tensor.default:
            i, self.gather_idx = self.gather_idx, self.gather_idx + 1
            expected = self.gathered[i] if i < len(self.gathered) else "<no all-gather>"
            actual = _gather_fqn(args)
            if actual != expected:
                raise RuntimeError(
                    f"fsdptag: activation-checkpoint replay mismatch at all-gather #{i}: forward "
                    f"gathered {_describe(expected)} but the recompute gathers {_describe(actual)}. "
                    "A checkpointed region must access the same parameters in the same order "
                    "in forward and recompute (no data-dependent control flow over parameters)."
                )
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except RuntimeError as e:
            if not is_sac_replay_error(e):
                raise
            fqn = _gather_fqn(args)
            where = f" on FSDP parameter {fqn!r}" if fqn else ""
            raise RuntimeError(
                f"fsdptag: activation-checkpoint replay failed at {func}{where}: the recompute "
                "did not run the ops the forward ran. Likely causes: state that changed between "
                "forward and recompute (a KV cache growing: pass use_cache=False to a Hugging Face "
                "model in training; a counter, a random branch), or a second backward through the "
                f"region (retain_graph=True and double backward are not supported). SAC said: {e}"
            ) from e


def _describe(fqn) -> str:
    return "a non-FSDP tensor (e.g. a TP all-gather)" if fqn is None else repr(fqn)


def checkpoint_context_fn(base=None, *, policy_factory: Callable[[], Any] | None = None
                          ) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` with :func:`checkpoint_policy`.

    Each call (one per checkpointed call of a region) builds fresh SAC modes plus the
    replay check of Note [Tagged checkpoint policy], and the user's part of the policy:
    ``base`` (``None``: recompute all, an op list, or a policy function; fsdptag's own
    stateful save lists are copied fresh), or ``policy_factory()``, a zero-argument
    callable that returns a fresh ``base`` for each region. A policy that keeps state
    (e.g. torchtitan's "save every second matmul" counter) must come from a factory:
    one shared object would carry its count from region to region and step to step.

    Example::

        >>> ctx_fn = fsdptag.checkpoint_context_fn([torch.ops.aten.mm.default])
        >>> y = checkpoint(block, x, use_reentrant=False, context_fn=ctx_fn)
        >>> ctx_fn = fsdptag.checkpoint_context_fn(policy_factory=lambda: MatmulCounter())
    """
    if policy_factory is not None:
        if base is not None:
            raise ValueError("pass either base or policy_factory to checkpoint_context_fn, not both")
        if not callable(policy_factory):
            raise TypeError(f"policy_factory={policy_factory!r} must be a zero-argument callable returning a policy")
        spec = ("factory", policy_factory)
    else:
        checked = as_policy(base)  # validate now, not at the first forward
        spec = (("ops", tuple(sorted(map(str, checked.ops))), checked.every_other_mm)
                if isinstance(checked, SaveOps) else ("base", base))
    # A partial of a module-level function over plain data: dynamo's checkpoint takes it
    # (a function or a partial, not any callable), and a checkpointed model pickles
    # (Note [Pickling generated classes] in _class_swap.py).
    return functools.partial(_tagged_context, spec)


def _region_base(spec: tuple):
    """The user's part of the policy for one region, from ``checkpoint_context_fn``'s spec."""
    kind = spec[0]
    if kind == "factory":
        return as_policy(spec[1]())
    if kind == "ops":
        return SaveOps(map(_op_named, spec[1]), every_other_mm=spec[2])
    return spec[1]


def _tagged_context(spec: tuple) -> tuple[Any, Any]:
    storage = sac_storage()
    gathered: list = []
    return (
        _RecordingCachingMode(checkpoint_policy(_region_base(spec)), storage, gathered),
        # its own policy: torch 2.11 asks it again, with a fresh count of its own
        _CheckingCachedMode(checkpoint_policy(_region_base(spec)), storage, gathered),
    )
