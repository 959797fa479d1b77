"""When to log, evaluate and save, as a builtin plugin (Trainer's ``DefaultFlowCallback``).

After each step and each epoch it turns on ``run.control.should_log`` / ``should_evaluate`` /
``should_save`` where the run's schedule says so; the loop then logs, evaluates and saves, in that
order. It runs before other plugins' ``on_step_end`` / ``on_epoch_end`` (as Trainer's flow callback
comes first), which may turn on more; what the schedule asks for is not turned off.

* ``logging_strategy = "steps"``: every ``logging_steps`` steps, at the last step, and at step 1
  with ``logging_first_step``; ``"epoch"``: at each epoch's end.
* ``eval_strategy = "steps"``: every ``eval_steps`` steps (default ``logging_steps``); ``"epoch"``:
  at each epoch's end; neither before ``eval_delay`` (steps, or epochs for ``"epoch"``).
* ``save_strategy = "steps"``: every ``save_steps`` steps; ``"epoch"``: at each epoch's end
  (``"best"``: the best model builtin asks after an evaluation that improved).

``[train]`` keys read: ``logging_strategy``, ``logging_steps``, ``logging_first_step``,
``eval_strategy``, ``eval_steps``, ``eval_delay``, ``save_strategy``, ``save_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine import hookimpl
from engine.config import option
from engine.errors import ConfigError


@dataclass
class FlowOptions:
    """``[train]`` keys of builtin.flow: when to log, evaluate and save."""

    logging_steps: int = option(10, min=1, help="log metrics every N optimizer steps")
    logging_first_step: bool = option(False, help="also log after the first step")
    logging_strategy: Literal["no", "steps", "epoch"] = option("steps", help=(
        "when to log the training loss: every logging_steps steps (and the last), at each epoch's end, or never"))
    eval_strategy: Literal["no", "steps", "epoch"] = option("no", help="when to evaluate")
    eval_steps: int | None = option(None, min=1, help="evaluate every N steps (default: logging_steps)")
    eval_delay: float = option(0.0, min=0, help=(
        "no evaluation before this step (eval_strategy 'steps') or epoch (eval_strategy 'epoch')"))
    save_strategy: Literal["no", "steps", "epoch", "best"] = option("steps", help=(
        "when to save a checkpoint; 'best': after each evaluation that improves metric_for_best_model"))
    save_steps: int = option(500, min=1, help="save every N steps when save_strategy = 'steps'")


class Flow:
    """One instance per run: the intervals, read once at the start of training (0: not by steps)."""

    TRAIN_OPTIONS = FlowOptions  # the [train] keys it reads: engine.config.TrainConfig has them

    def __init__(self):
        self.log_every = self.eval_every = self.save_every = 0
        self.log_first = False

    # tryfirst: before the enabled plugins' configure, after builtin.best_model's (registered later: called
    # first), which fills in metric_for_best_model
    @hookimpl(tryfirst=True)
    def configure(self, run):
        train = run.config.train
        if train.save_strategy == "best" and (train.metric_for_best_model is None or train.eval_strategy == "no"):
            raise ConfigError("train.save_strategy = 'best' saves after evaluations that improve a metric: set "
                              "train.metric_for_best_model and train.eval_strategy")

    @hookimpl
    def on_train_start(self, run):
        train = run.config.train
        self.log_every = train.logging_steps if train.logging_strategy == "steps" else 0
        self.log_first = train.logging_first_step
        self.eval_every = (train.eval_steps or train.logging_steps) if train.eval_strategy == "steps" else 0
        self.save_every = train.save_steps if train.save_strategy == "steps" else 0

    @hookimpl(tryfirst=True)
    def on_step_end(self, run):
        step, control = run.state.global_step, run.control
        if self.log_every and (step % self.log_every == 0 or step >= run.state.max_steps) or \
                (self.log_first and step == 1):
            control.should_log = True
        if self.eval_every and step % self.eval_every == 0 and step >= run.config.train.eval_delay:
            control.should_evaluate = True
        if self.save_every and step % self.save_every == 0:
            control.should_save = True

    @hookimpl(tryfirst=True)
    def on_epoch_end(self, run):
        train, control = run.config.train, run.control
        if train.logging_strategy == "epoch":
            control.should_log = True
        if train.eval_strategy == "epoch" and run.state.epoch >= train.eval_delay:
            control.should_evaluate = True
        if train.save_strategy == "epoch":
            control.should_save = True
