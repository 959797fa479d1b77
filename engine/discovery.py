"""Finding plugins without loading them: entry points, the builtins' list, the environment's selection.

* :func:`installed_plugins` reads entry-point metadata (group ``engine.plugins``) and imports nothing.
* :func:`builtin_specs`: the builtins, from the entry-point group ``engine.builtins`` (engine's own
  ``engine.builtin:PLUGINS``): the kernel names no builtin.
* :class:`EnvironmentPlugins`: ``ENGINE_PLUGINS="a,b,-c"`` enables a and b in every run and keeps c from
  loading; ``ENGINE_DISABLE_PLUGIN_AUTOLOAD=1`` imports no installed plugin that is not named.
* :func:`check_required_plugins` and :func:`unknown_plugin_message`: a run's ``required_plugins`` against
  the installed versions, and the instruction an unknown name gets.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable

from .catalogue import FIRST_PARTY
from .errors import ConfigError, PluginError
from .util import describe_exception, is_missing

PLUGINS_ENV = "ENGINE_PLUGINS"
NO_AUTOLOAD_ENV = "ENGINE_DISABLE_PLUGIN_AUTOLOAD"
PROJECT = "engine"  # pluggy's project name: markers set the attribute "engine_impl"
ENTRY_POINT_GROUP = f"{PROJECT}.plugins"  # where installed distributions name their plugins
BUILTIN_PREFIX = "builtin."  # builtins are named "builtin.<module>" (names only: never tested by prefix)
BUILTINS_GROUP = "engine.builtins"  # entry points naming ordered tuples of builtin specs (engine.builtin:PLUGINS)
COMMANDS_GROUP = "engine.commands"  # the tooling: commands, command-line options, config conversions


@functools.cache
def _builtins() -> dict[str, str]:
    specs = [spec for entry in sorted(importlib.metadata.entry_points(group=BUILTINS_GROUP), key=lambda e: e.name)
             for spec in entry.load()]
    if not specs:
        raise PluginError(f"no builtins are registered (entry-point group {BUILTINS_GROUP!r} is empty): this "
                          "installation of engine is incomplete; reinstall it (pip install -U engine, or "
                          "pip install -e . in its source folder)")
    return {BUILTIN_PREFIX + spec.partition(":")[0].rsplit(".", 1)[1]: spec for spec in specs}


def builtin_specs() -> dict[str, str]:
    """The builtins by plugin name: {"builtin.console": "engine.builtin.console:Console", ...}, in call order.

    They come from the entry-point group ``engine.builtins`` (engine's own: ``engine.builtin:PLUGINS``), as
    plugins come from ``engine.plugins``: the kernel names no builtin."""
    return dict(_builtins())


def load_builtin(spec: str) -> Any:
    """A builtin's plugin object: its module, or a fresh instance of ``module:Class`` (state per run)."""
    module_name, _, class_name = spec.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)() if class_name else module


@dataclass(frozen=True)
class InstalledPlugin:
    """An entry point in group ``engine.plugins``: metadata only, nothing imported."""

    name: str
    value: str
    distribution: str
    version: str

    def load(self) -> Any:
        """Import the plugin; any failure is a PluginError naming it and the real cause."""
        module_name, _, attr = self.value.partition(":")
        where = f"plugin {self.name!r} ({self.distribution})"
        try:
            target = importlib.import_module(module_name)
        except ImportError as exc:
            if is_missing(exc, module_name) and exc.name and not module_name.startswith(exc.name):
                missing = exc.name
                raise PluginError(f"{where} failed to import: missing module {missing!r} ({exc}); install it, "
                                  f"e.g. pip install {missing.split('.')[0]}") from exc
            raise PluginError(f"{where} failed to import: {describe_exception(exc)}") from exc
        except Exception as exc:  # its own code raised while importing
            raise PluginError(f"{where} failed to import: {describe_exception(exc)}") from exc
        for part in filter(None, attr.split(".")):
            try:
                target = getattr(target, part)
            except AttributeError:
                raise PluginError(f"{where}: its entry point {self.value!r} names {part!r}, which {module_name} "
                                  "does not define") from None
        if not isinstance(target, type):
            return target
        try:  # a class is instantiated: each run gets its own plugin state (counters, handles)
            return target()
        except Exception as exc:
            raise PluginError(f"{where}: {target.__name__}() raised {describe_exception(exc)}") from exc


def installed_plugins() -> dict[str, InstalledPlugin]:
    """All plugins installed in this environment, by name (reads metadata only)."""
    found: dict[str, InstalledPlugin] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        found[ep.name] = InstalledPlugin(
            name=ep.name,
            value=ep.value,
            distribution=dist.metadata["Name"] if dist else "?",
            version=dist.version if dist else "?",
        )
    return dict(sorted(found.items()))


def autoload_disabled() -> bool:
    """``ENGINE_DISABLE_PLUGIN_AUTOLOAD`` is set (to anything but 0/false/no): import no installed
    plugin that the run does not name, not even to list it or to look for a name's provider."""
    return os.environ.get(NO_AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no")


_PLUGIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class EnvironmentPlugins:
    """``ENGINE_PLUGINS``: comma-separated names enabled in every run (after the run's own, as
    ``--plugins +name`` would), and ``-name`` for a plugin that must not load in this environment.

    An excluded plugin named by a run is left out with its options section and one log line (a
    CI job or a shared machine decides what may load; the run still trains). Plugin objects
    passed to ``Run(plugins=...)`` are code the caller hands over, not entry points: they are not
    excluded.
    """

    added: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()

    @classmethod
    def read(cls) -> EnvironmentPlugins:
        added, excluded = [], []
        for item in filter(None, (part.strip() for part in os.environ.get(PLUGINS_ENV, "").split(","))):
            name = item[1:] if item[0] in "+-" else item
            if not _PLUGIN_NAME.fullmatch(name):
                raise ConfigError(f"{PLUGINS_ENV}: {item!r} is not a plugin name; expected comma-separated names, "
                                  f"'-name' to keep one from loading (e.g. {PLUGINS_ENV}=tensorboard,-wandb)")
            (excluded if item[0] == "-" else added).append(name)
        both = sorted(set(added) & set(excluded))
        if both:
            raise ConfigError(f"{PLUGINS_ENV}: {', '.join(both)} both added and excluded; keep one")
        return cls(tuple(dict.fromkeys(added)), tuple(dict.fromkeys(excluded)))

    def edits(self) -> list[str]:
        """The additions as a ``--plugins`` edit, applied before the command line's own."""
        return [",".join(f"+{name}" for name in self.added)] if self.added else []

    def exclude(self, raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """``raw`` without the excluded plugins and their sections, and the names it left out."""
        named = [name for name in raw.get("plugins", []) if name in self.excluded]
        kept = {key: value for key, value in raw.items() if key not in named}
        if named:
            kept["plugins"] = [name for name in raw["plugins"] if name not in self.excluded]
        return kept, named


def check_required_plugins(requirements: list[str], installed: dict[str, InstalledPlugin]) -> None:
    """Refuse a run whose ``required_plugins`` are not installed at a matching version.

    Each entry is a requirement string (``"galore"``, ``"galore>=0.2,<1"``, ``"engine>=0.1"``,
    environment markers allowed) naming a plugin by its entry-point name or distribution name, or
    ``engine`` for the core. Nothing is imported: versions come from the distributions' metadata.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    from . import __version__

    by_name = {canonicalize_name(plugin.name): plugin for plugin in installed.values()}
    by_name.update({canonicalize_name(plugin.distribution): plugin for plugin in installed.values()})
    for index, text in enumerate(requirements):
        key = f"required_plugins[{index}]"
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            raise ConfigError(f"{key}: {text!r} is not a requirement ({exc}); write e.g. 'galore' or "
                              "'galore>=0.2,<1'") from None
        if requirement.extras or requirement.url:
            raise ConfigError(f"{key}: {text!r}: name a plugin and versions only (no extras or URLs)")
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # e.g. "liger; sys_platform == 'linux'" on another platform
        name = canonicalize_name(requirement.name)
        if name == "engine":
            what, version, upgrade = "engine", __version__, "pip install -U engine"
        else:
            plugin = by_name.get(name)
            if plugin is None:
                info = FIRST_PARTY.get(requirement.name)
                how = f"it comes from {info.distribution}: {info.install}" if info else \
                    f"install the distribution that provides it (pip install {requirement.name!r})"
                raise ConfigError(f"{key}: {text!r}: plugin {requirement.name!r} is not installed; {how}; installed "
                                  f"plugins: {', '.join(sorted(installed)) or '(none)'}")
            what, version = plugin.distribution, plugin.version
            info = FIRST_PARTY.get(plugin.name)
            upgrade = f"pip install -U 'engine[{info.extra}]'" if info else f"pip install -U {plugin.distribution!r}"
        if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
            raise ConfigError(f"{key}: the run needs {text!r}, but {what} {version} is installed; "
                              f"{upgrade}, or change required_plugins")


def unknown_plugin_message(name: str, installed: Iterable[str]) -> str:
    installed = sorted(installed)
    parts = [f"unknown plugin {name!r}"]
    module = f"engine_{name.replace('-', '_')}"
    if name in builtin_specs():
        parts.append(f"builtins are always on and are not named in plugins or --plugins, except to block one "
                     f"('-{name}')")
    elif name in FIRST_PARTY:
        info = FIRST_PARTY[name]
        parts.append(f"it comes from {info.distribution}: {info.install}")
    elif module.isidentifier() and importlib.util.find_spec(module) is not None:
        parts.append(f"module {module!r} is importable but no entry point {name!r} is installed in group "
                     f"{ENTRY_POINT_GROUP!r}: add [project.entry-points.\"{ENTRY_POINT_GROUP}\"] {name} = "
                     f"\"{module}\" to its pyproject.toml and reinstall it (pip install -e .)")
    else:
        close = difflib.get_close_matches(name, [*installed, *FIRST_PARTY], n=1)
        if close:
            parts.append(f"did you mean {close[0]!r}?")
    parts.append(f"installed plugins: {', '.join(installed) or '(none)'} (plugins are the entry points of "
                 f"group {ENTRY_POINT_GROUP!r} of installed distributions)")
    return "; ".join(parts)


@functools.cache
def command_hooks() -> Any:
    """The hooks of the tooling (entry-point group ``engine.commands``), loaded once: commands, options, Run(config)."""
    import pluggy

    from . import hookspecs

    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(hookspecs)
    for entry in importlib.metadata.entry_points(group=COMMANDS_GROUP):
        plugin = InstalledPlugin(entry.name, entry.value, entry.dist.metadata["Name"] if entry.dist else "?",
                                 entry.dist.version if entry.dist else "?")
        manager.register(plugin.load(), name=entry.name)
    return manager.hook
