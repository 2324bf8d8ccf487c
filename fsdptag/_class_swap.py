"""The one way fsdptag changes a module's behaviour: a generated subclass.

``parametrize`` gives a module a property per parameter name (``FSDPTagLinear``),
a bucket root a scoped ``forward`` (``BucketedBlock``), ``apply_ac`` a checkpointed
``forward`` (``CheckpointedBlock``). Each kind is registered once, by the module that
owns it (:func:`register_kind`); each generated class is built once per (class,
kind, key) and marked ``_fsdptag_generated`` so errors can name the user's own class.
Generated methods call the base class's method directly (``cls.forward(self, ...)``,
the same as ``super()`` for a class with one base).

Note [Pickling generated classes]
---------------------------------
A generated class lives in no module, so pickle cannot name it. An instance pickles
instead as its recipe: the user's class and the kinds (with their keys) generated on
top of it, in order; unpickling rebuilds the same classes from the registry (which
``import fsdptag`` fills) and then restores the module's state as ``nn.Module`` does.
So ``torch.save(model)`` / ``torch.load(..., weights_only=False)`` round-trip a
parametrized model, in this process or a fresh one.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch.nn as nn

__all__ = ["register_kind", "swap_class", "user_class"]

_KINDS: dict[str, Callable[[type, Hashable], dict]] = {}  # prefix -> make_namespace(base, key)
_CACHE: dict[tuple[type, str, Hashable], type] = {}
_RECIPE = "_fsdptag_recipe"  # a generated class's (prefix, key)


def register_kind(prefix: str, make_namespace: Callable[[type, Hashable], dict]) -> None:
    """Register the kind of generated class named ``prefix + ClassName``, whose namespace
    is ``make_namespace(base class, key)``."""
    _KINDS[prefix] = make_namespace


def swap_class(module: nn.Module, prefix: str, key: Hashable = None) -> None:
    """Make ``module`` an instance of ``prefix + ClassName``, the registered kind
    ``prefix`` of its class (built once per class, prefix, key)."""
    module.__class__ = _generated(type(module), prefix, key)


def _generated(cls: type, prefix: str, key: Hashable) -> type:
    cache_key = (cls, prefix, key)
    new = _CACHE.get(cache_key)
    if new is None:
        namespace = dict(_KINDS[prefix](cls, key), _fsdptag_generated=True, __reduce_ex__=_reduce_ex)
        namespace[_RECIPE] = (prefix, key)
        new = _CACHE[cache_key] = type(f"{prefix}{cls.__name__}", (cls,), namespace)
    return new


def user_class(cls: type) -> type:
    """The nearest class in ``cls``'s MRO that fsdptag did not generate."""
    return next(c for c in cls.__mro__ if "_fsdptag_generated" not in c.__dict__)


def _recipe(cls: type) -> list[tuple[str, Hashable]]:
    """The kinds generated on top of the user's class, innermost first."""
    kinds = [c.__dict__[_RECIPE] for c in cls.__mro__ if "_fsdptag_generated" in c.__dict__]
    return kinds[::-1]


def _reduce_ex(self, protocol):  # Note [Pickling generated classes]
    return _restore, (user_class(type(self)), _recipe(type(self))), self.__getstate__()


def _restore(cls: type, recipe: list[tuple[str, Hashable]]) -> nn.Module:
    module = cls.__new__(cls)
    for prefix, key in recipe:
        module.__class__ = _generated(type(module), prefix, key)
    return module
