"""``--accelerate-config FILE.yaml``: an Accelerate config file mapped onto the engine's strategies.

Teams keep their distributed settings in the YAML ``accelerate config`` writes. This module
reads it and maps every key onto the engine: ``distributed_type`` enables the strategy plugin
(MULTI_GPU / MULTI_CPU -> ``ddp``, FSDP -> ``fsdp``, DEEPSPEED -> ``deepspeed``, NO -> none),
``fsdp_config`` / ``deepspeed_config`` fill that plugin's section, ``mixed_precision`` and
``use_cpu`` the ``[train]`` keys. Launcher keys (``num_processes``, ``num_machines``, ...)
describe the torchrun command, and are checked against the processes actually started. A key
the engine cannot honour is refused by name; nothing is skipped. ``engine plan`` shows each
mapping. Values also set by the run file must agree; ``--set`` still overrides both.

Every value read is checked (a wrong type is refused naming its key path and what it takes), and
the file is bounded before it is built: its size, its nesting, and what its aliases expand to.
Values under a credential's name are never shown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from .config import MAX_NESTING, SECRET_MASK, TrainConfig, check_value
from .errors import ConfigError
from .util import is_secret_name, mask_secrets, one_line, read_small_text

STRATEGY_PLUGINS = {"MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed", "NO": None}
# Accelerate's FSDP1 sharding strategies by name and by number
SHARDING = {"FULL_SHARD": 1, "SHARD_GRAD_OP": 2, "NO_SHARD": 3, "HYBRID_SHARD": 4, "HYBRID_SHARD_ZERO2": 5}
MAX_CONFIG_BYTES = 1 << 20
MAX_VALUES = 10_000  # once aliases are expanded; `accelerate config` writes a few dozen


class Mapping:
    """The settings an Accelerate config makes: plugins to enable, ``section.key`` values, and why."""

    def __init__(self, source: str):
        self.source = one_line(source)
        self.plugins: list[str] = []
        self.settings: dict[str, Any] = {}
        self.lines: list[str] = []
        self.launcher: dict[str, Any] = {}  # torchrun's settings: shown, and checked against the job

    def set(self, key: str, value: Any, accelerate_key: str, accelerate_value: Any) -> None:
        self.settings[key] = value
        self.lines.append(f"{one_line(accelerate_key)}: {_show(accelerate_value, accelerate_key)} -> {key} = "
                          f"{_show(value, key)}")

    def note(self, accelerate_key: str, value: Any, meaning: str) -> None:
        self.lines.append(f"{one_line(accelerate_key)}: {_show(value, accelerate_key)} -> {meaning}")

    def refuse(self, accelerate_key: str, value: Any, reason: str) -> ConfigError:
        return ConfigError(f"--accelerate-config {self.source}: {one_line(accelerate_key)}: "
                           f"{_show(value, accelerate_key)}: {reason}")


def _show(value: Any, key: Any = "") -> str:
    """``value`` as the file spells it; a credential's (by its key's name, at any depth) as the mask."""
    value = SECRET_MASK if value is not None and is_secret_name(str(key).rsplit(".", 1)[-1]) \
        else mask_secrets(value, SECRET_MASK)
    text = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in ``path``; a missing, special, oversized, binary or malformed file, or one
    nested too deep or expanding too far, is a ConfigError naming it."""
    import yaml

    what = f"--accelerate-config {one_line(path)}"
    text = read_small_text(path, what, "name the YAML file `accelerate config` wrote", MAX_CONFIG_BYTES)
    try:
        _check_size(yaml.parse(text), what)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{what} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} holds a {type(data).__name__}, expected a mapping of Accelerate settings (as "
                          "`accelerate config` writes)")
    return data


def _check_size(events: Any, what: str) -> None:
    """Refuse YAML nested more than MAX_NESTING levels, or holding more than MAX_VALUES values once its
    aliases are expanded, from its parse events, before anything is built: a few hundred bytes of nested
    aliases ("billion laughs") stand for billions of values, which no walk of them (showing, comparing)
    would get through."""
    import yaml

    values = 0
    stack: list[tuple[str | None, int]] = []  # each open mapping or list: its anchor, the values before it
    sizes: dict[str, int] = {}  # anchor -> the values it stands for
    for event in events:
        if isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for anchor, _ in stack):
                raise ConfigError(f"{what}: alias *{event.anchor} refers to a mapping or list that holds it; "
                                  "write the settings out")
            values += sizes.get(event.anchor, 1)  # an unknown anchor: yaml refuses it when building
        elif isinstance(event, yaml.CollectionStartEvent):
            stack.append((event.anchor, values))
            values += 1
            if len(stack) > MAX_NESTING:
                raise ConfigError(f"{what} nests mappings or lists more than {MAX_NESTING} levels deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, before = stack.pop()
            if anchor is not None:
                sizes[anchor] = values - before
        elif isinstance(event, yaml.ScalarEvent):
            values += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        if values > MAX_VALUES:
            raise ConfigError(f"{what} holds more than {MAX_VALUES:,} values once its aliases (*name) are "
                              "expanded; write the settings out")


def map_config(config: dict[str, Any], source: str) -> Mapping:
    """Map an Accelerate config onto plugins and settings (see the module docstring)."""
    mapping = Mapping(source)
    distributed = config.get("distributed_type", "NO")
    if not isinstance(distributed, str) or distributed not in STRATEGY_PLUGINS:
        raise mapping.refuse("distributed_type", distributed, f"the engine runs {', '.join(STRATEGY_PLUGINS)}")
    plugin = STRATEGY_PLUGINS[distributed]
    if plugin:
        mapping.plugins.append(plugin)
        mapping.note("distributed_type", distributed, f"plugins += [{plugin!r}]")
    for key, value in config.items():
        if key == "distributed_type":
            continue
        handler = _TOP_LEVEL.get(key)
        if handler is None:
            raise mapping.refuse(key, value, f"not an Accelerate key the engine can map; it maps "
                                             f"{', '.join(sorted(['distributed_type', *_TOP_LEVEL]))}")
        handler(mapping, key, value, plugin)
    _check_processes(mapping, config)
    return mapping


def apply(raw: dict[str, Any], path: str | Path) -> tuple[dict[str, Any], Mapping]:
    """``raw`` (a run-file mapping) with ``path``'s Accelerate settings added; values the run file
    sets differently are refused naming both."""
    import copy

    from .config import enabled_plugins

    mapping = map_config(read(path), str(path))
    raw = copy.deepcopy(raw)
    plugins = enabled_plugins(raw)
    raw["plugins"] = plugins + [name for name in mapping.plugins if name not in plugins]
    for dotted, value in mapping.settings.items():
        section, key = dotted.split(".", 1)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] is a {type(table).__name__} in the run file; expected a table")
        if key in table and table[key] != value:
            raise ConfigError(f"{dotted} = {_show(table[key])} in the run file, but --accelerate-config {path} "
                              f"sets {_show(value)}; remove one")
        table[key] = value
    return raw, mapping


# ---------------------------------------------------------------------------- keys


def _check_type(mapping: Mapping, key: str, value: Any, types: tuple[type, ...], expected: str) -> None:
    """Refuse ``value`` unless it is one of ``types`` (a bool is not a number here)."""
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise mapping.refuse(key, value, f"expected {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _launcher(*types: type, expected: str) -> Callable[..., None]:
    """A setting of the launcher (torchrun): checked, shown, and num_processes compared with the job."""

    def handle(mapping: Mapping, key: str, value: Any, plugin: str | None) -> None:
        _check_type(mapping, key, value, types, expected)
        mapping.launcher[key] = value

    return handle


def accept_only(*accepted: Any, meaning: str) -> Callable[..., None]:
    """A key the engine honours only at these values (TPU, SageMaker, ... settings at their defaults)."""

    def handle(mapping: Mapping, key: str, value: Any, plugin: str | None = None) -> None:
        if not any(type(value) is type(a) and value == a for a in accepted):  # 0 is not false here
            raise mapping.refuse(key, value, f"not supported by the engine (accepted: "
                                             f"{', '.join(_show(a) for a in accepted)})")
        mapping.note(key, value, meaning)

    return handle


def _mixed_precision(mapping: Mapping, key: str, value: Any, plugin: str | None) -> None:
    if value is False:  # YAML reads an unquoted `no` as false
        value = "no"
    if value not in ("no", "bf16", "fp16"):
        raise mapping.refuse(key, value, "the engine trains in 'no', 'bf16' or 'fp16'")
    mapping.set("train.bf16", value == "bf16", key, value)
    mapping.set("train.fp16", value == "fp16", key, value)


def _use_cpu(mapping: Mapping, key: str, value: Any, plugin: str | None) -> None:
    mapping.set("train.use_cpu", _boolean(mapping, key, value), key, value)


def _nested(plugin: str, distributed_type: str, what: str, handlers: Callable[[], dict[str, Callable[..., None]]]):
    """A table (``fsdp_config``, ``deepspeed_config``) whose keys ``handlers()`` maps, for ``plugin`` only."""

    def handle(mapping: Mapping, key: str, value: Any, enabled: str | None) -> None:
        if value is None or value == {}:  # `accelerate config` writes fsdp_config: {} for the other types
            return
        if not isinstance(value, dict):
            raise mapping.refuse(key, value, "expected a table of settings, as `accelerate config` writes it")
        if enabled != plugin:
            raise mapping.refuse(key, "{...}", f"{key} needs distributed_type: {distributed_type}")
        table = handlers()
        for name, setting in value.items():
            handler = table.get(name)
            if handler is None:
                raise mapping.refuse(f"{key}.{name}", setting, f"not {what} the engine can map; it maps "
                                                               f"{', '.join(sorted(table))}")
            handler(mapping, f"{key}.{name}", setting)

    return handle


def _check_processes(mapping: Mapping, config: dict[str, Any]) -> None:
    if mapping.launcher:
        settings = ", ".join(f"{key}: {_show(value)}" for key, value in mapping.launcher.items())
        mapping.lines.append(f"{settings} -> the launcher's settings (num_processes checked against WORLD_SIZE)")
    processes, machines = config.get("num_processes"), config.get("num_machines", 1)  # ints: checked by _launcher
    if processes is None:
        return
    if processes < 1 or machines < 1 or processes % machines:
        raise mapping.refuse("num_processes", processes, f"expected a positive multiple of num_machines ({machines})")
    started = os.environ.get("WORLD_SIZE")
    if started is not None and started.isdigit() and int(started) != processes:
        raise mapping.refuse("num_processes", processes, f"the launcher started {started} processes; launch "
                                                         f"{processes} or change the file")
    per_node = processes // machines
    nodes = f"--nnodes {machines} --node-rank <0..{machines - 1}> --rdzv-backend c10d --rdzv-endpoint HOST:PORT " \
        if machines > 1 else ""
    mapping.lines.append(f"launch with: torchrun {nodes}--nproc-per-node {per_node} -m engine train ...")


_TOP_LEVEL: dict[str, Callable[..., None]] = {
    **{key: _launcher(int, expected="a whole number") for key in ("num_processes", "num_machines", "machine_rank")},
    "main_process_ip": _launcher(str, type(None), expected="a host name or IP address"),
    "main_process_port": _launcher(int, type(None), expected="a port number"),
    "rdzv_backend": _launcher(str, expected="a rendezvous backend name, e.g. 'static' or 'c10d'"),
    "same_network": _launcher(bool, expected="true or false"),
    "gpu_ids": _launcher(str, int, expected="'all' or GPU numbers, e.g. '0,1'"),
    "main_training_function": _launcher(str, expected="a function name"),
    "enable_cpu_affinity": _launcher(bool, expected="true or false"),
    "compute_environment": accept_only("LOCAL_MACHINE", meaning="local processes (torchrun)"),
    "debug": accept_only(False, meaning="no Accelerate debug checks"),
    "downcast_bf16": accept_only("no", False, meaning="no TPU downcasting"),
    "tpu_env": accept_only([], meaning="no TPU"),
    "tpu_use_cluster": accept_only(False, meaning="no TPU"),
    "tpu_use_sudo": accept_only(False, meaning="no TPU"),
    "dynamo_config": accept_only({}, None, meaning="no torch.compile"),
    "mixed_precision": _mixed_precision,
    "use_cpu": _use_cpu,
    # the tables below are defined after this one
    "fsdp_config": _nested("fsdp", "FSDP", "an FSDP setting", lambda: FSDP_CONFIG),
    "deepspeed_config": _nested("deepspeed", "DEEPSPEED", "a DeepSpeed setting", lambda: _DEEPSPEED),
}


def _section_key(key: str, convert: Callable[[Mapping, str, Any], Any]) -> Callable[..., None]:
    def handle(mapping: Mapping, accelerate_key: str, value: Any) -> None:
        mapping.set(key, convert(mapping, accelerate_key, value), accelerate_key, value)

    return handle


def _boolean(mapping: Mapping, key: str, value: Any) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise mapping.refuse(key, value, "expected true or false")
    return value


def _fsdp_wrap(mapping: Mapping, key: str, value: Any) -> None:
    if value == "TRANSFORMER_BASED_WRAP":
        mapping.note(key, value, "each transformer block sharded (fsdp.wrap_modules, default: the model's "
                                 "_no_split_modules)")
        return
    raise mapping.refuse(key, value, "the engine shards transformer blocks (TRANSFORMER_BASED_WRAP); set "
                                     "fsdp_transformer_layer_cls_to_wrap to name them")


def _fsdp_sharding(mapping: Mapping, key: str, value: Any) -> None:
    number = SHARDING.get(value) if isinstance(value, str) else value if _is_int(value) else None
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
    if not _is_int(value) or value not in (1, 2):
        raise mapping.refuse(key, value, "expected 1 or 2")
    mapping.note(key, value, "FSDP2 (fully_shard) with the same sharding" + (" (FSDP1 settings mapped)" if value == 1
                                                                               else ""))


# Accelerate's fsdp_config keys and their handlers (engine.trainer_args maps TrainingArguments.fsdp_config through them)
FSDP_CONFIG: dict[str, Callable[..., None]] = {
    "fsdp_auto_wrap_policy": _fsdp_wrap,
    "fsdp_transformer_layer_cls_to_wrap": _section_key("fsdp.wrap_modules", _fsdp_layers),
    "fsdp_sharding_strategy": _fsdp_sharding,
    "fsdp_reshard_after_forward": _section_key("fsdp.reshard_after_forward", _boolean),
    "fsdp_offload_params": _section_key("fsdp.cpu_offload", _boolean),
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


def _zero_stage(mapping: Mapping, key: str, value: Any) -> int:
    if not _is_int(value) or value not in (0, 1, 2, 3):
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


def _same_as_train(train_key: str) -> Callable[..., None]:
    """A DeepSpeed value that the engine takes from [train] (both must agree, so it sets it)."""

    def handle(mapping: Mapping, key: str, value: Any) -> None:
        try:
            checked = check_value(TrainConfig, train_key, value, f"train.{train_key}")
        except ConfigError as exc:
            raise mapping.refuse(key, value, f"sets {exc}") from None
        mapping.set(f"train.{train_key}", checked, key, value)

    return handle


def _multinode_launcher(mapping: Mapping, key: str, value: Any) -> None:
    _check_type(mapping, key, value, (str,), "a launcher name, e.g. 'standard'")
    mapping.note(key, value, "launcher setting (torchrun or the deepspeed launcher)")


_DEEPSPEED: dict[str, Callable[..., None]] = {
    "deepspeed_config_file": _section_key("deepspeed.config", _config_file),
    "zero_stage": _section_key("deepspeed.zero_stage", _zero_stage),
    "offload_optimizer_device": _section_key("deepspeed.offload_optimizer", _offload_device),
    "offload_param_device": _section_key("deepspeed.offload_param", _offload_device),
    "zero3_init_flag": lambda mapping, key, value: mapping.note(
        key, _boolean(mapping, key, value), "under ZeRO-3 the model is always built inside deepspeed.zero.Init"),
    "zero3_save_16bit_model": lambda mapping, key, value: mapping.note(
        key, _boolean(mapping, key, value), "the final model is always consolidated to full HF weights"),
    "gradient_accumulation_steps": _same_as_train("gradient_accumulation_steps"),
    "gradient_clipping": _same_as_train("max_grad_norm"),
    "deepspeed_multinode_launcher": _multinode_launcher,
}
