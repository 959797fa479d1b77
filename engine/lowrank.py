"""Deprecated: moved to :mod:`engine.kit.lowrank`; this path goes in the next release."""

import warnings

from engine.kit.lowrank import *  # noqa: F403
from engine.kit.lowrank import __all__  # noqa: F401

warnings.warn("engine.lowrank moved to engine.kit.lowrank; import it from there", DeprecationWarning, stacklevel=2)
