"""What ``engine migrate`` and ``--accelerate-config`` map onto this plugin (hooks
``trainer_argument_mappings`` and ``accelerate_mappings``): Accelerate's ``deepspeed_config``, and
TrainingArguments' ``deepspeed`` (a JSON file or a table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from engine import ConfigError
from engine.kit.mappings import (Conversion, Mapping, boolean, check_type, is_int, is_secret_name, nested, plugin,
                                 read_json_file, same_as_train, section_key, show)


def _zero_stage(mapping: Mapping, key: str, value: Any) -> int:
    if not is_int(value) or value not in (0, 1, 2, 3):
        raise mapping.refuse(key, value, "expected 0, 1, 2 or 3")
    return value


def _offload_device(mapping: Mapping, key: str, value: Any) -> str:
    if value not in ("none", "cpu", None):
        raise mapping.refuse(key, value, "the engine offloads to 'cpu' or 'none' (nvme is not supported)")
    return value or "none"


def _config_file(mapping: Mapping, key: str, value: Any) -> str:
    if not isinstance(value, str) or not Path(value).is_file():
        raise mapping.refuse(key, value, "expected the path of a DeepSpeed JSON file that exists")
    return value


def _multinode_launcher(mapping: Mapping, key: str, value: Any) -> None:
    check_type(mapping, key, value, (str,), "a launcher name, e.g. 'standard'")
    mapping.note(key, value, "launcher setting (torchrun or the deepspeed launcher)")


# Accelerate's deepspeed_config keys and their handlers
DEEPSPEED_CONFIG: dict[str, Callable[..., None]] = {
    "deepspeed_config_file": section_key("deepspeed.config", _config_file),
    "zero_stage": section_key("deepspeed.zero_stage", _zero_stage),
    "offload_optimizer_device": section_key("deepspeed.offload_optimizer", _offload_device),
    "offload_param_device": section_key("deepspeed.offload_param", _offload_device),
    "zero3_init_flag": lambda mapping, key, value: mapping.note(
        key, boolean(mapping, key, value), "under ZeRO-3 the model is always built inside deepspeed.zero.Init"),
    "zero3_save_16bit_model": lambda mapping, key, value: mapping.note(
        key, boolean(mapping, key, value), "the final model is always consolidated to full HF weights"),
    "gradient_accumulation_steps": same_as_train("gradient_accumulation_steps"),
    "gradient_clipping": same_as_train("max_grad_norm"),
    "deepspeed_multinode_launcher": _multinode_launcher,
}


# DeepSpeed "auto" values Trainer fills and the engine does not: Trainer sizes them from the model's
# hidden size, which a run file cannot know; DeepSpeed's own defaults apply without them
_DEEPSPEED_TRAINER_AUTO = {"zero_optimization": ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                                 "stage3_param_persistence_threshold")}


def _deepspeed(c: Conversion, name: str, value: Any) -> None:
    if value is None or value in ("", {}):
        return
    config = value
    if isinstance(value, str):
        try:
            config = read_json_file(value, "deepspeed")
        except ConfigError as exc:
            c.enable("deepspeed")
            c.set("deepspeed.config", value)  # the run reads it where it starts; `engine plan` checks it
            c.note("deepspeed", f"deepspeed {value!r}", f"not readable here ({exc}): written as is")
            return
    if not isinstance(config, dict):
        raise ConfigError("expected the path of a DeepSpeed JSON file or a table")
    c.enable("deepspeed")
    config = json.loads(json.dumps(config))  # a copy
    changed = _remove(c, config, "deepspeed", _null)
    if "scheduler" in config:
        changed = True
        scheduler = config.pop("scheduler")
        c.lose(f"deepspeed.scheduler = {show(scheduler)}", "the engine's scheduler drives the learning rate "
                                                           "(train.lr_scheduler_type, from lr_scheduler_type)")
    for table, keys in _DEEPSPEED_TRAINER_AUTO.items():
        for key in keys:
            if isinstance(config.get(table), dict) and config[table].get(key) == "auto":
                changed = True
                del config[table][key]
                c.lose(f"deepspeed.{table}.{key} = \"auto\"", "Trainer sizes it from the model's hidden size; "
                                                             "DeepSpeed's default applies (set a number to choose)")
    if isinstance(value, str) and not changed:
        c.set("deepspeed.config", value)  # the file as it is, credentials included: it is the user's
    else:
        _remove(c, config, "deepspeed", _credential)
        c.set("deepspeed.config", config, note=f"the content of {value}" if isinstance(value, str) else "")


def _remove(c: Conversion, table: dict[str, Any], path: str, why: Callable[[str, Any], str | None]) -> bool:
    """Remove from ``table``, at any depth, each value ``why(key, value)`` gives a reason for, lost with it."""
    changed = False
    for key in list(table):
        reason = why(key, table[key])
        if reason:
            c.lose(f"{path}.{key} = {show(table.pop(key))}", reason)
            changed = True
        elif isinstance(table[key], dict):
            changed = _remove(c, table[key], f"{path}.{key}", why) or changed
    return changed


def _null(key: str, value: Any) -> str | None:
    return "a run file (TOML) cannot hold null; DeepSpeed's default applies" if value is None else None


def _credential(key: str, value: Any) -> str | None:
    return "a credential is never written to a run file: keep it in the DeepSpeed JSON file (deepspeed = its " \
           "path)" if is_secret_name(key) else None


TRAINER_ARGUMENTS = {
    "deepspeed": plugin("deepspeed", "config", convert=_deepspeed,
                        note="a path or a table, to [deepspeed] config; its \"auto\" values are filled from the run; "
                             "a scheduler section is dropped (the engine's scheduler drives the learning rate)"),
}
ACCELERATE = {"deepspeed_config": nested("deepspeed", "DEEPSPEED", "a DeepSpeed setting", DEEPSPEED_CONFIG)}
