"""A trial of a hyper-parameter search, seen from inside its run.

:class:`TrialReporter` is a plugin: at every evaluation it computes the search's objective from the
metrics and reports it (``report(value, step)``); when the search answers that the trial should be
pruned, it raises :class:`engine.errors.TrialPruned`, which ends the run with status "pruned" in
run.json. The decision is the main process's, broadcast to the others, so a distributed trial stops
on every rank at the same step.

``Run.hyperparameter_search`` adds a reporter to each trial's run (engine/tooling/search.py);
``engine sweep`` runs each trial as ``engine train trial-<n>/run.toml`` with the plugin
``sweep_trial`` enabled through ``ENGINE_PLUGINS`` and told its trial by ``ENGINE_SWEEP_TRIAL``
(engine/tooling/sweep.py), so the run file itself stays the user's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Sequence

from engine import hookimpl
from engine.errors import ConfigError, TrialPruned
from engine.tooling.space import make_pruner, metric_key

TRIAL_ENV = "ENGINE_SWEEP_TRIAL"  # JSON: {"storage", "study", "trial_id", "pruner", "objective"}: engine sweep
SPEED_SUFFIXES = ("_runtime", "_per_second")  # not a result: Trainer's default objective leaves them out


def default_objective(metrics: dict[str, float]) -> float:
    """Trainer's ``default_compute_objective``: the evaluation loss, or the sum of the other metrics when
    ``compute_metrics`` gave any (``epoch`` and speed metrics left out)."""
    rest = {key: value for key, value in metrics.items()
            if key not in ("eval_loss", "epoch") and not key.endswith(SPEED_SUFFIXES)}
    return metrics.get("eval_loss") if not rest else sum(rest.values())


def named_objective(names: Sequence[str]) -> Callable[[dict[str, float]], float | list[float]]:
    """The objective of metrics named by the user: one value, or a list for several."""
    keys = [metric_key(name) for name in names]

    def objective(metrics: dict[str, float]) -> float | list[float]:
        missing = [key for key in keys if key not in metrics]
        if missing:
            shown = ", ".join(sorted(key for key in metrics if not key.endswith(SPEED_SUFFIXES)))
            raise ConfigError(f"objective {', '.join(missing)}: the evaluation gave {shown}; name one of those")
        values = [float(metrics[key]) for key in keys]
        return values[0] if len(values) == 1 else values

    return objective


class TrialReporter:
    """Reports each evaluation's objective to the search; prunes the run when the search says so.

    ``report(value, step) -> bool`` is the search's (True: prune). ``final_evaluation``: when training
    ends without an evaluation, evaluate once, as Trainer does in a search, so every trial has an
    objective. ``objective`` holds the last value.
    """

    name = "sweep_trial"

    def __init__(self, report: Callable[[Any, int], bool] | None = None,
                 compute_objective: Callable[[dict[str, float]], Any] | None = None, final_evaluation: bool = True):
        self.report = report
        self.compute_objective = compute_objective or default_objective
        self.final_evaluation = final_evaluation
        self.objective: Any = None
        self.ending = False

    @hookimpl
    def on_evaluate(self, run, metrics):
        self.objective = self.compute_objective(dict(metrics))
        if self.ending or self.report is None:
            return
        prune = bool(self.report(self.objective, run.state.global_step)) if run.strategy.is_main_process else None
        if run.strategy.broadcast_object(prune):
            raise TrialPruned(f"the search pruned this trial at step {run.state.global_step} "
                              f"(objective {self.objective!r})")

    @hookimpl
    def on_train_end(self, run):
        self.ending = True
        if self.objective is None and self.final_evaluation:
            run.evaluate()


class EnvironmentTrial(TrialReporter):
    """The plugin ``sweep_trial``: the trial ``ENGINE_SWEEP_TRIAL`` names, in an Optuna study's storage
    (``engine sweep`` sets both). Without the variable it reports nothing and changes nothing."""

    def __init__(self):
        spec = json.loads(os.environ.get(TRIAL_ENV) or "{}")
        names = spec.get("objective")
        report = self._report if spec.get("prune") else None
        if spec.get("tune"):  # Ray Tune: the trial's actor answers each evaluation (engine/tooling/sweep_ray.py)
            from engine.tooling.ray_trial import TuneExchange

            report = TuneExchange(spec["tune"]).ask
        super().__init__(report, named_objective(names) if names else None, final_evaluation=False)
        self.spec = spec
        self.trial = None

    def _report(self, value: Any, step: int) -> bool:
        if not math.isfinite(value):
            return True  # a nan objective: nothing to learn from the rest of the trial
        if self.trial is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = optuna.load_study(study_name=self.spec["study"], storage=self.spec["storage"],
                                      pruner=make_pruner(self.spec["pruner"]))
            self.trial = optuna.trial.Trial(study, self.spec["trial_id"])
        self.trial.report(value, step)
        return self.trial.should_prune()
