"""An explicit gather schedule: ``unshard`` / ``reshard`` and the prefetch lists, as
FSDP2's ``FSDPModule`` methods, for pipeline schedules and custom loops.

Note [Explicit schedule]
------------------------
By default a bucket's gather issues the all-gathers of the buckets that gathered
after it in the last step (Note [Prefetch] in ``_prefetch.py``). A loop that owns
the order can say it instead; everything runs on the same mechanism, so a
checkpointed block still sees a cast, an all-gather and a wait in its forward and
its replay, and zero3's recompute still gathers for real:

* ``set_modules_to_forward_prefetch(module, [m1, m2])``: when ``module``'s buckets
  gather in forward, issue the all-gathers of ``m1``'s and ``m2``'s buckets (those not
  gathered yet in this forward) instead of the learned next ones;
  ``set_modules_to_backward_prefetch`` the same for zero3's backward re-gathers (those
  that forward left to re-gather). An empty list issues nothing. Buckets without a
  list keep the learned order (``prefetch=k``, none with ``prefetch=False``). What a
  list issued and nobody claimed is released at the end of that forward or backward.
* ``unshard(module)``: issue ``module``'s buckets' all-gathers now (``async_op=True``:
  return a handle whose ``wait()`` waits for them; else wait now). Their next gather,
  in forward or in backward, claims them: it then only waits and copies out. Unclaimed,
  they stay issued (one gathered bucket each alive) until ``reshard(module)`` releases
  them. A bucket gathered in an open forward of its root is not issued again.

Lists name bucket roots (the modules with buckets: the model, each block with
``bucket="blocks"``, each module ``apply_ac`` checkpointed), are resolved to buckets on
first use (a later ``apply_ac`` that splits a bucket is followed) and must be the same
on every rank: they decide the order of collectives. Eager only: compiled code
(``torch.compile``) gathers in its own graph and ignores them. ``reshard`` does not
free what autograd keeps: zero2's gathered parameters stay until backward, as always.
"""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn

from ._prefetch import Prefetched, Prefetcher
from ._state import RootState, _buckets_of, module_state

__all__ = ["UnshardHandle", "reshard", "set_modules_to_backward_prefetch", "set_modules_to_forward_prefetch",
           "unshard"]


class UnshardHandle:
    """What ``unshard(module, async_op=True)`` returns: ``wait()`` waits for its all-gathers."""

    def __init__(self, issued: list[Prefetched]) -> None:
        self._issued = issued

    def wait(self) -> None:
        for entry in self._issued:
            entry.wait()
        self._issued = []


def _root_of(module: nn.Module, what: str) -> RootState:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what} takes an nn.Module, got {type(module).__name__}")
    state = module_state(module)
    if state is None:
        raise ValueError(
            f"{type(module).__name__} is not parametrized: call fsdptag.parametrize(model, mesh) first")
    if not state.buckets:
        raise ValueError(
            f"{what}: {type(module).__name__} is not a bucket root (it has no buckets of its own); pass "
            "the model, a block (bucket='blocks') or a module apply_ac checkpointed")
    return state.root


def _prefetcher(root: RootState) -> Prefetcher:
    """The root's prefetcher; with ``prefetch=False`` one that prefetches nothing learned."""
    if root.prefetcher is None:
        prefetcher = Prefetcher(0)
        prefetcher.buckets_of = _buckets_of
        root.prefetcher = prefetcher
    return root.prefetcher


def _set(direction: str, module: nn.Module, modules: Iterable[nn.Module]) -> None:
    what = f"set_modules_to_{direction}_prefetch"
    root = _root_of(module, what)
    if isinstance(modules, nn.Module) or not isinstance(modules, Iterable):
        raise TypeError(f"{what}(module, modules): modules must be a list of modules, got {type(modules).__name__}")
    modules = list(modules)
    for m in modules:
        if _root_of(m, what) is not root:
            raise ValueError(f"{what}: {type(m).__name__} belongs to another parametrized model than "
                             f"{type(module).__name__}")
    _prefetcher(root).set_schedule(direction, module, modules)


def set_modules_to_forward_prefetch(module: nn.Module, modules: Iterable[nn.Module]) -> None:
    """When ``module``'s buckets gather in forward, issue the all-gathers of ``modules``'
    buckets (Note [Explicit schedule]), as FSDP2's ``set_modules_to_forward_prefetch``.

    Example::

        >>> for a, b in zip(model.layers, model.layers[1:]):
        ...     fsdptag.set_modules_to_forward_prefetch(a, [b])
    """
    _set("forward", module, modules)


def set_modules_to_backward_prefetch(module: nn.Module, modules: Iterable[nn.Module]) -> None:
    """When ``module``'s zero3 buckets re-gather in backward, issue the re-gathers of
    ``modules``' buckets (Note [Explicit schedule]), as FSDP2's
    ``set_modules_to_backward_prefetch``."""
    _set("backward", module, modules)


def unshard(module: nn.Module, *, async_op: bool = False) -> UnshardHandle | None:
    """Issue the all-gathers of ``module``'s buckets now, for their next gather
    (Note [Explicit schedule]), as FSDP2's ``FSDPModule.unshard``. ``async_op=True``:
    return a handle to ``wait()`` on; else wait now and return None."""
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op={async_op!r} must be True or False")
    prefetcher = _prefetcher(_root_of(module, "fsdptag.unshard"))
    issued = []
    for b in module_state(module).buckets:
        if b.scopes and b.scopes[-1].gathered:
            continue  # gathered in an open forward of its root: in use already
        entry = prefetcher.unshard(b)
        if entry is not None:
            issued.append(entry)
    handle = UnshardHandle(issued)
    if async_op:
        return handle
    handle.wait()
    return None


def reshard(module: nn.Module) -> None:
    """Release the all-gathers ``unshard(module)`` issued that no gather claimed
    (Note [Explicit schedule]), as FSDP2's ``FSDPModule.reshard`` frees the unsharded
    parameters. What autograd keeps for backward (zero2) stays."""
    root = _root_of(module, "fsdptag.reshard")
    if root.prefetcher is not None:
        for b in module_state(module).buckets:
            root.prefetcher.reshard(b)
