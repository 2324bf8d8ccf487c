"""Launch a function on several gloo ranks; see :func:`fsdptag.launch.spawn`.

Starting ranks costs seconds, so tests run many cases per launch: the worker
returns a dict of results and the pytest functions assert on its entries.
"""

from fsdptag.launch import spawn as launch

__all__ = ["launch"]
