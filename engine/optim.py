"""Helpers optimizer plugins share: parameter groups, ``optim_args`` checking, target modules, and
:class:`OptimizerFamily`, which declares a plugin's optimizer names once."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .config import parse_value
from .errors import ConfigError
from .util import require

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


# Keys people carry over into train.optim_args from other optimizers, by the [train] setting that
# holds them instead: an OptimizerFamily that reads the setting names it in ``reads``.
ELSEWHERE: dict[str, dict[str, str]] = {
    "learning_rate": {"lr": "set train.learning_rate", "learning_rate": "set train.learning_rate"},
    "weight_decay": {"weight_decay": "set train.weight_decay (applied per parameter group, none on biases and norms)"},
    "adam": {"betas": "set train.adam_beta1 / train.adam_beta2", "beta1": "set train.adam_beta1",
             "beta2": "set train.adam_beta2", "eps": "set train.adam_epsilon"},
}


@dataclass(frozen=True, eq=False)
class OptimizerFamily:
    """Optimizer names a plugin provides that share one ``optim_args`` table, declared once.

    The plugin states what differs; the family registers the names and makes the configure-time
    checks every optimizer plugin needs:

    * ``plugin``: the entry-point name (for a first-party plugin also the engine extra that
      installs ``library``; a third party's missing library names its pip package);
    * ``names``: the ``train.optim`` names (Trainer's);
    * ``build(run, params, args)``: the optimizer; ``params`` are :func:`param_groups` (the
      decay / no-decay split), ``args`` the checked ``train.optim_args`` (:meth:`args`);
    * ``library``: ``(module, pip package)`` the names need (:meth:`require`);
    * ``optim_args``: the keys ``train.optim_args`` may set, with Trainer's defaults (see
      :func:`check_optim_args`);
    * ``reads``: the ``[train]`` settings the optimizers take, of ``"learning_rate"``,
      ``"weight_decay"`` and ``"adam"`` (adam_beta1/2, adam_epsilon): an optim_args key that one
      of them holds (``lr``, ``betas``, ...) is refused with a hint to set it there
      (:data:`ELSEWHERE`); ``elsewhere`` adds hints of the plugin's own;
    * ``check(run, args)``: further configure-time checks (conflicts, settings it ignores);
    * ``takes_target_modules``: the names use ``train.optim_target_modules``.

    :meth:`configure` does nothing unless the run's optimizer is one of this family's names (and
    not another plugin's under the same name); then it requires the library, checks optim_args and
    calls ``check``, all before the model loads. The plugin keeps its own two hookimpls::

        def create(run, params, args):
            optimi = FAMILY.require(run.config.train.optim)
            return optimi.StableAdamW(params, lr=run.config.train.learning_rate, **args)

        FAMILY = OptimizerFamily("optimi", ("stable_adamw",), create, library=("optimi", "torch-optimi"),
                                 optim_args={"kahan_sum": OptimArg(bool, expect="true or false")},
                                 reads=("learning_rate", "weight_decay", "adam"))

        @hookimpl
        def register_optimizers(register):
            FAMILY.register(register)

        @hookimpl
        def configure(run):
            FAMILY.configure(run)
    """

    plugin: str
    names: tuple[str, ...]
    build: Callable[[Any, list[dict[str, Any]], dict[str, Any]], Any]
    library: tuple[str, str] | None = None
    optim_args: Mapping[str, OptimArg] = field(default_factory=dict)
    reads: tuple[str, ...] = ("learning_rate",)
    elsewhere: Mapping[str, str] = field(default_factory=dict)
    check: Callable[[Any, dict[str, Any]], None] | None = None
    takes_target_modules: bool = False

    def __post_init__(self) -> None:
        unknown = [setting for setting in self.reads if setting not in ELSEWHERE]
        if unknown:
            raise ValueError(f"OptimizerFamily({self.plugin!r}).reads: unknown {unknown}; use {', '.join(ELSEWHERE)}")
        object.__setattr__(self, "names", tuple(self.names))

    def register(self, register: Callable[..., None]) -> None:
        """Register every name with :meth:`create` (from the plugin's ``register_optimizers``)."""
        for name in self.names:
            register(name, self.create, takes_target_modules=self.takes_target_modules)

    def configure(self, run: Any) -> None:
        """The configure-time checks for the run's optimizer, if it is this family's (from ``configure``)."""
        optim = run.config.train.optim
        if optim not in self.names or run.registries["optimizer"].get(optim).factory != self.create:
            return  # another optimizer, or another plugin's under this name
        self.require(optim)
        args = self.args(run)
        if self.check is not None:
            self.check(run, args)

    def create(self, run: Any, params: list[dict[str, Any]]) -> Any:
        """The registered factory: ``build(run, params, args(run))``."""
        return self.build(run, params, self.args(run))

    def args(self, run: Any) -> dict[str, Any]:
        """``train.optim_args`` checked against ``optim_args``: the keyword arguments to pass on."""
        hints = {key: hint for setting in self.reads for key, hint in ELSEWHERE[setting].items()}
        return check_optim_args(run, self.optim_args, elsewhere={**hints, **self.elsewhere})

    def require(self, optim: str) -> Any:
        """The ``library`` module, or a MissingDependencyError naming ``optim`` and the extra to install."""
        if self.library is None:
            return None
        from .catalogue import FIRST_PARTY

        module, package = self.library
        # a first-party family installs through the engine's extra; a third party's names its package
        return require(module, package, feature=f"train.optim = {optim!r}",
                       extra=self.plugin if self.plugin in FIRST_PARTY else None)
