"""The single-device strategy and the choice of strategy (``train.strategy``)."""

from __future__ import annotations

from engine import hookimpl
from engine.strategy import Strategy, strategy_name


@hookimpl
def register_strategies(register):
    register("single", Strategy)


@hookimpl
def configure(run):
    strategy_name(run)


@hookimpl(trylast=True)
def create_strategy(run):
    return run.registries["strategy"].get(strategy_name(run)).factory(run)
