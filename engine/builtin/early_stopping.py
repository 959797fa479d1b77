"""Early stopping: stop training when ``metric_for_best_model`` stops improving.

Shipped with the engine as the plugin ``early_stopping`` (enable it by name, like any other)::

    plugins = ["early_stopping"]

    [train]
    eval_strategy = "steps"
    metric_for_best_model = "loss"      # and greater_is_better, as in Trainer

    [early_stopping]
    patience = 3                        # evaluations without improvement before stopping
    threshold = 0.0                     # an improvement must exceed this

Same rule as transformers' ``EarlyStoppingCallback``: an evaluation improves when it beats the
best value so far by more than ``threshold``; after ``patience`` evaluations in a row that do
not, the run stops (and still saves, loads the best model and writes the final model as
configured). The counter and the best value are saved in checkpoints, so a resumed run stops
where an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import hookimpl, option
from engine.builtin.best_model import improves, metric_value
from engine.errors import ConfigError

PLUGIN = "early_stopping"


@dataclass
class EarlyStoppingOptions:
    """``[early_stopping]``: how long to wait for an improvement."""

    patience: int = option(1, help="evaluations in a row without improvement before the run stops")
    threshold: float = option(0.0, help="minimum improvement of metric_for_best_model that counts")


class EarlyStopping:
    """One instance per run: the patience counter is run state."""

    name = PLUGIN

    def __init__(self):
        self.best: float | None = None
        self.evaluations_without_improvement = 0

    @hookimpl
    def plugin_options(self):
        return EarlyStoppingOptions

    @hookimpl
    def configure(self, run):
        options, train = run.config.section(PLUGIN), run.config.train
        if options.patience < 1:
            raise ConfigError(f"{PLUGIN}.patience: expected int >= 1, got {options.patience}")
        if options.threshold < 0:
            raise ConfigError(f"{PLUGIN}.threshold: expected float >= 0, got {options.threshold}")
        if train.metric_for_best_model is None:
            raise ConfigError(f"plugin {PLUGIN} needs train.metric_for_best_model (e.g. 'loss')")
        if train.eval_strategy == "no":
            raise ConfigError(f"plugin {PLUGIN} needs evaluations: set train.eval_strategy to 'steps' or 'epoch'")

    @hookimpl
    def on_evaluate(self, run, metrics):
        options = run.config.section(PLUGIN)
        value = metric_value(run, metrics)
        if improves(run, value, self.best, options.threshold):
            self.best, self.evaluations_without_improvement = value, 0
            return
        self.evaluations_without_improvement += 1
        if self.evaluations_without_improvement >= options.patience:
            reason = (f"{run.config.train.metric_for_best_model} did not improve on {self.best} for "
                      f"{self.evaluations_without_improvement} evaluations")
            run.control.request_stop(reason)

    @hookimpl
    def on_restart(self, run):
        self.best, self.evaluations_without_improvement = None, 0

    @hookimpl
    def checkpoint_state(self, run):
        return {"best": self.best, "evaluations_without_improvement": self.evaluations_without_improvement}

    @hookimpl
    def load_checkpoint_state(self, run, state):
        self.best = state.get("best")
        self.evaluations_without_improvement = state.get("evaluations_without_improvement", 0)
