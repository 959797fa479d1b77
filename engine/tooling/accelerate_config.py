"""``--accelerate-config FILE.yaml``: an Accelerate config file mapped onto the engine's strategies.

Teams keep their distributed settings in the YAML ``accelerate config`` writes. This module
reads it and maps every key onto the engine: ``distributed_type`` enables the strategy plugin
(MULTI_GPU / MULTI_CPU -> ``ddp``, FSDP -> ``fsdp``, DEEPSPEED -> ``deepspeed``, NO -> none),
``fsdp_config`` / ``deepspeed_config`` fill that plugin's section, ``mixed_precision`` and
``use_cpu`` the ``[train]`` keys. Launcher keys (``num_processes``, ``num_machines``, ...)
describe the torchrun command, and are checked against the processes actually started. A key
the engine cannot honour is refused by name; nothing is skipped. ``engine plan`` shows each
mapping. Values also set by the run file must agree; ``--set`` still overrides both. The
handlers' helpers, and the tables of the strategies' settings, are :mod:`engine.kit.mappings`.

Every value read is checked (a wrong type is refused naming its key path and what it takes), and
the file is bounded before it is built: its size, its nesting, and what its aliases expand to.
Values under a credential's name are never shown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from engine.config import MAX_NESTING
from engine.errors import ConfigError
from engine.kit.mappings import (Mapping, accept_only, boolean, check_type, one_line, plugin_mappings, read_small_text,
                                 show_setting, unavailable)

# What a first-party plugin answers for `--accelerate-config` (its hook accelerate_mappings): asked when
# installed, else named with its extra.
ACCELERATE_KEYS = {"fsdp_config": "fsdp", "deepspeed_config": "deepspeed"}  # Accelerate config key -> plugin
ACCELERATE_STRATEGIES = {"MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}
STRATEGY_PLUGINS = {**ACCELERATE_STRATEGIES, "NO": None}  # distributed_type -> the strategy plugin it enables
MAX_CONFIG_BYTES = 1 << 20
MAX_VALUES = 10_000  # once aliases are expanded; `accelerate config` writes a few dozen


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
        handler = _TOP_LEVEL.get(key) or _plugin_key(key)
        if handler is None:
            known = sorted(["distributed_type", *_TOP_LEVEL, *ACCELERATE_KEYS])
            raise mapping.refuse(key, value, f"not an Accelerate key the engine can map; it maps {', '.join(known)}")
        handler(mapping, key, value, plugin)
    _check_processes(mapping, config)
    return mapping


def apply(raw: dict[str, Any], path: str | Path) -> tuple[dict[str, Any], Mapping]:
    """``raw`` (a run-file mapping) with ``path``'s Accelerate settings added; values the run file
    sets differently are refused naming both."""
    import copy

    from engine.config import enabled_plugins

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
            raise ConfigError(f"{dotted} = {show_setting(table[key])} in the run file, but --accelerate-config {path} "
                              f"sets {show_setting(value)}; remove one")
        table[key] = value
    return raw, mapping


# ---------------------------------------------------------------------------- keys


def _launcher(*types: type, expected: str) -> Callable[..., None]:
    """A setting of the launcher (torchrun): checked, shown, and num_processes compared with the job."""

    def handle(mapping: Mapping, key: str, value: Any, plugin: str | None) -> None:
        check_type(mapping, key, value, types, expected)
        mapping.launcher[key] = value

    return handle



def _mixed_precision(mapping: Mapping, key: str, value: Any, plugin: str | None) -> None:
    if value is False:  # YAML reads an unquoted `no` as false
        value = "no"
    if value not in ("no", "bf16", "fp16"):
        raise mapping.refuse(key, value, "the engine trains in 'no', 'bf16' or 'fp16'")
    mapping.set("train.bf16", value == "bf16", key, value)
    mapping.set("train.fp16", value == "fp16", key, value)


def _use_cpu(mapping: Mapping, key: str, value: Any, plugin: str | None) -> None:
    mapping.set("train.use_cpu", boolean(mapping, key, value), key, value)


def _check_processes(mapping: Mapping, config: dict[str, Any]) -> None:
    if mapping.launcher:
        settings = ", ".join(f"{key}: {show_setting(value)}" for key, value in mapping.launcher.items())
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
}


def _plugin_key(key: str) -> Callable[..., None] | None:
    """The handler of a key a plugin maps (hook accelerate_mappings; the catalogue names the plugin);
    without that plugin installed, one that refuses any setting under the key."""
    provider = ACCELERATE_KEYS.get(key)
    if provider is None:
        return None
    handler = plugin_mappings(provider, "accelerate_mappings").get(key)
    if handler is not None:
        return handler

    def not_installed(mapping: Mapping, key: str, value: Any, enabled: str | None) -> None:
        if value not in (None, {}):  # `accelerate config` writes fsdp_config: {} for the other types
            raise mapping.refuse(key, "{...}", f"mapped by plugin {provider}, {unavailable(provider)}")

    return not_installed
