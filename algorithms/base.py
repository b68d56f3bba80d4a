"""The plug-in contract lives in `fedcore.kernel.contract`; this name still imports for plug-ins written against it."""
from fedcore.kernel.contract import *  # noqa: F401,F403
from fedcore.kernel.contract import __all__  # noqa: F401
