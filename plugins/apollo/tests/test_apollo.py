"""Tests for engine-apollo: real runs of the tiny model on CPU, compared with transformers' Trainer."""

from __future__ import annotations

import logging
import sys

import engine_apollo
import pytest
import torch

import engine
import engine.catalogue
import engine.plugins
from engine.errors import ConfigError, MissingDependencyError
from engine.kit.lowrank import LayerwiseOptimizer
from engine.strategy import Strategy
from engine.testing import assert_matches_trainer, assert_resume_is_exact, run_steps, tiny_dataset, tiny_model

TARGETS = [r".*attn.*", r".*mlp.*"]
ARGS = "rank=4,update_proj_gap=2"
OTHER_ARGS = "rank=4,proj=svd,scale_type=tensor,update_proj_gap=50,scale=2,proj_type=left"


def _train(**extra):
    return {"optim_target_modules": TARGETS, "optim_args": ARGS, **extra}


def _run(optim, tmp_path, plugins=(), **train):
    """A composed (not set up) run of the tiny model."""
    config = {"plugins": ["apollo"], "train": {"output_dir": str(tmp_path), "max_steps": 1, "save_strategy": "no",
                                               "disable_tqdm": True, **_train(optim=optim), **train}}
    return engine.Run(config, model=tiny_model(), train_dataset=tiny_dataset(), plugins=list(plugins))


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


def _inner(optimizer):
    return list(optimizer.optimizers.values()) if isinstance(optimizer, LayerwiseOptimizer) else [optimizer]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Both names trained 12 steps: apollo_adamw without clipping, the layerwise name with the default."""
    return {optim: run_steps(12, plugins=["apollo"], output_dir=tmp_path_factory.mktemp(optim),
                             train=_train(optim=optim, **({} if "layerwise" in optim else {"max_grad_norm": 0.0})))
            for optim in engine_apollo.NAMES}


def test_plugin_is_installed():
    installed = engine.plugins.installed_plugins()
    assert installed["apollo"].distribution == "engine-apollo"
    assert installed["apollo"].load() is engine_apollo
    assert engine_apollo.NAMES == engine.catalogue.FIRST_PARTY["apollo"].provides["optimizer"]


# ---------------------------------------------------------------------------- training


@pytest.mark.parametrize("optim", engine_apollo.NAMES)
def test_loss_falls_on_cpu(trained, optim):
    run = trained[optim]
    losses = _losses(run)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    projectors = [s["projector"] for o in _inner(run.optimizer) for s in o.state.values() if "projector" in s]
    assert len(projectors) == 14 and all(type(p).__name__ == "GradientProjector" for p in projectors)
    assert all(4 in p.ortho_matrix.shape for p in projectors)


def test_layerwise_equals_the_whole_model_optimizer(trained):
    """Same seeds per parameter as one APOLLOAdamW, so the same training (no clipping either way)."""
    whole, layerwise = trained["apollo_adamw"], trained["apollo_adamw_layerwise"]
    assert _losses(layerwise) == _losses(whole)
    for (name, a), b in zip(whole.model.named_parameters(), layerwise.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert all("grad_norm" not in h for h in layerwise.state.log_history)


# ---------------------------------------------------------------------------- same as transformers


def _seeds(optimizer, model):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s["seed"] for p, s in optimizer.state.items()}


ADAM = {"adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-7}


@pytest.mark.parametrize("optim_args, adam", [(None, {}), (OTHER_ARGS, ADAM)])
def test_optimizer_equals_trainers(optim_args, adam, tmp_path):
    """Trainer's class, groups, hyper-parameters and projection seeds; the same weights after two steps."""
    pair = assert_matches_trainer("apollo_adamw", tmp_path, plugins=["apollo"], train={"learning_rate": 1e-2, **adam},
                                  optim_args=optim_args, optim_target_modules=TARGETS)
    assert _seeds(pair.ours, pair.our_model) == _seeds(pair.theirs, pair.their_model)


def test_layerwise_optimizers_equal_trainers_but_seeds(tmp_path):
    """Per parameter: Trainer's class, groups and hyper-parameters; not its seeds (so not its updates:
    ours train as apollo_adamw does, see test_layerwise_equals_the_whole_model_optimizer)."""
    pair = assert_matches_trainer("apollo_adamw_layerwise", tmp_path, plugins=["apollo"],
                                  train={"learning_rate": 1e-2}, optim_args=ARGS, optim_target_modules=TARGETS, steps=0)
    ours, theirs = pair.ours.optimizers, pair.theirs.optimizer_dict
    # Trainer gives every per-parameter optimizer seed 1; ours keep the whole-model seeds
    assert {s for o in theirs.values() for s in _seeds(o, pair.their_model).values()} == {1}
    whole_run = _run("apollo_adamw", tmp_path)
    whole = engine_apollo.FAMILY.create(whole_run, None)
    layerwise_seeds = {name: seed for o in ours.values() for name, seed in _seeds(o, pair.our_model).items()}
    assert layerwise_seeds == _seeds(whole, whole_run.model)
    assert sorted(layerwise_seeds.values()) == list(range(1, len(ours) + 1))


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("optim", engine_apollo.NAMES)
def test_resume_continues_exactly(optim, tmp_path):
    """5 steps straight == 3 steps, checkpoint, resume to 5 (logged values, weights, optimizer state),
    with the projections and seeds the checkpoint holds."""
    # update_proj_gap=2: the step-2 projection (second seed) is in use at step 3, where we resume
    runs = assert_resume_is_exact(5, 3, tmp_path, plugins=["apollo"], train=_train(optim=optim, max_grad_norm=0.0))
    torch.load(runs.checkpoint / "optimizer.pt", weights_only=True)  # no pickled projector objects
    states = [(s, t) for a, b in zip(_inner(runs.straight.optimizer), _inner(runs.resumed.optimizer))
              for s, t in zip(a.state.values(), b.state.values()) if "projector" in s]
    assert len(states) == 14
    for s, t in states:
        assert t["projector"].seed == s["projector"].seed and t["seed"] == s["seed"]
        torch.testing.assert_close(t["projector"].ortho_matrix, s["projector"].ortho_matrix, rtol=0, atol=0)
        torch.testing.assert_close(t["scaled_grad"], s["scaled_grad"], rtol=0, atol=0)


# ---------------------------------------------------------------------------- refused before training


@pytest.mark.parametrize("optim_args, message", [
    ("rank=4,alpha=1", (r"train\.optim_args: apollo_adamw takes rank, proj, scale_type, update_proj_gap, "
                        r"scale, proj_type; got 'alpha'")),
    ("rank=-1", r"rank expects int >= 1, got -1"),
    ("proj=qr", r"proj expects random \| svd, got 'qr'"),
    ("scale_type=row", r"scale_type expects channel \| tensor, got 'row'"),
    ("proj_type=full,scale_type=tensor", r"proj_type expects std \| reverse_std \| left \| right, got 'full'"),
    ("proj_type=left", r"proj_type=left needs scale_type=tensor"),
    ("scale=big", r"scale expects float > 0, got 'big'"),
])
def test_bad_optim_args_are_refused(optim_args, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        _run("apollo_adamw", tmp_path, optim_args=optim_args)


@pytest.mark.parametrize("targets, message", [
    (None, r"train\.optim_target_modules: apollo_adamw needs target modules"),
    ("nothing", r"train\.optim_target_modules: 'nothing' selects no nn\.Linear module"),
    (["mlp", "norm"], r"model\.layers\.0\.input_layernorm \(LlamaRMSNorm\).*apollo_adamw only projects nn\.Linear"),
])
def test_bad_target_modules_are_refused(targets, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        _run("apollo_adamw", tmp_path, optim_target_modules=targets)


class _DDP:
    name = "ddp_like"

    @engine.hookimpl
    def register_strategies(self, register):
        register("ddp", Strategy)


def test_layerwise_conflicts_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps: apollo_adamw_layerwise .*; set it to 1"):
        _run("apollo_adamw_layerwise", tmp_path, gradient_accumulation_steps=4)
    with pytest.raises(ConfigError, match=r"train\.strategy: apollo_adamw_layerwise runs in a single process only"):
        _run("apollo_adamw_layerwise", tmp_path, plugins=[_DDP()], strategy="ddp")


def test_adam_settings_reach_the_projected_weights_only(tmp_path):
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("engine.apollo").addHandler(handler)
    try:
        run = _run("apollo_adamw", tmp_path, adam_beta1=0.8, weight_decay=0.1)
    finally:
        logging.getLogger("engine.apollo").removeHandler(handler)
    assert any("train.weight_decay = 0.1 not used" in m for m in messages)
    assert any("train.adam_beta1 = 0.8 only reach the projected weights" in m for m in messages)
    groups = engine_apollo.FAMILY.create(run, None).param_groups
    assert groups[0]["betas"] == (0.9, 0.999) and groups[1]["betas"] == (0.8, 0.999)


def test_missing_library_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "apollo_torch", None)  # what an absent package looks like to import
    with pytest.raises(MissingDependencyError, match=r"'apollo-torch' is needed for train.optim = 'apollo_adamw'.*pip install 'engine\[apollo\]'"):
        _run("apollo_adamw", tmp_path)
