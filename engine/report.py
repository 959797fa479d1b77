"""Deprecated: the report writer moved to :mod:`engine.builtin.report_writer`, ``--size`` parsing to
:mod:`engine.tooling.commands`."""

import warnings

from engine.builtin.report_writer import (DEFAULT_SIZE, Document, RunFiles, config_differences,  # noqa: F401
                                          default_config, figures, write_report)
from engine.tooling.commands import SIZE_RANGE, parse_size  # noqa: F401

warnings.warn("engine.report is deprecated: import engine.builtin.report_writer (the writer)",
              DeprecationWarning, stacklevel=2)
