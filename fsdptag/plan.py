"""``python -m fsdptag.plan``: the planner, :mod:`fsdptag.tools.plan`, under the name its
users call (``fsdptag.plan.plan(...)``, ...)."""

from .tools.plan import *  # noqa: F401,F403
from .tools.plan import __all__, main, plot  # noqa: F401

if __name__ == "__main__":
    main()
