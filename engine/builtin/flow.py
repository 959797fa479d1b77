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

from engine import hookimpl


class Flow:
    """One instance per run: the intervals, read once at the start of training (0: not by steps)."""

    # the [train] keys it owns
    TRAIN_KEYS = ("logging_strategy", "logging_steps", "logging_first_step", "eval_strategy", "eval_steps", "eval_delay",
                  "save_strategy", "save_steps")

    def __init__(self):
        self.log_every = self.eval_every = self.save_every = 0
        self.log_first = False

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
