"""The DeepSpeed config of a run: the user's JSON file or inline table, its ``"auto"`` values
filled from the run, and every value that contradicts the run refused by name.

Pure (no deepspeed import, no processes): ``configure`` calls it to refuse bad input before
anything loads, and the strategy calls it again to get the config it initializes with.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from engine import ConfigError

AUTO = "auto"
DEFAULT_STAGE = 2
# what the engine decides itself: a DeepSpeed config naming these would fight the run
REFUSED = {
    "scheduler": "the engine's scheduler drives the learning rate (train.lr_scheduler_type, train.warmup_steps)",
}
# DeepSpeed optimizer parameters that follow [train] when "auto" (and must agree with it otherwise)
OPTIMIZER_PARAMS = {"lr": "learning_rate", "weight_decay": "weight_decay", "eps": "adam_epsilon"}
# zero_optimization sizes that "auto" derives from the model's hidden size, as Trainer's DeepSpeed
# integration does (trainer_config_finalize); DeepSpeed itself cannot read "auto" there
SIZED_BY_HIDDEN = {
    "reduce_bucket_size": lambda hidden: hidden * hidden,
    "stage3_prefetch_bucket_size": lambda hidden: int(0.9 * hidden * hidden),
    "stage3_param_persistence_threshold": lambda hidden: 10 * hidden,
}


def read_config(spec: str | dict[str, Any] | None, key: str = "deepspeed.config") -> dict[str, Any]:
    """The user's DeepSpeed config: a JSON file's content, a copy of an inline table, or {}."""
    if spec is None:
        return {}
    if isinstance(spec, dict):
        return copy.deepcopy(spec)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"{key}: {spec} is not a file; name a DeepSpeed JSON file or give an inline table")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot read {spec} as JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {spec} holds a JSON {type(value).__name__}, expected an object")
    return value


class _Filler:
    """Sets ``"auto"`` or missing keys of a (nested) table to the run's values; refuses others that differ."""

    def __init__(self, root: dict[str, Any], key: str):
        self.root, self.key = root, key

    def table(self, *path: str) -> dict[str, Any]:
        node = self.root
        for depth, name in enumerate(path):
            child = node.setdefault(name, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{self.key}: {'.'.join(path[:depth + 1])} is a {type(child).__name__}, "
                                  "expected a table")
            node = child
        return node

    def fill(self, path: tuple[str, ...], value: Any, source: str) -> Any:
        """``path``'s value: ``value`` when missing or "auto", else the config's, which must equal ``value``."""
        node = self.table(*path[:-1])
        current = node.get(path[-1], AUTO)
        if current == AUTO:
            node[path[-1]] = value
            return value
        if not _same(current, value):
            raise ConfigError(f"{self.key}: {'.'.join(path)} = {json.dumps(current)} contradicts the run's "
                              f"{source} = {json.dumps(value)}; set it to \"auto\" (or to the run's value)")
        return current


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def resolve(run: Any, world_size: int) -> dict[str, Any]:
    """The complete DeepSpeed config for ``run`` launched as ``world_size`` processes."""
    options, train = run.config.section("deepspeed"), run.config.train
    config = read_config(options.config)
    fill = _Filler(config, "deepspeed.config")
    for name, reason in REFUSED.items():
        if name in config:
            raise ConfigError(f"deepspeed.config: {name}: {reason}; remove it from the DeepSpeed config")

    micro, accumulation = train.per_device_train_batch_size, train.gradient_accumulation_steps
    fill.fill(("train_micro_batch_size_per_gpu",), micro, "train.per_device_train_batch_size")
    fill.fill(("gradient_accumulation_steps",), accumulation, "train.gradient_accumulation_steps")
    fill.fill(("train_batch_size",), micro * accumulation * world_size,
              f"global batch (per_device_train_batch_size x gradient_accumulation_steps x {world_size} processes)")
    # explicit: DeepSpeed's own default is 1.0, which would clip a run that asked for no clipping
    fill.fill(("gradient_clipping",), train.max_grad_norm, "train.max_grad_norm")
    fill.fill(("bf16", "enabled"), train.bf16, "train.bf16")
    fill.fill(("fp16", "enabled"), train.fp16, "train.fp16")

    zero = fill.table("zero_optimization")
    if options.zero_stage is not None:
        stage = fill.fill(("zero_optimization", "stage"), options.zero_stage, "deepspeed.zero_stage")
    elif zero.get("stage", AUTO) == AUTO:
        stage = zero["stage"] = DEFAULT_STAGE
    else:
        stage = zero["stage"]
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed.config: zero_optimization.stage = {json.dumps(stage)}; expected 0, 1, 2 or 3")
    for what in ("optimizer", "param"):
        option_value = getattr(options, f"offload_{what}")
        if option_value is not None:
            fill.fill(("zero_optimization", f"offload_{what}", "device"), option_value, f"deepspeed.offload_{what}")
        device = zero.get(f"offload_{what}", {}).get("device", "none") if isinstance(
            zero.get(f"offload_{what}"), dict) else "none"
        if device != "none" and stage < (3 if what == "param" else 1):
            raise ConfigError(f"deepspeed.offload_{what}: offloading {what}s needs ZeRO stage "
                              f"{3 if what == 'param' else '1 or more'} (zero_optimization.stage = {stage})")

    auto_sized = [key for key in SIZED_BY_HIDDEN if zero.get(key) == AUTO]
    if auto_sized:
        hidden = _hidden_size(run)
        if hidden is None:
            raise ConfigError(f"deepspeed.config: zero_optimization.{auto_sized[0]} = \"auto\" comes from the model's "
                              "hidden_size (as in Trainer), which this model's config does not give; set a number")
        for key in auto_sized:
            zero[key] = SIZED_BY_HIDDEN[key](hidden)

    if "optimizer" in config:  # DeepSpeed builds this one instead of the registry's
        params = fill.table("optimizer", "params")
        for name, train_key in OPTIMIZER_PARAMS.items():
            if name in params:
                fill.fill(("optimizer", "params", name), getattr(train, train_key), f"train.{train_key}")
        if "betas" in params:
            fill.fill(("optimizer", "params", "betas"), [train.adam_beta1, train.adam_beta2],
                      "[train.adam_beta1, train.adam_beta2]")
    else:  # the registry's optimizer: a torch optimizer, which also steps on CPU when offloaded
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    # any torch optimizer works under ZeRO (the equivalence tests use SGD); DeepSpeed only vouches for its own
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 2**31 - 1)  # the engine logs progress itself
    return config


def _hidden_size(run: Any) -> int | None:
    """The model's hidden size: of the model given to the run, else of the config ``train.model`` names."""
    from engine.kit.models import model_config

    config = getattr(run.model, "config", None) if run.model is not None else model_config(run.config.train)
    if config is None:
        return None
    sizes = getattr(config, "hidden_sizes", None)
    return getattr(config, "hidden_size", None) or (max(sizes) if sizes else None)


def stage_of(config: dict[str, Any]) -> int:
    return config["zero_optimization"]["stage"]
