"""Errors a user can act on.

Every error the engine raises for bad input derives from :class:`EngineError`. The CLI prints
its message on one line and exits with status 2, without a traceback, so the message must say
what to change.
"""


class EngineError(Exception):
    """Bad input the user can fix; the message says what to change."""


class ConfigError(EngineError):
    """A run file, a section or a value is wrong; the message names the key path."""


class PluginError(EngineError):
    """A plugin is unknown, fails to import, registers a duplicate name or refuses the run."""


class MissingDependencyError(EngineError):
    """A feature needs a package that is not installed; the message names it."""


class CheckpointError(EngineError):
    """A checkpoint is missing, incomplete or does not match the run."""
