"""Deprecated: ``engine migrate`` moved to :mod:`engine.tooling.migration`."""

import warnings

from engine.tooling.migration import Migration, migrate, read_arguments, trainer_defaults  # noqa: F401

warnings.warn("engine.migration is deprecated: import engine.tooling.migration (or call engine.migrate)",
              DeprecationWarning, stacklevel=2)
