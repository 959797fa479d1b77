"""Helpers optimizer plugins share: parameter groups, ``optim_args`` checking, target modules."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .config import parse_value
from .errors import ConfigError

# Parameter names (lower-cased, full path) that get no weight decay, as in transformers' Trainer.
_NO_DECAY_PATTERNS = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that take weight decay: Trainer.get_decay_parameter_names' rule.

    Excluded: parameters of ``nn.LayerNorm`` modules and names matching bias / layernorm /
    rmsnorm / norm patterns (so RMSNorm weights are excluded by name).
    """
    layer_norm_params = {
        f"{module_name}.{param_name}" if module_name else param_name
        for module_name, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)
        for param_name, _ in module.named_parameters(recurse=False)
    }
    return {name for name, _ in model.named_parameters()
            if name not in layer_norm_params and not any(p.search(name.lower()) for p in _NO_DECAY_PATTERNS)}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters split into a decay group and a no-decay group, as Trainer does."""
    decay = decay_parameter_names(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """Parse ``train.optim_args`` ("key=value,key=value") into typed values."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"train.optim_args: expected 'key=value,key=value', got {text!r} "
                              f"(bad item {item!r})")
        out[key] = parse_value(value)
    return out


@dataclass(frozen=True)
class OptimArg:
    """One key that ``train.optim_args`` may set for an optimizer.

    ``type`` is int, float, bool or str; ``default`` is passed when the key is not given
    (None: not passed, the library's own default applies); ``expect`` describes the valid
    values in errors ("float > 0"); ``valid`` checks a value of the right type.
    """

    type: type
    default: Any = None
    expect: str = ""
    valid: Callable[[Any], bool] = lambda value: True


def check_optim_args(run: Any, table: dict[str, OptimArg], elsewhere: dict[str, str] | None = None) -> dict[str, Any]:
    """``train.optim_args`` checked against ``table``: the keyword arguments to pass on.

    An unknown key, a wrong type or an invalid value is a :class:`ConfigError` naming the key,
    what the optimizer takes and what was expected. Ints widen to float; "true"/"false" in any
    case become bools. The result holds the given keys plus every non-None default, in table
    order. ``elsewhere`` maps keys people carry over from other optimizers to where they go
    instead ("lr": "set train.learning_rate"), added to the unknown-key error. Call it from
    ``configure`` too, so bad values are refused before the model loads.

    Example::

        ARGS = {"rank": OptimArg(int, 128, "int >= 1", lambda v: v >= 1),
                "momentum": OptimArg(float, expect="float in [0, 1)", valid=lambda v: 0 <= v < 1)}
        kwargs = check_optim_args(run, ARGS)     # optim_args = "rank=64" -> {"rank": 64}
    """
    name = run.config.train.optim
    given = parse_optim_args(run.config.train.optim_args)
    for key, value in given.items():
        arg = table.get(key)
        if arg is None:
            takes = f"takes {', '.join(table)}" if table else "takes no optim_args"
            hint = f"; {elsewhere[key]}" if elsewhere and key in elsewhere else ""
            raise ConfigError(f"train.optim_args: {name} {takes}; got {key!r}{hint}")
        if arg.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif arg.type is bool and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if (isinstance(value, bool) and arg.type is not bool) or not isinstance(value, arg.type) \
                or not arg.valid(value):
            raise ConfigError(f"train.optim_args: {key} expects {arg.expect or arg.type.__name__}, got {value!r}")
        given[key] = value
    return {key: given.get(key, arg.default) for key, arg in table.items()
            if key in given or arg.default is not None}


def _target_match(target_modules: str | list[str], name: str) -> tuple[bool, bool]:
    """(matches, by_pattern): transformers' ``check_target_module_exists`` rule for one module name.

    A string is a regex that must match the whole name; a list entry matches by equal name, by
    substring, or as a whole-name regex (only the last counts as a pattern).
    """
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None, target_modules != name
    if name in target_modules or any(entry in name for entry in target_modules):
        return True, False
    return any(re.fullmatch(entry, name) for entry in target_modules), True


def target_linear_parameters(model: torch.nn.Module, target_modules: str | list[str] | None,
                             key: str = "train.optim_target_modules",
                             user: str = "this optimizer") -> dict[str, torch.nn.Parameter]:
    """The ``weight`` of each ``nn.Linear`` module that ``target_modules`` selects, by parameter name.

    Selection follows transformers' Trainer for ``optim_target_modules`` (GaLore, APOLLO):
    ``"all-linear"`` takes every ``nn.Linear``; another string is a regex matched against the
    whole module name (``re.fullmatch``); a list selects a module whose name equals an entry,
    contains an entry, or fully matches an entry as a regex. Names are ``model.named_modules()``
    names; the result keeps ``model.named_parameters()`` order (a weight tied to one listed
    earlier under another name is left out, as in Trainer).

    Refused with a :class:`ConfigError` naming ``key``: no ``target_modules``, a malformed regex,
    a selection without any ``nn.Linear``, and a module that is not ``nn.Linear`` but holds
    parameters of its own (an embedding, a norm) selected by its name or a substring of it
    (Trainer only warns and skips it). Parameter-free containers (``self_attn``, ``mlp``) and
    modules that a regex happens to match are skipped, as in Trainer.

    Example::

        weights = target_linear_parameters(model, [r".*attn.*", r".*mlp.*"], user="galore_adamw")
        target = set(weights.values())
    """
    if target_modules is None:
        raise ConfigError(f"{key}: {user} needs target modules; set it to 'all-linear', a regex "
                          "(e.g. '.*(attn|mlp).*') or a list of module names")
    all_linear = isinstance(target_modules, str) and target_modules.replace("_", "-") == "all-linear"
    if not all_linear:
        for pattern in [target_modules] if isinstance(target_modules, str) else target_modules:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"{key}: {pattern!r} is not a valid regex ({exc})") from None
    names, refused, skipped = [], [], []
    for name, module in model.named_modules():
        matches, by_pattern = (True, True) if all_linear else _target_match(target_modules, name)
        if not matches:
            continue
        if isinstance(module, torch.nn.Linear):
            names.append(f"{name}.weight")
        elif by_pattern or not any(True for _ in module.parameters(recurse=False)):
            skipped.append(f"{name} ({type(module).__name__})")
        else:
            refused.append(f"{name} ({type(module).__name__})")
    if refused:
        raise ConfigError(f"{key}: {target_modules!r} selects modules that are not nn.Linear: "
                          f"{', '.join(refused[:5])}{' ...' if len(refused) > 5 else ''}; {user} only "
                          "projects nn.Linear weights: name the Linear layers or use a regex")
    wanted = set(names)
    found = {name: p for name, p in model.named_parameters() if name in wanted}
    if names and not found:
        raise ConfigError(f"{key}: {target_modules!r} selects only nn.Linear weights tied to a parameter "
                          f"listed under another name ({', '.join(names[:5])}); select other Linear layers")
    if not found:
        linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        seen = f" (it selects only {', '.join(skipped[:5])})" if skipped else ""
        raise ConfigError(f"{key}: {target_modules!r} selects no nn.Linear module{seen}; "
                          f"{user} needs at least one. Linear modules here: "
                          f"{', '.join(linear[:5]) or 'none'}{' ...' if len(linear) > 5 else ''}; "
                          "or use 'all-linear'")
    return found
