"""Helpers for a plugin's TrainingArguments and Accelerate mappings (``engine migrate``, ``--accelerate-config``).

* :class:`Answer`: what the engine does with one ``transformers.TrainingArguments`` field, of five
  kinds (``accepted``, ``plugin``, ``builtin``, ``refused``, ``not yet``), made with
  :func:`accepted`, :func:`plugin`, :func:`builtin`, :func:`refused`.
* :class:`Conversion`: what an answer's converter ``convert(conversion, name, value)`` writes
  through: ``set("section.key", value)`` (only the keys its answer declares), ``enable(plugin)``,
  ``lose(what, reason)`` for part of a value that has no counterpart, or a raised
  :class:`~engine.errors.ConfigError` to drop the whole value with that reason; :func:`write`,
  :func:`enable` and :func:`enable_with_value` are the common converters.
* :class:`Mapping`: what an Accelerate config file makes (``--accelerate-config``): a handler
  ``handler(mapping, key, value)`` calls ``mapping.set("section.key", value, key, value)``,
  ``mapping.note(key, value, meaning)`` or raises ``mapping.refuse(key, value, reason)``;
  :func:`accept_only`, :func:`section_key`, :func:`same_as_train`, :func:`nested` (a table of
  settings) and :func:`boolean` make or help handlers.

A plugin returns its answers from the hooks ``trainer_argument_mappings`` (``{field: Answer}``) and
``accelerate_mappings`` (``{Accelerate key: handler}``); :func:`plugin_mappings` asks an installed
plugin for them, enabled in a run or not. The table of every field is the builtin ``trainer_args``
plugin's (:mod:`engine.builtin.trainer_args`, whose ``TRAINER_FIELDS`` names the first-party plugin
that answers a field; :mod:`engine.tooling.accelerate_config`'s ``ACCELERATE_KEYS`` the one of a key).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.catalogue import FIRST_PARTY
from engine.config import SECRET_MASK, check_nesting, check_value
from engine.errors import ConfigError
from engine.util import decode_utf8, is_secret_name, mask_secrets

ACCEPTED, PLUGIN, BUILTIN, REFUSED, NOT_YET = "accepted", "plugin", "builtin", "refused", "not yet"


def read_small_text(path: str | Path, what: str, fix: str, limit: int = 1 << 20) -> str:
    """The UTF-8 text of ``path``, a regular file of at most ``limit`` bytes. A missing file, a folder, a
    device or pipe (``/dev/zero`` would never end), a larger or binary file is one ConfigError naming
    ``what`` and saying ``fix``."""
    path = Path(path)
    try:
        if not path.is_file():
            problem = ": no such file" if not path.exists() else " is a folder" if path.is_dir() else \
                " is not a regular file"
            raise ConfigError(f"{what}{problem}; {fix}")
        with path.open("rb") as file:
            data = file.read(limit + 1)  # no more, whatever its size says
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror}") from None
    if len(data) > limit:
        raise ConfigError(f"{what} is larger than {limit:,} bytes; {fix}")
    return decode_utf8(data, what, fix)


def one_line(text: Any) -> str:
    """``text`` (a string, or any key of a user's file) as it is when printable, else its repr: line breaks and
    control characters escaped, so that it can neither break a one-line message nor end a TOML comment."""
    text = str(text)
    return text if text.isprintable() else repr(text)
KINDS = (ACCEPTED, PLUGIN, BUILTIN, REFUSED, NOT_YET)


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
            head = "accepted as " + ", ".join(f"[train] {key}" for key in train_keys) if train_keys else \
                "accepted as " + ", ".join(f"[{key.split('.', 1)[0]}] {key.split('.', 1)[1]}" for key in self.keys)
            if name not in train_keys and name not in (key.split(".", 1)[1] for key in self.keys):
                head += " (the engine's name)"
        elif self.kind == PLUGIN:
            if len(self.plugins) > 2:  # the trackers: one pip line for all
                head = f"provided by the plugins {', '.join(self.plugins)} (pip install 'engine[<plugin>]')"
            else:
                head = "provided by " + " or ".join(
                    f"plugin {p}" + (f" ({FIRST_PARTY[p].install})" if p in FIRST_PARTY else "") for p in self.plugins)
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
            (answer.convert or write)(self, name, value)
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


def flag(value: Any) -> bool:
    """A true/false field: a string ("false" is truthy) or a number is refused, not read as a switch."""
    if not isinstance(value, bool):
        raise ConfigError("expected true or false")
    return value


def write(c: Conversion, name: str, value: Any) -> None:
    if value is not None:
        c.set(c.answer.keys[0], value)


def enable(c: Conversion, name: str, value: Any) -> None:
    if value is not None and flag(value):
        c.enable(c.answer.plugins[0])


def enable_with_value(c: Conversion, name: str, value: Any) -> None:
    if value is not None:
        c.enable(c.answer.plugins[0])
        c.set(c.answer.keys[0], value)


def accepted(*keys: str, note: str = "", convert: Callable[..., None] | None = None) -> Answer:
    """A ``[train]`` key; without ``keys``, the field's own name (filled in by the table)."""
    return Answer(ACCEPTED, tuple(f"train.{key}" for key in keys), note=note, convert=convert)


def plugin(name: str | tuple[str, ...], *keys: str, note: str = "",
           convert: Callable[..., None] | None = None) -> Answer:
    plugins = (name,) if isinstance(name, str) else name
    return Answer(PLUGIN, tuple(k if "." in k else f"{plugins[0]}.{k}" for k in keys), plugins, note, convert)


def builtin(note: str) -> Answer:
    return Answer(BUILTIN, note=note)


def refused(note: str) -> Answer:
    return Answer(REFUSED, note=note)


def plugin_mappings(name: str, hook: str) -> dict[str, Any]:
    """Plugin ``name``'s answers to ``hook`` (``trainer_argument_mappings`` or ``accelerate_mappings``),
    merged, when it is installed (enabled in a run or not); {} when it is not, or when
    ENGINE_DISABLE_PLUGIN_AUTOLOAD keeps installed plugins from loading."""
    from engine.plugins import autoload_disabled, installed_plugins

    installed = installed_plugins().get(name)
    if installed is None or autoload_disabled():
        return {}
    return dict(_plugin_mappings(installed, hook))


def unavailable(name: str) -> str:
    """Why :func:`plugin_mappings` has nothing from plugin ``name``, and what to do."""
    from engine.plugins import NO_AUTOLOAD_ENV, installed_plugins

    if name in installed_plugins():
        return f"which {NO_AUTOLOAD_ENV} keeps from loading here"
    return f"which is not installed: {FIRST_PARTY[name].install if name in FIRST_PARTY else 'install it'}"


@functools.cache
def _plugin_mappings(installed: Any, hook: str) -> tuple[tuple[str, Any], ...]:
    import pluggy

    from engine import hookspecs
    from engine.plugins import PROJECT

    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(installed.load(), name=installed.name)
    return tuple(item for answer in getattr(manager.hook, hook)() for item in (answer or {}).items())


# ---------------------------------------------------------------------------- Accelerate settings

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
        self.lines.append(f"{one_line(accelerate_key)}: {show_setting(accelerate_value, accelerate_key)} -> {key} = "
                          f"{show_setting(value, key)}")

    def note(self, accelerate_key: str, value: Any, meaning: str) -> None:
        self.lines.append(f"{one_line(accelerate_key)}: {show_setting(value, accelerate_key)} -> {meaning}")

    def refuse(self, accelerate_key: str, value: Any, reason: str) -> ConfigError:
        return ConfigError(f"--accelerate-config {self.source}: {one_line(accelerate_key)}: "
                           f"{show_setting(value, accelerate_key)}: {reason}")


def show_setting(value: Any, key: Any = "") -> str:
    """``value`` as the file spells it; a credential's (by its key's name, at any depth) as the mask."""
    value = SECRET_MASK if value is not None and is_secret_name(str(key).rsplit(".", 1)[-1]) \
        else mask_secrets(value, SECRET_MASK)
    text = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_type(mapping: Mapping, key: str, value: Any, types: tuple[type, ...], expected: str) -> None:
    """Refuse ``value`` unless it is one of ``types`` (a bool is not a number here)."""
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise mapping.refuse(key, value, f"expected {expected}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def accept_only(*accepted: Any, meaning: str) -> Callable[..., None]:
    """A key the engine honours only at these values (TPU, SageMaker, ... settings at their defaults)."""

    def handle(mapping: Mapping, key: str, value: Any, plugin: str | None = None) -> None:
        if not any(type(value) is type(a) and value == a for a in accepted):  # 0 is not false here
            raise mapping.refuse(key, value, f"not supported by the engine (accepted: "
                                             f"{', '.join(show_setting(a) for a in accepted)})")
        mapping.note(key, value, meaning)

    return handle


def section_key(key: str, convert: Callable[[Mapping, str, Any], Any]) -> Callable[..., None]:
    def handle(mapping: Mapping, accelerate_key: str, value: Any) -> None:
        mapping.set(key, convert(mapping, accelerate_key, value), accelerate_key, value)

    return handle


def boolean(mapping: Mapping, key: str, value: Any) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise mapping.refuse(key, value, "expected true or false")
    return value


def same_as_train(train_key: str) -> Callable[..., None]:
    """A DeepSpeed value that the engine takes from [train] (both must agree, so it sets it)."""

    def handle(mapping: Mapping, key: str, value: Any) -> None:
        from engine.config import TrainConfig  # assembled from the builtins' options: not at import

        try:
            checked = check_value(TrainConfig, train_key, value, f"train.{train_key}")
        except ConfigError as exc:
            raise mapping.refuse(key, value, f"sets {exc}") from None
        mapping.set(f"train.{train_key}", checked, key, value)

    return handle


def nested(plugin: str, distributed_type: str, what: str, table: dict[str, Callable[..., None]]) -> Callable[..., None]:
    """A table (``fsdp_config``, ``deepspeed_config``) whose keys ``table``'s handlers map, for ``plugin``
    only: a plugin's answer to ``accelerate_mappings`` for its table of settings."""

    def handle(mapping: Mapping, key: str, value: Any, enabled: str | None) -> None:
        if value is None or value == {}:  # `accelerate config` writes fsdp_config: {} for the other types
            return
        if not isinstance(value, dict):
            raise mapping.refuse(key, value, "expected a table of settings, as `accelerate config` writes it")
        if enabled != plugin:
            raise mapping.refuse(key, "{...}", f"{key} needs distributed_type: {distributed_type}")
        for name, setting in value.items():
            handler = table.get(name)
            if handler is None:
                raise mapping.refuse(f"{key}.{name}", setting, f"not {what} the engine can map; it maps "
                                                               f"{', '.join(sorted(table))}")
            handler(mapping, f"{key}.{name}", setting)

    return handle
