"""Tests for engine-optimi: stable_adamw trains on the CPU, equals transformers' Trainer optimizer and
resumes exactly from engine checkpoints. Real torch-optimi, real transformers; no mocks."""

from __future__ import annotations

import logging
import sys

import engine_optimi
import pytest
import torch
from optimi import StableAdamW

import engine
import engine.plugins
from engine.testing import assert_matches_trainer, assert_resume_is_exact, tiny_dataset, tiny_model

# Non-default values everywhere, so a value taken from the wrong place shows.
TRAIN = {"learning_rate": 3e-3, "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6}


def _config(tmp_path, **train):
    return {"plugins": ["optimi"], "train": {"optim": "stable_adamw", "output_dir": str(tmp_path), "max_steps": 1,
                                             "disable_tqdm": True, **train}}


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


def test_plugin_is_installed(tmp_path):
    installed = engine.plugins.installed_plugins()
    assert installed["optimi"].distribution == "engine-optimi"
    assert installed["optimi"].load() is engine_optimi
    assert engine.Run(_config(tmp_path)).registries["optimizer"].get("stable_adamw").plugin == "optimi"


def test_catalogue_names_the_plugin():
    from engine.catalogue import FIRST_PARTY

    if "optimi" not in FIRST_PARTY:
        pytest.skip("engine/catalogue.py has no optimi entry yet")
    assert FIRST_PARTY["optimi"].provides["optimizer"] == ("stable_adamw",)


# ---------------------------------------------------------------------------- training and resume


@pytest.fixture(scope="module", params=[None, "decouple_lr=true,max_lr=0.02"])
def trained(request, tmp_path_factory):
    """7 steps with a checkpoint at step 4, and a run resumed from it that ends the same
    (``assert_resume_is_exact``: restored state, logged values, weights, optimizer state)."""
    train = {"optim": "stable_adamw", "optim_args": request.param, "weight_decay": 1e-4, "save_final_model": False}
    return assert_resume_is_exact(7, 4, tmp_path_factory.mktemp("stable_adamw"), plugins=["optimi"], train=train)


def test_trains_on_cpu_and_loss_falls(trained):
    run = trained.straight
    assert type(run.optimizer) is StableAdamW and run.state.global_step == 7
    losses = _losses(run)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    group = run.optimizer.param_groups[0]
    assert group["step"].item() == 7  # optimi counts steps per group, not per parameter
    assert group["decouple_lr"] is (run.config.train.optim_args is not None)
    assert group["max_lr"] == (0.02 if group["decouple_lr"] else None)


def test_resume_restores_state_and_steps_identically(trained):
    saved = torch.load(trained.checkpoint / "optimizer.pt", weights_only=True)  # what the engine loads
    assert [g["step"].item() for g in saved["param_groups"]] == [4, 4]  # restored too (the fixture checked)
    assert trained.resumed.optimizer.param_groups[0]["step"].item() == 7


# ---------------------------------------------------------------------------- equals transformers


def _without_triton(theirs):
    # on the CPU with triton installed, optimi would pick Triton for Trainer's optimizer too (it decides
    # before looking at the parameters); the plugin turns that off, so do the same for the reference
    theirs.defaults["triton"] = False
    for group in theirs.param_groups:
        group["triton"] = False


@pytest.mark.parametrize("optim_args", [None, "decouple_lr=true,max_lr=0.01,kahan_sum=true", "kahan_sum=true"])
def test_equals_transformers_trainer_optimizer(optim_args, tmp_path):
    """Same class, groups, hyper-parameters; the same weights and state after two steps."""
    pair = assert_matches_trainer("stable_adamw", tmp_path, plugins=["optimi"], train=TRAIN, optim_args=optim_args,
                                  atol=0, compare_state=True, adjust_reference=_without_triton)
    assert type(pair.ours) is StableAdamW
    assert [g["weight_decay"] for g in pair.ours.param_groups] == [0.1, 0.0]


def test_false_means_false(tmp_path):
    """Trainer turns optim_args strings into bools with bool(), so 'decouple_lr=false' and
    'kahan_sum=false' switch both on; the plugin parses them."""
    from transformers import Trainer, TrainingArguments

    text = "decouple_lr=false,kahan_sum=false"
    run = engine.Run(_config(tmp_path, optim_args=text), model=tiny_model(), train_dataset=tiny_dataset())
    run.setup()
    assert (run.optimizer.defaults["decouple_lr"], run.optimizer.defaults["kahan_sum"]) == (False, False)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), optim="stable_adamw", optim_args=text, report_to=[],
                             use_cpu=True)
    kwargs = Trainer.get_optimizer_cls_and_kwargs(args)[1]
    assert (kwargs["decouple_lr"], kwargs["kahan_sum"]) == (True, True)


def test_kahan_sum_on_float32_weights_is_said(tmp_path):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("engine.optimi").addHandler(handler)
    try:
        engine.Run(_config(tmp_path, optim_args="kahan_sum=true"), model=tiny_model(),
                   train_dataset=tiny_dataset()).setup()
    finally:
        logging.getLogger("engine.optimi").removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "stable_adamw: kahan_sum applies to float16/bfloat16 parameters only and there are none here "
        "(train.bf16 autocasts, it does not store the weights in bfloat16)"]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("optim_args, match", [
    ("max_lr=0", r"max_lr expects float > 0, got 0\.0"),
    ("max_lr=0.01", r"max_lr=0\.01 only scales fully decoupled weight decay; add decouple_lr=true"),
    ("decouple_lr=false,max_lr=0.01", r"add decouple_lr=true, or remove max_lr"),
    ("decouple_lr=1", r"decouple_lr expects true or false, got 1"),
    ("kahan_sum=yes", r"kahan_sum expects true or false, got 'yes'"),
    ("foreach=true", r"stable_adamw takes decouple_lr, max_lr, kahan_sum; got 'foreach'$"),
    ("beta2=0.99", r"got 'beta2'; set train\.adam_beta2"),
    ("weight_decay=0.1", r"got 'weight_decay'; set train\.weight_decay"),
    ("decouple_lr", r"expected 'key=value,key=value'"),
])
def test_bad_optim_args_are_refused_before_the_model_loads(optim_args, match, tmp_path):
    with pytest.raises(engine.ConfigError, match=r"^train\.optim_args: .*" + match):
        engine.Run(_config(tmp_path, optim_args=optim_args))


def test_optim_target_modules_are_refused(tmp_path):
    with pytest.raises(engine.ConfigError, match=r"^train\.optim_target_modules: stable_adamw .* no target modules"):
        engine.Run(_config(tmp_path, optim_target_modules=[".*attn.*"]))


def test_missing_optimi_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "optimi", None)  # what an environment without torch-optimi imports
    with pytest.raises(engine.MissingDependencyError, match=r"package 'torch-optimi' is needed for train\.optim = "
                                                            r"'stable_adamw' .*: pip install 'engine\[optimi\]'"):
        engine.Run(_config(tmp_path))
    engine.Run(_config(tmp_path, optim="adamw_torch"))  # other optimizers do not need it
