"""Tests for engine-galore: real runs of the tiny model on CPU, compared with transformers' Trainer."""

from __future__ import annotations

import io
import logging
import sys

import engine_galore
import pytest
import torch

import engine
import engine.catalogue
import engine.plugins
from engine.kit import lowrank
from engine.errors import ConfigError, MissingDependencyError
from engine.kit.lowrank import LayerwiseOptimizer
from engine.strategy import Strategy
from engine.testing import assert_matches_trainer, assert_resume_is_exact, run_steps, tiny_dataset, tiny_model

TARGETS = [r".*attn.*", r".*mlp.*"]
ARGS = "rank=4,update_proj_gap=50,scale=0.5,proj_type=std"
CPU_NAMES = ("galore_adamw", "galore_adafactor", "galore_adamw_layerwise", "galore_adafactor_layerwise")


def _train(**extra):
    return {"optim_target_modules": TARGETS, "optim_args": ARGS, **extra}


def _run(optim, tmp_path, model=None, **train):
    """A composed (not set up) run of the tiny model."""
    config = {"plugins": ["galore"], "train": {"output_dir": str(tmp_path), "max_steps": 1, "save_strategy": "no",
                                               "disable_tqdm": True, **_train(optim=optim), **train}}
    return engine.Run(config, model=model if model is not None else tiny_model(), train_dataset=tiny_dataset())


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_of_galore():
    handler = _Messages()
    logging.getLogger("engine.galore").addHandler(handler)
    yield handler.lines
    logging.getLogger("engine.galore").removeHandler(handler)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each CPU name trained 12 steps; non-layerwise names without clipping, layerwise with the default."""
    runs = {}
    for optim in CPU_NAMES:
        train = _train(optim=optim)
        if not lowrank.is_layerwise(optim):
            train["max_grad_norm"] = 0.0
        runs[optim] = run_steps(12, plugins=["galore"], train=train, output_dir=tmp_path_factory.mktemp(optim))
    return runs


# ---------------------------------------------------------------------------- discovery


def test_plugin_is_installed():
    installed = engine.plugins.installed_plugins()
    assert installed["galore"].distribution == "engine-galore"
    assert installed["galore"].load() is engine_galore
    assert engine_galore.NAMES == engine.catalogue.FIRST_PARTY["galore"].provides["optimizer"]


# ---------------------------------------------------------------------------- training


@pytest.mark.parametrize("optim", CPU_NAMES)
def test_loss_falls(trained, optim):
    run = trained[optim]
    losses = _losses(run)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    layerwise = lowrank.is_layerwise(optim)
    assert isinstance(run.optimizer, LayerwiseOptimizer) == layerwise
    inner = run.optimizer.optimizers.values() if layerwise else [run.optimizer]
    projectors = [s["projector"] for o in inner for s in o.state.values() if "projector" in s]
    assert len(projectors) == 14 and all(p.ortho_matrix.shape[0] == 4 or p.ortho_matrix.shape[1] == 4
                                         for p in projectors)


@pytest.mark.parametrize("base", ["galore_adamw", "galore_adafactor"])
def test_layerwise_equals_the_whole_model_optimizer(trained, base):
    """Per-parameter steps inside backward give the same training as one optimizer (no clipping)."""
    whole, layerwise = trained[base], trained[base + "_layerwise"]
    assert _losses(layerwise) == _losses(whole)
    for (name, a), b in zip(whole.model.named_parameters(), layerwise.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # the scheduler made for the dummy optimizer drove every per-parameter optimizer's lr
    lrs = {g["lr"] for o in layerwise.optimizer.optimizers.values() for g in o.param_groups}
    assert lrs == {whole.optimizer.param_groups[0]["lr"]} and lrs != {1e-2}
    # clipping cannot apply: no grad_norm is logged, and the hooks are gone after training
    assert all("grad_norm" not in h for h in layerwise.state.log_history)
    assert layerwise.optimizer._handles == []


# ---------------------------------------------------------------------------- same as transformers


def _trainer_build(optim, model, optim_args, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, optim_args=optim_args, learning_rate=1e-2,
                             optim_target_modules=TARGETS, report_to=[])
    return Trainer.get_optimizer_cls_and_kwargs(args, model)


def _ours(optim, tmp_path, optim_args):
    """Our (model, optimizer) for ``optim``; 8-bit names are refused on CPU, so build those from a galore_adamw run."""
    run = _run(optim.replace("_8bit", ""), tmp_path, optim_args=optim_args, learning_rate=1e-2)
    run.config.train.optim = optim
    return run.model, engine_galore.FAMILY.create(run, None)


def _matches_trainer(optim, tmp_path, optim_args):
    """Trainer's optimizer, groups and hyper-parameters (per parameter for layerwise names), and the
    same weights after two steps; 8-bit names only as built (they need CUDA to step)."""
    if "8bit" in optim:
        return assert_matches_trainer(optim, tmp_path, train={"learning_rate": 1e-2}, optim_args=optim_args,
                                      optim_target_modules=TARGETS, ours=_ours(optim, tmp_path, optim_args), steps=0)
    return assert_matches_trainer(optim, tmp_path, plugins=["galore"], train={"learning_rate": 1e-2},
                                  optim_args=optim_args, optim_target_modules=TARGETS)


@pytest.mark.parametrize("optim_args", [ARGS.replace("std", "left"), None])
@pytest.mark.parametrize("optim", ["galore_adamw", "galore_adamw_8bit", "galore_adafactor"])
def test_optimizer_equals_trainers(optim, optim_args, tmp_path):
    _matches_trainer(optim, tmp_path, optim_args)


@pytest.mark.parametrize("optim", ["galore_adamw_layerwise", "galore_adamw_8bit_layerwise"])
def test_layerwise_optimizers_equal_trainers(optim, tmp_path):
    pair = _matches_trainer(optim, tmp_path, ARGS)
    assert isinstance(pair.ours, LayerwiseOptimizer) and len(pair.ours.optimizers) == len(pair.theirs.optimizer_dict)


def test_adafactor_layerwise_works_where_trainer_fails(tmp_path):
    """Trainer passes relative_step=False only for galore_adafactor: its layerwise variant fails."""
    with pytest.raises(ValueError, match="Cannot combine manual `lr` and `relative_step=True`"):
        _trainer_build("galore_adafactor_layerwise", tiny_model(), ARGS, tmp_path)
    model, ours = _ours("galore_adafactor_layerwise", tmp_path, ARGS)
    cls, kwargs = _trainer_build("galore_adafactor", tiny_model(), ARGS, tmp_path)
    whole = [{k: v for k, v in g.items() if k != "params"} for g in kwargs["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(ours.optimizers) == len(names)
    for param, inner in ours.optimizers.items():
        name = names[id(param)]
        assert type(inner) is cls
        expected = {**cls([torch.zeros(1)], **{k: v for k, v in kwargs.items() if k != "params"}).defaults,
                    **whole["proj" in name]}  # the targets: attn / mlp projections
        assert {k: v for k, v in inner.param_groups[0].items() if k != "params"} == expected
        assert inner.defaults["relative_step"] is False and inner.defaults["scale_parameter"] is False


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("optim", ["galore_adamw", "galore_adafactor_layerwise"])
def test_resume_continues_exactly(optim, tmp_path):
    """4 steps straight == 2 steps, checkpoint, resume to 4 (logged values, weights, optimizer state),
    with the projections the checkpoint holds."""
    runs = assert_resume_is_exact(4, 2, tmp_path, plugins=["galore"], train=_train(optim=optim, max_grad_norm=0.0))
    saved = torch.load(runs.checkpoint / "optimizer.pt", weights_only=True)  # no pickled projector objects
    states = saved["layerwise"] if lowrank.is_layerwise(optim) else [saved]
    ortho = [s["projector"]["ortho_matrix"] for sd in states for s in sd["state"].values() if "projector" in s]
    assert len(ortho) == 14
    resumed = runs.resumed
    inner = resumed.optimizer.optimizers.values() if lowrank.is_layerwise(optim) else [resumed.optimizer]
    projectors = [s["projector"] for o in inner for s in o.state.values() if "projector" in s]
    assert all(type(p).__name__ == "GaLoreProjector" and p.proj_type == "std" for p in projectors)
    # update_proj_gap=50: the step-0 projections came from the checkpoint, not from a new SVD
    for matrix, projector in zip(ortho, projectors, strict=True):
        torch.testing.assert_close(matrix, projector.ortho_matrix, rtol=0, atol=0)


def test_8bit_projector_state_loads_through_bitsandbytes():
    """GaLoreAdamW8bit loads with bitsandbytes' own load_state_dict (no torch hooks): restored anyway."""
    from galore_torch import GaLoreAdamW8bit
    from galore_torch.galore_projector import GaLoreProjector

    def make(weight):
        opt = GaLoreAdamW8bit([{"params": [weight], "rank": 2, "update_proj_gap": 9, "scale": 0.5,
                                "proj_type": "full"}], lr=1e-3)
        lowrank.keep_projectors_loadable(opt, engine_galore._make_projector)
        return opt

    weight = torch.nn.Parameter(torch.randn(6, 4))
    first = make(weight)
    projector = GaLoreProjector(2, update_proj_gap=9, scale=0.5, proj_type="full")
    projector.project(torch.randn(6, 4), 0)  # an SVD: ortho_matrix = [U, V]
    first.state[weight].update(step=3, projector=projector)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = make(weight)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    assert isinstance(second.state[weight]["projector"], dict)  # bitsandbytes ran no hook ...
    lowrank.restore_projectors(second)  # ... the plugin's load_checkpoint_state hook does this
    loaded = second.state[weight]["projector"]
    assert isinstance(loaded, GaLoreProjector) and loaded.proj_type == "full" and second.state[weight]["step"] == 3
    for a, b in zip(loaded.ortho_matrix, projector.ortho_matrix):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------- refused before training


@pytest.mark.parametrize("optim_args, message", [
    ("rank=4,alpha=1", r"train\.optim_args: galore_adamw takes rank, update_proj_gap, scale, proj_type; got 'alpha'"),
    ("rank=4.5", r"train\.optim_args: rank expects int >= 1, got 4\.5"),
    ("rank=0", r"rank expects int >= 1, got 0"),
    ("update_proj_gap=true", r"update_proj_gap expects int >= 1 .*, got True"),
    ("scale=-1", r"scale expects float > 0, got -1\.0"),
    ("proj_type=diagonal", r"proj_type expects std \| reverse_std \| right \| left \| full, got 'diagonal'"),
    ("rank", r"train\.optim_args: expected 'key=value,key=value'"),
])
def test_bad_optim_args_are_refused(optim_args, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        _run("galore_adamw", tmp_path, model=None, optim_args=optim_args)


def test_target_modules_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"optim_target_modules: galore_adamw needs target modules"):
        _run("galore_adamw", tmp_path, optim_target_modules=None)
    # the model is given: refused while composing the run
    with pytest.raises(ConfigError, match=r"optim_target_modules: .*selects no nn\.Linear module"):
        _run("galore_adamw", tmp_path, optim_target_modules=[r".*nothing.*"])
    with pytest.raises(ConfigError, match=r"model\.embed_tokens \(Embedding\).*galore_adamw only projects nn\.Linear"):
        _run("galore_adamw", tmp_path, optim_target_modules=["q_proj", "embed_tokens"])
    # no model while composing: refused when the optimizer is made, before any step
    run = engine.Run({"plugins": ["galore"], "train": {"output_dir": str(tmp_path), "max_steps": 1,
                                                        **_train(optim="galore_adamw", optim_target_modules="nothing")}},
                     train_dataset=tiny_dataset())
    run.model = tiny_model()
    with pytest.raises(ConfigError, match=r"'nothing' selects no nn\.Linear"):
        run.setup()
    assert run.state.global_step == 0


def test_8bit_needs_cuda(tmp_path):
    for optim in ("galore_adamw_8bit", "galore_adamw_8bit_layerwise"):
        with pytest.raises(ConfigError, match=rf"train\.optim: {optim} needs a CUDA device .*torch\.cuda\.synchronize"):
            _run(optim, tmp_path, use_cpu=True)


class _DDP:
    """A plugin offering a strategy named "ddp" (the single-process Strategy is enough to be chosen)."""

    name = "ddp_like"

    @engine.hookimpl
    def register_strategies(self, register):
        register("ddp", Strategy)


@pytest.mark.parametrize("train, plugins, message", [
    ({"gradient_accumulation_steps": 2}, [], r"train\.gradient_accumulation_steps: .*cannot accumulate"),
    ({"strategy": "ddp"}, [_DDP()], (r"train\.strategy: galore_adamw_layerwise runs in a single process only "
                                     r"\(train\.strategy = 'ddp'\)")),
    ({}, [_DDP()], r"single process only \(train\.strategy = 'ddp'\)"),  # "auto" picks the plugin's
    ({"fp16": True}, [], r"train\.fp16: galore_adamw_layerwise cannot unscale"),
])
def test_layerwise_conflicts_are_refused(train, plugins, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        engine.Run({"plugins": ["galore"], "train": {"output_dir": str(tmp_path),
                                                      **_train(optim="galore_adamw_layerwise"), **train}},
                   plugins=plugins)


def test_layerwise_refuses_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"single process only \(WORLD_SIZE=2\)"):
        _run("galore_adafactor_layerwise", tmp_path)


def test_ignored_settings_are_reported(tmp_path, warnings_of_galore):
    _run("galore_adamw_layerwise", tmp_path, weight_decay=0.1, adam_epsilon=1e-6)
    assert any("train.max_grad_norm = 1.0 is not applied" in line for line in warnings_of_galore)
    assert any("train.weight_decay = 0.1, train.adam_epsilon = 1e-06 not used" in line
               for line in warnings_of_galore)


def test_missing_library_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "galore_torch", None)  # what an absent package looks like to import
    with pytest.raises(MissingDependencyError, match=r"'galore-torch' is needed for train.optim = 'galore_adamw'.*pip install 'engine\[galore\]'"):
        _run("galore_adamw", tmp_path)
