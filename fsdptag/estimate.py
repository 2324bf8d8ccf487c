"""``python -m fsdptag.estimate``: the estimator, :mod:`fsdptag.tools.estimate`, under the
name its users call (``fsdptag.estimate.estimate(...)``, ``hf_tp_plan``, ...)."""

from .tools.estimate import *  # noqa: F401,F403
from .tools.estimate import __all__, main  # noqa: F401

if __name__ == "__main__":
    main()
