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
take ``labels`` (num_labels, id2label, label2id, problem_type: engine/tasks.py).
"""

from __future__ import annotations

import difflib
import inspect
import json
import re
from pathlib import Path
from typing import Any

import torch

from .checkpoint import check_model_folder
from .config import TrainConfig
from .errors import ConfigError
from .util import call_user, is_callable_spec, load_callable

_LLAMA = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    # ~0.2M parameters: the default run and the tests
    "tiny-llama": {**_LLAMA, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                   "vocab_size": 1024},
    # ~50M parameters with a 32k vocabulary: benchmarks
    "small-llama": {**_LLAMA, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
                    "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 2048,
                    "vocab_size": 32000},
}


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


def model_config(train: TrainConfig, tokenizer: Any = None, labels: dict[str, Any] | None = None) -> Any:
    """The transformers config of the model ``train.model`` names (None for a model factory).

    Built from a folder's config.json, a .json file or a builtin name, with ``train.model_config``
    on top and, given a tokenizer, its vocabulary size and special token ids. A bad value is a
    ConfigError naming its key: transformers' own validation, turned into one line. ``labels``
    (a classifier's num_labels, id2label, ...) go on top.
    """
    import transformers

    spec = train.model
    if is_callable_spec(spec):
        return None
    path = Path(spec)
    if path.is_dir():
        check_model_folder(path, "train.model")
        try:
            return transformers.AutoConfig.from_pretrained(path, **(labels or {}))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # garbage, or a model_type it does not know
            raise ConfigError(f"train.model: {path / 'config.json'} is not a config transformers can read: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    if spec.endswith(".json"):
        return _config_from_values({**_read_config_file(path), **(labels or {})}, train, tokenizer, source=spec)
    if spec in BUILTIN_CONFIGS:
        return _config_from_values({**BUILTIN_CONFIGS[spec], **(labels or {})}, train, tokenizer, source=spec)
    raise ConfigError(
        f"train.model: {spec!r} is not a folder, a .json config, 'package.module:function' or a "
        f"builtin name ({', '.join(BUILTIN_CONFIGS)})"
    )


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"train.model: config file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"train.model: {path} is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"train.model: {path} holds a JSON {type(values).__name__ if values is not None else 'null'},"
                          " expected an object with a model_type (a transformers config)")
    return values


def _config_from_values(values: dict[str, Any], train: TrainConfig, tokenizer: Any, source: str) -> Any:
    import transformers

    values = dict(values)
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(transformers.CONFIG_MAPPING), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ConfigError(f"train.model: {source} needs a known 'model_type', got {model_type!r}{hint}")
    if tokenizer is not None:
        values["vocab_size"] = len(tokenizer)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            values[name] = getattr(tokenizer, name)
    config_class = transformers.CONFIG_MAPPING[model_type]
    # configs accept any keyword silently: compare with the keys a default config has
    known = config_class().to_dict()
    if values.get("is_encoder_decoder", known.get("is_encoder_decoder")) and (
            tokenizer is not None or values.get("decoder_start_token_id") is None):
        # T5's convention: decoding starts at pad
        values["decoder_start_token_id"] = values.get("pad_token_id", known.get("pad_token_id")) or 0
    unknown = sorted(k for k in train.model_config if k not in known)
    if unknown:
        raise ConfigError(f"train.model_config: {model_type} config has no key {unknown[0]!r}")
    values.update(train.model_config)
    try:
        return config_class(**values)
    except Exception as exc:  # transformers validates its configs: name the key it refused
        raise _config_error(exc, model_type, train.model_config, source) from None


def _config_error(exc: Exception, model_type: str, overrides: dict[str, Any], source: str) -> ConfigError:
    message = str(exc.__cause__ or exc)
    field = re.search(r"for field '(\w+)'", str(exc))
    if field and field.group(1) in overrides:
        return ConfigError(f"train.model_config.{field.group(1)}: {message}")
    where = "train.model_config" if overrides else f"train.model: {source}"
    return ConfigError(f"{where}: the {model_type} config refuses it: {type(exc.__cause__ or exc).__name__}: {message}")


def _instantiate(config: Any, task: str | None = None) -> torch.nn.Module:
    cls = _model_class(config, task)
    return cls.from_config(config) if cls.__name__.startswith("AutoModel") else cls(config)


# Config attributes that hold how many positions a model has, by architecture family.
POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


def max_positions(config: Any) -> tuple[int, str] | None:
    """(positions, attribute) of a model config, when it declares how many it has."""
    for name in POSITION_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value, name
    return None


def check_positions(config: Any, max_length: int | None, where: str) -> None:
    """Refuse examples longer than the model's positions (GPT-2 would fail mid-training, Llama extrapolate).
    ``max_length`` is data.max_length where the engine tokenizes the rows; None for rows of token ids,
    whose own lengths are checked once they load (engine.data.check_token_rows)."""
    found = max_positions(config)
    if found is not None and max_length is not None and max_length > found[0]:
        positions, name = found
        raise ConfigError(f"data.max_length: {max_length} tokens per example, but {where} has {positions} positions "
                          f"({name}); lower data.max_length, or raise train.model_config.{name}")


def input_limits(model_or_config: Any) -> Any:
    """What rows of token ids must fit in a model, or the model a config builds (engine.data.ModelLimits):
    ids below its input embedding's rows (the config's vocab_size), lengths within its positions."""
    from .data import ModelLimits

    config = getattr(model_or_config, "config", model_or_config)
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(model_or_config, torch.nn.Module):
        try:
            vocab_size = model_or_config.get_input_embeddings().num_embeddings
        except (AttributeError, NotImplementedError):
            pass
    return ModelLimits(vocab_size if isinstance(vocab_size, int) else None, max_positions(config))


def fill_pad_token_id(model: torch.nn.Module, tokenizer: Any, task: str) -> None:
    """A sequence classifier scores each row at its last token before the padding, which it finds by
    config.pad_token_id (transformers refuses batches of 2 or more without one): set from the
    tokenizer when the config has none, as Trainer users do; refused when neither has one."""
    config = getattr(model, "config", None)
    if task != "sequence-classification" or config is None or getattr(config, "pad_token_id", 0) is not None:
        return
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        raise ConfigError("the model's config has no pad_token_id, which sequence classification needs to find each "
                          "row's last token, and the tokenizer has no pad token to take it from; set the tokenizer's "
                          "pad token (e.g. tokenizer.pad_token = tokenizer.eos_token) or config.pad_token_id")
    config.pad_token_id = pad_id


def check_model(train: TrainConfig, max_length: int | None, task: str = "causal-lm") -> None:
    """Before the tokenizer, data or weights load: the model's config, built on the meta device.

    A config-built model runs one forward pass there (shapes only, no memory, ~0.1 s), which
    finds sizes that do not fit together (heads, key/value heads, negative sizes) as one
    ConfigError instead of a traceback in the middle of setup.
    """
    from .tasks import SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, label_settings

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

    from .tasks import auto_class

    if task is not None:
        return auto_class(task)
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM
