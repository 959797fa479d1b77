"""Plugin discovery, loading and the name registries.

* :func:`installed_plugins` reads entry-point metadata (group ``engine.plugins``) and imports
  nothing.
* :class:`PluginManager` loads the builtins plus ONLY the plugins a run enables. Enabled
  plugins are called before the builtins, in list order; a plugin that fails to import, names
  an unknown hook or a wrong argument is a :class:`~engine.errors.PluginError` (builtins pass
  the same checks). A builtin is known by where it was registered from (the entry-point group
  ``engine.builtins``, or registered by a builtin), never by its name; ``"-name"`` in a run's ``plugins`` blocks one
  (``plugins = ["-builtin.console"]``), refused where it leaves a hook every run needs unanswered.
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

import dataclasses
import difflib
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy
from pluggy._hooks import varnames as pluggy_varnames

from . import hookspecs
from .catalogue import FIRST_PARTY, UNSUPPORTED_OPTIMIZERS, provider_of
from .config import builtin_options
from .errors import ConfigError, PluginError
from .util import describe_exception

logger = logging.getLogger("engine")

from .discovery import (  # noqa: F401 (their public home is here too)
    ENTRY_POINT_GROUP, PLUGINS_ENV, NO_AUTOLOAD_ENV, PROJECT, BUILTIN_PREFIX, BUILTINS_GROUP, builtin_specs, load_builtin, InstalledPlugin, installed_plugins, autoload_disabled, EnvironmentPlugins, check_required_plugins, unknown_plugin_message,
)


# Registry kinds: (register hook, config key that selects a name, noun in messages)
REGISTRIES = {
    "optimizer": ("register_optimizers", "train.optim"),
    "scheduler": ("register_schedulers", "train.lr_scheduler_type"),
    "strategy": ("register_strategies", "train.strategy"),
}


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
    for attribute in hookspecs.SPEC_NAMES:
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
    builtin: bool = False  # registered by a builtin: replaced by an enabled plugin's entry of the same name


class Registry:
    """Names -> factories for one kind (optimizer, scheduler, strategy)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.config_key = REGISTRIES[kind][1]
        self.entries: dict[str, RegistryEntry] = {}

    def callback(self, plugin: str, builtin: bool = False) -> Callable[..., None]:
        """The ``register(name, factory)`` function handed to ``plugin``'s register hook."""

        def register(name: str, factory: Callable[..., Any], *, takes_target_modules: bool = False) -> None:
            if not isinstance(name, str) or not callable(factory):
                raise PluginError(f"plugin {plugin!r}: register(name: str, factory: callable) "
                                  f"got ({name!r}, {factory!r})")
            current = self.entries.get(name)
            if current is not None and not current.builtin:
                if not builtin:
                    raise PluginError(f"{self.kind} {name!r} is registered by both plugin "
                                      f"{current.plugin!r} and plugin {plugin!r}; disable one")
                return  # a builtin never replaces an enabled plugin's entry
            self.entries[name] = RegistryEntry(name, factory, plugin, takes_target_modules, builtin)

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

    ``enabled`` names entry points (``"-name"`` blocks a builtin or an installed plugin: it does not
    load); ``objects`` maps names to plugin objects passed in from Python (the API's ``plugins=``
    argument, test recorders). Both are called before the builtins, in order. ``origins`` says what
    named each one (for ``engine plan``), ``excluded`` what ``ENGINE_PLUGINS`` kept out;
    ``required`` (a run's ``required_plugins``) is checked against the installed versions before
    anything loads. ``builtins`` holds the names of the builtins registered, ``blocked`` the names
    the run blocks.
    """

    def __init__(self, enabled: Iterable[str] = (), objects: dict[str, Any] | None = None, *,
                 origins: dict[str, str] | None = None, excluded: Iterable[str] = (), required: Iterable[str] = ()):
        self.blocked = [name[1:] for name in enabled if name.startswith("-")]
        self.enabled = [name for name in enabled if not name.startswith("-")]
        self.objects = dict(objects or {})
        self.origins = dict(origins or {})
        self.excluded = list(excluded)
        self.installed = installed_plugins()
        check_required_plugins(list(required), self.installed)
        self._check_blocks()
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.builtins: set[str] = set()
        for name, spec in builtin_specs().items():
            if name not in self.blocked:
                self._register(load_builtin(spec), name, builtin=True)
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
        self._check_answers()
        for name in self.objects:
            if not self.pm.get_hookcallers(self.objects[name]):
                raise PluginError(f"plugin {name!r}: a {type(self.objects[name]).__qualname__} object has no "
                                  "@engine.hookimpl functions and is not a transformers TrainerCallback; pass "
                                  "hook implementations (docs/writing-plugins.md) or TrainerCallbacks")
        self.hook = self.pm.hook
        self.registries = {kind: self._fill_registry(kind) for kind in REGISTRIES}

    # ------------------------------------------------------------------ registration

    def _register(self, plugin: Any, name: str, builtin: bool = False) -> None:
        problems = plugin_problems(plugin, name)
        if problems:
            raise PluginError(problems[0])
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r}: {exc}") from None
        if builtin:
            self.builtins.add(name)

    def add_argument_plugins(self, arguments: dict[str, Any]) -> None:
        """Register the plugin objects that ``Run``'s Trainer-style arguments need (``register_argument_plugins``),
        in the order of their names; one a builtin registers is a builtin."""
        wanted: dict[str, tuple[Any, bool]] = {}
        for impl in reversed(self.pm.hook.register_argument_plugins.get_hookimpls()):
            builtin = impl.plugin_name in self.builtins

            def register(name: str, plugin: Any, builtin: bool = builtin) -> None:
                wanted[name] = (plugin, builtin)

            self._call_impl(impl, {"register": register, "arguments": arguments})
        for name in sorted(wanted):
            plugin, builtin = wanted[name]
            self._register(plugin, name, builtin)

    def is_builtin(self, name: str) -> bool:
        """``name`` is a plugin registered as a builtin (from ``engine.builtins``, or by a builtin)."""
        return name in self.builtins

    def plugins_answering(self, hook_name: str) -> list[str]:
        """The plugins other than the builtins that implement ``hook_name`` (wrappers aside), in call order."""
        return [impl.plugin_name for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls())
                if impl.plugin_name not in self.builtins and not (impl.wrapper or impl.hookwrapper)]

    def check_blocked_keys(self, train: dict[str, Any]) -> None:
        """A ``[train]`` key that a blocked builtin declares (its ``TRAIN_OPTIONS``) is refused: nothing would read it."""
        declared = builtin_options("train") if self.blocked else {}
        for name in self.blocked:
            owned = dataclasses.fields(declared[name]) if name in declared else ()
            for key in (option.name for option in owned if not option.metadata.get("shared")):
                if key in train:
                    raise ConfigError(f"train.{key} is read by {name}, which this run blocks ('-{name}' in plugins); "
                                      f"remove train.{key} or the block")

    def _check_blocks(self) -> None:
        """Each ``-name`` names a builtin or an installed plugin that the run does not also enable."""
        for name in self.blocked:
            if name in self.enabled or name in self.objects:
                raise ConfigError(f"plugins: {name!r} is both enabled and blocked ('-{name}'); keep one")
            if name not in builtin_specs() and name not in self.installed:
                raise PluginError(unknown_plugin_message(name, self.installed))

    def _check_answers(self) -> None:
        """The hooks every run needs answered have an answer (a blocked builtin may have been the only one),
        and a single-answer hook has at most one enabled plugin answering it."""
        for hook_name in hookspecs.REQUIRED_HOOKS:
            impls = getattr(self.pm.hook, hook_name).get_hookimpls()
            if any(not (impl.wrapper or impl.hookwrapper) for impl in impls):
                continue
            blocks = [name for name in self.blocked if name in builtin_specs() and
                      self.pm.parse_hookimpl_opts(load_builtin(builtin_specs()[name]), hook_name) is not None]
            raise ConfigError(f"plugins: {', '.join(repr('-' + name) for name in blocks) or 'the run'} leaves no "
                              f"plugin answering {hook_name}, which every run needs; remove the block or enable a "
                              f"plugin that implements {hook_name}")
        for hook_name in hookspecs.SINGLE_ANSWER_HOOKS:
            answering = self.plugins_answering(hook_name)
            if len(answering) > 1:
                raise PluginError(f"plugins {answering[0]!r} and {answering[1]!r} both answer {hook_name}, which "
                                  "takes one answer; enable one of them")

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
                       key=lambda impl: impl.plugin_name not in self.builtins)
        for impl in impls:
            builtin = impl.plugin_name in self.builtins
            self._call_impl(impl, {"register": registry.callback(impl.plugin_name, builtin)})
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
            if plugin not in self.builtins:
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
        if hook_name not in hookspecs.SPEC_NAMES:
            close = difflib.get_close_matches(hook_name, hookspecs.SPEC_NAMES, n=1)
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
    return [h for h in hooks if h in hookspecs.SPEC_NAMES], names, problems


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
