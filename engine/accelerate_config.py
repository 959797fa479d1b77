"""Deprecated: the Accelerate mapping moved to :mod:`engine.tooling.accelerate_config`, its
helpers to :mod:`engine.kit.mappings`."""

import warnings

from engine.kit.mappings import Mapping, accept_only  # noqa: F401
from engine.tooling.accelerate_config import STRATEGY_PLUGINS, apply, map_config, read  # noqa: F401

warnings.warn("engine.accelerate_config is deprecated: import engine.tooling.accelerate_config (helpers: "
              "engine.kit.mappings)",
              DeprecationWarning, stacklevel=2)
