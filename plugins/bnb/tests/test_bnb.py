"""Tests for engine-bnb: every name trains, equals transformers' Trainer optimizer, resumes exactly.

Real bitsandbytes on the CPU, real transformers Trainer; no mocks.
"""

from __future__ import annotations

import sys
import warnings

import bitsandbytes.optim as bnb_optim
import engine_bnb
import pytest
import torch

import engine
import engine.plugins
from engine.testing import assert_matches_trainer, assert_resume_is_exact, run_steps, tiny_dataset, tiny_model

NAMES = list(engine_bnb.OPTIMIZERS)
CLASSES = {"adamw": bnb_optim.AdamW, "lion": bnb_optim.Lion, "rmsprop": bnb_optim.RMSprop,
           "ademamix": bnb_optim.AdEMAMix}
TRANSFORMERS_NAME = {"rmsprop_8bit": "rmsprop_bnb_8bit"}  # transformers has no "rmsprop_8bit"
# Non-default values everywhere, so a value taken from the wrong place shows.
TRAIN = {"learning_rate": 3e-3, "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.95,
         "adam_epsilon": 1e-6}
OPTIM_ARGS = {"ademamix": "beta1=0.85,beta3=0.999,alpha=8,eps=1e-7,t_alpha=100,t_beta3=50"}
LEARNING_RATE = {"rmsprop": 1e-3}  # RMSprop's first steps are large: 1e-2 oscillates on the tiny model
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"  # 4096 elements each: 8-bit eligible


def _fresh_bnb_overrides():
    """Empty bitsandbytes' process-global override table, as in a fresh process: it is keyed by
    (group index, parameter index) across all optimizers, so earlier tests would leak into later ones."""
    bnb_optim.GlobalOptimManager.get_instance().initialize()


@pytest.fixture(autouse=True)
def fresh_bnb_overrides():
    _fresh_bnb_overrides()


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


def _config(optim, tmp_path, **train):
    return {"plugins": ["bnb"], "train": {"optim": optim, "output_dir": str(tmp_path), "max_steps": 1,
                                          "disable_tqdm": True, **train}}


# ---------------------------------------------------------------------------- discovery


def test_plugin_is_installed_and_registers_every_name(tmp_path):
    from engine.catalogue import FIRST_PARTY

    installed = engine.plugins.installed_plugins()
    assert installed["bnb"].distribution == "engine-bnb"
    assert installed["bnb"].load() is engine_bnb
    assert sorted(NAMES) == sorted(FIRST_PARTY["bnb"].provides["optimizer"])
    registry = engine.Run(_config("adamw_8bit", tmp_path)).registries["optimizer"]
    assert all(registry.get(name).plugin == "bnb" for name in NAMES)


def test_names_need_the_plugin(tmp_path):
    with pytest.raises(engine.ConfigError, match="it comes from plugin 'bnb', which is installed but not enabled"):
        engine.Run({"train": {"optim": "paged_adamw_8bit", "output_dir": str(tmp_path)}})


# ---------------------------------------------------------------------------- training and resume


@pytest.fixture(scope="module", params=NAMES)
def trained(request, tmp_path_factory):
    """7 steps of the tiny model with a checkpoint at step 4, and a run resumed from it that ends
    the same (``assert_resume_is_exact``: restored state, logged values, weights, optimizer state)."""
    _fresh_bnb_overrides()
    name = request.param
    train = {"optim": name, "weight_decay": 0.1, "save_final_model": False,
             "learning_rate": LEARNING_RATE.get(engine_bnb.OPTIMIZERS[name].family, 1e-2)}
    return assert_resume_is_exact(7, 4, tmp_path_factory.mktemp(name), plugins=["bnb"], train=train)


def test_trains_and_loss_falls(trained):
    run = trained.straight
    spec = engine_bnb.OPTIMIZERS[run.config.train.optim]
    assert type(run.optimizer) is CLASSES[spec.family]
    assert run.state.global_step == 7
    losses = _losses(run)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    state = {n: run.optimizer.state[p] for n, p in run.model.named_parameters()}
    assert all(s["step"] == 7 for s in state.values())
    # 8-bit state only for tensors of >= 4096 elements, and never for embeddings (Trainer's override)
    assert state[HEAD]["state1"].dtype == (torch.uint8 if spec.optim_bits == 8 else torch.float32)
    assert state[EMBED]["state1"].dtype == torch.float32
    assert state["model.layers.0.mlp.up_proj.weight"]["state1"].dtype == torch.float32  # 2048 elements


def test_resume_restores_state_and_steps_identically(trained):
    straight = trained.straight
    saved = torch.load(trained.checkpoint / "optimizer.pt", weights_only=True)  # restored as saved (the fixture)
    order = [id(p) for group in straight.optimizer.param_groups for p in group["params"]]
    quant = saved["state"][order.index(id(straight.model.lm_head.weight))]["__bnb_optimizer_quant_state__"]
    assert quant["state1"].dtype == (torch.uint8 if engine_bnb.OPTIMIZERS[straight.config.train.optim].optim_bits == 8
                                     else torch.float32)
    if quant["state1"].dtype == torch.uint8:
        assert {"absmax1", "qmap1"} <= quant.keys()
    assert trained.resumed.state.global_step == 7


# ---------------------------------------------------------------------------- equals transformers


@pytest.mark.parametrize("name", NAMES)
def test_equals_transformers_trainer_optimizer(name, tmp_path):
    """Same class, bitsandbytes arguments, groups and hyper-parameters; after two steps the same
    weights and state (dtype and values: per-parameter overrides included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' paged optimizers warn on the CPU
        pair = assert_matches_trainer(name, tmp_path, plugins=["bnb"], train=TRAIN,
                                      trainer_optim=TRANSFORMERS_NAME.get(name),
                                      optim_args=OPTIM_ARGS.get(engine_bnb.OPTIMIZERS[name].family), atol=0,
                                      compare_state=True)
    ours, theirs = pair.ours, pair.theirs
    assert vars(ours.args) == vars(theirs.args)  # optim_bits, min_8bit_size, max_unorm, skip_zeros
    # on the CPU ours is built unpaged (Trainer's paged flag does nothing there but crash AdEMAMix)
    assert theirs.is_paged == engine_bnb.OPTIMIZERS[name].is_paged and ours.is_paged is False
    assert len(ours.param_groups) == 2


def test_rmsprop_optim_args_are_typed(tmp_path):
    """transformers passes RMSprop's optim_args as strings (so bitsandbytes raises TypeError);
    the plugin passes the same values as numbers."""
    from transformers import Trainer, TrainingArguments

    text = "alpha=0.9,momentum=0.5,eps=1e-6"
    run = engine.Run(_config("rmsprop_bnb", tmp_path, optim_args=text), model=tiny_model(),
                     train_dataset=tiny_dataset())
    run.setup()
    assert all(g["betas"] == (0.9, 0.5) and g["eps"] == 1e-6 for g in run.optimizer.param_groups)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), optim="rmsprop_bnb", optim_args=text,
                             report_to=[], use_cpu=True)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is bnb_optim.RMSprop
    assert kwargs == {"lr": args.learning_rate, "alpha": "0.9", "momentum": "0.5", "eps": "1e-6", "optim_bits": 32}


# ---------------------------------------------------------------------------- paged on the CPU


@pytest.mark.parametrize("name", ["paged_ademamix_8bit", "paged_ademamix_32bit", "paged_adamw_8bit"])
def test_paged_names_train_on_cpu_with_large_tensors(name, tmp_path):
    # bitsandbytes' AdEMAMix asks for CUDA managed memory for tensors of >= 100k elements: the
    # 4096 x 32 embedding here has 131k
    run = run_steps(2, plugins=["bnb"], output_dir=tmp_path, model=tiny_model(vocab_size=4096),
                    dataset=tiny_dataset(vocab_size=4096), train={"optim": name, "save_final_model": False})
    assert run.state.global_step == 2 and run.optimizer.is_paged is False


def test_paged_on_cpu_is_said_once_per_process(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(engine_bnb, "_paged_cpu_warned", False)  # as in a fresh process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, name in enumerate(("paged_adamw_8bit", "paged_lion_32bit", "paged_ademamix_8bit")):
            run_steps(1, plugins=["bnb"], output_dir=tmp_path / str(i),
                      train={"optim": name, "save_final_model": False})
    said = [line for line in capsys.readouterr().err.splitlines() if "aged" in line]
    assert said == [("engine: paged_adamw_8bit: paged optimizer state needs CUDA (unified memory); the "
                     "parameters are on the CPU, so bitsandbytes keeps the state in ordinary CPU memory "
                     "instead. Training is the same as with the non-paged optimizer; only the paging is "
                     "off. (Said once per process.)")]
    assert not [w for w in caught if "aged" in str(w.message)]  # bitsandbytes' own warning is replaced


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("optim, optim_args, match", [
    ("adamw_8bit", "beta1=0.5", r"adamw_8bit takes no optim_args; got 'beta1'; set train\.adam_beta1"),
    ("paged_lion_32bit", "weight_decay=0.1",
     r"paged_lion_32bit takes no optim_args; got 'weight_decay'; set train\.weight_decay"),
    ("rmsprop_bnb", "centered=true",
     r"rmsprop_bnb takes alpha, eps, momentum; got 'centered'; bitsandbytes has no centered RMSprop"),
    ("rmsprop_bnb_8bit", "alpha=0", r"alpha expects float in \(0, 1\), got 0\.0"),
    ("rmsprop_8bit", "momentum=fast", r"momentum expects float in \[0, 1\), got 'fast'"),
    ("ademamix", "t_alpha=1.5", r"t_alpha expects int >= 1, got 1\.5"),
    ("ademamix_8bit", "beta3=1.0", r"beta3 expects float in \[0, 1\), got 1\.0"),
    ("paged_ademamix_32bit", "alpha=true", r"alpha expects float >= 0, got True"),
    ("paged_ademamix_8bit", "gamma=2",
     r"paged_ademamix_8bit takes beta1, beta2, beta3, alpha, eps, t_alpha, t_beta3; got 'gamma'"),
    ("lion_8bit", "oops", r"expected 'key=value,key=value'"),
])
def test_bad_optim_args_are_refused_before_the_model_loads(optim, optim_args, match, tmp_path):
    with pytest.raises(engine.ConfigError, match=r"^train\.optim_args: .*" + match):
        engine.Run(_config(optim, tmp_path, optim_args=optim_args))


@pytest.mark.parametrize("optim, key, value", [
    ("lion_8bit", "adam_beta1", 1.0), ("adamw_8bit", "adam_beta2", -0.1),
    ("paged_adamw_32bit", "adam_epsilon", -1e-8), ("rmsprop_bnb", "weight_decay", -0.1),
])
def test_bad_train_values_are_refused(optim, key, value, tmp_path):
    with pytest.raises(engine.ConfigError, match=rf"^train\.{key}: expected float .*, got {value}"):
        engine.Run(_config(optim, tmp_path, **{key: value}))


def test_optim_target_modules_are_refused(tmp_path):
    with pytest.raises(engine.ConfigError, match=r"^train\.optim_target_modules: adamw_8bit .* takes no target modules"):
        engine.Run(_config("adamw_8bit", tmp_path, optim_target_modules=[".*attn.*"]))


def test_missing_bitsandbytes_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what an environment without it imports
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", None)
    with pytest.raises(engine.MissingDependencyError, match=r"pip install 'engine\[bnb\]'"):
        engine.Run(_config("paged_adamw_8bit", tmp_path))
    engine.Run(_config("adamw_torch", tmp_path))  # other optimizers do not need it
