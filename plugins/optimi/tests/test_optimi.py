"""Tests for engine-optimi: stable_adamw trains on the CPU, equals transformers' Trainer optimizer and
resumes exactly from engine checkpoints. Real torch-optimi, real transformers; no mocks."""

from __future__ import annotations

import copy
import logging
import sys

import engine_optimi
import pytest
import torch
from optimi import StableAdamW

import engine
import engine.plugins
from engine import hookimpl
from engine.testing import run_steps, tiny_dataset, tiny_model

# Non-default values everywhere, so a value taken from the wrong place shows.
TRAIN = {"learning_rate": 3e-3, "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6}


def _config(tmp_path, **train):
    return {"plugins": ["optimi"], "train": {"optim": "stable_adamw", "output_dir": str(tmp_path), "max_steps": 1,
                                             "disable_tqdm": True, **train}}


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


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


class Capture:
    """Records the optimizer state at train start (after a resume restored it)."""

    name = "capture"

    @hookimpl
    def on_train_start(self, run):
        self.restored = copy.deepcopy(run.optimizer.state_dict())  # state_dict() shares the tensors


@pytest.fixture(scope="module", params=[None, "decouple_lr=true,max_lr=0.02"])
def trained(request, tmp_path_factory):
    """7 steps with a checkpoint at step 4, and a run resumed from it (shared by the tests below)."""
    out = tmp_path_factory.mktemp("stable_adamw")
    train = {"optim": "stable_adamw", "optim_args": request.param, "weight_decay": 1e-4, "save_final_model": False}
    straight = run_steps(7, plugins=["optimi"], objects=[Capture()], output_dir=out / "straight",
                         train={**train, "save_strategy": "steps", "save_steps": 4})
    capture = Capture()
    checkpoint = out / "straight" / "checkpoint-4"
    resumed = run_steps(7, plugins=["optimi"], objects=[capture], output_dir=out / "resumed", model=tiny_model(seed=1),
                        train={**train, "resume_from_checkpoint": str(checkpoint)})
    return straight, resumed, capture, checkpoint


def test_trains_on_cpu_and_loss_falls(trained):
    run, _, _, _ = trained
    assert type(run.optimizer) is StableAdamW and run.state.global_step == 7
    losses = _losses(run)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    group = run.optimizer.param_groups[0]
    assert group["step"].item() == 7  # optimi counts steps per group, not per parameter
    assert group["decouple_lr"] is (run.config.train.optim_args is not None)
    assert group["max_lr"] == (0.02 if group["decouple_lr"] else None)


def test_resume_restores_state_and_steps_identically(trained):
    straight, resumed, capture, checkpoint = trained
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)  # what the engine loads
    assert [g["step"].item() for g in saved["param_groups"]] == [4, 4]
    _assert_same(capture.restored, saved)  # the group step counters come back too
    assert resumed.state.global_step == 7
    assert _losses(resumed)[-3:] == _losses(straight)[-3:]
    for (n, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)
    _assert_same(resumed.optimizer.state_dict(), straight.optimizer.state_dict())


# ---------------------------------------------------------------------------- equals transformers


def _batch():
    rows = torch.stack([tiny_dataset()[i]["input_ids"] for i in range(4)])
    return {"input_ids": rows, "labels": rows}


@pytest.mark.parametrize("optim_args", [None, "decouple_lr=true,max_lr=0.01,kahan_sum=true", "kahan_sum=true"])
def test_equals_transformers_trainer_optimizer(optim_args, tmp_path):
    from transformers import Trainer, TrainingArguments

    run = engine.Run(_config(tmp_path, optim_args=optim_args, **TRAIN), model=tiny_model(),
                     train_dataset=tiny_dataset())
    run.setup()
    ours = run.optimizer
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), optim="stable_adamw", optim_args=optim_args,
                             report_to=[], use_cpu=True, **TRAIN)
    trainer = Trainer(model=tiny_model(), args=args)
    theirs = trainer.create_optimizer()
    # on the CPU with triton installed, optimi would pick Triton for Trainer's optimizer too (it decides
    # before looking at the parameters); the plugin turns that off, so do the same for the reference
    theirs.defaults["triton"] = False
    for group in theirs.param_groups:
        group["triton"] = False

    assert type(ours) is type(theirs) is StableAdamW
    assert ours.defaults == theirs.defaults
    our_names = {id(p): n for n, p in run.model.named_parameters()}
    their_names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert len(ours.param_groups) == len(theirs.param_groups) == 2
    for mine, hf in zip(ours.param_groups, theirs.param_groups):
        assert [our_names[id(p)] for p in mine["params"]] == [their_names[id(p)] for p in hf["params"]]
        assert mine.pop("initial_lr") == hf["lr"]  # initial_lr: our scheduler's
        assert {k: v for k, v in mine.items() if k != "params"} == {k: v for k, v in hf.items() if k != "params"}
    assert [g["weight_decay"] for g in ours.param_groups] == [0.1, 0.0]

    # same gradients -> same update and state
    for model, optimizer in ((run.model, ours), (trainer.model, theirs)):
        for _ in range(2):
            model(**_batch()).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for (n, p), q in zip(run.model.named_parameters(), trainer.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    _assert_same(ours.state_dict(), theirs.state_dict())


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
