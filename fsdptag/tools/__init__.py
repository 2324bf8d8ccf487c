"""Tools built on fsdptag, outside its runtime (the runtime never imports them):

* ``estimate`` (``python -m fsdptag.estimate``): one rank's training step at full size
  on fake tensors; ``models`` (what it measures: a ``ModelSpec``, its TP plan) and
  ``measure`` (the step, counted: bytes, collectives, FLOPs).
* ``plan`` (``python -m fsdptag.plan``): the zero / AC / TP sweep and its Pareto set.
* ``llama``: the Llama 3 reference model and its TP plan (the estimator's built-in
  models, the examples' and benchmarks' model).
* ``baselines``: the policies fsdptag is compared against (op-name, no fix).
"""
