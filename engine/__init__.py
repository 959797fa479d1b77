"""engine: a small, plugin-based training engine for PyTorch and Hugging Face models.

Public API::

    import engine

    @engine.hookimpl
    def on_step_end(run): ...            # a plugin: see engine.hookspecs

    run = engine.Run("run.toml", overrides=["train.max_steps=50"])
    run.train()

Importing ``engine`` loads only pluggy; torch and the rest load on first use of an attribute.
"""

from __future__ import annotations

import importlib
from typing import Any

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("engine")
"""Marker for plugin hook implementations: ``@engine.hookimpl``."""

_LAZY = {
    "Run": "engine.run",
    "StepOutput": "engine.state",
    "TrainState": "engine.state",
    "Control": "engine.state",
    "Strategy": "engine.strategy",
    "ModelWeights": "engine.kit.checkpoint",
    "EvalPrediction": "engine.metrics",
    "TrainConfig": "engine.config",
    "DataConfig": "engine.config",
    "option": "engine.config",
    "to_toml": "engine.config",
    "EngineError": "engine.errors",
    "ConfigError": "engine.errors",
    "PluginError": "engine.errors",
    "MissingDependencyError": "engine.errors",
    "CheckpointError": "engine.errors",
    "TrainingDiverged": "engine.errors",
    "PredictionOutput": "engine.state",
    "Datasets": "engine.state",
    "param_groups": "engine.optim",
    "parse_optim_args": "engine.optim",
    "OptimArg": "engine.optim",
    "check_optim_args": "engine.optim",
    "OptimizerFamily": "engine.optim",
    "target_linear_parameters": "engine.optim",
    "strategy_name": "engine.strategy",
    "require": "engine.util",
    "load_callable": "engine.util",
    "dumps_json": "engine.util",
    "migrate": "engine.tooling.migration",
}

__all__ = ["hookimpl", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
