"""The plug-in contract lives in `fedcore.contract`; this name still imports for plug-ins written against it."""
from fedcore.contract import *  # noqa: F401,F403
from fedcore.contract import __all__  # noqa: F401
