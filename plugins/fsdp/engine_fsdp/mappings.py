"""What ``engine migrate`` and ``--accelerate-config`` map onto this plugin (hooks
``trainer_argument_mappings`` and ``accelerate_mappings``): Accelerate's ``fsdp_config``, and
TrainingArguments' ``fsdp`` and ``fsdp_config`` through the same handlers."""

from __future__ import annotations

from typing import Any, Callable

from engine import ConfigError
from engine.kit.mappings import (Conversion, Mapping, accept_only, boolean, is_int, nested, plugin, read_json_file,
                                 section_key, show)

# Accelerate's FSDP1 sharding strategies by name and by number
SHARDING = {"FULL_SHARD": 1, "SHARD_GRAD_OP": 2, "NO_SHARD": 3, "HYBRID_SHARD": 4, "HYBRID_SHARD_ZERO2": 5}
FSDP_KEYS = ("fsdp.wrap_modules", "fsdp.reshard_after_forward", "fsdp.cpu_offload", "fsdp.state_dict_type",
             "fsdp.sharding")


def _fsdp_wrap(mapping: Mapping, key: str, value: Any) -> None:
    if value == "TRANSFORMER_BASED_WRAP":
        mapping.note(key, value, "each transformer block sharded (fsdp.wrap_modules, default: the model's "
                                 "_no_split_modules)")
        return
    raise mapping.refuse(key, value, "the engine shards transformer blocks (TRANSFORMER_BASED_WRAP); set "
                                     "fsdp_transformer_layer_cls_to_wrap to name them")


def _fsdp_sharding(mapping: Mapping, key: str, value: Any) -> None:
    number = SHARDING.get(value) if isinstance(value, str) else value if is_int(value) else None
    if number == 1:
        mapping.set("fsdp.reshard_after_forward", True, key, value)
    elif number == 2:
        mapping.set("fsdp.reshard_after_forward", False, key, value)
    elif number == 4:
        mapping.set("fsdp.sharding", "hybrid", key, value)
    elif number == 3:
        raise mapping.refuse(key, value, "NO_SHARD is data parallelism: use distributed_type: MULTI_GPU (ddp)")
    else:
        raise mapping.refuse(key, value, "the engine maps FULL_SHARD (1), SHARD_GRAD_OP (2) and HYBRID_SHARD (4)")


def _fsdp_state_dict(mapping: Mapping, key: str, value: Any) -> None:
    types = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"}
    if not isinstance(value, str) or value not in types:
        raise mapping.refuse(key, value, "the engine saves FULL_STATE_DICT or SHARDED_STATE_DICT")
    mapping.set("fsdp.state_dict_type", types[value], key, value)


def _fsdp_layers(mapping: Mapping, key: str, value: Any) -> list[str]:
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise mapping.refuse(key, value, "expected class names, e.g. 'LlamaDecoderLayer' or 'BertLayer,BertEmbeddings'")
    return [n.strip() for n in names]


def _fsdp_prefetch(mapping: Mapping, key: str, value: Any) -> None:
    if value not in ("BACKWARD_PRE", None):
        raise mapping.refuse(key, value, "FSDP2 prefetches the next block before each block's backward "
                                         "(BACKWARD_PRE) and has no other policy")
    mapping.note(key, value, "FSDP2's own backward prefetch")


def _fsdp_version(mapping: Mapping, key: str, value: Any) -> None:
    if not is_int(value) or value not in (1, 2):
        raise mapping.refuse(key, value, "expected 1 or 2")
    mapping.note(key, value, "FSDP2 (fully_shard) with the same sharding" + (" (FSDP1 settings mapped)" if value == 1
                                                                               else ""))


# Accelerate's fsdp_config keys and their handlers (TrainingArguments.fsdp_config is mapped through them too)
FSDP_CONFIG: dict[str, Callable[..., None]] = {
    "fsdp_auto_wrap_policy": _fsdp_wrap,
    "fsdp_transformer_layer_cls_to_wrap": section_key("fsdp.wrap_modules", _fsdp_layers),
    "fsdp_sharding_strategy": _fsdp_sharding,
    "fsdp_reshard_after_forward": section_key("fsdp.reshard_after_forward", boolean),
    "fsdp_offload_params": section_key("fsdp.cpu_offload", boolean),
    "fsdp_state_dict_type": _fsdp_state_dict,
    "fsdp_backward_prefetch_policy": _fsdp_prefetch,
    "fsdp_backward_prefetch": _fsdp_prefetch,
    "fsdp_forward_prefetch": accept_only(False, meaning="no forward prefetch (FSDP2's default)"),
    "fsdp_use_orig_params": accept_only(True, False, meaning="FSDP2 always keeps the original parameters"),
    "fsdp_sync_module_states": accept_only(True, False, meaning=(
        "every process builds the same weights (same checkpoint or seed); nothing to broadcast")),
    "fsdp_cpu_ram_efficient_loading": accept_only(True, False, meaning=(
        "every process loads the model itself (not only rank 0): more host memory at start")),
    "fsdp_version": _fsdp_version,
    "fsdp_activation_checkpointing": accept_only(False, meaning="no activation checkpointing"),
}


class _AccelerateSettings(Mapping):
    """What the Accelerate handlers below make of a setting: settings, notes kept apart, and
    refusals worded for TrainingArguments."""

    def __init__(self, source: str):
        super().__init__(source)
        self.meanings: list[tuple[str, str]] = []

    def note(self, accelerate_key: str, value: Any, meaning: str) -> None:
        self.meanings.append((accelerate_key, meaning))

    def refuse(self, key: str, value: Any, reason: str) -> ConfigError:
        return ConfigError(reason)


def _boolean(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"  # fsdp_config from a JSON file often holds "true"/"false"
    return value


def _fsdp_activation_checkpointing(mapping: Mapping, key: str, value: Any) -> None:
    if value is True:  # FSDP checkpoints each wrapped block: the engine's activation checkpointing does that
        mapping.set("train.activation_checkpointing", True, key, value)
    elif value is not False:
        raise mapping.refuse(key, value, "expected true or false")


def _fsdp_reshard(mapping: Mapping, key: str, value: Any) -> None:
    if isinstance(value, str):  # FSDP1: a sharding strategy's name
        FSDP_CONFIG["fsdp_sharding_strategy"](mapping, key, value.upper())
    else:
        FSDP_CONFIG["fsdp_reshard_after_forward"](mapping, key, value)


def _trainer_prefetch(mapping: Mapping, key: str, value: Any) -> None:
    FSDP_CONFIG["fsdp_backward_prefetch"](mapping, key, value.upper() if isinstance(value, str) else value)


# fsdp_config keys by Trainer's name (transformers strips "fsdp_"): Accelerate's own handlers for the
# keys both have, these for Trainer's others
_TRAINER_FSDP: dict[str, Callable[..., None]] = {
    "cpu_offload": FSDP_CONFIG["fsdp_offload_params"],
    "reshard_after_forward": _fsdp_reshard,
    "backward_prefetch": _trainer_prefetch,
    "activation_checkpointing": _fsdp_activation_checkpointing,
    "min_num_params": accept_only(0, meaning="transformer-block wrapping, no size-based policy"),
    "xla": accept_only(False, meaning="no XLA"),
    "xla_fsdp_v2": accept_only(False, meaning="no XLA"),
    "xla_fsdp_grad_ckpt": accept_only(False, meaning="no XLA"),
    "limit_all_gathers": accept_only(True, False, meaning="FSDP1's rate limiter; FSDP2 has no such setting"),
}
# what transformers' post-init adds to every fsdp_config, with or without fsdp
_FSDP_POST_INIT = {"min_num_params": 0, "xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False}
# legacy `fsdp` words -> (Accelerate key, value) for its handlers
_FSDP_WORDS = {"offload": ("fsdp_offload_params", True), "auto_wrap": ("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")}


def _apply_fsdp(c: Conversion, key: str, setting: str, value: Any) -> None:
    """One FSDP setting through its Accelerate handler: its settings and notes into ``c``."""
    mapping = _AccelerateSettings("TrainingArguments")
    handler = _TRAINER_FSDP.get(setting) or FSDP_CONFIG.get("fsdp_" + setting)
    if handler is None:
        known = sorted({*_TRAINER_FSDP, *(k[5:] for k in FSDP_CONFIG)})
        raise ConfigError(f"not an FSDP setting the engine maps; it maps {', '.join(known)}")
    handler(mapping, key, _boolean(value))
    for dotted, mapped in mapping.settings.items():
        c.set(dotted, mapped)
    for what, meaning in mapping.meanings:
        c.note("fsdp", what, meaning)


def _fsdp(c: Conversion, name: str, value: Any) -> None:
    if value is None or value is False or value in ("", []):
        return
    words = [] if value is True else value.split() if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
        raise ConfigError("expected true, or FSDP options such as 'full_shard auto_wrap'")
    c.enable("fsdp")
    for word in words:  # older transformers: "full_shard auto_wrap offload"
        accelerate_key, setting = _FSDP_WORDS.get(word, ("fsdp_sharding_strategy", word.upper()))
        try:
            _apply_fsdp(c, f"fsdp {word!r}", accelerate_key[5:], setting)
        except ConfigError as exc:
            c.lose(f"fsdp {word!r}", str(exc))


def _fsdp_config(c: Conversion, name: str, value: Any) -> None:
    if isinstance(value, str):  # Trainer reads a path at start
        value = read_json_file(value, "fsdp_config")
    if not value:
        return
    if not isinstance(value, dict):
        raise ConfigError("expected a table of FSDP settings")
    if not c.arguments.get("fsdp"):
        if any(_FSDP_POST_INIT.get(k, object()) != v for k, v in value.items()):
            raise ConfigError("used only with fsdp, which is not set (Trainer ignores it too)")
        return
    for key, setting in value.items():
        key = key[5:] if key.startswith("fsdp_") else key  # as transformers reads them
        try:
            _apply_fsdp(c, f"fsdp_config.{key}", key, setting)
        except ConfigError as exc:
            c.lose(f"fsdp_config.{key} = {show(setting)}", str(exc))


TRAINER_ARGUMENTS = {
    "fsdp": plugin("fsdp", *FSDP_KEYS, convert=_fsdp,
                   note="enables the plugin (FSDP2); older values like 'full_shard auto_wrap offload' map to its "
                        "options"),
    "fsdp_config": plugin("fsdp", *FSDP_KEYS, "train.activation_checkpointing", convert=_fsdp_config,
                          note="mapped key by key as --accelerate-config maps Accelerate's fsdp_config "
                               "(transformer_layer_cls_to_wrap -> wrap_modules, reshard_after_forward, cpu_offload, "
                               "state_dict_type, ...)"),
}
ACCELERATE = {"fsdp_config": nested("fsdp", "FSDP", "an FSDP setting", FSDP_CONFIG)}
