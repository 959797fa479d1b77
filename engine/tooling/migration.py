"""``engine migrate``: a run file from ``transformers.TrainingArguments``, TRL's ``SFTConfig`` /
``ModelConfig`` / command line, an alignment-handbook recipe or an Axolotl config (docs/migrate-sft.md).

::

    engine migrate args.json -o run.toml          # args.json: TrainingArguments.to_json_string()
    engine migrate recipe.yaml -o run.toml        # a handbook recipe, an SFTConfig dump, an Axolotl config

    import engine
    migration = engine.migrate(training_args)     # a TrainingArguments, or its to_dict()
    print(migration.toml(), migration.report())

Every field is converted through its answer in :mod:`engine.builtin.trainer_args` (TRL's fields:
:mod:`engine.tooling.sft_args`; Axolotl's keys: :mod:`engine.tooling.axolotl`). A field at
Trainer's default is written only where the engine's default differs (so the run behaves as
the Trainer run did); a field set away from Trainer's default that has no counterpart is
listed with the reason. Each value written is checked against its section's schema, and the
optimizer and scheduler names against the registries, so ``engine plan`` accepts the file
once the placeholders (the model and the data, which ``TrainingArguments`` does not hold) are
filled in. A credential (``hub_token``, any field or nested key named like one) is never written
or shown: its value is masked before anything reads it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.builtin.trainer_args import ENABLED_BY, SEQ2SEQ_FIELDS, STRATEGIES, answer_for
from engine.config import SECRET_MASK, TrainConfig, check_nesting, check_value, core_config, toml_key, toml_value
from engine.errors import ConfigError, EngineError
from engine.kit.mappings import ACCEPTED, BUILTIN, PLUGIN, Conversion, load_json, one_line, read_small_text, show
from engine.tooling.axolotl import AXOLOTL_DEFAULTS, AXOLOTL_FIELDS
from engine.tooling.dpo_args import dpo_answer, dpo_defaults, is_dpo
from engine.tooling.sft_args import (PEFT_ENABLED_BY, SFT_ANSWERS, cached_defaults, is_sft, parse_command_line,
                                     sft_defaults)
from engine.util import is_secret_name, mask_secrets

MAX_ARGUMENTS_BYTES = 1 << 20
# Axolotl's keys that no TRL or Trainer source has: a config holding one is read as Axolotl's
AXOLOTL_KEYS = ("base_model", "micro_batch_size", "sequence_len", "num_epochs", "sample_packing", "val_set_size",
                "adapter", "train_on_inputs", "lr_scheduler", "special_tokens")
# what TrainingArguments does not hold: left as commented keys for the user to fill in
PLACEHOLDERS = {
    "train.model": ("path/to/model", "TrainingArguments names no model: a local HF folder, a config .json or "
                                     "'package.module:function' (unset: the builtin tiny-llama)"),
    "data.train": ("data/train.jsonl", "TrainingArguments names no data: a file, glob, folder, dataset name or "
                                       "'package.module:function' (unset: the embedded demo text)"),
}


@dataclass
class Migration:
    """A converted run: its sections, and what the conversion did not carry over."""

    source: str
    plugins: list[str]
    sections: dict[str, dict[str, Any]]  # "train", "data" and each plugin's section: key -> value
    placeholders: dict[str, tuple[str, str]]  # "section.key" -> (an example, what to fill in)
    mapped: list[str] = field(default_factory=list)  # what went to plugins, or was renamed or converted
    trainer_defaults: list[str] = field(default_factory=list)  # written at Trainer's default: the engine's differs
    lost: list[tuple[str, str]] = field(default_factory=list)  # (field = value, why): not converted
    unknown: list[str] = field(default_factory=list)  # not a TrainingArguments field
    idle: list[str] = field(default_factory=list)  # no counterpart, at Trainer's default
    problems: list[str] = field(default_factory=list)  # what `engine plan` would refuse
    notes: list[str] = field(default_factory=list)
    kind: str = "transformers TrainingArguments"  # what the source is: named in the file's header and the report

    @property
    def mapping(self) -> dict[str, Any]:
        """The run as a mapping: what the TOML holds, without the placeholders."""
        # a plugin without settings is enabled by name only (some take no options: no [section] for them)
        return {"plugins": list(self.plugins), **{name: dict(table) for name, table in self.sections.items()
                                                  if table or name in ("train", "data")}}

    def toml(self) -> str:
        lines = [f"# Run file converted by `engine migrate` from {one_line(self.source)} ({self.kind}).",
                 "# Fill in the commented keys below; `engine plan` shows the whole run."]
        if self.lost:
            lines.append("# Not converted (set away from Trainer's default):")
            lines += [f"#   {one_line(f'{what}: {why}')}" for what, why in self.lost]
        mapping = self.mapping
        lines.append(f"plugins = {toml_value(mapping.pop('plugins'))}")
        for section, table in mapping.items():
            lines += ["", f"[{section}]"]
            for dotted, (example, what) in self.placeholders.items():
                if dotted.split(".", 1)[0] == section:
                    lines.append(f"# {dotted.split('.', 1)[1]} = {toml_value(example)}  # {what}")
            lines += _table_lines(section, table)
        return "\n".join(lines) + "\n"

    def report(self) -> str:
        from importlib.metadata import version

        kind = "" if self.kind == "transformers TrainingArguments" else f" ({self.kind})"
        lines = [f"engine migrate: {self.source}{kind} -> plugins = {toml_value(self.plugins)}"]
        groups = [
            ("mapped to plugins, renamed or converted:", self.mapped),
            ("written with the source's default (Trainer's, TRL's or Axolotl's), which differs from the engine's:",
             self.trainer_defaults),
            ("not converted (set away from Trainer's default):", [f"{what}: {why}" for what, why in self.lost]),
            ("to fill in:", [f"{dotted}: {what}" for dotted, (_, what) in self.placeholders.items()]),
            ("before `engine plan` accepts the run:", self.problems),
            ("notes:", self.notes),
        ]
        for title, items in groups:
            if items:
                lines += [title, *(f"  {item}" for item in items)]
        if self.unknown:
            known = "TrainingArguments" if self.kind.endswith("TrainingArguments") else self.kind
            lines.append(f"unknown (not fields of transformers {version('transformers')}'s {known}), "
                         f"not converted: {', '.join(self.unknown)}")
        if self.idle:
            lines.append(f"no counterpart, at Trainer's default (docs/trainer-arguments.md): {', '.join(self.idle)}")
        return "\n".join(lines)


def read_arguments(path: str | Path) -> dict[str, Any]:
    """The settings in ``path``: a JSON object (``TrainingArguments.to_json_string()``, an SFTConfig or
    ModelConfig dump), a YAML mapping (an alignment-handbook recipe, an Axolotl config) or, in a ``.txt`` or
    ``.sh`` file, TRL's command-line arguments; anything else is a ConfigError."""
    text = read_small_text(path, str(path), "name the JSON file TrainingArguments.to_json_file() wrote, a YAML "
                           "recipe or a .txt of TRL's command-line arguments", MAX_ARGUMENTS_BYTES)
    suffix = Path(path).suffix.lower()
    if suffix in (".txt", ".sh"):
        return parse_command_line(text)
    if suffix in (".yaml", ".yml"):
        data = _load_yaml(text, str(path))
        if not isinstance(data, dict):
            raise ConfigError(f"{path} holds a YAML {type(data).__name__}, expected a mapping of settings (an "
                              "alignment-handbook recipe, an SFTConfig dump or an Axolotl config)")
    else:
        try:
            data = load_json(text, str(path))
        except ConfigError as exc:
            raise ConfigError(f"{exc}; expected TrainingArguments.to_json_string() output") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}, expected an object of TrainingArguments "
                          "fields (TrainingArguments.to_json_string())")
    return data


def _load_yaml(text: str, what: str) -> Any:
    """``text`` parsed as YAML (safe types only), nested no deeper than the engine walks."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} is not YAML: {one_line(str(exc).splitlines()[0])}") from None
    if data is not None:
        check_nesting(data, what)
    return data


def trainer_defaults() -> dict[str, Any]:
    """Every field's default, as a dump of a default ``TrainingArguments`` holds it."""
    return cached_defaults(_trainer_defaults, ("transformers",))


def _trainer_defaults() -> dict[str, Any]:
    from transformers import Seq2SeqTrainingArguments  # TrainingArguments' fields and the seq2seq ones

    defaults = {f.name: f.default for f in dataclasses.fields(Seq2SeqTrainingArguments)
                if f.default is not dataclasses.MISSING}
    defaults.update(json.loads(Seq2SeqTrainingArguments(output_dir="trainer_output").to_json_string()))
    return defaults


def migrate(arguments: Any, source: str | None = None, kind: str | None = None) -> Migration:
    """Convert ``arguments``: a ``TrainingArguments`` or ``SFTConfig`` (or ``ModelConfig``) object, a dict of
    their fields (a dump, an alignment-handbook recipe, TRL's parsed command line), a list of TRL's
    ``--key value`` strings, or an Axolotl config (found by its keys, or ``kind = "axolotl"``)."""
    if hasattr(arguments, "to_json_string"):
        source = source or type(arguments).__name__
        arguments = json.loads(arguments.to_json_string())
    elif dataclasses.is_dataclass(arguments) and not isinstance(arguments, type):  # trl's ModelConfig
        source = source or type(arguments).__name__
        arguments = json.loads(json.dumps(dataclasses.asdict(arguments), default=str))
    elif isinstance(arguments, list) and all(isinstance(item, str) for item in arguments):
        source = source or "TRL's command line"
        arguments = parse_command_line(arguments)
    if not isinstance(arguments, dict):
        raise ConfigError(f"engine migrate takes a TrainingArguments or a dict of its fields, got "
                          f"{type(arguments).__name__}")
    check_nesting(arguments, source or "the TrainingArguments")
    if kind not in (None, "axolotl"):
        raise ConfigError(f"--from {one_line(kind)}: expected 'axolotl' (other sources are recognised by their keys)")
    if kind == "axolotl" or is_axolotl(arguments):
        kind, lookup = "Axolotl config", AXOLOTL_FIELDS.get
        defaults = AXOLOTL_DEFAULTS  # a key it has no default for: its answer's legacy_defaults (null)
        arguments = {**AXOLOTL_DEFAULTS, **arguments}
    elif is_dpo(arguments):  # as SFT below, with DPOConfig's defaults and fields
        kind, lookup = "TRL DPOConfig, ModelConfig and ScriptArguments", lambda name: dpo_answer(name) or \
            answer_for(name)
        defaults = {**trainer_defaults(), **dpo_defaults()}
        arguments = {**{k: v for k, v in defaults.items() if k not in SEQ2SEQ_FIELDS}, **arguments}
    elif is_sft(arguments):  # what a recipe leaves out is TRL's default, which the run must reproduce
        kind, lookup = "TRL SFTConfig, ModelConfig and ScriptArguments", lambda name: SFT_ANSWERS.get(name) or \
            answer_for(name)
        defaults = {**trainer_defaults(), **sft_defaults()}
        arguments = {**{k: v for k, v in defaults.items() if k not in SEQ2SEQ_FIELDS}, **arguments}
    else:
        kind, lookup, defaults = "transformers TrainingArguments", answer_for, trainer_defaults()
    shown = mask_secrets(arguments, SECRET_MASK)  # all that converters see: no credential reaches a file or a log
    conversion = Conversion(shown)
    unknown, idle = [], []
    for name, value in arguments.items():
        answer = lookup(name)
        if answer is None:
            unknown.append(name)
            continue
        at_default = value in answer.legacy_defaults if name not in defaults else value == defaults[name]
        if answer.kind in (ACCEPTED, PLUGIN):
            conversion.convert(name, shown[name], answer, at_default)
        elif not at_default:
            conversion.lose(f"{name} = {show(shown[name])}", answer.describe(name))
        elif answer.kind != BUILTIN:
            idle.append(name)
    migration = _finish(conversion, source or "TrainingArguments")
    migration.unknown, migration.idle, migration.kind = unknown, idle, kind
    return migration


def is_axolotl(arguments: dict[str, Any]) -> bool:
    """An Axolotl config: it names its model ``base_model``, or holds two of Axolotl's own keys."""
    return "base_model" in arguments or sum(key in arguments for key in AXOLOTL_KEYS) >= 2


def _finish(c: Conversion, source: str) -> Migration:
    """The run from a conversion: one strategy, options only of enabled plugins, values checked."""
    strategies = _one_strategy(c)
    sections = ("train", "data", *c.plugins)
    kept = {dotted: s for dotted, s in c.settings.items() if dotted.split(".", 1)[0] in sections}
    for name in dict.fromkeys(s.field for s in c.settings.values() if not s.at_default):
        if not any(s.field == name for s in kept.values()) and not any(what.startswith(f"{name} = ")
                                                                       for what, _ in c.lost):
            plugins = sorted({d.split(".", 1)[0] for d, s in c.settings.items() if s.field == name})
            when = "; ".join(f"{p}: {(ENABLED_BY | PEFT_ENABLED_BY)[p]}" for p in plugins)
            c.lose(f"{name} = {show(c.arguments[name])}",
                   f"used by plugin {' or '.join(plugins)} only, which no argument enables (Trainer: {when})")

    placeholders = {k: v for k, v in {**PLACEHOLDERS, **c.placeholders}.items() if k not in kept}
    for given, filled in (("data.mixture", "data.train"), ("data.eval", "data.eval_split")):  # a recipe's data
        if given in kept:
            placeholders.pop(filled, None)
    migration = Migration(source, c.plugins, {section: {} for section in sections}, placeholders, lost=c.lost)
    schemas, registries = _load(c.plugins, migration.problems)
    schemas["data"] = core_config("DataConfig")
    for dotted, setting in kept.items():
        section, key = dotted.split(".", 1)
        schema = schemas.get(section)
        value = setting.value
        unwritable = _unwritable(value, dotted)
        if unwritable:
            migration.lost.append((f"{setting.field} = {show(c.arguments[setting.field])}", unwritable))
            continue
        if schema is not None:
            try:
                value = check_value(schema, key, value, dotted)
            except ConfigError as exc:
                migration.lost.append((f"{setting.field} = {show(c.arguments[setting.field])}", str(exc)))
                continue
            default = _default(schema, key)
            if setting.at_default and value == default:
                continue
            if setting.at_default:
                migration.trainer_defaults.append(f"{dotted} = {show(value)} (engine default: {show(default)})")
        migration.sections[section][key] = value
        if dotted != f"train.{setting.field}" or setting.note:
            migration.mapped.append(f"{setting.field} -> {dotted} = {show(value)}"
                                    + (f" ({setting.note})" if setting.note else ""))
    migration.mapped[:0] = [f"{c.enabled_by[plugin]} -> plugins += [{plugin!r}]" for plugin in c.plugins]
    migration.mapped += [f"{what} -> {meaning}" for plugin, what, meaning in c.notes if plugin in c.plugins]
    if not strategies:
        migration.notes.append("Trainer trains with DDP when launched on several processes: for that, add 'ddp' "
                               "to plugins and launch with torchrun")
    for section, schema in schemas.items():  # each section in its schema's order, as `engine plan` shows it
        order = [f.name for f in dataclasses.fields(schema)]
        migration.sections[section] = dict(sorted(migration.sections[section].items(),
                                                  key=lambda item: order.index(item[0])))
    if registries is not None:
        _check_names(migration, registries)
    return migration


def _one_strategy(c: Conversion) -> list[str]:
    """Trainer uses DeepSpeed, else FSDP, else DDP: the strategy plugins asked for, the first kept,
    the fields that only the others use lost."""
    strategies = [name for name in STRATEGIES if name in c.plugins]
    for extra in strategies[1:]:
        c.plugins.remove(extra)
        fields = [c.enabled_by[extra], *(s.field for d, s in c.settings.items()
                                         if d.startswith(f"{extra}.") and not s.at_default)]
        for name in dict.fromkeys(fields):
            used = any(d.split(".", 1)[0] in ("train", strategies[0]) for d, s in c.settings.items() if s.field == name)
            if not used:
                c.lose(f"{name} = {show(c.arguments[name])}",
                       f"for plugin {extra}; one strategy per run: {strategies[0]} is used (as under Trainer)")
    return strategies


def _load(plugins: list[str], problems: list[str]) -> tuple[dict[str, type], dict[str, Any] | None]:
    """Each section's options class ([train], and every enabled plugin that is installed and loads)
    and the registries of those plugins; what is missing goes to ``problems``."""
    from engine.catalogue import FIRST_PARTY
    from engine.plugins import PluginManager, installed_plugins

    installed = installed_plugins()
    for name in plugins:
        if name not in installed:
            install = FIRST_PARTY[name].install if name in FIRST_PARTY else "install it"
            problems.append(f"plugin {name!r} is not installed: {install}")
    schemas: dict[str, type] = {"train": TrainConfig}
    try:
        manager = PluginManager(enabled=[name for name in plugins if name in installed])
    except EngineError as exc:
        problems.append(str(exc))
        return schemas, None
    schemas.update({name: schema for name, schema in manager.option_schemas().items() if schema is not None})
    return schemas, manager.registries


def _unwritable(value: Any, path: str) -> str | None:
    """Why ``value`` cannot go into a run file: a null in it (TOML has none) or a credential (never written)."""
    if value is None:
        return f"{path} would be null, which a run file (TOML) cannot hold"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if is_secret_name(key) and item is not None:
            return f"{path}.{key} is a credential, never written to a run file: give it to the run another way"
        problem = _unwritable(item, f"{path}.{key}" if isinstance(value, dict) else f"{path}[{key}]")
        if problem:
            return problem
    return None


def _default(schema: type, key: str) -> Any:
    option = {f.name: f for f in dataclasses.fields(schema)}[key]
    if option.default_factory is not dataclasses.MISSING:
        return option.default_factory()
    return None if option.default is dataclasses.MISSING else option.default


def _check_names(migration: Migration, registries: dict[str, Any]) -> None:
    """An optimizer or scheduler name no enabled plugin registers is not written (`engine plan` refuses it)."""
    from engine.catalogue import provider_of

    train = migration.sections["train"]
    for key, kind in (("optim", "optimizer"), ("lr_scheduler_type", "scheduler")):
        if key not in train:
            continue
        try:
            registries[kind].get(train[key])
        except ConfigError as exc:
            if provider_of(kind, train[key]) in migration.plugins:  # its plugin is not installed: said above
                continue
            migration.lost.append((f"{key} = {show(train.pop(key))}", str(exc)))


# ---------------------------------------------------------------------------- TOML


def _is_subtable(value: Any) -> bool:
    """A table written as its own [section.key] block (large or nested) rather than inline."""
    return isinstance(value, dict) and (len(value) > 4 or any(isinstance(v, dict) for v in value.values()))


def _table_lines(path: str, table: dict[str, Any]) -> list[str]:
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items() if not _is_subtable(v)]
    for key, value in table.items():
        if _is_subtable(value):
            lines += ["", f"[{path}.{toml_key(key)}]", *_table_lines(f"{path}.{toml_key(key)}", value)]
    return lines
