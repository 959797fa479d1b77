"""The single-device strategy and the choice of strategy (``train.strategy``)."""

from __future__ import annotations

from engine import hookimpl
from engine.errors import ConfigError
from engine.plugins import BUILTIN_PREFIX
from engine.strategy import Strategy


@hookimpl
def register_strategies(register):
    register("single", Strategy)


def strategy_name(run) -> str:
    """``train.strategy``, with "auto" resolved: an enabled plugin's strategy, else "single"."""
    registry = run.registries["strategy"]
    name = run.config.train.strategy
    if name != "auto":
        registry.get(name)
        return name
    offered = {n: e.plugin for n, e in registry.entries.items() if not e.plugin.startswith(BUILTIN_PREFIX)}
    if len(offered) > 1:
        listed = ", ".join(f"{n} (plugin {p})" for n, p in sorted(offered.items()))
        raise ConfigError(f"train.strategy: enabled plugins offer several strategies ({listed}); "
                          "set train.strategy to one or disable the others")
    return next(iter(offered), "single")


@hookimpl
def configure(run):
    strategy_name(run)


@hookimpl(trylast=True)
def create_strategy(run):
    return run.registries["strategy"].get(strategy_name(run)).factory(run)
