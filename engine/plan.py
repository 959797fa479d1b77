"""``engine plan``: the composed run as text, before anything heavy loads."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from . import __version__
from .config import DataConfig, TrainConfig, to_toml
from .hookspecs import HOOK_NAMES, combine_kind
from .plugins import BUILTIN_PREFIX, NO_AUTOLOAD_ENV, PLUGINS_ENV, autoload_disabled

if TYPE_CHECKING:
    from .run import Run

def _origin(run: Run, name: str) -> str:
    """Where a plugin's code comes from, and what named it."""
    pm = run.plugin_manager
    if name.startswith(BUILTIN_PREFIX):
        return f"engine {__version__}, builtin"
    named = f"named by {pm.origins[name]}" if name in pm.origins else ""
    installed = pm.installed.get(name)
    if name in pm.objects or installed is None:
        return f"python object; {named}"
    return f"{installed.distribution} {installed.version}, entry point {installed.value}; {named}"


def _help_comments(run: Run) -> dict[str, dict[str, str]]:
    sections = {"train": TrainConfig, "data": DataConfig}
    sections.update({name: type(options) for name, options in run.config.sections.items()})
    return {section: {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
            for section, cls in sections.items()}


def render_plan(run: Run) -> str:
    from .builtin.strategies import strategy_name

    pm = run.plugin_manager
    lines = [f"engine {__version__}: composed run", "", "plugins (enabled first, in call order):"]
    builtins = [name for name, _ in pm.pm.list_name_plugin() if name.startswith(BUILTIN_PREFIX)]
    for name in [*run.config.plugins, *builtins]:
        lines.append(f"  {name:<24} {_origin(run, name)}")
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

    if run.plan_notes:
        lines += ["", "plugin notes:", *(f"  {note}" for note in run.plan_notes)]

    lines += ["", "config (defaults filled in):", ""]
    lines.append(to_toml(run.config.to_mapping(), _help_comments(run)))
    return "\n".join(lines)

