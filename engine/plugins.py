"""Plugin discovery, loading and the name registries.

* :func:`installed_plugins` reads entry-point metadata (group ``engine.plugins``) and imports
  nothing.
* :class:`PluginManager` loads the builtins plus ONLY the plugins a run enables. Enabled
  plugins are called before the builtins, in list order; a plugin that fails to import, names
  an unknown hook or a wrong argument is a :class:`~engine.errors.PluginError`.
* :class:`Registry` maps names (optimizers, schedulers, strategies) to factories; duplicates
  name both plugins, unknown names list what is installed and the pip extra that provides it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy

from . import hookspecs
from .catalogue import FIRST_PARTY, UNSUPPORTED_OPTIMIZERS, provider_of
from .errors import ConfigError, PluginError

ENTRY_POINT_GROUP = "engine.plugins"
BUILTIN_PREFIX = "builtin."
# "module" registers the module; "module:Class" registers a fresh instance per run.
BUILTIN_PLUGINS = (
    "engine.builtin.loss",
    "engine.builtin.optimizers",
    "engine.builtin.schedulers",
    "engine.builtin.strategies",
    "engine.builtin.steps",
    "engine.builtin.console:Console",
    "engine.builtin.jsonl:JsonlLogger",
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
        module_name, _, attr = self.value.partition(":")
        try:
            target = importlib.import_module(module_name)
        except ImportError as exc:
            missing = exc.name or str(exc)
            raise PluginError(
                f"plugin {self.name!r} ({self.distribution}) failed to import: "
                f"missing module {missing!r} ({exc}); install it, e.g. pip install {missing.split('.')[0]}"
            ) from exc
        for part in filter(None, attr.split(".")):
            target = getattr(target, part)
        # a class is instantiated: each run gets its own plugin state (counters, handles)
        return target() if isinstance(target, type) else target


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


def unknown_plugin_message(name: str, installed: Iterable[str]) -> str:
    installed = sorted(installed)
    parts = [f"unknown plugin {name!r}"]
    if name in FIRST_PARTY:
        info = FIRST_PARTY[name]
        parts.append(f"it comes from {info.distribution}: {info.install}")
    else:
        close = difflib.get_close_matches(name, [*installed, *FIRST_PARTY], n=1)
        if close:
            parts.append(f"did you mean {close[0]!r}?")
    parts.append(f"installed plugins: {', '.join(installed) or '(none)'}")
    return "; ".join(parts)


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
        provider = provider_of(self.kind, name)
        if provider is not None:
            info = FIRST_PARTY[provider]
            if provider in installed_plugins():
                parts.append(f"it comes from plugin {provider!r}, which is installed but not enabled: "
                             f"add {provider!r} to plugins (or --plugins +{provider})")
            else:
                parts.append(f"it comes from {info.distribution}: {info.install} "
                             f"and add {provider!r} to plugins")
        else:
            close = difflib.get_close_matches(name, self.entries, n=1)
            if close:
                parts.append(f"did you mean {close[0]!r}?")
        parts.append(f"available: {', '.join(self.names())}")
        elsewhere = [f"{plugin} ({info.install})" for plugin, info in FIRST_PARTY.items()
                     if info.provides.get(self.kind)]
        if elsewhere and provider is None:
            parts.append(f"more from {', '.join(elsewhere)}")
        return "; ".join(parts)


class PluginManager:
    """The builtins plus the enabled plugins, registered with pluggy, and their registries.

    ``enabled`` names entry points; ``objects`` maps names to plugin objects passed in from
    Python (the API's ``plugins=`` argument, test recorders). Both are called before the
    builtins, in order.
    """

    def __init__(self, enabled: Iterable[str] = (), objects: dict[str, Any] | None = None):
        self.enabled = list(enabled)
        self.objects = dict(objects or {})
        self.installed = installed_plugins()
        self.pm = pluggy.PluginManager("engine")
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
        self.hook = self.pm.hook
        self.registries = {kind: self._fill_registry(kind) for kind in REGISTRIES}

    # ------------------------------------------------------------------ registration

    def _register(self, plugin: Any, name: str) -> None:
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


def describe_installed(plugin: InstalledPlugin) -> tuple[list[str], dict[str, list[str]]]:
    """Import one plugin on its own: (hooks it implements, names it registers per kind)."""
    target = plugin.load()
    pm = pluggy.PluginManager("engine")
    pm.add_hookspecs(hookspecs)
    pm.register(target, name=plugin.name)
    hooks = sorted(impl_hook for impl_hook, caller in vars(pm.hook).items()
                   if any(impl.plugin_name == plugin.name for impl in caller.get_hookimpls()))
    names: dict[str, list[str]] = {}
    for kind, (hook_name, _) in REGISTRIES.items():
        registry = Registry(kind)
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            PluginManager._call_impl(impl, {"register": registry.callback(plugin.name)})
        if registry.entries:
            names[kind] = registry.names()
    return hooks, names
