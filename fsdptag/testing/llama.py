"""The Llama 3 reference model, for the tests: it lives in :mod:`fsdptag.tools.llama`."""

from ..tools.llama import *  # noqa: F401,F403
from ..tools.llama import __all__  # noqa: F401
