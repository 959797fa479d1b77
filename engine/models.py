"""Building the model named by ``train.model``.

Forms, tried in this order:

* ``package.module:function``: called with the tokenizer (or None), returns an ``nn.Module``;
* an existing folder: ``from_pretrained``; its weights must be there and intact (checked
  against the engine's manifest, or the safetensors headers, before anything loads);
* a ``.json`` file: a transformers config (``model_type`` required), random weights;
* a builtin name (:data:`BUILTIN_CONFIGS`), random weights.

Config-built models take ``train.model_config`` overrides and the tokenizer's vocabulary size
and special token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .checkpoint import check_model_folder
from .config import TrainConfig
from .errors import ConfigError
from .util import is_callable_spec, load_callable

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


def build_model(train: TrainConfig, tokenizer: Any = None) -> torch.nn.Module:
    """The model named by ``train.model`` (see the module docstring)."""
    spec = train.model
    if is_callable_spec(spec):
        model = load_callable(spec, "train.model")(tokenizer)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"train.model: {spec!r} returned {type(model).__name__}, expected torch.nn.Module")
        return model
    path = Path(spec)
    if path.is_dir():
        check_model_folder(path, "train.model")
        return _from_pretrained(path)
    if spec.endswith(".json"):
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"train.model: config file not found: {spec}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"train.model: {spec} is not valid JSON: {exc}") from None
        return _from_config(config, train, tokenizer)
    if spec in BUILTIN_CONFIGS:
        return _from_config(dict(BUILTIN_CONFIGS[spec]), train, tokenizer)
    raise ConfigError(
        f"train.model: {spec!r} is not a folder, a .json config, 'package.module:function' or a "
        f"builtin name ({', '.join(BUILTIN_CONFIGS)})"
    )


def _from_pretrained(path: Path) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    return _model_class(config).from_pretrained(path)


def _from_config(values: dict[str, Any], train: TrainConfig, tokenizer: Any) -> torch.nn.Module:
    import transformers

    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"train.model: config needs a known 'model_type', got {model_type!r}")
    if tokenizer is not None:
        values["vocab_size"] = len(tokenizer)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            values[name] = getattr(tokenizer, name)
    config_class = transformers.CONFIG_MAPPING[model_type]
    # configs accept any keyword silently: compare with the keys a default config has
    known = config_class().to_dict()
    unknown = sorted(k for k in train.model_config if k not in known)
    if unknown:
        raise ConfigError(f"train.model_config: {model_type} config has no key {unknown[0]!r}")
    values.update(train.model_config)
    config = config_class(**values)
    torch.manual_seed(train.seed)
    cls = _model_class(config)
    return cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)


def _model_class(config: Any) -> Any:
    """The class the config names in ``architectures``, else the causal-LM auto class."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM
