"""Fixtures for fsdptag's tests and benchmarks; not library API (the reference Llama
and the baseline policies live in :mod:`fsdptag.tools`).

* ``launch``: run a function on N local gloo ranks.
* ``slow_link``: an emulated slow link for the overlap benchmark.
"""
