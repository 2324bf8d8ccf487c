"""Fixtures for fsdptag's tests, benchmarks, example and estimator; not library API.

* ``llama``: the Llama 3 model and its TP plan.
* ``launch``: run a function on N local gloo ranks.
* ``baselines``: the policies fsdptag is compared against (op-name, no fix).
"""
