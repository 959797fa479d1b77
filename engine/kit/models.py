"""The transformers config a run's model is built from, before the model exists.

:func:`model_config` is the config ``train.model`` names (a folder's config.json, a ``.json``
file or a builtin name of :data:`BUILTIN_CONFIGS`, with ``train.model_config`` on top); a plugin
that must know the architecture at configure time (Liger, DeepSpeed, peft) asks it.
:func:`max_positions` is how many positions a config declares.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import check_model_folder
from ..errors import ConfigError
from ..util import is_callable_spec

if TYPE_CHECKING:
    from ..config import TrainConfig  # assembled from the builtins' options: not at import

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


# Config attributes that hold how many positions a model has, by architecture family.
POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


def max_positions(config: Any) -> tuple[int, str] | None:
    """(positions, attribute) of a model config, when it declares how many it has."""
    for name in POSITION_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value, name
    return None
