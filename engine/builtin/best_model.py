"""The best model, as a builtin plugin (Lightning's ModelCheckpoint: when to save, which checkpoints
to keep, the best path, in one place).

* After each evaluation of the training loop (not ``eval_on_start``, as Trainer), the value of
  ``train.metric_for_best_model`` is compared with the best so far (``greater_is_better``); an
  improvement is noted in ``run.state`` (``best_metric``, ``best_global_step``), and with
  ``save_strategy = "best"`` asks for a checkpoint at that step.
* A checkpoint written at the best step becomes ``run.state.best_model_checkpoint`` (saved in its
  trainer_state.json, as Trainer's TrainerState has it).
* ``save_total_limit``: after each checkpoint, this run's oldest beyond the limit are deleted, never
  the best one.
* ``load_best_model_at_end``: the best checkpoint's weights are loaded before the final save.

Early stopping compares with :func:`improves` and :func:`metric_value` too.

``[train]`` keys read: ``metric_for_best_model``, ``greater_is_better``, ``save_strategy``,
``save_total_limit``, ``load_best_model_at_end``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from engine import hookimpl
from engine.checkpoint import delete_folder, list_checkpoints
from engine.config import option
from engine.errors import ConfigError
from engine.kit.checkpoint import check_model_folder
from engine.layout import PREFIX
from engine.state import RunView

logger = logging.getLogger("engine")


def best_metric_name(run: RunView) -> str | None:
    """``train.metric_for_best_model`` as an evaluation key (``loss`` -> ``eval_loss``)."""
    name = run.config.train.metric_for_best_model
    if name is None:
        return None
    return name if name.startswith("eval_") else f"eval_{name}"


def metric_value(run: RunView, metrics: dict[str, float]) -> float:
    """The value of ``metric_for_best_model`` in ``metrics``; a clear error when absent."""
    name = best_metric_name(run)
    if name not in metrics:
        raise ConfigError(f"train.metric_for_best_model: {name!r} is not among the evaluation metrics "
                          f"({', '.join(sorted(metrics))})")
    value = metrics[name]
    return float(value) if value is not None else math.nan


def improves(run: RunView, value: float, reference: float | None, threshold: float = 0.0) -> bool:
    """Whether ``value`` beats ``reference`` by more than ``threshold`` in the configured direction.

    A non-finite value (a nan evaluation) never improves on anything.
    """
    if not math.isfinite(value):
        return False
    if reference is None:
        return True
    gain = value - reference if run.config.train.greater_is_better else reference - value
    return gain > threshold


def note_evaluation(run: RunView, metrics: dict[str, float]) -> bool:
    """Track the best metric (Trainer's rule); whether this evaluation is the new best."""
    value = metric_value(run, metrics)
    state = run.state
    if not math.isfinite(value):
        logger.warning("%s is %s at step %d: not a candidate for the best model", best_metric_name(run), value,
                       state.global_step)
        return False
    if not improves(run, value, state.best_metric):
        return False
    state.best_metric, state.best_global_step = value, state.global_step
    return True


def rotate(run: RunView) -> None:
    """Delete this run's oldest checkpoints beyond ``save_total_limit``, never the best one.

    As in Trainer: the best checkpoint is kept in the second-newest slot, so with a limit of 1
    and a best that is not the newest, two are kept.
    """
    limit = run.config.train.save_total_limit
    if not limit:
        return
    ordered = list_checkpoints(run.output_dir, run.run_id)
    best = run.state.best_model_checkpoint
    best_path = next((p for p in ordered if str(p) == best), None)
    if best_path is not None and best_path != ordered[-1]:
        ordered.remove(best_path)
        ordered.insert(len(ordered) - 1, best_path)
        limit = max(limit, 2)
    for path in ordered[: max(0, len(ordered) - limit)]:
        delete_folder(path)


def load_best_model(run: RunView) -> None:
    """Load the best checkpoint's weights into the model (``load_best_model_at_end``)."""
    best = run.state.best_model_checkpoint
    if best is None:
        logger.warning("load_best_model_at_end: no checkpoint was saved after an evaluation; "
                       "keeping the last weights")
        return
    check_model_folder(Path(best), "load_best_model_at_end")
    run.strategy.load_model_weights(run.model, Path(best))
    logger.info("loaded the best model from %s (%s = %s)", best, best_metric_name(run), run.state.best_metric)


@dataclass
class BestModelOptions:
    """``[train]`` keys of builtin.best_model: ranking checkpoints, keeping and loading the best."""

    save_total_limit: int | None = option(None, min=1, help=(
        "keep at most this many checkpoints (oldest deleted first; the best one is always kept)"))
    load_best_model_at_end: bool = option(False, help=(
        "track the best checkpoint by metric_for_best_model and load it when training ends"))
    metric_for_best_model: str | None = option(None, help=(
        "evaluation metric that ranks checkpoints, e.g. 'loss' or 'eval_accuracy' "
        "(default: 'loss' when load_best_model_at_end)"))
    greater_is_better: bool | None = option(None, help=(
        "whether a larger metric_for_best_model is better (default: false for *loss, else true)"))


class BestModel:
    """One instance per run: whether evaluations are candidates yet (the loop's, not eval_on_start's)."""

    TRAIN_OPTIONS = BestModelOptions  # the [train] keys it reads: engine.config.TrainConfig has them

    strict = True  # a failed rotation ends the run, as it did when the save itself rotated

    def __init__(self):
        self.candidates = False

    @hookimpl(tryfirst=True)  # the defaults before other plugins read them (early_stopping, flow's 'best' check)
    def configure(self, run):
        train = run.config.train
        # defaults that depend on other keys, as TrainingArguments resolves them
        if train.load_best_model_at_end and train.metric_for_best_model is None:
            train.metric_for_best_model = "loss"
        if train.metric_for_best_model is not None and train.greater_is_better is None:
            train.greater_is_better = not train.metric_for_best_model.endswith("loss")
        if train.load_best_model_at_end:
            if train.eval_strategy == "no":
                raise ConfigError("train.load_best_model_at_end needs evaluations: set train.eval_strategy")
            if train.save_strategy not in (train.eval_strategy, "best"):
                raise ConfigError(f"train.load_best_model_at_end: save_strategy ({train.save_strategy!r}) must "
                                  f"equal eval_strategy ({train.eval_strategy!r}) so each evaluation has a checkpoint")
            eval_steps = train.eval_steps or train.logging_steps
            if train.save_strategy == "steps" and train.save_steps % eval_steps:
                raise ConfigError(f"train.load_best_model_at_end: save_steps ({train.save_steps}) must be a "
                                  f"multiple of eval_steps ({eval_steps})")

    @hookimpl
    def on_epoch_start(self, run):
        self.candidates = True

    @hookimpl(trylast=True)  # after the other plugins saw the evaluation (TrainerCallbacks: the best before it)
    def on_evaluate(self, run, metrics):
        if self.candidates and best_metric_name(run) is not None and note_evaluation(run, metrics) \
                and run.config.train.save_strategy == "best":
            run.control.should_save = True  # a new best metric, as Trainer's save_strategy "best"

    @hookimpl
    def checkpoint_state(self, run):
        # called as a checkpoint is written: one written at the best step is the best checkpoint
        state = run.state
        if state.best_global_step == state.global_step:
            state.best_model_checkpoint = str(run.output_dir / f"{PREFIX}{state.global_step}")

    @hookimpl(tryfirst=True)  # before uploads see the folder, as when the save itself rotated
    def on_checkpoint_saved(self, run, path):
        rotate(run)

    @hookimpl
    def on_before_final_save(self, run):
        if run.config.train.load_best_model_at_end:
            load_best_model(run)

    @hookimpl
    def on_train_exit(self, run, status):
        self.candidates = False  # Run.evaluate() after training is no candidate either
