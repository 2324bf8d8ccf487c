"""The one way fsdptag changes a module's behaviour: a generated subclass.

``parametrize`` gives a module a property per parameter name (``FSDPTagLinear``),
a bucket root a scoped ``forward`` (``BucketedBlock``), ``apply_ac`` a checkpointed
``forward`` (``CheckpointedBlock``). Each generated class is built once per (class,
kind, key), marked ``_fsdptag_generated`` so errors can name the user's own class.
Generated methods call the base class's method directly (``cls.forward(self, ...)``,
the same as ``super()`` for a class with one base).
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch.nn as nn

__all__ = ["swap_class", "user_class"]

_CACHE: dict[tuple[type, str, Hashable], type] = {}


def swap_class(module: nn.Module, prefix: str, make_namespace: Callable[[type], dict],
               key: Hashable = None) -> None:
    """Make ``module`` an instance of ``prefix + ClassName``, a subclass of its class
    whose namespace is ``make_namespace(its class)`` (built once per class, prefix, key)."""
    cls = type(module)
    cache_key = (cls, prefix, key)
    new = _CACHE.get(cache_key)
    if new is None:
        namespace = dict(make_namespace(cls), _fsdptag_generated=True)
        new = _CACHE[cache_key] = type(f"{prefix}{cls.__name__}", (cls,), namespace)
    module.__class__ = new


def user_class(cls: type) -> type:
    """The nearest class in ``cls``'s MRO that fsdptag did not generate."""
    return next(c for c in cls.__mro__ if "_fsdptag_generated" not in c.__dict__)
