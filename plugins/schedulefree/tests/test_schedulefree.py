"""Tests for engine-schedulefree: real runs of the tiny model on CPU, no mocks."""

from __future__ import annotations

import logging
import sys

import engine_schedulefree
import pytest
import schedulefree
import torch
from safetensors.torch import load_file

import engine
import engine.plugins
from engine.testing import assert_matches_trainer, assert_resume_is_exact, run_steps, tiny_dataset

NAMES = {"schedule_free_adamw": schedulefree.AdamWScheduleFree, "schedule_free_sgd": schedulefree.SGDScheduleFree,
         "schedule_free_radam": schedulefree.RAdamScheduleFree}
EVAL = tiny_dataset(8, seed=1)


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _eval_batch():
    rows = torch.stack([EVAL[i]["input_ids"] for i in range(len(EVAL))])
    return {"input_ids": rows, "labels": rows.clone()}


def _sf(optim, steps, tmp_path, **train):
    return run_steps(steps, plugins=["schedulefree"], output_dir=tmp_path, eval_dataset=EVAL,
                     train={"optim": optim, "lr_scheduler_type": "constant", **train})


class ModeRecorder:
    """Records the optimizer's mode after each switch hook and at every loss computation."""

    name = "mode_recorder"

    def __init__(self):
        self.switches, self.losses = [], []

    @engine.hookimpl
    def on_train_mode(self, run):
        self.switches.append(("train", run.optimizer.param_groups[0]["train_mode"]))

    @engine.hookimpl
    def on_eval_mode(self, run):
        self.switches.append(("eval", run.optimizer.param_groups[0]["train_mode"]))

    @engine.hookimpl
    def compute_loss(self, run, model):
        self.losses.append((model.training, run.optimizer.param_groups[0]["train_mode"]))


def test_plugin_is_installed():
    installed = engine.plugins.installed_plugins()
    assert installed["schedulefree"].distribution == "engine-schedulefree"
    assert installed["schedulefree"].load() is engine_schedulefree


# ---------------------------------------------------------------------------- training and Trainer


@pytest.mark.parametrize("optim, lr", [("schedule_free_adamw", 1e-2), ("schedule_free_sgd", 1.0),
                                       ("schedule_free_radam", 0.1)])
def test_loss_falls(tmp_path, optim, lr):
    run = _sf(optim, 12, tmp_path, learning_rate=lr)
    assert type(run.optimizer) is NAMES[optim]
    losses = _losses(run)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2  # RAdam: no update in its first steps
    assert run.optimizer.param_groups[0]["k"] == 12
    assert run.optimizer.param_groups[0]["train_mode"] is False  # the run ends on the evaluation weights


@pytest.mark.parametrize("optim", NAMES)
def test_optimizer_matches_trainer(tmp_path, optim):
    """Trainer's class, groups and hyper-parameters (warmup_steps in the optimizer); the same weights
    after six steps in train mode (RAdam makes no update before its fifth)."""
    train = {"learning_rate": 3e-3, "weight_decay": 0.05, "warmup_steps": 3, "adam_beta1": 0.8, "adam_epsilon": 1e-6}
    pair = assert_matches_trainer(optim, tmp_path, plugins=["schedulefree"], train=train,
                                  optim_args="weight_lr_power=1.5,r=0.5", steps=6)
    assert type(pair.ours) is NAMES[optim]
    assert [g["weight_decay"] for g in pair.ours.param_groups] == [0.05, 0.0]
    assert all(g["initial_lr"] == 3e-3 for g in pair.ours.param_groups)


# ---------------------------------------------------------------------------- train/eval modes


def test_evaluation_uses_the_eval_mode_weights(tmp_path):
    recorder = ModeRecorder()
    run = run_steps(4, plugins=["schedulefree"], objects=[recorder], output_dir=tmp_path, eval_dataset=EVAL,
                    train={"optim": "schedule_free_adamw", "learning_rate": 1e-2, "lr_scheduler_type": "constant",
                           "eval_strategy": "steps", "eval_steps": 4})
    logged = [h["eval_loss"] for h in run.state.log_history if "eval_loss" in h]
    eval_weights = _params(run.model)  # the run ended in eval mode, as it was at the step-4 evaluation
    with torch.no_grad():
        manual = run.model(**_eval_batch()).loss.item()
        run.optimizer.train()
        train_weights_loss = run.model(**_eval_batch()).loss.item()
    assert logged == [pytest.approx(manual, abs=1e-5)]
    assert abs(train_weights_loss - manual) > 1e-3  # the two points really differ
    assert _max_diff(eval_weights, _params(run.model)) > 1e-4
    # every training loss was computed in train mode, every evaluation loss in eval mode
    assert recorder.losses == [(True, True)] * 4 + [(False, False)]  # 8 eval rows: one batch


def test_mode_switches_at_every_boundary(tmp_path):
    recorder = ModeRecorder()
    run_steps(4, plugins=["schedulefree"], objects=[recorder], output_dir=tmp_path, eval_dataset=EVAL,
              train={"optim": "schedule_free_sgd", "lr_scheduler_type": "constant", "eval_strategy": "steps",
                     "eval_steps": 2, "save_strategy": "steps", "save_steps": 3})
    # start; eval at 2; save at 3; eval at 4; end. The plugin switched before the recorder looked.
    assert recorder.switches == [("train", True), ("eval", False), ("train", True), ("eval", False),
                                 ("train", True), ("eval", False), ("train", True), ("eval", False)]


def test_checkpoint_holds_the_eval_mode_weights_and_resume_is_exact(tmp_path):
    train = {"learning_rate": 1e-2, "save_strategy": "steps", "save_steps": 3, "eval_strategy": "steps",
             "eval_steps": 2}
    # 6 steps straight == 3 steps, checkpoint, resume to 6: logged values (eval losses too), weights, state
    runs = assert_resume_is_exact(6, 3, tmp_path / "resume", plugins=["schedulefree"], eval_dataset=EVAL,
                                  train={"optim": "schedule_free_adamw", "lr_scheduler_type": "constant", **train})
    saved = load_file(str(runs.checkpoint / "model.safetensors"))
    optimizer_state = torch.load(runs.checkpoint / "optimizer.pt", weights_only=True)
    assert all(g["train_mode"] is False and g["k"] == 3 for g in optimizer_state["param_groups"])

    # the step-3 weights in eval mode (x) and in train mode (y), from a run that stops at step 3
    short = _sf("schedule_free_adamw", 3, tmp_path / "short", **train)
    x = _params(short.model)
    short.optimizer.train()
    y = _params(short.model)
    assert _max_diff({n: saved[n] for n in x}, x) < 1e-6  # the checkpoint holds x ...
    assert _max_diff({n: saved[n] for n in y}, y) > 1e-4  # ... not y
    assert runs.resumed.optimizer.param_groups[0]["k"] == 6


# ---------------------------------------------------------------------------- the lr schedule


@pytest.fixture
def warnings_seen():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    sf_logger = logging.getLogger("engine.schedulefree")
    sf_logger.addHandler(handler)
    yield records
    sf_logger.removeHandler(handler)


def test_a_schedule_is_replaced_by_constant_with_one_warning(tmp_path, warnings_seen):
    run = run_steps(4, plugins=["schedulefree"], output_dir=tmp_path, train={
        "optim": "schedule_free_adamw", "lr_scheduler_type": "cosine", "warmup_steps": 2})
    assert [h["learning_rate"] for h in run.state.log_history if "loss" in h] == [1e-2] * 4
    assert run.optimizer.param_groups[0]["warmup_steps"] == 2  # the optimizer warms up itself
    assert [r.levelno for r in warnings_seen] == [logging.WARNING]
    message = warnings_seen[0].getMessage()
    assert "schedule_free_adamw needs no learning-rate schedule: using constant instead of " \
           "train.lr_scheduler_type 'cosine' (the optimizer does the warmup)" in message
    assert "keep_scheduler = true" in message


def test_radam_keeps_its_warmup_through_the_schedule(tmp_path, warnings_seen):
    run = run_steps(4, plugins=["schedulefree"], output_dir=tmp_path, train={
        "optim": "schedule_free_radam", "warmup_steps": 2})
    assert [h["learning_rate"] for h in run.state.log_history if "loss" in h] == [0.0, 5e-3, 1e-2, 1e-2]
    assert "using constant_with_warmup instead of train.lr_scheduler_type 'linear'" in warnings_seen[0].getMessage()


def test_keep_scheduler_applies_it_on_top_as_trainer_does(tmp_path, warnings_seen):
    run = run_steps(4, plugins=["schedulefree"], output_dir=tmp_path, sections={"schedulefree": {"keep_scheduler": True}},
                    train={"optim": "schedule_free_adamw"})
    assert [h["learning_rate"] for h in run.state.log_history if "loss" in h] == [1e-2, 7.5e-3, 5e-3, 2.5e-3]
    assert warnings_seen == []


def test_constant_needs_no_warning(tmp_path, warnings_seen):
    _sf("schedule_free_sgd", 1, tmp_path)
    assert warnings_seen == []


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("train, section, match", [
    ({"optim_args": "momentum=0.5"}, None, r"train\.optim_args: schedule_free_sgd takes weight_lr_power, r; got 'momentum'"),
    ({"optim_args": "r=-1"}, None, r"train\.optim_args: r expects float >= 0, got -1"),
    ({"optim_args": "weight_lr_power=high"}, None, r"train\.optim_args: weight_lr_power expects float >= 0"),
    ({}, {"keep_scheduler": "yes"}, r"schedulefree\.keep_scheduler: expected bool"),
    ({}, {"warmup": 3}, r"schedulefree\.warmup: unknown key"),
])
def test_bad_input_is_refused_before_the_model_loads(train, section, match):
    config = {"plugins": ["schedulefree"], "train": {"optim": "schedule_free_sgd", **train}}
    if section is not None:
        config["schedulefree"] = section
    with pytest.raises(engine.ConfigError, match=match):
        engine.Run(config)


def test_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "schedulefree", None)  # as if schedulefree were not installed
    with pytest.raises(engine.MissingDependencyError, match=r"pip install 'engine\[schedulefree\]'"):
        engine.Run({"plugins": ["schedulefree"], "train": {"optim": "schedule_free_radam"}})


def test_names_need_the_plugin():
    with pytest.raises(engine.ConfigError, match=r"train\.optim: unknown optimizer 'schedule_free_sgd'.*'schedulefree'"):
        engine.Run({"train": {"optim": "schedule_free_sgd"}})


def test_other_optimizers_are_left_alone(tmp_path, warnings_seen):
    run = run_steps(2, plugins=["schedulefree"], output_dir=tmp_path, train={"optim": "adamw_torch"})
    assert isinstance(run.optimizer, torch.optim.AdamW) and warnings_seen == []
    assert [h["learning_rate"] for h in run.state.log_history if "loss" in h] == [1e-2, 5e-3]  # linear kept
