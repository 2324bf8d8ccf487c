"""Gather scopes (Note [Buckets] in ``_bucket.py``): one per open bucket-root
``forward``, in which a bucket is gathered at the first access to any of its
parameters and reused by the rest of that call."""

from __future__ import annotations

import contextlib
from typing import Iterator

from ._bucket import Bucket, Scope
from ._context import sac_region
from ._handout import check_unchanged

__all__ = ["open_scopes", "scoped"]


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
