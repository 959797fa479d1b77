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
import importlib.util
import sys
import warnings
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


# ---------------------------------------------------------------------------- deprecated module paths

# The modules the 0.2 re-layering moved: ``import engine.models`` still works for one release, warning
# (DeprecationWarning) with the new home and giving the names the old module had, from their new modules.
# old path -> (its new home, {module: the names taken from it}); "*" takes the module's __all__, "old=new"
# gives a renamed name under its old one. The paths go away in the next release.
MOVED = {
    "engine.lowrank": ("engine.kit.lowrank", {"engine.kit.lowrank": "*"}),
    "engine.migration": ("engine.tooling.migration", {
        "engine.tooling.migration": "Migration migrate read_arguments trainer_defaults"}),
    "engine.accelerate_config": ("engine.tooling.accelerate_config (helpers: engine.kit.mappings)", {
        "engine.kit.mappings": "Mapping accept_only",
        "engine.tooling.accelerate_config": "STRATEGY_PLUGINS apply map_config read"}),
    "engine.report": ("engine.builtin.report_writer (--size parsing: engine.tooling.commands)", {
        "engine.builtin.report_writer": "DEFAULT_SIZE Document RunFiles config_differences default_config figures "
                                        "write_report",
        "engine.tooling.commands": "SIZE_RANGE parse_size"}),
    "engine.models": ("engine.builtin.models (model_config, max_positions: engine.kit.models)", {
        "engine.builtin.data.checks": "input_limits",
        "engine.builtin.models": "build_model check_forward check_model check_positions",
        "engine.builtin.tasks": "fill_pad_token_id",
        "engine.kit.models": "BUILTIN_CONFIGS POSITION_ATTRIBUTES max_positions model_config"}),
    "engine.trainer_args": ("engine.builtin.trainer_args (its types: engine.kit.mappings)", {
        "engine.builtin.trainer_args": "ENABLED_BY FIELDS LEGACY SEQ2SEQ_FIELDS STRATEGIES TRACKERS "
                                       "TRANSFORMERS_VERSION answer_for",
        "engine.kit.mappings": "ACCEPTED BUILTIN KINDS NOT_YET PLUGIN REFUSED Answer Conversion accepted builtin "
                               "load_json plugin read_json_file refused show"}),
    "engine.tasks": ("engine.builtin.tasks (generation: engine.builtin.generation)", {
        "engine.builtin.data.task_rows": "label_ids_by_name",
        "engine.builtin.generation": "Generation check_generation_values generate generation",
        "engine.builtin.tasks": "AUTO_CLASSES CAUSAL_LM CLASS_SUFFIXES CLASSIFICATION SEQ2SEQ SEQUENCE_CLASSIFICATION "
                                "TOKEN_CLASSIFICATION auto_class check_can_generate check_labels collator label_names "
                                "label_settings task_of_class configure=check_task_keys resolve_task=task_of"}),
    "engine.data": ("engine.builtin.data (Datasets: engine.Datasets)", {
        "engine.builtin.data.build": "build_datasets needs_tokenizer prepare_given tokenized_max_length",
        "engine.builtin.data.chat": "render_chat",
        "engine.builtin.data.checks": "ModelLimits check_token_rows input_limits token_row_problem",
        "engine.builtin.data.collators": "DataCollator FlatteningCollator collator_for enable_document_packing",
        "engine.builtin.data.prepare": "prepare",
        "engine.builtin.data.sources": "BadRow column_names embedded_corpus load_source source_files",
        "engine.builtin.data.streaming": "ResumableStream",
        "engine.builtin.data.tokenizer": "EOS_TOKEN PAD_TOKEN build_tokenizer has_tokenizer load_tokenizer "
                                         "train_tokenizer",
        "engine.kit.loaders": "example_lengths forward_columns without_unused_columns",
        "engine.loss": "IGNORE_INDEX",
        "engine.state": "Datasets",
        "engine.util": "is_datasets_object"}),
}


class MovedModules:
    """The finder and loader of the old paths in :data:`MOVED` (last on ``sys.meta_path``: a real module wins)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        home, sources = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {home}; import it from there (the old path goes away in the "
                      "next release)", DeprecationWarning, stacklevel=2)
        for source, names in sources.items():
            new = importlib.import_module(source)
            for item in new.__all__ if names == "*" else names.split():
                old, _, current = item.partition("=")
                setattr(module, old, getattr(new, current or old))


if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(MovedModules())
