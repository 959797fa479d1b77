"""Tests for engine-torchao: both names train on the CPU, equal transformers' Trainer optimizer and
resume exactly from engine checkpoints. Real torchao, real transformers; no mocks.

The update runs through torch.compile: the first step of each name compiles (about 10-30 s on two
CPU cores, less with a warm inductor cache), so the runs share one small model and one fixture.
"""

from __future__ import annotations

import logging
import sys

import engine_torchao
import pytest
import torch
from torchao.optim import AdamW4bit, AdamW8bit
from torchao.optim.subclass_4bit import OptimState4bit
from torchao.optim.subclass_8bit import OptimState8bit

import engine
import engine.plugins
from engine.testing import assert_matches_trainer, assert_resume_is_exact, tiny_dataset, tiny_model

MODEL = {"num_hidden_layers": 1}  # 12 tensors: each step calls the compiled update once per tensor

NAMES = {"adamw_torch_4bit": (AdamW4bit, OptimState4bit), "adamw_torch_8bit": (AdamW8bit, OptimState8bit)}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"  # 4096 elements: quantized state
UP = "model.layers.0.mlp.up_proj.weight"  # 2048 elements: float state
# Non-default values everywhere, so a value taken from the wrong place shows.
TRAIN = {"learning_rate": 3e-3, "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6}


def _model():
    return tiny_model(**MODEL)


def _config(optim, tmp_path, **train):
    return {"plugins": ["torchao"], "train": {"optim": optim, "output_dir": str(tmp_path), "max_steps": 1,
                                              "disable_tqdm": True, **train}}


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


def test_plugin_is_installed(tmp_path):
    installed = engine.plugins.installed_plugins()
    assert installed["torchao"].distribution == "engine-torchao"
    assert installed["torchao"].load() is engine_torchao
    registry = engine.Run(_config("adamw_torch_4bit", tmp_path)).registries["optimizer"]
    assert all(registry.get(name).plugin == "torchao" for name in NAMES)


def test_catalogue_names_the_plugin():
    from engine.catalogue import FIRST_PARTY

    if "torchao" not in FIRST_PARTY:
        pytest.skip("engine/catalogue.py has no torchao entry yet")
    assert sorted(FIRST_PARTY["torchao"].provides["optimizer"]) == sorted(NAMES)


# ---------------------------------------------------------------------------- training and resume


@pytest.fixture(scope="module", params=list(NAMES))
def trained(request, tmp_path_factory):
    """6 steps with a checkpoint at step 3, and a run resumed from it that ends the same
    (``assert_resume_is_exact``: restored quantized state, logged values, weights, optimizer state)."""
    name = request.param
    # TRAIN's betas, eps and weight decay: torch.compile specializes on them, so the test against
    # Trainer below reuses these compiled kernels (lr is a tensor: any value shares them)
    train = {**TRAIN, "optim": name, "learning_rate": 1e-2, "save_final_model": False, "lr_scheduler_type": "linear"}
    return assert_resume_is_exact(6, 3, tmp_path_factory.mktemp(name), plugins=["torchao"], train=train,
                                  model_config=MODEL)


def test_trains_on_cpu_and_loss_falls(trained):
    run = trained.straight
    cls, quantized = NAMES[run.config.train.optim]
    assert type(run.optimizer) is cls and run.state.global_step == 6
    losses = _losses(run)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    state = {n: run.optimizer.state[p] for n, p in run.model.named_parameters()}
    assert all(s["step"].item() == 6 for s in state.values())
    for key in ("exp_avg", "exp_avg_sq"):  # quantized state from 4096 elements on, float below
        assert type(state[HEAD][key]) is quantized and state[HEAD][key].block_size == 256
        assert type(state[EMBED][key]) is quantized
        assert type(state[UP][key]) is torch.Tensor and state[UP][key].dtype == torch.float32
    # the group lr is a tensor in torchao; the logs hold the number each step used (linear decay)
    assert isinstance(run.optimizer.param_groups[0]["lr"], torch.Tensor)
    logged = [h["learning_rate"] for h in run.state.log_history if "loss" in h]
    assert all(type(lr) is float for lr in logged)
    assert logged == pytest.approx([1e-2 * (6 - i) / 6 for i in range(6)], rel=1e-6)


def test_resume_restores_quantized_state_and_steps_identically(trained):
    straight = trained.straight
    _, quantized = NAMES[straight.config.train.optim]
    saved = torch.load(trained.checkpoint / "optimizer.pt", weights_only=True)  # what the engine loads
    order = [id(p) for g in straight.optimizer.param_groups for p in g["params"]]
    head = order.index(id(straight.model.lm_head.weight))
    assert type(saved["state"][head]["exp_avg"]) is quantized  # torchao's subclasses load with weights_only
    # restored as saved (same quantized codes, scales, steps, lr): checked by the fixture
    assert type(trained.restored["state"][head]["exp_avg"]) is quantized
    assert trained.resumed.state.global_step == 6


# ---------------------------------------------------------------------------- equals transformers


@pytest.mark.parametrize("name, optim_args", [("adamw_torch_4bit", "bf16_stochastic_round=true"),
                                              ("adamw_torch_8bit", None)])
def test_equals_transformers_trainer_optimizer(name, optim_args, tmp_path):
    """Same class, groups and hyper-parameters (the lr a tensor); after a step the same weights and
    the same quantized state."""
    pair = assert_matches_trainer(name, tmp_path, plugins=["torchao"], train=TRAIN, optim_args=optim_args,
                                  model_config=MODEL, steps=1, atol=0, compare_state=True)
    ours, theirs = pair.ours, pair.theirs
    assert type(ours) is NAMES[name][0]
    assert (ours.block_size, ours.bf16_stochastic_round, ours.is_adamw) == \
           (theirs.block_size, theirs.bf16_stochastic_round, theirs.is_adamw) == (256, optim_args is not None, True)
    assert all(isinstance(g["lr"], torch.Tensor) and g["initial_lr"].item() == pytest.approx(3e-3)
               for g in ours.param_groups)
    assert [g["weight_decay"] for g in ours.param_groups] == [0.1, 0.0]


def test_block_size_is_passed_as_a_number(tmp_path):
    """Trainer passes optim_args' block_size through as a string, so torchao's first step raises
    TypeError; the plugin passes the int."""
    from transformers import Trainer, TrainingArguments

    run = engine.Run(_config("adamw_torch_8bit", tmp_path, optim_args="block_size=128"), model=_model(),
                     train_dataset=tiny_dataset())
    run.setup()
    assert run.optimizer.block_size == 128
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), optim="adamw_torch_8bit", optim_args="block_size=128",
                             report_to=[], use_cpu=True)
    assert Trainer.get_optimizer_cls_and_kwargs(args)[1]["block_size"] == "128"


# ---------------------------------------------------------------------------- warnings


@pytest.fixture
def warnings_seen():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("engine.torchao")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_says_when_nothing_is_quantized(tmp_path, warnings_seen):
    run = engine.Run(_config("adamw_torch_8bit", tmp_path, optim_args="block_size=3000,bf16_stochastic_round=true"),
                     model=_model(), train_dataset=tiny_dataset())
    run.setup()
    said = [r.getMessage() for r in warnings_seen]
    assert said == [
        "adamw_torch_8bit: no parameter has >= 4096 elements divisible by block_size 3000, so every tensor "
        "keeps 32-bit Adam state (no memory saved)",
        "adamw_torch_8bit: bf16_stochastic_round applies to bfloat16 parameters only; these are float32 "
        "(train.bf16 autocasts, it does not store the weights in bfloat16)"]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("optim, optim_args, match", [
    ("adamw_torch_4bit", "block_size=-128", r"block_size expects int >= 1, got -128"),
    ("adamw_torch_8bit", "block_size=0", r"block_size expects int >= 1, got 0"),
    ("adamw_torch_8bit", "block_size=1.5", r"block_size expects int >= 1, got 1\.5"),
    ("adamw_torch_4bit", "bf16_stochastic_round=maybe", r"bf16_stochastic_round expects true or false, got 'maybe'"),
    ("adamw_torch_8bit", "eps=1e-6", r"adamw_torch_8bit takes block_size, bf16_stochastic_round; got 'eps'; "
                                     r"set train\.adam_epsilon"),
    ("adamw_torch_4bit", "amsgrad=true", r"got 'amsgrad'; Trainer does not pass amsgrad"),
    ("adamw_torch_4bit", "block_size", r"expected 'key=value,key=value'"),
])
def test_bad_optim_args_are_refused_before_the_model_loads(optim, optim_args, match, tmp_path):
    with pytest.raises(engine.ConfigError, match=r"^train\.optim_args: .*" + match):
        engine.Run(_config(optim, tmp_path, optim_args=optim_args))


def test_optim_target_modules_are_refused(tmp_path):
    with pytest.raises(engine.ConfigError, match=r"^train\.optim_target_modules: adamw_torch_4bit .* no target"):
        engine.Run(_config("adamw_torch_4bit", tmp_path, optim_target_modules="all-linear"))


def test_cpu_without_a_cxx_compiler_is_refused(monkeypatch, tmp_path):
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/g++"))
    with pytest.raises(engine.ConfigError, match=r"torch\.compile, which on the CPU needs a C\+\+ compiler: "
                                                 r"no C\+\+ compiler found \(tried \['/nonexistent/g\+\+'\]\)"):
        engine.Run(_config("adamw_torch_8bit", tmp_path, use_cpu=True))
    engine.Run(_config("adamw_torch", tmp_path, use_cpu=True))  # other optimizers do not compile


def test_missing_torchao_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what an environment without it imports
    with pytest.raises(engine.MissingDependencyError, match=r"package 'torchao' is needed for train\.optim = "
                                                            r"'adamw_torch_4bit' .*: pip install 'engine\[torchao\]'"):
        engine.Run(_config("adamw_torch_4bit", tmp_path))
    engine.Run(_config("adamw_torch", tmp_path))  # other optimizers do not need it


def test_torchao_without_torchao_optim_asks_for_an_upgrade(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # torchao < 0.11 has no torchao.optim
    with pytest.raises(engine.MissingDependencyError, match=r"torchao >= 0\.11\.0 is needed \(torchao\.optim; "
                                                            r"found torchao .*pip install -U 'engine\[torchao\]'"):
        engine.Run(_config("adamw_torch_8bit", tmp_path))
