"""transformers ``TrainerCallback``s, unchanged, on the engine's hooks.

A run gets this plugin when it is given callbacks: ``Run(callbacks=[...])``, or a
``TrainerCallback`` (instance or class) in ``Run(plugins=[...])``. A run without callbacks does
not register it, so it costs nothing per step.

Trainer's events fire where Trainer fires them, in its order::

    configure                       -> on_init_end
    on_train_start                  -> on_train_begin
    on_epoch_start                  -> on_epoch_begin
    training_step (wrapper)         -> on_step_begin, then per micro-batch but the last:
      compute_loss (wrapper)        -> on_substep_end (before the next micro-batch's forward)
      optimizer.step pre/post hooks -> on_pre_optimizer_step / on_optimizer_step
    on_step_end                     -> on_step_end
    log_metrics                     -> on_log (train logs, evaluations, the train summary)
    on_prediction_step              -> on_prediction_step
    on_evaluate                     -> on_evaluate
    on_predict                      -> on_predict (Run.predict)
    on_checkpoint_saved             -> on_save
    on_epoch_end                    -> on_epoch_end
    on_train_end                    -> on_train_end

Callbacks get Trainer's ``args`` (a ``TrainingArguments`` built from ``[train]``), ``state`` (a
``TrainerState`` kept in step with ``run.state``) and ``control``, which transformers'
``DefaultFlowCallback`` sets at the intervals Trainer would, plus the keyword arguments
Trainer passes (model, processing_class, optimizer, lr_scheduler, train_dataloader, ...).
What a callback turns on in ``control`` is requested from the engine: ``should_training_stop``
stops the run, ``should_epoch_stop`` ends the epoch, ``should_save`` / ``should_evaluate`` /
``should_log`` save, evaluate, log after the current step. ``on_log`` fires on the main process
only (the logging hooks do); what it requests is shared with the other processes at once. Turning off what the run's schedule asks for is not honoured: the schedule
is the run's config. Callbacks with state (``ExportableState``, e.g. ``EarlyStoppingCallback``)
are saved in checkpoints and restored with ``train.restore_callback_states_from_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

from engine import hookimpl
from engine.config import option
from engine.errors import ConfigError
from engine.util import is_callback

PLUGIN = "builtin.callbacks"
FLAGS = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")
# TrainingArguments keys the engine cannot always take over (a name only a plugin registers)
_OPTIONAL_ARGS = ("optim", "optim_args", "optim_target_modules", "lr_scheduler_type", "lr_scheduler_kwargs")


def training_arguments(train: Any, plugins: list[str] = ()) -> Any:
    """A ``TrainingArguments`` with the values of the ``[train]`` keys it shares with the engine, and
    ``report_to`` naming the integrations of the enabled tracker ``plugins`` (callbacks branch on it)."""
    import torch
    import transformers

    from engine.builtin.trainer_args import report_to_names

    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    values = {f.name: getattr(train, f.name) for f in dataclasses.fields(train) if f.name in names}
    values["report_to"] = report_to_names(plugins) or "none"
    if not torch.accelerator.is_available():  # training on the CPU: TrainingArguments refuses bf16 without it
        values["use_cpu"] = True
    try:
        return transformers.TrainingArguments(**values)
    except (ValueError, TypeError):
        pass
    try:  # e.g. an optimizer name only a plugin registers: Trainer's default in args
        return transformers.TrainingArguments(**{k: v for k, v in values.items() if k not in _OPTIONAL_ARGS})
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"TrainerCallbacks get Trainer's args, and TrainingArguments refuses this [train]: "
                          f"{exc}") from None


@dataclasses.dataclass
class CallbackOptions:
    """``[train]`` keys of the TrainerCallback adapter (registered by builtin.arguments)."""

    restore_callback_states_from_checkpoint: bool = option(False, shared=True, help=(
        "on resume: TrainerCallbacks with state (ExportableState, e.g. EarlyStoppingCallback) get it back"))


class TrainerCallbacks:
    """Runs ``callbacks`` (TrainerCallback instances or classes) as Trainer's CallbackHandler does."""

    strict = True  # a callback that raises in on_log / on_save ends the run, as under Trainer

    def __init__(self, callbacks: list[Any]):
        from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState

        for callback in callbacks:
            if not is_callback(callback):
                raise ConfigError(f"Run(callbacks=...): {callback!r:.80} is not a transformers TrainerCallback "
                                  "(an instance or subclass); engine plugins go in Run(plugins=...)")
        self.callbacks = [callback() if isinstance(callback, type) else callback for callback in callbacks]
        self.flow = DefaultFlowCallback()
        self.control = TrainerControl()
        self.state = TrainerState()
        self.args: Any = None
        self.run: Any = None
        self.micro_batch: int | None = None  # inside a training step: micro-batches begun
        self.optimizer_stepped = False
        self.handles: list[Any] = []
        self.initial_states: list[dict[str, Any]] = []  # the stateful callbacks' state() at the start

    # ------------------------------------------------------------------ dispatch

    def _sync_state(self) -> None:
        ours, theirs = self.run.state, self.state
        theirs.global_step, theirs.epoch, theirs.max_steps = ours.global_step, ours.epoch, ours.max_steps
        theirs.num_input_tokens_seen = ours.num_input_tokens_seen
        theirs.best_metric, theirs.best_global_step = ours.best_metric, ours.best_global_step
        theirs.best_model_checkpoint = ours.best_model_checkpoint
        theirs.log_history = ours.log_history

    def _call(self, event: str, **kwargs: Any) -> None:
        """``event`` on DefaultFlowCallback, then on each callback; what they turn on goes to run.control."""
        self._sync_state()
        run, control = self.run, self.control
        kwargs.update(model=run.model, processing_class=run.tokenizer, optimizer=run.optimizer,
                      lr_scheduler=run.scheduler, train_dataloader=run.train_loader, eval_dataloader=None)
        getattr(self.flow, event)(self.args, self.state, control, **kwargs)
        before = {flag: getattr(control, flag) for flag in FLAGS}
        for callback in self.callbacks:
            result = getattr(callback, event)(self.args, self.state, control, **kwargs)
            if result is not None:  # as in CallbackHandler: a callback may return a new control
                self.control = control = result
        turned_on = [flag for flag in FLAGS if getattr(control, flag) and not before[flag]]
        if "should_training_stop" in turned_on and run.state.global_step < run.state.max_steps:
            names = ", ".join(type(callback).__name__ for callback in self.callbacks)
            run.control.request_stop(f"a TrainerCallback ({names}) set control.should_training_stop in {event}")
        run.control.should_save |= "should_save" in turned_on
        run.control.should_evaluate |= "should_evaluate" in turned_on
        run.control.should_log |= "should_log" in turned_on
        run.control.should_epoch_stop |= "should_epoch_stop" in turned_on

    # ------------------------------------------------------------------ hooks

    @hookimpl
    def configure(self, run):
        self.run = run
        self.args = training_arguments(run.config.train, run.config.plugins)
        self.control.should_training_stop = False
        self._call("on_init_end")

    @hookimpl
    def on_train_start(self, run):
        self._begin(run)
        self.initial_states = [callback.state() for callback in self._stateful()]
        self.control.should_training_stop = False
        self._call("on_train_begin")

    def _begin(self, run) -> None:
        """The TrainerState of a run starting, and the optimizer step events hooked onto the optimizer."""
        train, state = run.config.train, self.state
        state.compute_steps(self.args, run.state.max_steps)
        state.train_batch_size = train.per_device_train_batch_size * run.strategy.world_size
        per_epoch = run.state.steps_per_epoch
        state.num_train_epochs = math.ceil(run.state.max_steps / per_epoch) if per_epoch else sys.maxsize
        state.is_world_process_zero = run.strategy.is_main_process
        state.is_local_process_zero = run.strategy.local_rank == 0
        stepper = getattr(run.optimizer, "register_step_pre_hook", None)
        if stepper is not None:
            self.handles = [stepper(self._before_optimizer_step),
                            run.optimizer.register_step_post_hook(self._after_optimizer_step)]

    @hookimpl
    def on_restart(self, run):
        """As a run started with the new settings: a fresh TrainerState and control, the stateful callbacks'
        state as at the start, the step events on the new optimizer (on_train_begin does not fire again)."""
        from transformers.trainer_callback import TrainerControl, TrainerState

        self._remove_handles()
        self.state, self.control = TrainerState(), TrainerControl()
        self._begin(run)
        for callback, initial in zip(self._stateful(), self.initial_states):
            _set_attributes(callback, initial)

    @hookimpl
    def on_epoch_start(self, run):
        self.control.should_epoch_stop = False
        self._call("on_epoch_begin")

    @hookimpl(wrapper=True)
    def training_step(self, run, batches, num_items_in_batch):
        for flag in ("should_log", "should_evaluate", "should_save"):  # as CallbackHandler.on_step_begin
            setattr(self.control, flag, False)
        self._call("on_step_begin")
        self.micro_batch, self.optimizer_stepped = 0, False
        try:
            out = yield
        finally:
            self.micro_batch = None
        if not self.optimizer_stepped:  # a step that does not call optimizer.step (fused, skipped)
            self._call("on_pre_optimizer_step")
            self._call("on_optimizer_step")
        return out

    @hookimpl(wrapper=True)
    def compute_loss(self, run, model, batch, num_items_in_batch):
        if self.micro_batch is not None:
            if self.micro_batch:
                self._call("on_substep_end")
            self.micro_batch += 1
        return (yield)

    def _before_optimizer_step(self, optimizer, args, kwargs):
        if self.micro_batch is not None:
            self._call("on_pre_optimizer_step")

    def _after_optimizer_step(self, optimizer, args, kwargs):
        if self.micro_batch is not None:
            self.optimizer_stepped = True
            self._call("on_optimizer_step")

    @hookimpl
    def on_step_end(self, run):
        self._call("on_step_end")

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if "loss" in metrics and not self.control.should_log:
            # the engine also logs the steps since the last log at a stop or the last step; Trainer
            # does not, so its callbacks see only the logs Trainer makes (the train summary follows)
            return
        self.control.should_log = False
        logs = dict(metrics)
        logs.setdefault("epoch", run.state.epoch)
        self._call("on_log", logs=logs)

    @hookimpl
    def on_prediction_step(self, run, step, total):
        self._call("on_prediction_step")

    @hookimpl
    def on_evaluate(self, run, metrics):
        self.control.should_evaluate = False
        self._call("on_evaluate", metrics=metrics)

    @hookimpl
    def on_predict(self, run, metrics):
        self._call("on_predict", metrics=metrics)

    @hookimpl
    def on_checkpoint_saved(self, run, path):
        self.control.should_save = False
        self._call("on_save")

    @hookimpl
    def on_epoch_end(self, run):
        self._call("on_epoch_end")

    @hookimpl
    def on_train_end(self, run):
        self._remove_handles()
        self._call("on_train_end")

    def _remove_handles(self) -> None:
        while self.handles:
            self.handles.pop().remove()

    def _stateful(self) -> list[Any]:
        from transformers.trainer_callback import ExportableState

        return [callback for callback in self.callbacks if isinstance(callback, ExportableState)]

    @hookimpl
    def checkpoint_state(self, run):
        stateful = self._stateful()
        if not stateful:
            return None
        return {"stateful_callbacks": [{"class": type(callback).__name__, **callback.state()} for callback in stateful]}

    @hookimpl
    def load_checkpoint_state(self, run, state):
        """Each saved callback state back onto the callback of its class, in order (as Trainer restores them)."""
        if not run.config.train.restore_callback_states_from_checkpoint:
            return
        saved = list(state.get("stateful_callbacks", []))
        for callback in self._stateful():
            entry = next((e for e in saved if e.get("class") == type(callback).__name__), None)
            if entry is not None:
                saved.remove(entry)
                _set_attributes(callback, entry)


def _set_attributes(callback: Any, saved: dict[str, Any]) -> None:
    """An ``ExportableState`` callback's attributes from its ``state()``."""
    for key, value in saved.get("attributes", {}).items():
        setattr(callback, key, value)
