"""Console output: tqdm progress bars on a terminal, one line per log event.

On a terminal (stderr is a tty) the main process draws a training bar (steps done/total, rate,
time left, and in its postfix the latest logged loss and learning rate: values the loop has
already read at its log steps, so the bar adds no host sync) and a second bar while evaluating
or predicting. Log lines are written above the bars (``tqdm.write``). Without a terminal, or with
``train.disable_tqdm``, no bar is drawn and no carriage return written: only the log lines
(none with ``disable_tqdm``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from engine import hookimpl
from engine.config import option

# tqdm redraws at most this often (seconds); between redraws an update is a counter increment
REFRESH_S = 0.2


def format_metrics(metrics: dict) -> str:
    parts = []
    for key, value in metrics.items():
        if isinstance(value, float):
            value = f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
        parts.append(f"{key}={value}")
    return " ".join(parts)


@dataclass
class ConsoleOptions:
    """``[train]`` keys of builtin.console: the progress bar."""

    disable_tqdm: bool = option(False, shared=True, help="no console progress bar")


class Console:
    """One instance per run (see ``BUILTIN_PLUGINS``)."""

    TRAIN_OPTIONS = ConsoleOptions  # the [train] keys it reads: engine.config.TrainConfig has them

    def __init__(self):
        self.bar = None  # training
        self.eval_bar = None

    def _draws(self, run) -> bool:
        return (not run.config.train.disable_tqdm and run.strategy is not None and run.strategy.is_main_process
                and sys.stderr.isatty())

    @staticmethod
    def _bar(**kwargs):
        from tqdm.auto import tqdm

        return tqdm(file=sys.stderr, dynamic_ncols=True, mininterval=REFRESH_S, **kwargs)

    @hookimpl
    def on_train_start(self, run):
        if self._draws(run):
            state = run.state
            self.bar = self._bar(total=state.max_steps, initial=state.global_step, desc="train", unit="step")

    @hookimpl
    def on_step_end(self, run):
        if self.bar is not None:
            self.bar.update(run.state.global_step - self.bar.n)

    @hookimpl
    def on_restart(self, run):
        if self.bar is not None:  # auto_find_batch_size: the steps count again from 0, and may be more now
            self.bar.reset(total=run.state.max_steps)

    @hookimpl
    def on_prediction_step(self, run, step, total):
        if step == 1 and self._draws(run):
            self._close_eval_bar()
            # below the training bar, cleared when done
            self.eval_bar = self._bar(total=total, desc="eval", unit="batch", leave=False,
                                      position=1 if self.bar is not None else 0)
        if self.eval_bar is not None:
            self.eval_bar.update(1)
            if step == total:
                self._close_eval_bar()

    def _close_eval_bar(self) -> None:
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if run.config.train.disable_tqdm:
            return
        self._close_eval_bar()
        line = f"step {step}: {format_metrics(metrics)}"
        if self.bar is None:
            print(line, flush=True)
            return
        self.bar.write(line, file=sys.stdout)
        if "loss" in metrics:
            postfix = {"loss": f"{metrics['loss']:.4g}"}
            if isinstance(metrics.get("learning_rate"), float):
                postfix["lr"] = f"{metrics['learning_rate']:.3g}"
            self.bar.set_postfix(postfix, refresh=False)

    @hookimpl
    def on_train_end(self, run):
        self._close()

    @hookimpl
    def log_finish(self, run, status):
        self._close()  # also when training ended by an error

    def _close(self) -> None:
        self._close_eval_bar()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
