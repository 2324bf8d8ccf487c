"""Every private torch API fsdptag relies on, in one place.

A torch upgrade that changes one of these fails here and in ``tests/test_compat.py``
(which pins each assumption below), not somewhere deep in the runtime.

=================================================  ==========================================
what                                               why fsdptag needs it
=================================================  ==========================================
``checkpoint._CachingTorchDispatchMode`` /          the SAC modes: the replay check subclasses
``_CachedTorchDispatchMode``                        them; a bucket scope finds its region by them
SAC modes' ``policy_fn`` / ``storage``             whether a region's policy decides FSDP ops,
                                                   kept for its recompute under a key of ours
SAC's error texts (``SAC_REPLAY_ERRORS``)           to re-raise replay failures with the cause
``_get_current_dispatch_mode_stack``                the innermost SAC region running now
``torch._functionalize_unsafe_set``                 a view's tagged wrapper aliases its base
``_top_saved_tensors_default_hooks``                zero3 hooks only where nobody else has any
``torch._C._current_graph_task_id``                 "inside backward" (``in_backward``), which one
``_top_saved_tensors_default_hooks``                whose saved-tensor hooks are active (a
                                                   checkpoint's: defined in ``torch.utils.checkpoint``)
``_execution_engine.queue_callback``               a callback at the end of the running backward
``DeviceMesh._concatenate``                         the (dp, tp) mesh of a TP parameter
``unset_fake_temporarily``                          mesh bookkeeping while estimating on fakes
``_prims_common.make_contiguous_strides_for``       the stride DTensor.from_local is told
``distributed.utils._apply_to_tensors``             casting nested forward inputs, as FSDP2 does
``placement_types._StridedShard``                   FSDP sharding a dim TP already shards
``_functional_collectives.AsyncCollectiveTensor``  the all-gather output before its wait;
``_maybe_wrap_tensor``                              a gradient whose reduction is still in flight
``_functional_collectives._are_we_tracing``        replaced while estimating (``fakes_run_eager``):
``proxy_tensor.get_proxy_mode``                     fake collectives wait at first use, as real ones
``DTensor._local_tensor`` (``local_of``; written:  the local tensor without ``to_local``'s
``replace_local``)                                  autograd op; bound bucket storage, a gradient
                                                   unwrapped once its reduction is done (read
                                                   directly in the tag's dispatch, a hot path)
``DTensor(local, spec, requires_grad=)``            a DTensor from a local tensor and a known
(``dtensor_of``)                                    spec, without ``from_local``'s checks
``OpOverload._op``                                  the C++ op, called in the tag's dispatch (a
                                                   hot path: used directly in ``_tag.py``)
``torch._chunk_cat`` (``chunk_cat``)                gradients packed for the reduce-scatter in
                                                   one kernel, as FSDP2 does
``torch._foreach_norm`` (``foreach_amax``)          float8 scales: every weight's amax at once
``_python_dispatch`` mode stack pop / push          an all-gather issued ahead inside a SAC
                                                   region, unseen by its replay (``sac_hidden``)
``testing._internal...fake_pg.FakeStore``           the estimator's ``fake`` process group
                                                   (imported on first use, by ``fake_store``)
``SelectiveCheckpointContext.op_output``            2.13+: the policy sees the op's output;
                                                   2.11: derived (``SAC_POLICY_SEES_OUTPUT``)
``flop_counter`` SDPA formulas                      2.11's assert equal q / kv heads (GQA):
                                                   widened (``gqa_sdpa_flop_formulas``)
``StorageWeakRef``, ``UntypedStorage._expired`` /   the live-storage tracker: weak references
``_new_with_weak_ptr``                              to storages, checked without reviving them
``_dynamo.callback_handler`` start callbacks       unbinding bucket storage before dynamo
                                                   fakeifies parameters (Note [Bound storage])
``torch._C._storage_Use_Count``                     the tracker's collective settle: who still
                                                   holds a buffer (views hold only the storage)
``_functorch.partitioners.functionalize_rng_ops``   wrapped to fix a torch 2.13 bug that breaks
                                                   compiled checkpoints of DTensor code (below)
``_dynamo.config.skip_fwd_side_effects_in_bwd...``  compiled buckets inside someone's checkpoint
                                                   (Note [Compiled buckets]; torchtitan sets it too)
=================================================  ==========================================

Compiled code's APIs sit in ``compiled.py`` (with Note [Compiled checkpoint, DeviceMesh
saved]), the estimator's in ``estimator.py``; everything is importable from here.

"""

from __future__ import annotations

import collections
import contextlib
import inspect

import torch
import torch._dynamo  # parametrize's DTensor ops import it anyway
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed._functional_collectives import AsyncCollectiveTensor, _maybe_wrap_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.utils import _apply_to_tensors
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
from torch.utils.checkpoint import SelectiveCheckpointContext, _CachedTorchDispatchMode, _CachingTorchDispatchMode

from .compiled import allow_checkpoint_side_effects, fix_compiled_rng_states, is_opaque_node, on_compile_start
from .estimator import fake_store, fakes_run_eager, gqa_sdpa_flop_formulas

__all__ = [
    "chunk_cat",
    "dtensor_of",
    "foreach_amax",
    "is_opaque_node",
    "local_of",
    "resolve_group",
    "OncePerBackward",
    "AsyncCollectiveTensor",
    "SAC_POLICY_SEES_OUTPUT",
    "fake_store",
    "SACCachedMode",
    "SACCachingMode",
    "StorageWeakRef",
    "StridedShard",
    "apply_to_tensors",
    "at_backward_end",
    "lazy_wait",
    "fakes_run_eager",
    "replace_local",
    "sac_hidden",
    "concatenate_meshes",
    "contiguous_strides",
    "allow_checkpoint_side_effects",
    "current_sac_region",
    "DECIDES_FSDP_OPS",
    "sac_policy_decides_fsdp_ops",
    "fix_compiled_rng_states",
    "graph_task_id",
    "in_backward",
    "is_compiling",
    "on_compile_start",
    "is_sac_replay_error",
    "gqa_sdpa_flop_formulas",
    "sac_cached_mode_args",
    "sac_storage",
    "set_alias_storage",
    "storage_expired",
    "storage_from_weak",
    "storage_use_count",
    "top_saved_tensor_hooks",
    "is_checkpoint_hook",
    "unset_fake_temporarily",
]

SACCachingMode = _CachingTorchDispatchMode  # SAC's forward mode (runs the policy)
SACCachedMode = _CachedTorchDispatchMode  # SAC's recompute mode (replays by op index)
StridedShard = _StridedShard
apply_to_tensors = _apply_to_tensors
is_compiling = torch.compiler.is_compiling  # public; here so the runtime has one source
storage_expired = torch.UntypedStorage._expired  # (weak cdata) -> bool
storage_from_weak = torch.UntypedStorage._new_with_weak_ptr  # (weak cdata) -> storage

# torch 2.13+ calls a selective-checkpoint policy after the op ran, with its output as
# ``ctx.op_output``, and replays the recompute by op index without asking the policy;
# torch 2.11/2.12 call it before the op (no output) in forward *and* recompute, and
# replay per op from a FIFO. Note [Policy without the output] in ``_checkpoint.py``.
SAC_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters

def sac_storage() -> collections.defaultdict:
    """A fresh storage shared by SAC's two modes: per op, the saved outputs by op index
    (2.13+), or a FIFO (2.11, which also asks the policy in the recompute)."""
    return collections.defaultdict(dict if SAC_POLICY_SEES_OUTPUT else list)


def sac_cached_mode_args(policy, storage) -> tuple:
    """The arguments of SAC's recompute mode: the policy (asked again by torch 2.11,
    ignored by 2.13+), the storage, no cache mutation."""
    return policy, storage, False


def storage_use_count(t: torch.Tensor) -> int:
    """Strong references to ``t``'s storage (one per tensor or view on it, plus ours)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

# Substrings of the errors SAC raises when a recompute cannot be replayed from its
# cache: an op the forward did not run, or a second backward through the region.
SAC_REPLAY_ERRORS = ("not found in storage", "backward an extra time")


def is_sac_replay_error(e: BaseException) -> bool:
    """Whether ``e`` is SAC's own failure to replay a recompute from its cache."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in SAC_REPLAY_ERRORS)


def current_sac_region():
    """The innermost selective-checkpoint region running now (its SAC mode), or None."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
            return mode
    return None


DECIDES_FSDP_OPS = "_fsdptag_decides_fsdp_ops"  # a policy function's marker (Note [Whose selective policy])
_FOREIGN_KEY = object()  # in a foreign region's SAC storage: read back in its recompute


def sac_policy_decides_fsdp_ops(mode) -> bool:
    """Whether the policy of the SAC region ``mode`` decides FSDP ops itself (it carries
    ``DECIDES_FSDP_OPS``: fsdptag's tagged policy). Read off the policy in the region's
    forward; torch 2.13's recompute mode does not keep the policy, so a region whose
    policy does not decide them says so in the storage its forward and recompute modes
    share (SAC reads its storage by op only: the extra key is never seen). A recompute
    finds the key, or none: a region of fsdptag's policy, whose storage is left as is."""
    storage = mode.storage
    if _FOREIGN_KEY in storage:
        return False
    if not isinstance(mode, _CachingTorchDispatchMode):  # a recompute: its forward said
        return True
    if getattr(mode.policy_fn, DECIDES_FSDP_OPS, False):
        return True
    storage[_FOREIGN_KEY] = ()
    return False


@contextlib.contextmanager
def sac_hidden():
    """Ops run inside are unseen by every selective-checkpoint mode (and by the modes
    above the outermost one): popped for the duration, pushed back after."""
    stack = _get_current_dispatch_mode_stack()
    sac = [i for i, m in enumerate(stack) if isinstance(m, (_CachingTorchDispatchMode, _CachedTorchDispatchMode))]
    if not sac:
        yield
        return
    popped = [_pop_mode() for _ in range(len(stack) - sac[0])]
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def lazy_wait(t: torch.Tensor) -> torch.Tensor:
    """An issued collective's output, waited at its first use (an AsyncCollectiveTensor;
    now when tracing or on fakes, but see :func:`fakes_run_eager`), as DTensor does."""
    return _maybe_wrap_tensor(t)


def local_of(d: DTensor) -> torch.Tensor:
    """``d``'s local tensor, as it is (no autograd op, no wait)."""
    return d._local_tensor


def dtensor_of(local: torch.Tensor, spec) -> DTensor:
    """A DTensor of ``local`` with DTensor spec ``spec`` (no checks, no autograd)."""
    return DTensor(local, spec, requires_grad=False)


def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Each tensor split in ``num_chunks`` along dim 0 (padded), chunk i of every tensor
    side by side in row i of ``out``: the reduce-scatter input, one kernel."""
    torch._chunk_cat(tensors, dim=0, num_chunks=num_chunks, out=out)


def foreach_amax(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The max absolute value of each tensor (one foreach kernel)."""
    return torch._foreach_norm(tensors, float("inf"))


def replace_local(d: DTensor, local: torch.Tensor) -> None:
    """Point DTensor ``d`` at ``local`` (same shape, dtype and device)."""
    d._local_tensor = local


def in_backward() -> bool:
    """Whether the autograd engine is running this code (backward, or a checkpoint
    recompute inside it)."""
    return torch._C._current_graph_task_id() != -1


def graph_task_id() -> int:
    """The autograd engine's id of the backward running now (-1 outside backward)."""
    return torch._C._current_graph_task_id()


def at_backward_end(fn) -> None:
    """Run ``fn`` when the backward running now finishes (FSDP's final callback). A
    backward that raises drops its callbacks: see :class:`OncePerBackward`."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class OncePerBackward:
    """Queues a callback at the end of the running backward at most once per backward.
    Keyed by the backward's graph task, not by a flag the callback clears: a backward
    that raises drops its callbacks, and such a flag would stay set and skip the
    callback in every later backward."""

    __slots__ = ("queued_for",)

    def __init__(self) -> None:
        self.queued_for = -1  # graph task ids are per process: a pickled one starts afresh

    def __reduce__(self):
        return OncePerBackward, ()

    def queue(self, fn) -> None:
        task = graph_task_id()
        if task != self.queued_for:
            self.queued_for = task
            at_backward_end(fn)


def top_saved_tensor_hooks() -> tuple | None:
    """``(pack, unpack)`` of the innermost active saved-tensor hooks, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def is_checkpoint_hook(pack) -> bool:
    """Whether ``pack`` is a non-reentrant checkpoint region's (forward or recompute)."""
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint"


def set_alias_storage(out: torch.Tensor, base: torch.Tensor) -> None:
    """Make the wrapper ``out`` alias ``base``'s storage (what
    ``return_and_correct_aliasing`` does for view ops)."""
    torch._functionalize_unsafe_set(out, base)


def contiguous_strides(shape) -> tuple[int, ...]:
    return tuple(make_contiguous_strides_for(shape))


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh spanning ``meshes``' dims (sub-meshes of one root mesh); raises
    RuntimeError when they are not. Real even while estimating on fake tensors."""
    with unset_fake_temporarily():
        return DeviceMesh._concatenate(meshes)


def resolve_group(group_name: str):
    """The process group registered as ``group_name`` (functional collectives' names)."""
    return torch.distributed.distributed_c10d._resolve_process_group(group_name)
