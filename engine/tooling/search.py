"""``Run.hyperparameter_search``: Trainer's search, with each trial an ordinary run.

A trial is ``Run(**run.arguments)`` again, with the original overrides, then
``train.output_dir=<output_dir>/run-<n>`` and the trial's parameters as ``--set`` strings
(:func:`engine.tooling.space.as_overrides`: a bare key is a ``[train]`` key, ``"peft.r"`` a plugin's),
and a :class:`~engine.tooling.trial.TrialReporter` among its plugins. So a trial composes, checks its
config and writes its folder (run.json, metrics, checkpoints) as any run does, and an ``hp_space`` key
that is no key of the run is refused in one line before the search starts (:meth:`Trials.check`
composes a run with one point of the space).

Backends, as Trainer's ``run_hp_search_optuna`` / ``run_hp_search_ray`` use them:

* ``optuna``: ``kwargs`` go to ``optuna.create_study``, except ``timeout``, ``n_jobs``,
  ``gc_after_trial`` and ``catch``, which go to ``study.optimize``. A single objective is reported at
  every evaluation; a trial the pruner stops ends with status "pruned" in its run.json.
* ``ray``: ``ray.tune.Tuner`` over ``tune.with_parameters`` (the run's arguments travel once, through
  Ray's object store). ``kwargs``: ``resources_per_trial`` (default 1 CPU, and 1 GPU where there is
  one), ``scheduler``, ``search_alg``, ``max_concurrent_trials``, ``time_budget_s`` (the TuneConfig),
  ``storage_path`` (default ``<output_dir>/ray_results``), ``name``, ``stop``, ``callbacks``,
  ``verbose`` (the RunConfig). Ray is the one the caller started, else ``Tuner`` starts it (on the
  cluster ``RAY_ADDRESS`` names, or a local one). The best trial is chosen over ``train.ray_scope``
  (else ``$RAY_SCOPE``, else "last"), as Trainer's ``ray_scope``.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine import Run
from engine.config import toml_value
from engine.errors import ConfigError, TrialPruned
from engine.tooling.space import as_overrides
from engine.tooling.trial import TrialReporter, default_objective

BACKENDS = {"optuna": "sweep", "ray": "ray"}  # the backend (its module's name): the engine's extra
STUDY_OPTIMIZE = ("timeout", "n_jobs", "gc_after_trial", "catch")  # Trainer's split of the optuna kwargs
TUNE_CONFIG = ("scheduler", "search_alg", "max_concurrent_trials", "time_budget_s")
RUN_CONFIG = ("name", "stop", "callbacks", "verbose")


def hyperparameter_search(run: Run, hp_space: Callable[[Any], dict[str, Any]] | None,
                          compute_objective: Callable[[dict[str, float]], Any] | None, n_trials: int,
                          direction: str | list[str], backend: str | None, hp_name: Callable[[Any], str] | None,
                          kwargs: dict[str, Any]) -> Any:
    """Trainer's ``hyperparameter_search``: the best trial as ``BestRun`` (a list of them for several
    directions, with Optuna)."""
    backend = _backend(backend)
    if run.arguments["model_init"] is None:
        raise ConfigError("Run.hyperparameter_search: pass Run(model_init=...), a function returning a fresh "
                          "model: every trial trains its own")
    if run.arguments["optimizers"] is not None:  # incompatible under Trainer too
        raise ConfigError("Run.hyperparameter_search: Run(optimizers=...) holds one model's parameters and every "
                          "trial trains its own: pass optimizer_cls_and_kwargs=(cls, kwargs), or set train.optim")
    if hp_space is None:
        from transformers.trainer_utils import default_hp_space_optuna, default_hp_space_ray

        hp_space = default_hp_space_optuna if backend == "optuna" else default_hp_space_ray
    trials = Trials(run.arguments, run.config.train, hp_space, compute_objective or default_objective, hp_name)
    search = _optuna if backend == "optuna" else _ray
    return search(trials, n_trials, direction, dict(kwargs))


def _backend(backend: str | None) -> str:
    """The backend's name, installed; None: the first installed of optuna, ray (Trainer's order)."""
    import importlib.util

    def installed(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    backend = getattr(backend, "value", backend)  # Trainer's HPSearchBackend
    if backend is None:
        backend = next((name for name in BACKENDS if installed(name)), None)
        if backend is None:
            raise ConfigError("Run.hyperparameter_search: no search backend is installed: "
                              "pip install 'engine[sweep]' (optuna) or 'engine[ray]' (Ray Tune)")
    if backend in ("wandb", "sigopt"):  # Trainer's others
        why = " (W&B sweeps need the W&B server)" if backend == "wandb" else ""
        raise ConfigError(f"Run.hyperparameter_search: backend {backend!r} is not supported{why}; the engine's "
                          "backends are 'optuna' and 'ray'")
    if backend not in BACKENDS:
        raise ConfigError(f"Run.hyperparameter_search: unknown backend {backend!r}; choose 'optuna' or 'ray'")
    if not installed(backend):
        raise ConfigError(f"Run.hyperparameter_search: backend {backend!r} is not installed: "
                          f"pip install 'engine[{BACKENDS[backend]}]'")
    return backend


@dataclass
class Trials:
    """What makes each trial's run: the original run's arguments and config, and the search's functions."""

    arguments: dict[str, Any]
    train: Any  # the original run's [train] section
    hp_space: Callable[[Any], dict[str, Any]]
    compute_objective: Callable[[dict[str, float]], Any]
    hp_name: Callable[[Any], str] | None

    def run(self, trial: Any, params: dict[str, Any], run_id: str, output_dir: str | Path,
            report: Callable[[Any, int], bool] | None) -> TrialReporter:
        """Train the trial's run; the reporter holds its objective. ``trial`` is what ``hp_name`` and a
        one-argument ``model_init`` get (Trainer's: the optuna trial, or Ray's config)."""
        name = self.hp_name(trial) if self.hp_name is not None else f"run-{run_id}"
        reporter = TrialReporter(report, self.compute_objective)
        plugins = self.arguments["plugins"]
        plugins = {**plugins, reporter.name: reporter} if isinstance(plugins, dict) else [*(plugins or ()), reporter]
        Run(**{**self.arguments, "overrides": self.overrides(params, Path(output_dir) / name), "plugins": plugins,
               "model_init": _with_trial(self.arguments["model_init"], trial)}).train()
        return reporter

    def overrides(self, params: dict[str, Any], output_dir: Path | None = None) -> list[str]:
        """The original run's overrides, then the trial's folder and its parameters."""
        folder = [f"train.output_dir={toml_value(str(output_dir))}"] if output_dir is not None else []
        return [*self.arguments["overrides"], *folder, *as_overrides(self.cast(params))]

    def cast(self, params: dict[str, Any]) -> dict[str, Any]:
        """Plain Python values; a ``[train]`` number cast to the type of the run's value, as Trainer casts
        them (Ray's default space draws ``seed`` from a uniform float)."""
        cast = {}
        for key, value in params.items():
            value = value.item() if hasattr(value, "item") else value  # numpy scalars (Ray's samplers)
            section, _, name = key.rpartition(".")
            current = getattr(self.train, name, None) if section in ("", "train") else None
            if type(current) in (int, float) and type(value) in (int, float):
                value = type(current)(value)
            cast[key] = value
        return cast

    def check(self, params: dict[str, Any]) -> None:
        """Compose a trial's run with ``params`` (nothing trains): an unknown key or a bad value is refused
        here, in one line, before any trial starts."""
        Run(**{**self.arguments, "overrides": self.overrides(params)})
        try:  # every objective comes from an evaluation: the data builtin's check of a run that evaluates, asked
            Run(**{**self.arguments, "overrides": [*self.overrides(params), "train.eval_on_start=true"]})
        except ConfigError:
            raise ConfigError("Run.hyperparameter_search: each trial's objective comes from an evaluation, but the "
                              "run has no evaluation data: pass eval_dataset, or set data.eval or data.eval_split"
                              ) from None


def _with_trial(model_init: Callable[..., Any], trial: Any) -> Callable[..., Any]:
    """``model_init`` as Trainer calls it in a search: with the trial when it takes one argument."""
    return functools.partial(model_init, trial) if len(inspect.signature(model_init).parameters) == 1 else model_init


# ---------------------------------------------------------------------------- optuna


def _optuna(trials: Trials, n_trials: int, direction: str | list[str], kwargs: dict[str, Any]) -> Any:
    import optuna
    from transformers.trainer_utils import BestRun

    optimize = {key: kwargs.pop(key) for key in STUDY_OPTIMIZE if key in kwargs}
    several = isinstance(direction, list)
    trials.check(trials.hp_space(_probe(optuna)))
    study = optuna.create_study(direction=None if several else direction, directions=direction if several else None,
                                **kwargs)

    def objective(trial: optuna.Trial) -> Any:
        params = trials.hp_space(trial)

        def report(value: Any, step: int) -> bool:
            trial.report(value, step)
            return trial.should_prune()

        try:
            reporter = trials.run(trial, params, str(trial.number), trials.train.output_dir,
                                  None if several else report)
        except TrialPruned:
            raise optuna.TrialPruned() from None
        return reporter.objective

    study.optimize(objective, n_trials=n_trials, **optimize)
    if several:
        return [BestRun(str(best.number), best.values, best.params) for best in study.best_trials]
    best = study.best_trial
    return BestRun(str(best.number), best.value, best.params)


def _probe(optuna: Any) -> Any:
    """A trial of a study of its own, quietly made: ``hp_space`` of it is checked before the user's study
    starts, which then holds no failed trial for a key that is no key of the run."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.create_study().ask()
    finally:
        optuna.logging.set_verbosity(verbosity)


# ---------------------------------------------------------------------------- ray


def _ray_trial(config: dict[str, Any], trials: Trials, output_dir: str, cwd: str) -> None:
    """One Ray Tune trial (a function trainable): reports each evaluation's objective, and the final one
    when training evaluated nowhere (Trainer's ``done`` report)."""
    from ray import tune

    if Path(cwd).is_dir():  # Ray starts a trial in a folder of its own: the run's relative paths are the caller's
        os.chdir(cwd)

    reported = []

    def report(value: Any, step: int) -> bool:
        reported.append(step)
        tune.report({"objective": value, "step": step})
        return False  # Ray's schedulers stop a trial themselves

    params = {key: value for key, value in config.items() if key != "wandb"}  # as Trainer's _hp_search_setup
    reporter = trials.run(config, params, tune.get_context().get_trial_id(), output_dir, report)
    if not reported:
        tune.report({"objective": reporter.objective, "done": True})


def _ray(trials: Trials, n_trials: int, direction: str | list[str], kwargs: dict[str, Any]) -> Any:
    if isinstance(direction, list):
        raise ConfigError(f"Run.hyperparameter_search: direction={direction}: several objectives need "
                          "backend='optuna'; Ray Tune ranks trials by one")
    import torch
    from ray import tune
    from transformers.trainer_utils import BestRun

    output_dir = Path(trials.train.output_dir).absolute()  # the same folder from any node's working directory
    gpu = torch.cuda.is_available() and not trials.train.use_cpu
    resources = kwargs.pop("resources_per_trial", {"cpu": 1, **({"gpu": 1} if gpu else {})})  # Trainer's default
    tune_config = {key: kwargs.pop(key) for key in TUNE_CONFIG if key in kwargs}
    run_config = {key: kwargs.pop(key) for key in RUN_CONFIG if key in kwargs}
    storage = kwargs.pop("storage_path", str(output_dir / "ray_results"))
    if kwargs:
        raise ConfigError(f"Run.hyperparameter_search: backend 'ray' takes no {', '.join(sorted(kwargs))}; it takes "
                          f"resources_per_trial, storage_path, {', '.join(TUNE_CONFIG + RUN_CONFIG)}")
    if "scheduler" in tune_config and trials.train.eval_strategy == "no":
        raise ConfigError("Run.hyperparameter_search: a Ray scheduler stops trials from their evaluations: set "
                          "train.eval_strategy = 'steps' (and eval_steps) or 'epoch'")
    space = trials.hp_space(None)
    trials.check(_sample(space))
    mode = direction[:3]
    trainable = tune.with_resources(tune.with_parameters(_ray_trial, trials=trials, output_dir=str(output_dir),
                                                         cwd=os.getcwd()), resources)
    tuner = tune.Tuner(trainable, param_space=space,
                       tune_config=tune.TuneConfig(num_samples=n_trials, metric="objective", mode=mode, **tune_config),
                       run_config=tune.RunConfig(storage_path=storage, **run_config))
    results = tuner.fit()
    failed = [result.error for result in results if result.error is not None]
    if failed:
        raise failed[0]
    best = results.get_best_result(metric="objective", mode=mode,
                                   scope=trials.train.ray_scope or os.environ.get("RAY_SCOPE", "last"))
    return BestRun(best.metrics["trial_id"], best.metrics["objective"], best.config, results)


def _sample(space: dict[str, Any]) -> dict[str, Any]:
    """One point of a Ray search space: a domain's sample, a grid's first value."""
    from ray.tune.search.sample import Domain

    return {key: value.sample() if isinstance(value, Domain) else value["grid_search"][0]
            if isinstance(value, dict) and "grid_search" in value else value for key, value in space.items()}
