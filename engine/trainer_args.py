"""Every ``transformers.TrainingArguments`` field, answered: what the engine does with it.

One :class:`Answer` per field, of five kinds:

* ``accepted``: a ``[train]`` key with Trainer's meaning (the same name, or the engine's name for it);
* ``plugin``: provided by a named plugin, the value going to a key of that plugin's section;
* ``builtin``: the engine always behaves as Trainer's default does; there is no switch;
* ``refused``: no counterpart, with the reason and what to use instead;
* ``not yet``: no counterpart yet (a plain Trainer feature the engine is still to implement).

:data:`FIELDS` covers the installed transformers' fields exactly (a test walks
``dataclasses.fields(TrainingArguments)``, so a new release shows its new names at once);
:data:`SEQ2SEQ_FIELDS` those ``Seq2SeqTrainingArguments`` adds; :data:`LEGACY` answers names of
older releases found in older dumps. ``engine migrate``
(:mod:`engine.migration`) converts a ``TrainingArguments`` dump with it, and
``docs/generate_trainer_arguments.py`` renders it into ``docs/trainer-arguments.md``.

A converter ``convert(conversion, name, value)`` writes a value through the
:class:`Conversion` it is given: ``set("section.key", value)`` (only the keys its answer declares),
``enable(plugin)``, ``lose(what, reason)`` for part of a value that has no counterpart, or raises
:class:`~engine.errors.ConfigError` to drop the whole value with that reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import accelerate_config
from .catalogue import FIRST_PARTY, UNSUPPORTED_OPTIMIZERS, provider_of
from .config import SECRET_MASK, check_nesting
from .errors import ConfigError
from .util import is_secret_name, mask_secrets, read_small_text

ACCEPTED, PLUGIN, BUILTIN, REFUSED, NOT_YET = "accepted", "plugin", "builtin", "refused", "not yet"
KINDS = (ACCEPTED, PLUGIN, BUILTIN, REFUSED, NOT_YET)
TRANSFORMERS_VERSION = "5.24"  # FIELDS answers this release's TrainingArguments

TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")  # report_to names the engine has a plugin for
STRATEGIES = ("deepspeed", "fsdp", "ddp")  # one per run; when several are asked for, the first wins (as Trainer)
# what enables each plugin under Trainer: said when an option of a plugin that is not enabled is dropped
ENABLED_BY = {
    "hub": "push_to_hub = true", "liger": "use_liger_kernel = true", "neftune": "neftune_noise_alpha",
    "fsdp": "fsdp", "deepspeed": "deepspeed", "ddp": "a run on several processes without fsdp or deepspeed",
    **{tracker: f"report_to {tracker!r}" for tracker in TRACKERS},
}
LIGER_KERNELS = ("rope", "rms_norm", "swiglu", "geglu", "layer_norm", "cross_entropy", "fused_linear_cross_entropy")
FSDP_KEYS = ("fsdp.wrap_modules", "fsdp.reshard_after_forward", "fsdp.cpu_offload", "fsdp.state_dict_type",
             "fsdp.sharding")


@dataclass(frozen=True)
class Answer:
    """What the engine does with one ``TrainingArguments`` field."""

    kind: str
    keys: tuple[str, ...] = ()  # run-file keys ("section.key") a value may be written to
    plugins: tuple[str, ...] = ()  # the plugins that provide it
    note: str = ""  # how it maps; for the other kinds why not, and what to use instead
    convert: Callable[..., None] | None = None  # default: the value (unless None) to keys[0]
    legacy_defaults: tuple[Any, ...] = ()  # LEGACY only: the values that were that release's default

    def describe(self, name: str) -> str:
        """One line: the answer, for reports, error messages and the docs."""
        if self.kind == ACCEPTED:
            train_keys = [key.split(".", 1)[1] for key in self.keys if key.startswith("train.")]
            head = "accepted as " + ", ".join(f"[train] {key}" for key in train_keys)
            if name not in train_keys:
                head += " (the engine's name)"
        elif self.kind == PLUGIN:
            installs = [f"plugin {p}" + (f" ({FIRST_PARTY[p].install})" if p in FIRST_PARTY else "")
                        for p in self.plugins]
            head = "provided by " + " or ".join(installs)
            plugin_keys = [key for key in self.keys if not key.startswith("train.")]
            if plugin_keys and len(self.keys) <= 2:
                head += " as " + ", ".join(f"[{key.split('.', 1)[0]}] {key.split('.', 1)[1]}" for key in plugin_keys)
        else:
            head = {BUILTIN: "the engine always does what Trainer's default does", REFUSED: "refused",
                    NOT_YET: "no counterpart yet"}[self.kind]
        return f"{head}: {self.note}" if self.note else head


class Conversion:
    """A ``TrainingArguments`` mapping being converted: what converters write, enable and lose."""

    @dataclass
    class Setting:
        value: Any
        field: str  # the TrainingArguments field it comes from
        at_default: bool  # that field was at Trainer's default
        note: str = ""

    def __init__(self, arguments: dict[str, Any]):
        self.arguments = arguments  # every field given, for converters that read a neighbour
        self.plugins: list[str] = []
        self.enabled_by: dict[str, str] = {}  # plugin -> the field that enabled it
        self.settings: dict[str, Conversion.Setting] = {}  # "section.key" -> setting
        self.notes: list[tuple[str, str, str]] = []  # (plugin, field, what it means there)
        self.lost: list[tuple[str, str]] = []  # (what, why): set away from Trainer's default, not converted
        self.placeholders: dict[str, tuple[str, str]] = {}  # "section.key" -> (an example, what to fill in)
        self.field_name, self.answer, self.at_default = "", Answer(REFUSED), True

    def convert(self, name: str, value: Any, answer: Answer, at_default: bool) -> None:
        self.field_name, self.answer, self.at_default = name, answer, at_default
        try:
            (answer.convert or _write)(self, name, value)
        except ConfigError as exc:
            if not at_default:
                self.lose(f"{name} = {show(value)}", str(exc))

    def set(self, key: str, value: Any, note: str = "") -> None:
        if key not in self.answer.keys:  # the table's schema test checks only declared keys
            raise RuntimeError(f"the converter of {self.field_name} writes {key}, which its answer does not declare")
        existing = self.settings.get(key)
        if existing is not None and not existing.at_default and existing.value != value:
            if self.at_default:
                return  # a value set away from Trainer's default wins over a default
            raise ConfigError(f"{key} is already {show(existing.value)} from {existing.field}")
        self.settings[key] = Conversion.Setting(value, self.field_name, self.at_default, note)

    def enable(self, plugin: str) -> None:
        if plugin not in self.plugins:
            self.plugins.append(plugin)
            self.enabled_by[plugin] = self.field_name

    def note(self, plugin: str, what: str, meaning: str) -> None:
        self.notes.append((plugin, what, meaning))

    def lose(self, what: str, why: str) -> None:
        self.lost.append((what, why))

    def placeholder(self, key: str, example: str, what: str) -> None:
        self.placeholders[key] = (example, what)


def show(value: Any, limit: int = 80) -> str:
    """A value as JSON (as the dump holds it), shortened."""
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_json(text: str, what: str) -> Any:
    """``text`` parsed as JSON; malformed, or nested deeper than the engine walks, a ConfigError naming ``what``."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{what} is not JSON ({exc})") from None
    except RecursionError:  # the parser recurses once per level
        check_nesting(None, what)  # None: too deep to parse; this raises
    if value is not None:
        check_nesting(value, what)
    return value


def read_json_file(path: str, what: str) -> Any:
    """The JSON in the file ``path`` names (a DeepSpeed or FSDP config), credentials masked."""
    text = read_small_text(path, f"{what} {path}", f"name the {what} JSON file")
    return mask_secrets(load_json(text, f"{what} {path}"), SECRET_MASK)


def _flag(value: Any) -> bool:
    """A true/false field: a string ("false" is truthy) or a number is refused, not read as a switch."""
    if not isinstance(value, bool):
        raise ConfigError("expected true or false")
    return value


# ---------------------------------------------------------------------------- converters


def _write(c: Conversion, name: str, value: Any) -> None:
    if value is not None:
        c.set(c.answer.keys[0], value)


def _enable(c: Conversion, name: str, value: Any) -> None:
    if value is not None and _flag(value):
        c.enable(c.answer.plugins[0])


def _enable_with_value(c: Conversion, name: str, value: Any) -> None:
    if value is not None:
        c.enable(c.answer.plugins[0])
        c.set(c.answer.keys[0], value)


def _static_space(c: Conversion, name: str, value: Any) -> None:
    if isinstance(value, str):  # False: none; None: Trainer's default name, which the engine does not make
        c.set(c.answer.keys[0], value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < 1:
        raise ConfigError("expected a whole number of steps, or a ratio in (0, 1)")
    return int(value)


def _steps_or_ratio(c: Conversion, name: str, value: Any) -> None:
    """``logging_steps`` / ``eval_steps`` / ``save_steps``: a step count, or below 1 a ratio of the total steps."""
    if value is None:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1:
        max_steps = c.arguments.get("max_steps", -1)
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= 0:
            raise ConfigError(f"a ratio of the total steps, which depend on the data when max_steps is unset; "
                              f"set train.{name} to a step count")
        steps = math.ceil(max_steps * value)  # as Trainer's TrainerState.compute_steps
        c.set(c.answer.keys[0], steps, note=f"{value} x max_steps {max_steps}, rounded up as Trainer does")
        return
    c.set(c.answer.keys[0], _count(value))


def _warmup(c: Conversion, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError("expected a step count or a ratio in [0, 1)")
    if 0 < value < 1:
        c.set("train.warmup_ratio", float(value))
    else:
        c.set("train.warmup_steps", int(value))  # Trainer: int(warmup_steps)


def _eval_strategy(c: Conversion, name: str, value: Any) -> None:
    _write(c, name, value)
    if value not in ("no", None):  # `engine plan` refuses evaluation without data
        c.placeholder("data.eval_split", 0.1, "Trainer evaluated the eval_dataset it was given, which "
                                              "TrainingArguments does not hold: a fraction of data.train held out, "
                                              "or data.eval = a file, glob or dataset name")


def _optim(c: Conversion, name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError("expected an optimizer name, e.g. 'adamw_torch'")
    if value in UNSUPPORTED_OPTIMIZERS:
        raise ConfigError(UNSUPPORTED_OPTIMIZERS[value])
    provider = provider_of("optimizer", value)
    if provider is not None:
        c.enable(provider)
    if provider == "schedulefree":
        c.set("schedulefree.keep_scheduler", True, note="Trainer applies lr_scheduler_type on top of it")
    c.set("train.optim", value)


_BATCH_REBALANCE = ("'batch_rebalance' is refused: it deals whole batches out across processes and accumulation "
                    "steps by token count, which the engine's per-example, resumable sampler does not do")


def _sampling_strategy(c: Conversion, name: str, value: Any) -> None:
    if value == "batch_rebalance":
        raise ConfigError(_BATCH_REBALANCE)
    _write(c, name, value)


def _group_by_length(c: Conversion, name: str, value: Any) -> None:
    """The older boolean that train_sampling_strategy = 'group_by_length' replaced."""
    if _flag(value):
        c.set("train.train_sampling_strategy", "group_by_length")


def _include_inputs(c: Conversion, name: str, value: Any) -> None:
    """The older boolean that include_for_metrics replaced."""
    if _flag(value):
        c.set("train.include_for_metrics", ["inputs"])


def _json_table(c: Conversion, name: str, value: Any) -> None:
    """A dict field Trainer also takes as a JSON string (lr_scheduler_kwargs)."""
    if isinstance(value, str):
        value = load_json(value, "expected a table or a JSON object, got a string that")
        if not isinstance(value, dict):
            raise ConfigError("expected a table or a JSON object")
    _write(c, name, value)


def _report_to(c: Conversion, name: str, value: Any) -> None:
    names = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError("expected an integration name or a list of them")
    if "all" in names:  # Trainer: every installed integration; here every installed tracker plugin
        from .plugins import installed_plugins

        installed = installed_plugins()
        names = [n for n in names if n != "all"] + [t for t in TRACKERS if t in installed]
    for tracker in dict.fromkeys(names):
        if tracker in TRACKERS:
            c.enable(tracker)
        elif tracker != "none":
            c.lose(f"report_to {tracker!r}", f"no engine plugin reports to {tracker}; the tracker plugins are "
                                             f"{', '.join(TRACKERS)} (a new one implements log_metrics, docs/hooks.md)")


def _push_to_hub(c: Conversion, name: str, value: Any) -> None:
    if not _flag(value):
        return
    c.enable("hub")
    if not c.arguments.get("hub_model_id"):
        output = Path(str(c.arguments.get("output_dir") or "trainer_output")).name
        c.placeholder("hub.repo", f"user/{output}", "Trainer pushed to your user's repo named after output_dir; "
                                                      "name the repo 'user/model' (or a path or fsspec URL)")


def _secret(c: Conversion, name: str, value: Any) -> None:
    if value is not None:  # masked by now (engine.migration); to_dict()'s "<HUB_TOKEN>" is Trainer's default
        raise ConfigError("a token is never written to a run file: set HF_TOKEN where the run starts "
                          "(or hub.token, which the engine masks)")


def _logging_dir(c: Conversion, name: str, value: Any) -> None:
    output_dir = c.arguments.get("output_dir")
    if value is not None and not (output_dir and Path(str(value)).parent == Path(str(output_dir)) / "runs"):
        c.set("tensorboard.logging_dir", value)  # not the folder older Trainers named by time and host


def _liger_config(c: Conversion, name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError("expected a table of liger-kernel arguments")
    for kernel, on in value.items():
        if kernel in LIGER_KERNELS and isinstance(on, bool):
            c.set(f"liger.{kernel}", on)
        else:
            c.lose(f"liger_kernel_config.{kernel} = {show(on)}",
                   f"the liger plugin switches these kernels on or off: {', '.join(LIGER_KERNELS)}")


def _ddp_option(c: Conversion, name: str, value: Any) -> None:
    if value is not None:  # set: the Trainer run used DDP (unless fsdp or deepspeed, which win)
        c.enable("ddp")
        c.set(c.answer.keys[0], value)


def _ddp_timeout(c: Conversion, name: str, value: Any) -> None:
    for strategy in STRATEGIES:  # init_process_group's timeout under Trainer: the enabled strategy's
        c.set(f"{strategy}.timeout", value)


class _AccelerateSettings(accelerate_config.Mapping):
    """What accelerate_config's FSDP handlers make of a setting: settings, notes kept apart, and
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


def _fsdp_activation_checkpointing(mapping: accelerate_config.Mapping, key: str, value: Any) -> None:
    if value is True:  # FSDP checkpoints each wrapped block: the engine's activation checkpointing does that
        mapping.set("train.activation_checkpointing", True, key, value)
    elif value is not False:
        raise mapping.refuse(key, value, "expected true or false")


def _fsdp_reshard(mapping: accelerate_config.Mapping, key: str, value: Any) -> None:
    if isinstance(value, str):  # FSDP1: a sharding strategy's name
        accelerate_config.FSDP_CONFIG["fsdp_sharding_strategy"](mapping, key, value.upper())
    else:
        accelerate_config.FSDP_CONFIG["fsdp_reshard_after_forward"](mapping, key, value)


def _fsdp_prefetch(mapping: accelerate_config.Mapping, key: str, value: Any) -> None:
    accelerate_config.FSDP_CONFIG["fsdp_backward_prefetch"](mapping, key, value.upper() if isinstance(value, str) else value)


# fsdp_config keys by Trainer's name (transformers strips "fsdp_"): Accelerate's own handlers for the
# keys both have, these for Trainer's others
_TRAINER_FSDP: dict[str, Callable[..., None]] = {
    "cpu_offload": accelerate_config.FSDP_CONFIG["fsdp_offload_params"],
    "reshard_after_forward": _fsdp_reshard,
    "backward_prefetch": _fsdp_prefetch,
    "activation_checkpointing": _fsdp_activation_checkpointing,
    "min_num_params": accelerate_config.accept_only(0, meaning="transformer-block wrapping, no size-based policy"),
    "xla": accelerate_config.accept_only(False, meaning="no XLA"),
    "xla_fsdp_v2": accelerate_config.accept_only(False, meaning="no XLA"),
    "xla_fsdp_grad_ckpt": accelerate_config.accept_only(False, meaning="no XLA"),
    "limit_all_gathers": accelerate_config.accept_only(True, False, meaning="FSDP1's rate limiter; FSDP2 has no "
                                                                            "such setting"),
}
# what transformers' post-init adds to every fsdp_config, with or without fsdp
_FSDP_POST_INIT = {"min_num_params": 0, "xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False}
# legacy `fsdp` words -> (Accelerate key, value) for its handlers
_FSDP_WORDS = {"offload": ("fsdp_offload_params", True), "auto_wrap": ("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")}


def _apply_fsdp(c: Conversion, key: str, setting: str, value: Any) -> None:
    """One FSDP setting through accelerate_config's handler: its settings and notes into ``c``."""
    mapping = _AccelerateSettings("TrainingArguments")
    handler = _TRAINER_FSDP.get(setting) or accelerate_config.FSDP_CONFIG.get("fsdp_" + setting)
    if handler is None:
        known = sorted({*_TRAINER_FSDP, *(k[5:] for k in accelerate_config.FSDP_CONFIG)})
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


# ---------------------------------------------------------------------------- the table


def check_train_keys(train: Any) -> None:
    """A ``[train]`` key that is not one but is a ``TrainingArguments`` field is refused with this table's
    answer (where it goes, or why not), never with a near name (``save_only_model`` is not ``save_final_model``)."""
    from .config import TrainConfig

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in train if isinstance(train, dict) else ():
        answer = answer_for(key)
        if key not in known and answer is not None:
            owner = "Seq2SeqTrainingArguments" if key in SEQ2SEQ_FIELDS else "TrainingArguments"
            raise ConfigError(f"train.{key}: not a [train] key; {owner}.{key}: {answer.describe(key)}")


def accepted(*keys: str, note: str = "", convert: Callable[..., None] | None = None) -> Answer:
    """A ``[train]`` key; without ``keys``, the field's own name (filled in by :func:`_named`)."""
    return Answer(ACCEPTED, tuple(f"train.{key}" for key in keys), note=note, convert=convert)


def plugin(name: str | tuple[str, ...], *keys: str, note: str = "",
           convert: Callable[..., None] | None = None) -> Answer:
    plugins = (name,) if isinstance(name, str) else name
    return Answer(PLUGIN, tuple(k if "." in k else f"{plugins[0]}.{k}" for k in keys), plugins, note, convert)


def builtin(note: str) -> Answer:
    return Answer(BUILTIN, note=note)


def refused(note: str) -> Answer:
    return Answer(REFUSED, note=note)


def _named(table: dict[str, Answer]) -> dict[str, Answer]:
    return {name: dataclasses.replace(a, keys=(f"train.{name}",)) if a.kind == ACCEPTED and not a.keys else a
            for name, a in table.items()}


_STEP_NOTE = "below 1, a ratio of max_steps (converted to steps when max_steps is set)"
_STRATEGY_NOTE = "the engine picks nccl on GPU, gloo on CPU"
_DDP_NOTE = "a value enables the plugin (the Trainer run used DDP), unless fsdp or deepspeed is used"
_OPTIMIZER_PLUGINS = ("bnb", "galore", "apollo", "lomo", "grokadamw", "schedulefree", "torchao", "optimi")

FIELDS: dict[str, Answer] = _named({
    "output_dir": accepted(),
    "per_device_train_batch_size": accepted(),
    "num_train_epochs": accepted(),
    "max_steps": accepted(),
    "learning_rate": accepted(),
    "lr_scheduler_type": accepted(note="linear, cosine, constant, constant_with_warmup, polynomial, or a "
                                       "plugin's name (register_schedulers)"),
    "lr_scheduler_kwargs": accepted(convert=_json_table),
    "warmup_steps": accepted("warmup_steps", "warmup_ratio", convert=_warmup,
                             note="a value below 1 is a ratio: [train] warmup_ratio"),
    "optim": Answer(ACCEPTED, ("train.optim", "schedulefree.keep_scheduler"), _OPTIMIZER_PLUGINS, convert=_optim,
                    note="a name from an optimizer plugin enables it (galore_adamw -> galore, adamw_8bit -> bnb, "
                         "...); hardware-specific names are refused with what to use instead"),
    "optim_args": accepted(),
    "weight_decay": accepted(),
    "adam_beta1": accepted(),
    "adam_beta2": accepted(),
    "adam_epsilon": accepted(),
    "optim_target_modules": accepted(),
    "gradient_accumulation_steps": accepted(),
    "average_tokens_across_devices": builtin(
        "the loss is normalized by the item count of the whole global batch, on any number of processes"),
    "max_grad_norm": accepted(),
    "label_smoothing_factor": accepted(),
    "bf16": accepted(),
    "fp16": accepted(),
    "bf16_full_eval": accepted(),
    "fp16_full_eval": accepted(),
    "tf32": accepted(),
    "activation_checkpointing": accepted(),
    "activation_checkpointing_kwargs": accepted(),
    "gradient_checkpointing": accepted("activation_checkpointing"),
    "gradient_checkpointing_kwargs": accepted("activation_checkpointing_kwargs"),
    "torch_compile": accepted(),
    "torch_compile_backend": accepted(),
    "torch_compile_mode": accepted(),
    "use_liger_kernel": plugin("liger", convert=_enable, note="true enables the plugin"),
    "liger_kernel_config": plugin("liger", *LIGER_KERNELS, convert=_liger_config,
                                  note="each kernel's switch to the [liger] key of the same name"),
    "use_cache": accepted(note="set on the model's config, so the saved config.json holds it too, as under Trainer"),
    "neftune_noise_alpha": plugin("neftune", "noise_alpha", convert=_enable_with_value,
                                  note="a value enables the plugin"),
    "torch_empty_cache_steps": accepted(),
    "auto_find_batch_size": accepted(note="x 0.9 per out-of-memory error, as accelerate's helper; the retry starts "
                                          "from the run's start, so it equals a run with the batch that fit; one "
                                          "process only"),
    "logging_strategy": accepted(),
    "logging_steps": accepted(convert=_steps_or_ratio, note=_STEP_NOTE),
    "logging_first_step": accepted(),
    "log_on_each_node": accepted(),
    "logging_nan_inf_filter": refused("the engine does not average non-finite losses away: a nan/inf loss stops "
                                      "the run (exit status 3), or train.on_nonfinite = 'skip' skips the step"),
    "include_num_input_tokens_seen": accepted(),
    "log_level": accepted(),
    "log_level_replica": accepted(),
    "disable_tqdm": accepted(),
    "report_to": plugin(TRACKERS, convert=_report_to,
                        note="each of tensorboard, mlflow, wandb, trackio enables that plugin; 'all' the installed "
                             "ones; other integrations have no plugin"),
    "run_name": accepted(note="the trackers' run name"),
    "project": plugin("trackio", "project"),
    "trackio_space_id": plugin("trackio", "space_id"),
    "trackio_bucket_id": plugin("trackio", "bucket_id"),
    "trackio_static_space_id": plugin("trackio", "static_space_id", convert=_static_space, note=(
        "a name: the snapshot Space made after training; the engine makes none unless named (Trainer's None "
        "makes one with a default name when pushing to the Hub)")),
    "eval_strategy": accepted(convert=_eval_strategy),
    "eval_steps": accepted(convert=_steps_or_ratio, note=_STEP_NOTE),
    "eval_delay": accepted(),
    "per_device_eval_batch_size": accepted(),
    "prediction_loss_only": accepted(),
    "eval_on_start": accepted(),
    "eval_do_concat_batches": builtin("evaluation concatenates the batches' predictions and labels"),
    "eval_use_gather_object": builtin("evaluation gathers every process's predictions with gather_object, in order"),
    "eval_accumulation_steps": accepted(note=(
        "checked (an int >= 1), with the same results whatever its value: the engine moves each evaluation "
        "batch's predictions, labels, inputs and losses to the CPU as it comes, as Trainer does with 1; a larger "
        "value (or none) only keeps them on the device longer, and their concatenation is the same")),
    "include_for_metrics": accepted(),
    "batch_eval_metrics": accepted(note="one process only so far"),
    "save_only_model": accepted(note="such a checkpoint is refused by resume_from_checkpoint"),
    "save_strategy": accepted(),
    "save_steps": accepted(convert=_steps_or_ratio, note=_STEP_NOTE),
    "save_on_each_node": builtin("a checkpoint is written once per run (its metadata by the main process), "
                                 "not once per node: put output_dir on storage every node sees"),
    "save_total_limit": accepted(),
    "enable_jit_checkpoint": accepted(),
    "push_to_hub": plugin("hub", convert=_push_to_hub, note="true enables the plugin"),
    "hub_token": plugin("hub", "token", convert=_secret,
                        note="never written to a run file: HF_TOKEN, or the cached login"),
    "hub_private_repo": plugin("hub", "private"),
    "hub_model_id": plugin("hub", "repo"),
    "hub_strategy": plugin("hub", "strategy"),
    "hub_always_push": plugin("hub", "always_push"),
    "hub_revision": plugin("hub", "revision"),
    "load_best_model_at_end": accepted(),
    "metric_for_best_model": accepted(),
    "greater_is_better": accepted(),
    "ignore_data_skip": accepted(),
    "restore_callback_states_from_checkpoint": accepted(),
    "full_determinism": accepted(),
    "seed": accepted(),
    "data_seed": accepted(),
    "use_cpu": accepted(),
    "accelerator_config": refused("the engine does not train through Accelerate's Accelerator (split_batches, "
                                  "dispatch_batches, even_batches ...); its samplers are seeded and resume exactly"),
    "parallelism_config": refused("tensor, context and sequence parallelism are not supported; the strategy "
                                  "plugins are ddp, fsdp and deepspeed"),
    "dataloader_drop_last": accepted(),
    "dataloader_num_workers": accepted(),
    "dataloader_pin_memory": accepted(),
    "dataloader_persistent_workers": accepted(),
    "dataloader_prefetch_factor": accepted(),
    "dataloader_multiprocessing_context": accepted(),
    "dataloader_in_order": accepted(),
    "remove_unused_columns": accepted(note=(
        "for the train, evaluation and predict loaders: a datasets.Dataset loses the columns, other datasets' "
        "examples the keys (RemoveColumnsCollator) that the model's forward does not take, label_names, label "
        "and label_ids kept (before the collator, so what it adds stays)")),
    "label_names": accepted(),
    "train_sampling_strategy": accepted(convert=_sampling_strategy, note=(
        "'random', 'sequential' or 'group_by_length': Trainer's get_length_grouped_indices over the engine's "
        "shuffle, seeded by data_seed and the epoch, so a resume is exact (Trainer draws its shuffle from the "
        "global RNG, which data_seed does not seed: its order differs); evaluation keeps the dataset's order "
        "(Trainer groups it too). " + _BATCH_REBALANCE)),
    "length_column_name": accepted(note=(
        "group_by_length: read before remove_unused_columns drops it (Trainer 5.24 reads it after, so only with "
        "remove_unused_columns = false or a forward taking it); without it, the length of each example's "
        "input_ids (the tokenizer's first model input)")),
    "ddp_find_unused_parameters": plugin("ddp", "find_unused_parameters", convert=_ddp_option, note=_DDP_NOTE),
    "ddp_bucket_cap_mb": plugin("ddp", "bucket_cap_mb", convert=_ddp_option, note=_DDP_NOTE),
    "ddp_broadcast_buffers": plugin("ddp", "broadcast_buffers", convert=_ddp_option, note=_DDP_NOTE),
    "ddp_static_graph": plugin("ddp", "static_graph", convert=_ddp_option, note=_DDP_NOTE),
    "ddp_backend": builtin(_STRATEGY_NOTE),
    "ddp_timeout": plugin(STRATEGIES, *(f"{s}.timeout" for s in STRATEGIES), convert=_ddp_timeout,
                          note="[ddp], [fsdp] or [deepspeed] timeout, whichever strategy the run uses"),
    "fsdp": plugin("fsdp", *FSDP_KEYS, convert=_fsdp,
                   note="enables the plugin (FSDP2); older values like 'full_shard auto_wrap offload' map to its "
                        "options"),
    "fsdp_config": plugin("fsdp", *FSDP_KEYS, "train.activation_checkpointing", convert=_fsdp_config,
                          note="mapped key by key as --accelerate-config maps Accelerate's fsdp_config "
                               "(transformer_layer_cls_to_wrap -> wrap_modules, reshard_after_forward, cpu_offload, "
                               "state_dict_type, ...)"),
    "deepspeed": plugin("deepspeed", "config", convert=_deepspeed,
                        note="a path or a table, to [deepspeed] config; its \"auto\" values are filled from the run; "
                             "a scheduler section is dropped (the engine's scheduler drives the learning rate)"),
    "debug": refused("underflow_overflow: the engine stops on a non-finite loss, gradient norm or weight instead "
                     "(exit status 3); tpu_metrics_debug: no TPU"),
    "skip_memory_metrics": accepted(note="Trainer's init_mem_* and before_init_mem_* figures are not reported"),
    "do_train": refused("a flag for training scripts, not used by Trainer: run `engine train RUN.toml`"),
    "do_eval": refused("a flag for training scripts, not used by Trainer: run `engine evaluate RUN.toml`, or "
                       "set train.eval_strategy"),
    "do_predict": refused("a flag for training scripts, not used by Trainer: call Run.predict(dataset)"),
    "resume_from_checkpoint": accepted(note="a checkpoint folder; true: this run's newest"),
    "local_rank": refused("the engine reads LOCAL_RANK from the launcher's environment (torchrun)"),
})

# names of older transformers releases (in older dumps); answers for the names they became
LEGACY: dict[str, Answer] = _named({
    "evaluation_strategy": dataclasses.replace(accepted("eval_strategy", convert=_eval_strategy),
                                               legacy_defaults=("no", None)),
    "warmup_ratio": dataclasses.replace(accepted(), legacy_defaults=(0.0,)),
    "no_cuda": dataclasses.replace(accepted("use_cpu"), legacy_defaults=(False,)),
    "per_gpu_train_batch_size": dataclasses.replace(accepted("per_device_train_batch_size"), legacy_defaults=(None,)),
    "per_gpu_eval_batch_size": dataclasses.replace(accepted("per_device_eval_batch_size"), legacy_defaults=(None,)),
    "torchdynamo": dataclasses.replace(accepted("torch_compile_backend"), legacy_defaults=(None,)),
    "overwrite_output_dir": Answer(REFUSED, legacy_defaults=(False,), note=(
        "a flag of the example scripts, not of Trainer; the engine refuses a fresh run into another run's "
        "folder: pass --set train.overwrite_output_dir=true when you mean to remove that run's output")),
    "logging_dir": dataclasses.replace(plugin("tensorboard", "logging_dir", convert=_logging_dir, note=(
        "Trainer's default output_dir/runs/{time}_{host} is the plugin's default too")), legacy_defaults=(None,)),
    "fsdp_transformer_layer_cls_to_wrap": Answer(REFUSED, legacy_defaults=(None,), note=(
        "set [fsdp] wrap_modules (default: the model's _no_split_modules)")),
    "fsdp_min_num_params": Answer(REFUSED, legacy_defaults=(0,), note=(
        "the fsdp plugin shards transformer blocks; no size-based wrapping")),
    "push_to_hub_model_id": Answer(REFUSED, legacy_defaults=(None,), note="set [hub] repo = 'user/model'"),
    "push_to_hub_organization": Answer(REFUSED, legacy_defaults=(None,), note="set [hub] repo = 'org/model'"),
    "push_to_hub_token": Answer(REFUSED, legacy_defaults=(None, "<PUSH_TO_HUB_TOKEN>"), note="set HF_TOKEN"),
    "save_safetensors": Answer(BUILTIN, legacy_defaults=(True,), note="weights are always saved as safetensors"),
    "include_inputs_for_metrics": dataclasses.replace(accepted("include_for_metrics", convert=_include_inputs,
                                                               note="true: include_for_metrics = ['inputs']"),
                                                      legacy_defaults=(False,)),
    "include_tokens_per_second": Answer(BUILTIN, legacy_defaults=(False,), note=(
        "always measured: tokens_per_second at each log step, train_tokens_per_second in the final metrics")),
    "group_by_length": dataclasses.replace(accepted("train_sampling_strategy", convert=_group_by_length,
                                                    note="true: train_sampling_strategy = 'group_by_length'"),
                                           legacy_defaults=(False,)),
    "half_precision_backend": Answer(REFUSED, legacy_defaults=("auto",), note="mixed precision is torch.autocast"),
    "fp16_backend": Answer(REFUSED, legacy_defaults=("auto",), note="mixed precision is torch.autocast"),
    "fp16_opt_level": Answer(REFUSED, legacy_defaults=("O1",), note="apex is not supported; fp16 is torch.autocast"),
    "tpu_num_cores": Answer(REFUSED, legacy_defaults=(None,), note="no TPU"),
    "tpu_metrics_debug": Answer(REFUSED, legacy_defaults=(False,), note="no TPU"),
    "use_mps_device": Answer(REFUSED, legacy_defaults=(False,), note="the engine trains on CUDA or the CPU"),
    "use_ipex": Answer(REFUSED, legacy_defaults=(False,), note="Intel Extension for PyTorch is not supported"),
    "jit_mode_eval": Answer(REFUSED, legacy_defaults=(False,), note="no TorchScript evaluation"),
    "past_index": Answer(REFUSED, legacy_defaults=(-1,), note="no past/mems inputs (Transformer-XL, XLNet)"),
    "ray_scope": Answer(REFUSED, legacy_defaults=("last",), note="no hyper-parameter search"),
    "mp_parameters": Answer(REFUSED, legacy_defaults=("",), note="no SageMaker model parallelism"),
    "use_legacy_prediction_loop": Answer(REFUSED, legacy_defaults=(False,), note="one prediction loop"),
    "dispatch_batches": Answer(REFUSED, legacy_defaults=(None,), note="no Accelerate dataloader dispatching"),
    "split_batches": Answer(REFUSED, legacy_defaults=(None, False), note="no Accelerate batch splitting"),
    "sharded_ddp": Answer(REFUSED, legacy_defaults=("", [], None), note="fairscale is gone: use plugin fsdp"),
    "adafactor": Answer(REFUSED, legacy_defaults=(False,), note="optim = 'adafactor' (older dumps hold both)"),
})


# the fields Seq2SeqTrainingArguments adds (a Seq2SeqTrainer run: train.task = "seq2seq")
SEQ2SEQ_FIELDS: dict[str, Answer] = _named({
    "sortish_sampler": builtin("Seq2SeqTrainer reads it nowhere (transformers 5.24: only the field is left), so "
                               "true changes nothing under Trainer either; batches of similar length: "
                               "train_sampling_strategy = 'group_by_length'"),
    "predict_with_generate": accepted(note="evaluation's compute_metrics gets generate()'s token ids"),
    "generation_max_length": accepted(),
    "generation_num_beams": accepted(),
    "generation_config": accepted(note="a folder holding generation_config.json, or a table of its values"),
})


def answer_for(name: str) -> Answer | None:
    """The answer for a TrainingArguments or Seq2SeqTrainingArguments field name (current or older), or None."""
    return FIELDS.get(name) or SEQ2SEQ_FIELDS.get(name) or LEGACY.get(name)

