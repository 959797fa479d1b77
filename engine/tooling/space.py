"""The search space of ``engine sweep``: a TOML file shaped like the run file it varies.

::

    objective = "eval_loss"          # the metric(s) to optimise; default: Trainer's default objective
    direction = "minimize"           # or "maximize"; a list with several objectives
    sampler = "tpe"                  # "tpe", "random" or "grid" (every combination of the values)
    seed = 0                         # the sampler's seed: the same seed tries the same parameters
    pruner = "median"                # "median", "percentile", "hyperband", "successive_halving", "none",
                                     #   or a table: { type = "median", n_startup_trials = 2 }

    [train]
    learning_rate = { low = 1e-5, high = 1e-2, log = true }   # a float (log scale)
    warmup_steps = { low = 0, high = 50, step = 10 }          # an int: both bounds are ints
    lr_scheduler_type = { values = ["linear", "cosine"] }     # a categorical

    [peft]
    r = { values = [8, 16, 32] }                              # any plugin's key

Each parameter is named by its key path (``train.learning_rate``); its values reach the trial's run
as ``--set`` would set them (:func:`as_overrides`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import read_run_file, toml_value
from engine.errors import ConfigError

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "percentile", "hyperband", "successive_halving", "none")
DIRECTIONS = ("minimize", "maximize")
PARAMETER_FIELDS = ("type", "low", "high", "log", "step", "values")
SETTINGS = ("objective", "direction", "sampler", "seed", "pruner")


@dataclass
class Parameter:
    """One key to vary: a float or int range (``log``, ``step``) or categorical ``values``."""

    key: str
    type: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    values: list[Any] = field(default_factory=list)

    def suggest(self, trial: Any) -> Any:
        """This parameter's value for an Optuna trial."""
        if self.type == "categorical":
            return trial.suggest_categorical(self.key, self.values)
        suggest = trial.suggest_int if self.type == "int" else trial.suggest_float
        return suggest(self.key, self.low, self.high, log=self.log, **({"step": self.step} if self.step else {}))

    def corners(self) -> list[Any]:
        """The values that bound what a trial may get: checked against the run before the sweep starts."""
        return list(self.values) if self.type == "categorical" else [self.low, self.high]

    def as_json(self) -> dict[str, Any]:
        shown = {"type": self.type}
        if self.type == "categorical":
            return {**shown, "values": self.values}
        return {**shown, "low": self.low, "high": self.high, "log": self.log,
                **({"step": self.step} if self.step else {})}


@dataclass
class Space:
    """The parameters and the settings of a search space file."""

    parameters: list[Parameter]
    objective: list[str] | None = None  # None: Trainer's default objective (eval_loss, or the sum of the metrics)
    directions: list[str] = field(default_factory=lambda: ["minimize"])
    sampler: str = "tpe"
    seed: int = 0
    pruner: dict[str, Any] = field(default_factory=lambda: {"type": "median"})

    @property
    def needs_evaluation(self) -> bool:
        return self.objective is None or any(metric_key(name).startswith("eval_") for name in self.objective)

    def suggest(self, trial: Any) -> dict[str, Any]:
        return {parameter.key: parameter.suggest(trial) for parameter in self.parameters}

    def grid(self) -> dict[str, list[Any]]:
        """The grid sampler's search space: every parameter categorical."""
        return {parameter.key: parameter.values for parameter in self.parameters}

    def make_sampler(self, seed: int) -> Any:
        import optuna

        if self.sampler == "grid":
            return optuna.samplers.GridSampler(self.grid(), seed=seed)
        if self.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(seed=seed)

    def make_pruner(self) -> Any:
        return make_pruner(self.pruner)


def make_pruner(spec: dict[str, Any]) -> Any:
    """The Optuna pruner a space's ``pruner`` setting names (also made again in each trial's process, where
    the study is loaded from its storage: a storage keeps no pruner)."""
    import optuna

    options = {key: value for key, value in spec.items() if key != "type"}
    kinds = {"median": optuna.pruners.MedianPruner, "percentile": optuna.pruners.PercentilePruner,
             "hyperband": optuna.pruners.HyperbandPruner, "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
             "none": optuna.pruners.NopPruner}
    try:
        return kinds[spec["type"]](**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"pruner: {exc}; see optuna.pruners.{kinds[spec['type']].__name__}") from None


def metric_key(name: str) -> str:
    """``accuracy`` -> ``eval_accuracy``, as Trainer reads ``metric_for_best_model``; other prefixes kept."""
    return name if name.startswith(("eval_", "train_", "test_")) or name in ("loss", "epoch") else f"eval_{name}"


def as_overrides(params: dict[str, Any]) -> list[str]:
    """``{"train.learning_rate": 0.001, "warmup_steps": 5}`` -> ``--set`` strings (a bare key is a [train] key)."""
    return [f"{key if '.' in key else 'train.' + key}={toml_value(value)}" for key, value in params.items()]


def read_space(path: str | Path) -> Space:
    """The space file at ``path``, checked: every error is one line naming the file and the key."""
    try:
        raw = read_run_file(path)
    except ConfigError as exc:  # read as a run file is: its messages name a run file
        raise ConfigError(f"--space: {str(exc).replace('run file', 'space file')}") from None
    where = Path(path).name
    unknown = [key for key, value in raw.items() if not isinstance(value, dict) and key not in SETTINGS]
    if unknown:
        raise ConfigError(f"{where}: unknown setting {unknown[0]!r}; the settings are {', '.join(SETTINGS)}, and "
                          "each [section] holds the keys to vary")
    parameters = [_parameter(f"{section}.{key}", spec, where) for section, table in raw.items()
                  if isinstance(table, dict) and section not in SETTINGS for key, spec in table.items()]
    if not parameters:
        raise ConfigError(f"{where}: no parameter to vary; add e.g. [train] learning_rate = {{ low = 1e-5, "
                          "high = 1e-3, log = true }")
    space = Space(parameters, **_settings(raw, where))
    if space.sampler == "grid":
        ranged = [parameter.key for parameter in parameters if parameter.type != "categorical"]
        if ranged:
            raise ConfigError(f"{where}: sampler = \"grid\" needs values for every key; {ranged[0]} is a range")
    return space


def _settings(raw: dict[str, Any], where: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    objective = raw.get("objective")
    if objective is not None:
        names = [objective] if isinstance(objective, str) else objective
        if not isinstance(names, list) or not names or not all(isinstance(name, str) and name for name in names):
            raise ConfigError(f"{where}: objective: expected a metric name or a list of them, got {objective!r}")
        settings["objective"] = names
    direction = raw.get("direction", "minimize")
    directions = [direction] if isinstance(direction, str) else direction
    if not isinstance(directions, list) or not all(item in DIRECTIONS for item in directions):
        raise ConfigError(f"{where}: direction: expected \"minimize\" or \"maximize\" (a list of them with several "
                          f"objectives), got {direction!r}")
    count = len(settings.get("objective") or ["default"])
    if len(directions) == 1 and count > 1:
        directions = directions * count
    if len(directions) != count:
        raise ConfigError(f"{where}: direction: {len(directions)} directions for {count} objectives; give one each")
    settings["directions"] = directions
    sampler = raw.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        raise ConfigError(f"{where}: sampler: expected one of {', '.join(SAMPLERS)}, got {sampler!r}")
    settings["sampler"] = sampler
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"{where}: seed: expected an int >= 0, got {seed!r}")
    settings["seed"] = seed
    pruner = raw.get("pruner", "median")
    pruner = {"type": pruner} if isinstance(pruner, str) else pruner
    if not isinstance(pruner, dict) or pruner.get("type") not in PRUNERS:
        raise ConfigError(f"{where}: pruner: expected one of {', '.join(PRUNERS)} (or a table with type = one of "
                          f"them), got {raw.get('pruner')!r}")
    settings["pruner"] = pruner
    return settings


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parameter(key: str, spec: Any, where: str) -> Parameter:
    name = f"{where}: {key}"
    if not isinstance(spec, dict):
        raise ConfigError(f"{name}: expected a table such as {{ low = 1e-5, high = 1e-3, log = true }} or "
                          f"{{ values = [...] }}, got {spec!r}")
    unknown = [item for item in spec if item not in PARAMETER_FIELDS]
    if unknown:
        raise ConfigError(f"{name}: unknown field {unknown[0]!r}; a parameter has {', '.join(PARAMETER_FIELDS)}")
    kind = spec.get("type") or ("categorical" if "values" in spec else
                                "int" if all(isinstance(spec.get(bound), int) and not isinstance(spec.get(bound), bool)
                                             for bound in ("low", "high")) else "float")
    if kind not in ("float", "int", "categorical"):
        raise ConfigError(f"{name}: type: expected float, int or categorical, got {kind!r}")
    if kind == "categorical":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{name}: a categorical needs values = [...] with at least one value")
        if any(isinstance(value, (dict, list)) for value in values):
            raise ConfigError(f"{name}: values: each value a number, a string or a bool")
        extra = [item for item in ("low", "high", "log", "step") if item in spec]
        if extra:
            raise ConfigError(f"{name}: {extra[0]} goes with a range (low, high), not with values")
        return Parameter(key, kind, values=values)
    low, high, log, step = spec.get("low"), spec.get("high"), spec.get("log", False), spec.get("step")
    if not (_is_number(low) and _is_number(high)):
        raise ConfigError(f"{name}: a range needs numbers low and high (or values = [...]), got low={low!r}, "
                          f"high={high!r}")
    if kind == "int" and not all(isinstance(bound, int) for bound in (low, high)):
        raise ConfigError(f"{name}: an int range needs int bounds, got low={low!r}, high={high!r}")
    if low > high:
        raise ConfigError(f"{name}: the range is empty (low {low!r} > high {high!r})")
    if not isinstance(log, bool):
        raise ConfigError(f"{name}: log: expected true or false, got {log!r}")
    if log and low <= 0:
        raise ConfigError(f"{name}: log = true needs low > 0, got low={low!r}")
    if step is not None and (not _is_number(step) or step <= 0 or (kind == "int" and not isinstance(step, int))):
        raise ConfigError(f"{name}: step: expected a number > 0 ({'an int ' if kind == 'int' else ''}), got {step!r}")
    if step is not None and log:
        raise ConfigError(f"{name}: step and log = true do not go together (Optuna samples one or the other)")
    return Parameter(key, kind, float(low) if kind == "float" else low, float(high) if kind == "float" else high,
                     log, step)
