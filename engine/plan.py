"""``engine plan``: the composed run as text, before anything heavy loads."""

from __future__ import annotations

import dataclasses

from . import __version__
from .config import to_toml
from .hookspecs import HOOK_NAMES, combine_kind
from .plugins import NO_AUTOLOAD_ENV, PLUGINS_ENV, autoload_disabled
from .state import RunView
from .strategy import strategy_name


def _origin(run: RunView, name: str) -> str:
    """Where a plugin's code comes from, and what named it."""
    pm = run.plugin_manager
    if pm.is_builtin(name):
        return f"engine {__version__}, builtin"
    named = f"named by {pm.origins[name]}" if name in pm.origins else ""
    installed = pm.installed.get(name)
    if name in pm.objects or installed is None:
        return f"python object; {named}"
    return f"{installed.distribution} {installed.version}, entry point {installed.value}; {named}"


def _help_comments(run: RunView) -> dict[str, dict[str, str]]:
    sections = {"train": type(run.config.train), "data": type(run.config.data)}
    sections.update({name: type(options) for name, options in run.config.sections.items()})
    return {section: {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
            for section, cls in sections.items()}


def _answering(run: RunView, hook_name: str) -> str:
    """The plugin whose answer a firstresult hook takes (asked again, in call order)."""
    pm = run.plugin_manager
    return next(name for name in pm.call_order(hook_name) if pm.call_plugin(hook_name, name, run=run) is not None)


def render_plan(run: RunView) -> str:
    pm = run.plugin_manager
    lines = [f"engine {__version__}: composed run", "", "plugins (enabled first, in call order; the hooks each answers):"]
    hooks: dict[str, list[str]] = {}
    for hook_name in HOOK_NAMES:
        for name in pm.call_order(hook_name):
            hooks.setdefault(name, []).append(hook_name)
    builtins = [name for name, _ in pm.pm.list_name_plugin() if pm.is_builtin(name)]
    for name in [*pm.enabled, *builtins]:
        lines.append(f"  {name:<24} {_origin(run, name)}; hooks: {', '.join(hooks.get(name, [])) or '-'}")
    if pm.blocked:
        lines.append(f"  blocked by the run: {', '.join(pm.blocked)}")
    if pm.excluded:
        lines.append(f"  excluded by {PLUGINS_ENV}: {', '.join(pm.excluded)}")
    if autoload_disabled():
        lines.append(f"  {NO_AUTOLOAD_ENV} is set: no other installed plugin is imported")
    if run.config.required_plugins:
        lines.append(f"  required_plugins satisfied: {', '.join(run.config.required_plugins)}")

    lines += ["", "hooks (implementations in call order; firstresult: the first non-None answer wins):"]
    for hook_name in HOOK_NAMES:
        order = pm.call_order(hook_name)
        kind = combine_kind(hook_name)
        lines.append(f"  {hook_name:<24} {kind:<12} {', '.join(order) or '(none)'}")

    lines += ["", "registries:"]
    selected = {"optimizer": run.config.train.optim, "scheduler": run.config.train.lr_scheduler_type,
                "strategy": strategy_name(run)}
    for kind, registry in run.registries.items():
        entry = registry.get(selected[kind])
        lines.append(f"  {kind:<10} selected {entry.name!r} from {entry.plugin}; "
                     f"available: {', '.join(registry.names())}")

    lines += ["", f"checkpoint weights: {type(run.weights).__name__} from {_answering(run, 'checkpoint_weights')} "
                  "(checkpoint_weights: what checkpoints and the final model hold)"]

    notes = pm.per_plugin("plan_lines", run=run)
    notes["run.plan_notes"] = run.plan_notes  # set in configure before the hook existed (deprecated)
    if any(notes.values()):
        lines += ["", "plugin notes:", *(f"  {name}: {line}" for name, plugin_lines in notes.items()
                                         for line in plugin_lines)]

    lines += ["", "config (defaults filled in):", ""]
    lines.append(to_toml(run.config.to_mapping(), _help_comments(run)))
    return "\n".join(lines)

