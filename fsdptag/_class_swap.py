"""The one way fsdptag changes a module's behaviour: a generated subclass.

``parametrize`` gives a module a property per parameter name (``FSDPTagLinear``),
a bucket root a scoped ``forward`` (``BucketedBlock``), ``apply_ac`` a checkpointed
``forward`` (``CheckpointedBlock``). Each kind is registered once, by the module that
owns it (:func:`register_kind`). A module has one generated class, whatever kinds it
took (``CheckpointedBucketedBlock``): a direct subclass of the user's class, built once
per (user class, recipe: the kinds with their keys, in the order taken) and marked
``_fsdptag_generated`` so errors can name the user's own class. Each kind's namespace
is made against the kinds taken before it (a class built for that, never a module's),
and its methods call that base's method directly (``cls.forward(self, ...)``): a
checkpointed ``forward`` runs the bucket scope's, which runs the user's.

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
_CACHE: dict[tuple[type, tuple], type] = {}  # (user class, recipe) -> its generated class
_RECIPE = "_fsdptag_recipe"  # a generated class's ((prefix, key), ...)


def register_kind(prefix: str, make_namespace: Callable[[type, Hashable], dict]) -> None:
    """Register the kind of generated class named ``prefix + ClassName``, whose namespace
    is ``make_namespace(base class, key)``."""
    _KINDS[prefix] = make_namespace


def swap_class(module: nn.Module, prefix: str, key: Hashable = None) -> None:
    """Make ``module`` an instance of the one generated class of its user class and
    the kinds it took, now with the registered kind ``prefix`` (and ``key``) on top."""
    cls = type(module)
    module.__class__ = _generated(user_class(cls), _recipe(cls) + ((prefix, key),))


def _generated(user: type, recipe: tuple[tuple[str, Hashable], ...]) -> type:
    new = _CACHE.get((user, recipe))
    if new is None:
        base, namespace, name = user, {"_fsdptag_generated": True}, user.__name__
        for prefix, key in recipe:  # each kind's methods call the kinds before it (``base``)
            namespace.update(_KINDS[prefix](base, key))
            name = prefix + name
            base = type(name, (user,), dict(namespace))
        new = _CACHE[(user, recipe)] = type(name, (user,), dict(namespace, __reduce_ex__=_reduce_ex,
                                                                **{_RECIPE: recipe}))
    return new


def user_class(cls: type) -> type:
    """The nearest class in ``cls``'s MRO that fsdptag did not generate."""
    return next(c for c in cls.__mro__ if "_fsdptag_generated" not in c.__dict__)


def _recipe(cls: type) -> tuple[tuple[str, Hashable], ...]:
    """The kinds a generated class was made of, in the order taken; () for a user's class."""
    return cls.__dict__.get(_RECIPE, ())


def _reduce_ex(self, protocol):  # Note [Pickling generated classes]
    return _restore, (user_class(type(self)), _recipe(type(self))), self.__getstate__()


def _restore(cls: type, recipe) -> nn.Module:
    return cls.__new__(_generated(cls, tuple(tuple(kind) for kind in recipe)))
