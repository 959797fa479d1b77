"""``engine plan``: the composed run as text, before anything heavy loads."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from . import __version__
from .config import DataConfig, TrainConfig, to_toml
from .hookspecs import HOOK_NAMES, combine_kind
from .plugins import BUILTIN_PREFIX

if TYPE_CHECKING:
    from .run import Run

def _origin(run: Run, name: str) -> str:
    if name.startswith(BUILTIN_PREFIX):
        return f"engine {__version__}"
    installed = run.plugin_manager.installed.get(name)
    if name in run.plugin_manager.objects or installed is None:
        return "python object"
    return f"{installed.distribution} {installed.version}"


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

    lines += ["", "config (defaults filled in):", ""]
    lines.append(to_toml(run.config.to_mapping(), _help_comments(run)))
    return "\n".join(lines)

