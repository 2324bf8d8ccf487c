"""Fixtures for fsdptag's tests, benchmarks and example; not library API.

* ``llama``, ``baselines``: re-exported from :mod:`fsdptag.tools` (the estimator's
  reference model and comparison policies).
* ``launch``: run a function on N local gloo ranks.
* ``slow_link``: an emulated slow link for the overlap benchmark.
"""
