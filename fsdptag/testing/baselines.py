"""The baseline policies, for the tests: they live in :mod:`fsdptag.tools.baselines`."""

from ..tools.baselines import *  # noqa: F401,F403
from ..tools.baselines import __all__  # noqa: F401
