"""Gather scopes (Note [Buckets] in ``_bucket.py``): one per open bucket-root
``forward``, in which a bucket is gathered at the first access to any of its
parameters and reused by the rest of that call."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from ._context import sac_region
from ._handout import check_unchanged

if TYPE_CHECKING:
    from ._bucket import Bucket

__all__ = ["Scope", "open_scopes", "scoped"]


@dataclass
class Scope:
    """One open bucket-root ``forward``: its checkpoint region (Note [Buckets]), the
    gathered parameters it serves and their version counters when gathered."""

    region: object
    gathered: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)


@contextlib.contextmanager
def open_scopes(buckets: tuple[Bucket, ...]) -> Iterator[None]:
    """A fresh gather scope of each of ``buckets`` (one root ``forward``)."""
    region = sac_region()
    for b in buckets:
        b.scopes.append(Scope(region))
    try:
        yield
        for b in buckets:  # not on the way out of an error: that error is the one to see
            scope = b.scopes[-1]
            check_unchanged((scope.gathered[p], v, p.fqn) for p, v in scope.versions.items())
    finally:
        for b in buckets:
            b.scopes.pop()


def scoped(buckets: tuple[Bucket, ...], fn):
    """``fn`` run inside a fresh gather scope of each of ``buckets``."""

    def run(*args, **kwargs):
        with open_scopes(buckets):
            return fn(*args, **kwargs)

    return run
