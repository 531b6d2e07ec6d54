"""servegate: a regression gate for LLM serving engines."""

from servegate.errors import *  # noqa: F401,F403
from servegate.errors import __all__ as _errors_all

__version__ = "0.1.0"

__all__ = ["__version__", *_errors_all]
