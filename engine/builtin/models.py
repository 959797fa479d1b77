"""Building the model named by ``train.model``.

Forms, tried in this order:

* ``package.module:function``: called with the tokenizer (or None), returns an ``nn.Module``;
* an existing folder: ``from_pretrained``; its weights must be there and intact (checked
  against the engine's manifest, or the safetensors headers, before anything loads);
* a ``.json`` file: a transformers config (``model_type`` required), random weights;
* a builtin name (:data:`BUILTIN_CONFIGS`), random weights.

Config-built models take ``train.model_config`` overrides and the tokenizer's vocabulary size
and special token ids. With ``train.task`` set, the task's ``AutoModelFor...`` class builds or
loads the model (a base checkpoint becomes a classifier, as
``AutoModelForSequenceClassification.from_pretrained(base, num_labels=3)`` does); classifiers
take ``labels`` (num_labels, id2label, label2id, problem_type: engine/builtin/tasks.py).

This is the model builtin: it answers ``create_model`` (merging the plugins'
``model_load_kwargs``) and checks the model's config before anything loads (``on_build_start``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine import hookimpl
from engine.builtin.data.build import tokenized_max_length
from engine.builtin.tasks import (
    SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, auto_class, label_names, label_settings,
)
from engine.config import option
from engine.errors import ConfigError
from engine.kit.models import max_positions, model_config
from engine.util import call_user, is_callable_spec, load_callable

if TYPE_CHECKING:
    from engine.config import TrainConfig  # assembled from the builtins' options: not at import


def build_model(train: TrainConfig, tokenizer: Any = None, labels: dict[str, Any] | None = None,
                load_kwargs: dict[str, Any] | None = None) -> torch.nn.Module:
    """The model named by ``train.model`` (see the module docstring); ``labels``: a classifier's
    num_labels, id2label, label2id, problem_type; ``load_kwargs`` go to ``from_pretrained``."""
    spec = train.model
    if is_callable_spec(spec):
        model = call_user("train.model", spec, load_callable(spec, "train.model"), tokenizer)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"train.model: {spec} returned {type(model).__name__}, expected a torch.nn.Module")
        return model
    if Path(spec).is_dir():  # its files were checked by check_model when setup began
        import transformers

        cls = _model_class(transformers.AutoConfig.from_pretrained(spec), train.task)
        return cls.from_pretrained(spec, **(labels or {}), **(load_kwargs or {}))
    config = model_config(train, tokenizer, labels)
    torch.manual_seed(train.seed)
    return _instantiate(config, train.task)


def _instantiate(config: Any, task: str | None = None) -> torch.nn.Module:
    cls = _model_class(config, task)
    return cls.from_config(config) if cls.__name__.startswith("AutoModel") else cls(config)


def check_positions(config: Any, max_length: int | None, where: str) -> None:
    """Refuse examples longer than the model's positions (GPT-2 would fail mid-training, Llama extrapolate).
    ``max_length`` is data.max_length where the engine tokenizes the rows; None for rows of token ids,
    whose own lengths are checked once they load (engine.builtin.data.checks.check_token_rows)."""
    found = max_positions(config)
    if found is not None and max_length is not None and max_length > found[0]:
        positions, name = found
        raise ConfigError(f"data.max_length: {max_length} tokens per example, but {where} has {positions} positions "
                          f"({name}); lower data.max_length, or raise train.model_config.{name}")


def check_model(train: TrainConfig, max_length: int | None, task: str = "causal-lm") -> None:
    """Before the tokenizer, data or weights load: the model's config, built on the meta device.

    A config-built model runs one forward pass there (shapes only, no memory, ~0.1 s), which
    finds sizes that do not fit together (heads, key/value heads, negative sizes) as one
    ConfigError instead of a traceback in the middle of setup.
    """
    labels = label_settings(train, task, None, None) if train.num_labels or train.id2label or train.label2id else None
    config = model_config(train, labels=labels)
    if config is None:
        return
    check_positions(config, max_length, f"the model ({train.model})")
    if Path(train.model).is_dir():
        return  # a saved model's config was valid when it was trained
    length = min(max_length or 16, 16)
    if task == SEQUENCE_CLASSIFICATION and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # the run's comes from the tokenizer (fill_pad_token_id); a batch of 2 needs one
    try:
        with torch.device("meta"):
            model = _instantiate(config, train.task)
            ids = torch.zeros(2, length, dtype=torch.long)
            targets = {SEQUENCE_CLASSIFICATION: ids[:, 0], TOKEN_CLASSIFICATION: ids}.get(task, ids)
            if getattr(config, "problem_type", None) in ("regression", "multi_label_classification"):
                targets = torch.zeros(2, config.num_labels)
            model(input_ids=ids, labels=targets)
    except Exception as exc:
        where = "train.model_config" if train.model_config else f"train.model: {train.model}"
        raise ConfigError(f"{where}: a {config.model_type} model with this config fails on a test batch: "
                          f"{type(exc).__name__}: {exc}") from None


def check_forward(model: torch.nn.Module, key: str) -> None:
    """Refuse a model whose forward cannot take the batches the default loss passes (``model(**batch)``)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return
    if not any(p.name == "input_ids" or p.kind is p.VAR_KEYWORD for p in parameters):
        raise ConfigError(f"{key}: {type(model).__name__}.forward{inspect.signature(model.forward)} takes no "
                          "input_ids; the default loss calls model(input_ids=..., attention_mask=..., labels=...): "
                          "accept them, or add a plugin whose compute_loss calls the model its way")


def _model_class(config: Any, task: str | None = None) -> Any:
    """The auto class of ``task`` (``train.task``) when set, else the class the config names in
    ``architectures``, else the causal-LM auto class."""
    import transformers

    if task is not None:
        return auto_class(task)
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def check_fit(model: torch.nn.Module, key: str, max_length: int | None, builtin_loss: bool) -> None:
    """The model fits the data (positions of data.max_length, None for rows of token ids) and, with the
    default loss, takes ``model(**batch)``."""
    config = getattr(model, "config", None)
    if config is not None:
        check_positions(config, max_length, "the model")
    if builtin_loss:
        check_forward(model, key)


def load_kwargs(run: Any) -> dict[str, Any]:
    """The plugins' ``model_load_kwargs`` merged; one key from two plugins is refused naming both."""
    merged: dict[str, Any] = {}
    owners: dict[str, str] = {}
    answers = run.plugin_manager.per_plugin("model_load_kwargs", run=run)
    answers["run.model_load_kwargs"] = run.model_load_kwargs  # set in configure before the hook existed (deprecated)
    for plugin, kwargs in answers.items():
        for key, value in kwargs.items():
            if key in merged:
                raise ConfigError(f"model_load_kwargs: plugins {owners[key]!r} and {plugin!r} both set {key!r} for "
                                  "loading train.model; enable one of them")
            merged[key], owners[key] = value, plugin
    return merged


# ---------------------------------------------------------------------------- the plugin


@dataclass
class ModelOptions:
    """``[train]`` keys of builtin.models (engine.kit.models reads them for any plugin building a model, so a
    block does not refuse them)."""

    model_config: dict[str, Any] = option(default_factory=dict, shared=True, help=(
        "overrides applied to the model config when building from a name or .json file"))


class Models:
    """The model builtin, one per run (it remembers the example length the data will have)."""

    TRAIN_OPTIONS = ModelOptions  # the [train] keys it reads: engine.config.TrainConfig has them

    def __init__(self) -> None:
        self.max_length: int | None = None

    @hookimpl
    def on_build_start(self, run):
        train, task = run.config.train, run.task
        self.max_length = tokenized_max_length(run.config.data, run.train_dataset, task)  # None: rows of token ids
        if run.model is None:
            check_model(train, self.max_length, task)  # its config, before the tokenizer, data and weights load
        else:
            check_fit(run.model, "model", self.max_length, run.uses_builtin_loss)

    @hookimpl(trylast=True)
    def create_model(self, run):
        train, task, dataset = run.config.train, run.task, run.train_dataset
        labels = label_settings(train, task, label_names(dataset, task), dataset)
        model = build_model(train, run.tokenizer, labels, load_kwargs(run))
        check_fit(model, "train.model", self.max_length, run.uses_builtin_loss)
        return model
