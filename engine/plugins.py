"""Plugin discovery, loading and the name registries.

* :func:`installed_plugins` reads entry-point metadata (group ``engine.plugins``) and imports
  nothing.
* :class:`PluginManager` loads the builtins plus ONLY the plugins a run enables. Enabled
  plugins are called before the builtins, in list order; a plugin that fails to import, names
  an unknown hook or a wrong argument is a :class:`~engine.errors.PluginError`.
* :class:`Registry` maps names (optimizers, schedulers, strategies) to factories; duplicates
  name both plugins, unknown names list what is installed and the pip extra that provides it.
* Selection controls, read from the environment like pytest's ``PYTEST_PLUGINS`` /
  ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``: ``ENGINE_PLUGINS="a,b,-c"`` enables a and b in every run
  and keeps c from loading (:class:`EnvironmentPlugins`); ``ENGINE_DISABLE_PLUGIN_AUTOLOAD=1``
  imports no installed plugin that is not named (no scans of installed plugins for hints or
  listings); a run file's ``required_plugins = ["galore>=0.2"]`` is checked against the installed
  versions before anything loads (:func:`check_required_plugins`).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy
from pluggy._hooks import varnames as pluggy_varnames

from . import hookspecs
from .catalogue import FIRST_PARTY, UNSUPPORTED_OPTIMIZERS, provider_of
from .errors import ConfigError, PluginError
from .util import describe_exception, is_missing

logger = logging.getLogger("engine")

ENTRY_POINT_GROUP = "engine.plugins"
PLUGINS_ENV = "ENGINE_PLUGINS"
NO_AUTOLOAD_ENV = "ENGINE_DISABLE_PLUGIN_AUTOLOAD"
PROJECT = "engine"  # pluggy's project name: markers set the attribute "engine_impl"
BUILTIN_PREFIX = "builtin."
# "module" registers the module; "module:Class" registers a fresh instance per run.
BUILTIN_PLUGINS = (
    "engine.builtin.data",
    "engine.builtin.loss",
    "engine.builtin.optimizers",
    "engine.builtin.schedulers",
    "engine.builtin.strategies",
    "engine.builtin.steps",
    "engine.builtin.patches",
    "engine.builtin.console:Console",
    "engine.builtin.jsonl:JsonlLogger",
    "engine.builtin.report:Report",
)

# Registry kinds: (register hook, config key that selects a name, noun in messages)
REGISTRIES = {
    "optimizer": ("register_optimizers", "train.optim"),
    "scheduler": ("register_schedulers", "train.lr_scheduler_type"),
    "strategy": ("register_strategies", "train.strategy"),
}


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
    if name.startswith(BUILTIN_PREFIX):
        parts.append("builtins are always on and are not named in plugins or --plugins")
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


class IsolatedHooks:
    """Calls the :data:`~engine.hookspecs.ISOLATED_HOOKS` plugin by plugin (see the hookspecs).

    ``failed`` maps each plugin switched off after raising to what happened and at which step.
    """

    def __init__(self, run: Any):
        self.run = run
        self.failed: dict[str, str] = {}
        self.fatal: set[str] = set()  # strict plugins whose failure ends the run: closed quietly after

    def call(self, hook_name: str, **kwargs: Any) -> None:
        run = self.run
        kwargs["run"] = run
        for impl in reversed(getattr(run.hook, hook_name).get_hookimpls()):
            plugin = impl.plugin_name
            switched_off = plugin in self.failed or plugin in self.fatal
            if switched_off and hook_name != "log_finish":
                continue
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception as exc:
                if switched_off:  # closing after an earlier failure: say so, nothing more
                    logger.warning("plugin %r failed again in %s: %s", plugin, hook_name, describe_exception(exc))
                    continue
                section = run.config.sections.get(plugin)
                if getattr(section, "strict", False) or getattr(run.plugin_manager.pm.get_plugin(plugin), "strict", False):
                    self.fatal.add(plugin)
                    raise PluginError(f"plugin {plugin!r} ({plugin}.strict = true) failed in {hook_name} at step "
                                      f"{run.state.global_step}: {describe_exception(exc)}") from exc
                what = f"{hook_name} raised {describe_exception(exc)} at step {run.state.global_step}"
                self.failed[plugin] = what
                logger.warning("plugin %r: %s; it is switched off for the rest of the run, training goes on (set "
                               "strict = true in [%s] to stop instead)", plugin, what, plugin)

    def report(self) -> None:
        """One line per plugin that was switched off, for the end of the run."""
        for plugin, what in self.failed.items():
            logger.warning("plugin %r was switched off after %s", plugin, what)


def plugin_problems(plugin: Any, name: str) -> list[str]:
    """What would make pluggy ignore or refuse ``plugin``'s hook functions, one message each.

    A function named like a hook but without ``@hookimpl`` (pluggy would skip it silently), and
    a hookimpl taking an argument its hook does not have (with the hook's real arguments).
    """
    problems = []
    markers = pluggy.PluginManager(PROJECT)  # reads markers the way registration will
    for attribute in hookspecs.HOOK_NAMES:
        raw = inspect.getattr_static(plugin, attribute, None)  # no property or descriptor runs
        function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        if not callable(function) or isinstance(function, type):
            continue
        opts = markers.parse_hookimpl_opts(plugin, attribute)
        if opts is None:
            problems.append(f"plugin {name!r} defines {attribute} without @engine.hookimpl, so it would never be "
                            f"called; mark it with @hookimpl")
            continue
        if attribute in hookspecs.ISOLATED_HOOKS and (opts.get("wrapper") or opts.get("hookwrapper")):
            problems.append(f"plugin {name!r}: {attribute} is called plugin by plugin (isolated), so it cannot be "
                            "a wrapper; implement it plainly")
            continue
        takes = pluggy_varnames(getattr(hookspecs, attribute))[0]
        extra = [arg for arg in pluggy_varnames(getattr(plugin, attribute))[0] if arg not in takes]
        if extra:
            close = difflib.get_close_matches(extra[0], takes, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"plugin {name!r}: {attribute} takes {extra[0]!r}{hint}, which the hook does not "
                            f"pass; {attribute} passes ({', '.join(takes)}), take any of them")
    return problems


@dataclass
class RegistryEntry:
    name: str
    factory: Callable[..., Any]
    plugin: str
    takes_target_modules: bool = False  # optimizers: uses train.optim_target_modules


class Registry:
    """Names -> factories for one kind (optimizer, scheduler, strategy)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.config_key = REGISTRIES[kind][1]
        self.entries: dict[str, RegistryEntry] = {}

    def callback(self, plugin: str) -> Callable[..., None]:
        """The ``register(name, factory)`` function handed to ``plugin``'s register hook."""

        def register(name: str, factory: Callable[..., Any], *, takes_target_modules: bool = False) -> None:
            if not isinstance(name, str) or not callable(factory):
                raise PluginError(f"plugin {plugin!r}: register(name: str, factory: callable) "
                                  f"got ({name!r}, {factory!r})")
            current = self.entries.get(name)
            if current is not None and not current.plugin.startswith(BUILTIN_PREFIX):
                if not plugin.startswith(BUILTIN_PREFIX):
                    raise PluginError(f"{self.kind} {name!r} is registered by both plugin "
                                      f"{current.plugin!r} and plugin {plugin!r}; disable one")
                return  # a builtin never replaces an enabled plugin's entry
            self.entries[name] = RegistryEntry(name, factory, plugin, takes_target_modules)

        return register

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> RegistryEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise ConfigError(self.unknown_message(name))
        return entry

    def unknown_message(self, name: str) -> str:
        if self.kind == "optimizer" and name in UNSUPPORTED_OPTIMIZERS:
            return f"{self.config_key}: {name!r} is not supported on this engine: {UNSUPPORTED_OPTIMIZERS[name]}"
        parts = [f"{self.config_key}: unknown {self.kind} {name!r}"]
        installed = installed_plugins()
        provider = provider_of(self.kind, name)
        enabled = {entry.plugin for entry in self.entries.values()}
        search = provider is None and not autoload_disabled()  # finding a provider imports installed plugins
        registering = plugins_registering(self.kind, name, skip=enabled) if search else []
        if provider is not None:
            info = FIRST_PARTY[provider]
            if provider in installed:
                parts.append(f"it comes from plugin {provider!r}, which is installed but not enabled: "
                             f"add {provider!r} to plugins (or --plugins +{provider})")
            else:
                parts.append(f"it comes from {info.distribution}: {info.install} "
                             f"and add {provider!r} to plugins")
        elif registering:
            parts.append("it is registered by installed plugin " + ", ".join(
                f"{p.name!r} ({p.distribution} {p.version})" for p in registering)
                + f": add it to plugins (or --plugins +{registering[0].name})")
        else:
            close = difflib.get_close_matches(name, self.entries, n=1)
            if close:
                parts.append(f"did you mean {close[0]!r}?")
        parts.append(f"available: {', '.join(self.names())}")
        if provider is None and not search:
            parts.append(f"installed plugins were not searched for it ({NO_AUTOLOAD_ENV} is set)")
        if provider is None and not registering:
            families = [plugin for plugin, info in FIRST_PARTY.items() if info.provides.get(self.kind)]
            idle = [plugin for plugin in families if plugin in installed and plugin not in enabled]
            missing = [f"{plugin} ({FIRST_PARTY[plugin].install})" for plugin in families if plugin not in installed]
            if idle:
                parts.append(f"more in installed plugins {', '.join(idle)} (add one to plugins)")
            if missing:
                parts.append(f"more from {', '.join(missing)}")
        return "; ".join(parts)


class PluginManager:
    """The builtins plus the enabled plugins, registered with pluggy, and their registries.

    ``enabled`` names entry points; ``objects`` maps names to plugin objects passed in from
    Python (the API's ``plugins=`` argument, test recorders). Both are called before the
    builtins, in order. ``origins`` says what named each one (for ``engine plan``), ``excluded``
    what ``ENGINE_PLUGINS`` kept out; ``required`` (a run's ``required_plugins``) is checked
    against the installed versions before anything loads.
    """

    def __init__(self, enabled: Iterable[str] = (), objects: dict[str, Any] | None = None, *,
                 origins: dict[str, str] | None = None, excluded: Iterable[str] = (), required: Iterable[str] = ()):
        self.enabled = list(enabled)
        self.objects = dict(objects or {})
        self.origins = dict(origins or {})
        self.excluded = list(excluded)
        self.installed = installed_plugins()
        check_required_plugins(list(required), self.installed)
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        for spec in BUILTIN_PLUGINS:
            module_name, _, class_name = spec.partition(":")
            module = importlib.import_module(module_name)
            plugin = getattr(module, class_name)() if class_name else module
            self._register(plugin, BUILTIN_PREFIX + module_name.rsplit(".", 1)[1])
        loaded = {}
        for name in self.enabled:
            if name in self.objects:
                continue
            if name not in self.installed:
                raise PluginError(unknown_plugin_message(name, self.installed))
            loaded[name] = self.installed[name].load()
        plugins = {**loaded, **self.objects}
        order = [n for n in self.enabled if n in plugins] + [n for n in plugins if n not in self.enabled]
        for name in reversed(order):  # pluggy calls the last registered first
            self._register(plugins[name], name)
        self._check_pending()
        for name in self.objects:
            if not self.pm.get_hookcallers(self.objects[name]):
                raise PluginError(f"plugin {name!r}: a {type(self.objects[name]).__qualname__} object has no "
                                  "@engine.hookimpl functions and is not a transformers TrainerCallback; pass "
                                  "hook implementations (docs/writing-plugins.md) or TrainerCallbacks")
        self.hook = self.pm.hook
        self.registries = {kind: self._fill_registry(kind) for kind in REGISTRIES}

    # ------------------------------------------------------------------ registration

    def _register(self, plugin: Any, name: str) -> None:
        problems = [] if name.startswith(BUILTIN_PREFIX) else plugin_problems(plugin, name)
        if problems:
            raise PluginError(problems[0])
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r}: {exc}") from None

    def _check_pending(self) -> None:
        known = list(self.pm.hook.__dict__)
        for hook_name in known:
            caller = getattr(self.pm.hook, hook_name)
            if caller.spec is not None:
                continue
            owners = [impl.plugin_name for impl in caller.get_hookimpls()]
            close = difflib.get_close_matches(hook_name, [n for n in known if getattr(self.pm.hook, n).spec], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PluginError(f"plugin {owners[0]!r} implements unknown hook {hook_name!r}{hint}")

    def _fill_registry(self, kind: str) -> Registry:
        registry = Registry(kind)
        hook_name = REGISTRIES[kind][0]
        # call order (the run's plugin order), builtins first so that enabled plugins replace their names
        impls = sorted(reversed(getattr(self.pm.hook, hook_name).get_hookimpls()),
                       key=lambda impl: not impl.plugin_name.startswith(BUILTIN_PREFIX))
        for impl in impls:
            self._call_impl(impl, {"register": registry.callback(impl.plugin_name)})
        return registry

    # ------------------------------------------------------------------ calling

    @staticmethod
    def _call_impl(impl: Any, kwargs: dict[str, Any]) -> Any:
        return impl.function(*[kwargs[arg] for arg in impl.argnames])

    def per_plugin(self, hook_name: str, **kwargs: Any) -> dict[str, Any]:
        """Call each plugin's implementation of ``hook_name`` separately: {plugin: result}.

        Results that are None are left out. Used by the *per plugin* hooks (options,
        checkpoint state).
        """
        results = {}
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            result = self._call_impl(impl, kwargs)
            if result is not None:
                results[impl.plugin_name] = result
        return results

    def call_plugin(self, hook_name: str, plugin: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of ``hook_name`` (None if it has none)."""
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            if impl.plugin_name == plugin:
                return self._call_impl(impl, kwargs)
        return None

    def call_order(self, hook_name: str) -> list[str]:
        """Plugin names in the order pluggy calls them for ``hook_name`` (wrappers first)."""
        return [impl.plugin_name for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls())]

    def option_schemas(self) -> dict[str, type | None]:
        schemas: dict[str, type | None] = {name: None for name in self.enabled}
        for plugin, schema in self.per_plugin("plugin_options").items():
            if not plugin.startswith(BUILTIN_PREFIX):
                schemas[plugin] = schema
        return schemas


def describe_installed(plugin: InstalledPlugin) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """Import one plugin on its own: (hooks it implements, names it registers per kind, problems).

    Problems (hook functions pluggy would ignore or refuse, unknown hooks) are reported, not
    raised, so ``engine plugins`` can list every plugin; a plugin that cannot be imported raises
    PluginError.
    """
    return inspect_plugin(plugin.load(), plugin.name)


def inspect_plugin(target: Any, name: str) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """A loaded plugin object's (hooks it implements, names it registers per kind, problems)."""
    problems = plugin_problems(target, name)
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    try:
        pm.register(target, name=name)
    except pluggy.PluginValidationError as exc:
        return [], {}, problems or [str(exc).replace("\n", " ")]  # plugin_problems says it with the right names
    hooks = sorted(impl_hook for impl_hook, caller in vars(pm.hook).items()
                   if any(impl.plugin_name == name for impl in caller.get_hookimpls()))
    for hook_name in hooks:
        if hook_name not in hookspecs.HOOK_NAMES:
            close = difflib.get_close_matches(hook_name, hookspecs.HOOK_NAMES, n=1)
            problems.append(f"unknown hook {hook_name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    names: dict[str, list[str]] = {}
    for kind, (hook_name, _) in REGISTRIES.items():
        registry = Registry(kind)
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            try:
                PluginManager._call_impl(impl, {"register": registry.callback(name)})
            except Exception as exc:  # its register hook is broken: list it, do not crash the listing
                problems.append(f"{hook_name} raised {describe_exception(exc)}")
        if registry.entries:
            names[kind] = registry.names()
    return [h for h in hooks if h in hookspecs.HOOK_NAMES], names, problems


def plugins_registering(kind: str, name: str, skip: Iterable[str] = ()) -> list[InstalledPlugin]:
    """Installed plugins (not in ``skip``) that register ``name`` in registry ``kind`` (imports them: error paths only)."""
    found = []
    for plugin in installed_plugins().values():
        if plugin.name in skip:
            continue
        try:
            _, names, _ = describe_installed(plugin)
        except PluginError:
            continue  # one that cannot load registers nothing; `engine plugins` says why
        if name in names.get(kind, ()):
            found.append(plugin)
    return found
