"""TrainerCallbacks run unchanged: the same events, stops and saves as under transformers.Trainer."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import EarlyStoppingCallback, TrainerCallback

from engine import Run
from engine.builtin.data.collators import DataCollator
from engine.errors import ConfigError, PluginError
from engine.testing import tiny_dataset, tiny_model

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_step_end", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_log", "on_evaluate",
          "on_save", "on_prediction_step")


class Recorder(TrainerCallback):
    """Records (event, global_step) for every event."""

    def __init__(self):
        self.events = []
        for event in EVENTS:
            setattr(self, event, self._recorder(event))

    def _recorder(self, event):
        def record(args, state, control, **kwargs):
            self.events.append((event, state.global_step))
        return record


class StopAt7(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 7:
            control.should_training_stop = True


class SaveAt5(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            control.should_save = True


SHARED = dict(max_steps=10, per_device_train_batch_size=4, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
              learning_rate=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=3, save_strategy="no")


def trainer_run(output_dir, callbacks, **args):
    trainer = transformers.Trainer(
        model=tiny_model(), train_dataset=tiny_dataset(), eval_dataset=tiny_dataset(8, seed=1),
        data_collator=DataCollator(0), callbacks=callbacks,
        args=transformers.TrainingArguments(output_dir=str(output_dir), use_cpu=True, report_to="none",
                                            remove_unused_columns=False, disable_tqdm=True, **args))
    trainer.train()
    return trainer


def engine_run(output_dir, plugins=(), **train):
    run = Run({"train": {"output_dir": str(output_dir), "disable_tqdm": True, "save_final_model": False, **train}},
              model=tiny_model(), train_dataset=tiny_dataset(), eval_dataset=tiny_dataset(8, seed=1),
              data_collator=DataCollator(0), plugins=list(plugins))
    run.train()
    return run


def test_events_stop_and_save_are_trainers(tmp_path):
    theirs = Recorder()
    trainer = trainer_run(tmp_path / "trainer", [theirs, StopAt7(), SaveAt5], **SHARED)
    ours = Recorder()
    run = engine_run(tmp_path / "engine", [ours, StopAt7(), SaveAt5], **SHARED)  # a class, as Trainer takes

    assert trainer.state.global_step == run.state.global_step == 7
    assert sorted(p.name for p in (tmp_path / "trainer").glob("checkpoint-*")) == ["checkpoint-5"]
    assert sorted(p.name for p in (tmp_path / "engine").glob("checkpoint-*")) == ["checkpoint-5"]
    names = {name for name, _ in theirs.events}
    assert names == set(EVENTS)  # every event fired under Trainer, so the comparison covers them all
    assert ours.events == theirs.events


def test_early_stopping_callback_stops_at_trainers_evaluation(tmp_path):
    args = dict(SHARED, gradient_accumulation_steps=1, max_steps=20, eval_steps=2, save_strategy="steps", save_steps=2,
                load_best_model_at_end=True, metric_for_best_model="loss")
    # a threshold no change reaches: evaluations 2 and 3 do not improve on the first; patience 2 stops at the 3rd
    trainer = trainer_run(tmp_path / "trainer", [EarlyStoppingCallback(2, 10.0)], **args)
    run = engine_run(tmp_path / "engine", [EarlyStoppingCallback(2, 10.0)], **args)
    evaluations = [[entry["step"] for entry in history if "eval_loss" in entry]
                   for history in (trainer.state.log_history, run.state.log_history)]
    assert evaluations[0] == evaluations[1] == [2, 4, 6]
    assert trainer.state.global_step == run.state.global_step == 6


def test_a_plugin_object_without_hooks_is_refused():
    with pytest.raises(PluginError, match="a Linear object has no @engine.hookimpl functions and is not a "
                                          "transformers TrainerCallback"):
        Run({"train": {"max_steps": 1}}, plugins=[torch.nn.Linear(1, 1)])


class EndEachEpochAfter2Steps(TrainerCallback):
    def on_epoch_begin(self, args, state, control, **kwargs):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        if self.steps == 2:
            control.should_epoch_stop = True


def test_epoch_stop_and_on_predict_are_trainers(tmp_path):
    args = dict(num_train_epochs=3, per_device_train_batch_size=4, logging_steps=1, learning_rate=1e-3,
                save_strategy="no")
    theirs, ours = Recorder(), Recorder()
    for recorder in (theirs, ours):
        recorder.on_predict = recorder._recorder("on_predict")
    trainer = trainer_run(tmp_path / "trainer", [theirs, EndEachEpochAfter2Steps()], **args)
    trainer.predict(tiny_dataset(8, seed=1))
    run = engine_run(tmp_path / "engine", [ours, EndEachEpochAfter2Steps()], **args)
    run.predict(tiny_dataset(8, seed=1))
    assert trainer.state.global_step == run.state.global_step == 6  # 3 epochs of 2 of their 16 steps
    assert ("on_predict", 6) in theirs.events
    assert ours.events == theirs.events


def test_callback_states_restore_from_a_checkpoint_as_under_trainer(tmp_path):
    args = dict(SHARED, gradient_accumulation_steps=1, max_steps=20, eval_steps=2, save_strategy="steps", save_steps=2,
                load_best_model_at_end=True, metric_for_best_model="loss")
    # the first evaluation is the best (a threshold no change reaches); patience 3 stops at step 8
    trainer_run(tmp_path / "trainer", [EarlyStoppingCallback(3, 10.0)], **args)
    engine_run(tmp_path / "engine", [EarlyStoppingCallback(3, 10.0)], **args)
    stopped = {}
    for restore in (True, False):
        resume = dict(args, restore_callback_states_from_checkpoint=restore)
        trainer = transformers.Trainer(
            model=tiny_model(), train_dataset=tiny_dataset(), eval_dataset=tiny_dataset(8, seed=1),
            data_collator=DataCollator(0), callbacks=[EarlyStoppingCallback(3, 10.0)],
            args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none",
                                                remove_unused_columns=False, disable_tqdm=True, **resume))
        trainer.train(resume_from_checkpoint=str(tmp_path / "trainer" / "checkpoint-4"))
        run = engine_run(tmp_path / "engine", [EarlyStoppingCallback(3, 10.0)],
                         resume_from_checkpoint=str(tmp_path / "engine" / "checkpoint-4"), **resume)
        stopped[restore] = trainer.state.global_step, run.state.global_step
    # restored, the patience counter (1 after step 4) goes on: stops at 8; afresh it counts again from 0
    assert stopped == {True: (8, 8), False: (10, 10)}


@pytest.mark.parametrize("stop", [True, False], ids=["stopped at 7", "max_steps 10"])
def test_on_log_fires_where_trainers_does_at_a_stop_and_the_last_step(tmp_path, stop):
    """The engine logs the steps since the last log at a stop and at the last step; Trainer does not,
    and its callbacks saw two on_log at step 7 (that log and the train summary)."""
    args = dict(SHARED, logging_steps=3, eval_strategy="no")
    callbacks = lambda recorder: [recorder, StopAt7()] if stop else [recorder]  # noqa: E731
    theirs, ours = Recorder(), Recorder()
    trainer_run(tmp_path / "trainer", callbacks(theirs), **args)
    run = engine_run(tmp_path / "engine", callbacks(ours), **args)
    last = 7 if stop else 10
    assert [step for name, step in theirs.events if name == "on_log"] == [3, 6, 9, last][:3 - stop] + [last]
    assert ours.events == theirs.events
    logged = [entry["step"] for entry in run.state.log_history if "loss" in entry]
    assert logged == [3, 6, last] if stop else [3, 6, 9, last]  # the engine's own log keeps the last interval


def test_callbacks_run_with_bf16_on_the_cpu(tmp_path):
    ours = Recorder()
    run = engine_run(tmp_path / "engine", [ours], max_steps=2, bf16=True, save_strategy="no")
    assert run.state.global_step == 2 and ("on_train_end", 2) in ours.events


def test_a_callback_that_is_not_a_trainer_callback_is_refused():
    with pytest.raises(ConfigError, match=r"Run\(callbacks=...\): <object object at .*> is not a transformers "
                                          r"TrainerCallback \(an instance or subclass\)"):
        Run({"train": {"max_steps": 1}}, callbacks=[object()])


def test_callbacks_see_the_runs_trackers_in_report_to(tmp_path):
    """A callback that logs only ``if "tensorboard" in args.report_to`` (as many do) logs under the engine
    too; the plugin's name maps back to Trainer's (comet: comet_ml)."""
    seen = []

    class ReportTo(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append(args.report_to)

    run = Run({"plugins": ["tensorboard"],
               "train": {"output_dir": str(tmp_path / "a"), "max_steps": 1, "save_final_model": False}},
              model=tiny_model(), train_dataset=tiny_dataset(), data_collator=DataCollator(0), callbacks=[ReportTo()])
    run.train()
    engine_run(tmp_path / "b", [ReportTo()], max_steps=1)
    assert seen == [["tensorboard"], []]
    from engine.builtin.trainer_args import report_to_names

    assert report_to_names(["comet", "azureml", "peft", "wandb"]) == ["comet_ml", "azure_ml", "wandb"]
