"""Run configuration: typed sections, validation, TOML run files and ``--set`` overrides.

A run is described by one mapping (a TOML file, a Python dict, or the embedded default)::

    plugins = ["neftune"]      # enabled plugins, by entry-point name
    required_plugins = ["neftune>=0.1"]   # optional: versions this run needs, checked before loading
    [train]                    # TrainConfig: model, optimizer, loop
    [data]                     # DataConfig: tokenizer and datasets
    [neftune]                  # one section per enabled plugin, validated by its schema

Every section is a dataclass. :func:`from_mapping` checks a mapping against one: unknown keys
and wrong types are :class:`~engine.errors.ConfigError` naming the key path and the expected
type. Plugins declare their own section the same way (see ``hookspecs.plugin_options``).

``[train]`` and ``[data]`` hold the keys the kernel reads (:class:`KernelTrainConfig`) and those each
builtin declares beside its code: its plugin object (module or class) names a dataclass of
:func:`option` fields as ``TRAIN_OPTIONS`` or ``DATA_OPTIONS`` (:data:`SECTION_OPTIONS`), e.g.
``TRAIN_OPTIONS = FlowOptions`` in engine/builtin/flow.py. ``TrainConfig`` and ``DataConfig`` are
assembled from them on first use; a builtin module reads them under ``TYPE_CHECKING`` only.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Literal, Union

import tomllib

from .errors import ConfigError, PluginError
from .util import decode_utf8, mask_secrets

CORE_SECTIONS = ("train", "data")
TOP_LEVEL_KEYS = ("plugins", "required_plugins")
# [train] keys that say how to start rather than what to train: not part of the run's identity,
# never listed as changes on resume
START_KEYS = ("resume_from_checkpoint", "overwrite_output_dir", "reset_optimizer", "output_dir")


def option(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
           min: float | None = None, max: float | None = None, below: float | None = None,
           nonempty: bool = False, secret: bool = False, shared: bool = False):
    """A dataclass field with a help text (shown by ``engine plan`` and the docs) and its valid range.

    ``min`` / ``max`` bound a number inclusively, ``below`` exclusively from above; ``nonempty``
    refuses an empty string. A value outside is refused naming its key and the range
    ("train.adam_beta1: expected float in [0, 1), got 1.5"). Floats must be finite (no nan/inf).
    ``secret`` marks a credential (a token): :func:`to_mapping` shows a set value as
    :data:`SECRET_MASK`, so it never reaches the plan, ``hyperparams.json``, checkpoints or trackers.
    A builtin's ``[train]`` option is refused while the run blocks that builtin (nothing would read it)
    unless it is ``shared``: other plugins read it too (one answering the same hook in its place).

    Example::

        rank: int = option(128, help="projection rank", min=1)
        ratio: float = option(0.5, help="share of the tokens", min=0, max=1)
        token: str | None = option(None, help="access token", secret=True)
    """
    bounds = {"min": min, "max": max, "below": below, "nonempty": nonempty, "secret": secret, "shared": shared}
    return field(default=default, default_factory=default_factory,
                 metadata={"help": help, **{k: v for k, v in bounds.items() if v is not None and v is not False}})


@dataclass
class KernelTrainConfig:
    """The ``[train]`` keys the kernel itself reads; :data:`TrainConfig` adds the builtins' keys."""

    model: str = option("tiny-llama", nonempty=True, help=(
        "builtin config name (tiny-llama, small-llama), a local HF folder (from_pretrained), "
        "a config .json file (random weights) or 'package.module:function' returning an nn.Module"))
    output_dir: str = option("output", nonempty=True, help="where metrics, checkpoints and the final model go")
    seed: int = option(42, min=0, max=2**32 - 1, help="seed for weights, data order and dropout")
    max_steps: int = option(-1, min=-1, help="total optimizer steps; > 0 overrides num_train_epochs")
    num_train_epochs: float = option(3.0, min=0, help="epochs to train when max_steps <= 0")
    per_device_train_batch_size: int = option(8, min=1, help="micro-batch size per device")
    gradient_accumulation_steps: int = option(1, min=1, help="micro-batches per optimizer step")
    optim: str = option("adamw_torch", nonempty=True, help="optimizer name, as TrainingArguments.optim")
    lr_scheduler_type: str = option("linear", help=(
        "linear, cosine, constant, constant_with_warmup, polynomial or a plugin's name"))
    warmup_steps: int = option(0, min=0, help="linear warmup steps; > 0 overrides warmup_ratio")
    warmup_ratio: float = option(0.0, min=0, max=1, help="warmup as a fraction of the total steps")
    bf16: bool = option(False, help="bfloat16 autocast (CPU or GPU)")
    fp16: bool = option(False, help="float16 autocast with loss scaling (GPU only)")
    use_cpu: bool = option(False, help="train on the CPU even when a GPU is present")
    strategy: str = option("auto", help=(
        "distributed strategy name; 'auto' takes the one an enabled plugin provides, else 'single'"))
    eval_on_start: bool = option(False, help="evaluate once before the first step (a sanity check)")
    save_only_model: bool = option(False, help=(
        "checkpoints hold the model and trainer_state.json only (no optimizer, scheduler or RNG state): smaller, "
        "and load_best_model_at_end still works, but they cannot be resumed"))
    save_final_model: bool = option(True, help=(
        "save the final model (HF layout) and tokenizer to output_dir when training ends"))
    resume_from_checkpoint: bool | str | None = option(None, help=(
        "true: this run's newest checkpoint in output_dir; a path: that checkpoint; a name a plugin "
        "fetches, e.g. 'hub' (engine-hub: the repo's last-checkpoint/)"))
    overwrite_output_dir: bool = option(False, help=(
        "a fresh run into an output_dir holding another run's checkpoints or final model removes "
        "them first (only what the engine wrote) instead of refusing to start"))
    ignore_data_skip: bool = option(False, help=(
        "on resume: start the resumed epoch's data from its beginning instead of skipping the batches already "
        "trained on (faster to start, not the uninterrupted run's data)"))
    on_nonfinite: Literal["stop", "skip"] = option("stop", help=(
        "a nan/inf loss, gradient norm or weight: 'stop' the run (exit status 3, nothing "
        "non-finite saved) or 'skip' the update (costs one host sync per step)"))
    max_skipped_in_a_row: int = option(10, min=1, help=(
        "on_nonfinite = 'skip': stop the run after this many skipped steps in a row"))
    label_names: list[str] | None = option(None, help=(
        "the batch keys holding the labels that evaluation and predict return as label_ids (several: a tuple) "
        "(default, as Trainer: the model's forward arguments named *label*; start_positions and end_positions "
        "for question answering)"))
    compute_metrics: str | None = option(None, help=(
        "'package.module:function' taking an EvalPrediction and returning a dict of floats"))
    use_cache: bool = option(False, help=(
        "the model's config.use_cache while training and in the saved model (as Trainer sets it): the key/value "
        "cache only costs memory in a training forward"))
    data_seed: int | None = option(None, min=0, max=2**32 - 1, help=(
        "seed of the data order (default: seed): the same batches whatever the model's seed"))
    include_num_input_tokens_seen: bool | Literal["no", "all", "non_padding"] = option("no", help=(
        "log num_input_tokens_seen: every input token ('all' or true) or those the attention mask keeps "
        "('non_padding')"))
    full_determinism: bool = option(False, help=(
        "torch's deterministic algorithms and cuDNN settings for the whole process (slower; as Trainer's)"))
    tf32: bool | None = option(None, help="allow TF32 matmuls and convolutions on Ampere+ GPUs (default: torch's)")
    log_level: Literal["passive", "debug", "info", "warning", "error", "critical"] = option("passive", help=(
        "log level of the main process for the engine and transformers loggers ('passive': "
        "engine info, transformers' own default)"))
    log_level_replica: Literal["passive", "debug", "info", "warning", "error", "critical"] = option(
        "warning", help="log level of the other processes")
    log_on_each_node: bool = option(True, help=(
        "multi-node: each node's local rank 0 logs at log_level (false: only global rank 0)"))
    run_name: str | None = option(None, help="a name for trackers (default: output_dir's name)")


# ---------------------------------------------------------------------------- the core sections

# the attribute of a builtin's plugin object (module or class) naming its options for a core section
SECTION_OPTIONS = {"train": "TRAIN_OPTIONS", "data": "DATA_OPTIONS"}
_ASSEMBLED = {
    "TrainConfig": ("train", KernelTrainConfig, "``[train]``: the model, the optimizer and the loop. Names follow "
                                                "``TrainingArguments``."),
    "DataConfig": ("data", None, "``[data]``: the tokenizer and the datasets."),
}
_assembling: set[str] = set()


def builtin_options(section: str) -> dict[str, type]:
    """The option dataclasses the builtins declare for core ``section`` ("train", "data"), by builtin name,
    in the builtins' order."""
    from .discovery import builtin_specs, load_builtin

    declared = {name: getattr(load_builtin(spec), SECTION_OPTIONS[section], None)
                for name, spec in builtin_specs().items()}
    return {name: options for name, options in declared.items() if options is not None}


def _assemble(name: str, section: str, kernel: type | None, doc: str) -> type:
    """One dataclass holding the fields of ``kernel`` and of every builtin's options for ``section``."""
    parts = {"the kernel": kernel} if kernel else {}
    parts.update(builtin_options(section))
    owners: dict[str, str] = {}
    fields = []
    for owner, options in parts.items():
        hints = typing.get_type_hints(options)
        for f in dataclasses.fields(options):
            if f.name in owners:
                raise PluginError(f"{section}.{f.name} is declared by {owners[f.name]} and by {owner}; keep one")
            owners[f.name] = owner
            fields.append((f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory,
                                                        metadata=f.metadata)))
    return dataclasses.make_dataclass(name, fields, namespace={"__module__": __name__, "__doc__": doc})


def __getattr__(name: str) -> Any:
    """``TrainConfig`` and ``DataConfig``, assembled on first use (see :data:`SECTION_OPTIONS`)."""
    if name not in _ASSEMBLED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return core_config(name)


def core_config(name: str) -> type:
    """``TrainConfig`` or ``DataConfig`` (by that name): assembled once, then the same class."""
    if name in globals():
        return globals()[name]
    if name in _assembling:  # a builtin module read it while it was being imported to assemble it
        raise ImportError(f"engine.config.{name} is assembled from the builtins' options: a builtin module "
                          "must not read it when it is imported (import it under TYPE_CHECKING)")
    _assembling.add(name)
    try:
        globals()[name] = _assemble(name, *_ASSEMBLED[name])
    finally:
        _assembling.discard(name)
    return globals()[name]


# ---------------------------------------------------------------------------- validation


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(item)}"
    if origin is dict:
        return "table"
    if tp is type(None):
        return "none"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` checked (and int->float widened) against type ``tp``, else raise."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp) or (Any,)
            return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return from_mapping(tp, value, path)
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{path}: expected a finite float, got {value}")
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")


def from_mapping(cls: type, data: dict[str, Any], path: str) -> Any:
    """Build dataclass ``cls`` from ``data``; ``path`` prefixes key names in errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table, got {_describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"{path}.{key}: unknown key{hint}")
    kwargs = {key: _convert(value, hints[key], f"{path}.{key}") for key, value in data.items()}
    for key, value in kwargs.items():
        _check_bounds(fields[key].metadata, value, hints[key], f"{path}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field without default was not given
        raise ConfigError(f"{path}: {exc}") from None


def check_value(cls: type, key: str, value: Any, path: str) -> Any:
    """One value for field ``key`` of dataclass ``cls``, converted and range-checked as a run file's
    value is (ints widen to float); a ConfigError naming ``path`` otherwise."""
    option = {f.name: f for f in dataclasses.fields(cls)}[key]
    tp = typing.get_type_hints(cls)[key]
    value = _convert(value, tp, path)
    _check_bounds(option.metadata, value, tp, path)
    return value


def _check_bounds(metadata: Any, value: Any, tp: Any, path: str) -> None:
    """Refuse ``value`` outside the range its :func:`option` declares."""
    if metadata.get("nonempty") and value == "":
        raise ConfigError(f"{path}: expected a non-empty string, got ''")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    low, high, below = metadata.get("min"), metadata.get("max"), metadata.get("below")
    if (low is None or value >= low) and (high is None or value <= high) and (below is None or value < below):
        return
    kind = "int" if isinstance(value, int) else "float"
    if low is not None and (high is not None or below is not None):
        expected = f"{kind} in [{low}, {high}]" if high is not None else f"{kind} in [{low}, {below})"
    elif low is not None:
        expected = f"{kind} >= {low}"
    else:
        expected = f"{kind} <= {high}" if high is not None else f"{kind} < {below}"
    raise ConfigError(f"{path}: expected {expected}, got {value}")


SECRET_MASK = "***"


def to_mapping(instance: Any) -> dict[str, Any]:
    """The dataclass as a plain dict (the inverse of :func:`from_mapping`), secrets masked: options
    declared ``secret`` and credentials by their name inside tables (a DeepSpeed config's ``api_key``)."""
    mapping = dataclasses.asdict(instance)
    for f in dataclasses.fields(instance):
        if f.metadata.get("secret") and mapping[f.name] is not None:
            mapping[f.name] = SECRET_MASK
        else:
            mapping[f.name] = mask_secrets(mapping[f.name], SECRET_MASK)
    return mapping


# ---------------------------------------------------------------------------- run files


MAX_RUN_FILE_BYTES = 1 << 20


def read_run_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML run file; a missing, special, oversized or non-UTF-8 file or a syntax error is a ConfigError.

    A UTF-8 byte-order mark (as some Windows editors write) is accepted.
    """
    path = Path(path)
    try:
        if not path.is_file():
            what = "a folder" if path.is_dir() else "not a regular file" if path.exists() else None
            if what is None:
                raise ConfigError(f"run file not found: {path}")
            raise ConfigError(f"run file {path} is {what}; name a .toml file")
        size = path.stat().st_size
        if size > MAX_RUN_FILE_BYTES:
            raise ConfigError(f"run file {path} is {size:,} bytes, more than a run file's {MAX_RUN_FILE_BYTES:,}: "
                              "is it the right file?")
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read run file {path}: {exc.strerror}") from None
    text = decode_utf8(data, f"run file {path}")
    try:
        mapping = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML syntax error: {exc}") from None
    except RecursionError:  # the parser recurses per nesting level
        mapping = None
    check_nesting(mapping, f"run file {path}")
    return mapping


MAX_NESTING = 32  # levels of tables and arrays in a run: far more than any real config has


def check_nesting(value: Any, where: str) -> None:
    """Refuse a value nested deeper than :data:`MAX_NESTING` (``None``: one that was too deep to parse),
    before code that walks it recursively overflows the stack."""
    level = [value]
    for _ in range(MAX_NESTING + 1):
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            break
    if value is None or level:
        raise ConfigError(f"{where} nests tables or arrays more than {MAX_NESTING} levels deep")


def default_run_mapping() -> dict[str, Any]:
    """The embedded default run (``engine train`` without a run file)."""
    from importlib import resources

    return tomllib.loads(resources.files("engine").joinpath("default_run.toml").read_text(encoding="utf-8"))


def parse_value(text: str) -> Any:
    """A ``--set`` value: any TOML value (1e-4, true, [1, 2], "x"), else the bare string."""
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        value = None
    check_nesting(value, f"--set value {text[:40]!r}")
    return value


def apply_overrides(raw: dict[str, Any], sets: list[str] = (), plugin_edits: list[str] = (),
                    blockable: Collection[str] = ()) -> dict[str, Any]:
    """Apply ``--set a.b=v`` and ``--plugins +x,-y`` (or ``--plugins x,y`` to replace) to ``raw``.

    ``-x`` of a ``blockable`` name (a builtin) blocks it (``"-x"`` in the list), ``+x`` lifts the
    block. Returns a new mapping; ``raw`` is not modified.
    """
    raw = _deep_copy(raw)
    if plugin_edits:
        enabled_plugins(raw)  # an edit of a malformed list would edit its characters
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.learning_rate=1e-4")
        parts = key.strip().split(".")
        if len(parts) > MAX_NESTING:
            raise ConfigError(f"--set {item[:60]!r}...: a key of more than {MAX_NESTING} parts")
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[:depth + 1])} is not a table")
            node = child
        node[parts[-1]] = parse_value(text.strip())
    for edit in plugin_edits:
        names = [n.strip() for n in edit.split(",") if n.strip()]
        if names and all(n[0] not in "+-" for n in names):
            for name in enabled_plugins(raw):
                if name not in names:
                    raw.pop(name, None)
            raw["plugins"] = names
            continue
        current = list(raw.get("plugins", []))
        before = list(current)
        for name in names:
            if name[0] == "+" and name[1:] in blockable and f"-{name[1:]}" in current:
                current.remove(f"-{name[1:]}")  # the builtin is on again
            elif name[0] == "+":
                if name[1:] not in current:
                    current.append(name[1:])
            elif name[0] == "-" and name[1:] in blockable:
                if name not in current:
                    current.append(name)  # blocks the builtin
            elif name[0] == "-":
                if name[1:] not in current:
                    raise ConfigError(f"--plugins {name}: {name[1:]!r} is not enabled (enabled: {current})")
                current.remove(name[1:])
            else:
                raise ConfigError(f"--plugins {edit!r}: mix of names with and without +/-; "
                                  "use +name,-name to edit or a plain list to replace")
        raw["plugins"] = current
        for name in before:
            if name not in current:
                raw.pop(name, None)  # a plugin switched off takes its options section with it
    enabled_plugins(raw)  # e.g. --set plugins=3
    return raw


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def enabled_plugins(raw: dict[str, Any]) -> list[str]:
    """The ``plugins`` list of a raw run mapping, checked."""
    names = raw.get("plugins", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"plugins: expected list of str, got {_describe(names)}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"plugins: {', '.join(duplicates)} listed twice")
    return list(names)


def required_plugins(raw: dict[str, Any]) -> list[str]:
    """The ``required_plugins`` list of a raw run mapping, checked for shape (the versions are
    checked against what is installed by :func:`engine.plugins.check_required_plugins`)."""
    names = raw.get("required_plugins", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"required_plugins: expected list of str like [\"galore>=0.2\"], got {_describe(names)}")
    return list(names)


@dataclass
class RunConfig:
    """The composed, validated run: core sections plus each enabled plugin's options."""

    plugins: list[str]
    train: TrainConfig
    data: DataConfig
    sections: dict[str, Any] = field(default_factory=dict)  # plugin name -> options dataclass
    required_plugins: list[str] = field(default_factory=list)  # ["galore>=0.2"]: checked before plugins load

    def section(self, plugin: str) -> Any:
        """The validated options of ``plugin`` (its ``plugin_options`` dataclass instance)."""
        try:
            return self.sections[plugin]
        except KeyError:
            raise ConfigError(f"plugin {plugin!r} declares no options or is not enabled") from None

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plugins": list(self.plugins)}
        if self.required_plugins:  # only when set: older runs' config fingerprints stay the same
            out["required_plugins"] = list(self.required_plugins)
        out.update(train=to_mapping(self.train), data=to_mapping(self.data))
        for name, options in self.sections.items():
            out[name] = to_mapping(options)
        return out


def compose(raw: dict[str, Any], schemas: dict[str, type | None]) -> RunConfig:
    """Validate a raw run mapping. ``schemas`` maps each enabled plugin to its options class."""
    plugins = enabled_plugins(raw)
    for key, value in raw.items():
        if key in TOP_LEVEL_KEYS or key in CORE_SECTIONS:
            continue
        if f"-{key}" in plugins:
            first = next(iter(value), None) if isinstance(value, dict) else None
            where = f"{key}.{first}" if first else f"[{key}]"
            raise ConfigError(f"{where}: plugin {key!r} is blocked ('-{key}' in plugins), so its options would do "
                              "nothing; remove them, or the block")
        if key not in plugins:
            known = ", ".join([*TOP_LEVEL_KEYS, *CORE_SECTIONS, *plugins])
            raise ConfigError(f"{key}: unknown section; not a core section or an enabled plugin "
                              f"(known: {known}); enable the plugin with plugins = [..., {key!r}]")
        if schemas.get(key) is None:
            raise ConfigError(f"[{key}]: plugin {key!r} takes no options")
    sections = {}
    for name in plugins:
        schema = schemas.get(name)
        if schema is not None:
            sections[name] = from_mapping(schema, raw.get(name, {}), name)
    return RunConfig(
        plugins=plugins,
        required_plugins=required_plugins(raw),
        train=from_mapping(core_config("TrainConfig"), raw.get("train", {}), "train"),
        data=from_mapping(core_config("DataConfig"), raw.get("data", {}), "data"),
        sections=sections,
    )


# ---------------------------------------------------------------------------- TOML output


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(key: str) -> str:
    """A TOML key: bare when it can be, else quoted."""
    return key if _BARE_KEY.fullmatch(key) else toml_value(key)


def toml_value(value: Any) -> str:
    """One value as TOML (strings with JSON's escapes, which are TOML's; inf and nan as TOML spells them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def to_toml(mapping: dict[str, Any], comments: dict[str, dict[str, str]] | None = None) -> str:
    """Write a run mapping as TOML. Unset (None) values appear as comments."""
    comments = comments or {}
    lines = []
    for key, value in mapping.items():
        if not isinstance(value, dict):
            lines.append(f"{toml_key(key)} = {toml_value(value)}")
    for section, values in mapping.items():
        if not isinstance(values, dict):
            continue
        lines.append(f"\n[{section}]")
        for key, value in values.items():
            note = comments.get(section, {}).get(key)
            suffix = f"  # {note}" if note else ""
            if value is None:
                lines.append(f"# {toml_key(key)} = (unset){suffix}")
            else:
                lines.append(f"{toml_key(key)} = {toml_value(value)}{suffix}")
    return "\n".join(lines) + "\n"
