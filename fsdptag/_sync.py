"""Gradient accumulation without reduction: ``set_requires_gradient_sync`` / ``no_sync``.

Note [Accumulation without sync]
--------------------------------
FSDP2's ``set_requires_gradient_sync(False)``: microbatches accumulate gradients
locally and the backward that syncs reduces their sum once. A bucket that does not
sync keeps its packed unsharded gradient (the ``(world, numel)`` reduce-scatter input,
in the reduce dtype, as FSDP2 keeps its unsharded accumulated gradient) instead of
reducing it, and leaves ``.grad`` untouched; the next backward adds its own packed
gradient to it, and a backward that syncs reduce-scatters (HSDP: then all-reduces)
the sum, once. So reductions per optimizer step do not depend on the number of
microbatches, and each bucket that does not sync holds one unsharded gradient
(``world`` times its shard, in the reduce dtype) until the syncing backward.

Only bucketed gathers accumulate (every ``bucket`` policy but ``"param"``); a
per-parameter gather (``bucket="param"``) reduces inside DTensor's redistribute, so
:func:`set_requires_gradient_sync` refuses models that have one. Compiled code
(``torch.compile``) reduces in its own graph and always syncs: its gradients are still
right (each reduced microbatch adds to ``.grad``), but it reduces every microbatch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from ._state import module_state

__all__ = ["no_sync", "set_requires_gradient_sync"]


def _buckets(module: nn.Module, recurse: bool):
    modules = list(module.modules()) if recurse else [module]
    states = [(m, module_state(m)) for m in modules]
    if all(st is None for _, st in states):
        raise ValueError(
            f"{type(module).__name__} is not parametrized: call fsdptag.parametrize(model, mesh) first"
        )
    for m, st in states:
        if st is None:
            continue
        alone = [g.fqn for g in st.params.values() if g not in st.root.bucket_of]
        if alone:
            raise NotImplementedError(
                f"gradient accumulation without sync needs bucketed gathers, but {alone[0]!r} is "
                "gathered alone (bucket='param'); parametrize with bucket='blocks' (the default), "
                "'module' or a callable"
            )
    return [b for _, st in states if st is not None for b in st.buckets]


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool, *,
                               recurse: bool = True) -> None:
    """Whether backward reduces the gradients of ``module``'s buckets (with ``recurse``,
    of every bucket root under it too), as FSDP2's ``FSDPModule.set_requires_gradient_sync``.

    ``False``: each backward adds its gradients to a local unsharded accumulator and
    ``.grad`` stays as it is; the next backward with ``True`` reduces the sum once
    (Note [Accumulation without sync]). Eager only.

    Example::

        >>> fsdptag.set_requires_gradient_sync(model, False)
        >>> for x in microbatches[:-1]:
        ...     loss_fn(model(x)).backward()
        >>> fsdptag.set_requires_gradient_sync(model, True)
        >>> loss_fn(model(microbatches[-1])).backward()  # one reduce-scatter per bucket
        >>> optim.step()
    """
    if not isinstance(requires_gradient_sync, bool):
        raise TypeError(f"requires_gradient_sync={requires_gradient_sync!r} must be True or False")
    for b in _buckets(module, recurse):
        b.requires_gradient_sync = requires_gradient_sync


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Backwards inside accumulate gradients without reducing them; the first backward
    after it reduces the sum (Note [Accumulation without sync]).

    Example::

        >>> with fsdptag.no_sync(model):
        ...     for x in microbatches[:-1]:
        ...         loss_fn(model(x)).backward()
        >>> loss_fn(model(microbatches[-1])).backward()
    """
    buckets = _buckets(module, True)
    before = [b.requires_gradient_sync for b in buckets]
    for b in buckets:
        b.requires_gradient_sync = False
    try:
        yield
    finally:
        for b, sync in zip(buckets, before):
            b.requires_gradient_sync = sync
