"""Tests for engine-grokadamw: real runs of the tiny model on CPU, no mocks."""

from __future__ import annotations

import io
import sys
import types

import engine_grokadamw
import grokadamw
import pytest
import torch
from engine_grokadamw.optimizer import GrokAdamW, LossGap

import engine
import engine.plugins
from engine.testing import assert_matches_trainer, assert_resume_is_exact, run_steps, tiny_dataset

# the library enters torch.cuda.amp.autocast() for every parameter update
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.cuda.amp.autocast"),
              pytest.mark.filterwarnings("ignore:CUDA is not available")]


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reload(optimizer_cls, optimizer, params):
    """A checkpoint round trip: torch.save, torch.load(weights_only=True), a fresh optimizer."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    fresh = optimizer_cls(params, lr=0.1)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    return fresh


def _steps(optimizer, params, count, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def test_plugin_is_installed():
    installed = engine.plugins.installed_plugins()
    assert installed["grokadamw"].distribution == "engine-grokadamw"
    assert installed["grokadamw"].load() is engine_grokadamw


# ---------------------------------------------------------------------------- state round trip


def test_the_library_state_dict_round_trip_resets_the_state():
    """grokadamw 0.1.2 keeps the state in param_groups keyed by tensors: after a reload, step 4 is 1."""
    param = torch.nn.Parameter(torch.ones(4, 3))
    optimizer = grokadamw.GrokAdamW([param], lr=0.1)
    _steps(optimizer, [param], 4, seed=0)
    assert optimizer.param_groups[0]["state"][param]["step"] == 4
    assert optimizer.state_dict()["state"] == {}  # nothing where torch keeps optimizer state
    reloaded = _reload(grokadamw.GrokAdamW, optimizer, [param])
    _steps(reloaded, [param], 1, seed=1)
    assert reloaded.param_groups[0]["state"][param]["step"] == 1  # silently started over


def test_our_state_dict_round_trip_continues_exactly():
    params = [torch.nn.Parameter(torch.ones(4, 3)) for _ in range(2)]
    reference = [torch.nn.Parameter(torch.ones(4, 3)) for _ in range(2)]
    ours, theirs = GrokAdamW(params, lr=0.1), grokadamw.GrokAdamW(reference, lr=0.1)
    for optimizer, group in ((ours, params), (theirs, reference)):
        _steps(optimizer, group, 4, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(params, reference))  # the library's update, unchanged
    reloaded = _reload(GrokAdamW, ours, params)
    assert reloaded.state[params[0]]["step"] == 4
    for optimizer, group in ((reloaded, params), (theirs, reference)):
        _steps(optimizer, group, 1, seed=7)
    assert reloaded.state[params[0]]["step"] == theirs.param_groups[0]["state"][reference[0]]["step"] == 5
    assert all(torch.equal(a, b) for a, b in zip(params, reference))
    for key in ("exp_avg", "exp_avg_sq", "grok_ema"):
        assert torch.equal(reloaded.state[params[0]][key], theirs.param_groups[0]["state"][reference[0]][key])


def test_resume_gives_the_uninterrupted_run(tmp_path):
    """6 steps straight == 3 steps, checkpoint, resume to 6 (logged values with the evaluations, weights,
    optimizer state), with the loss-gap signal reading the restored history."""
    train = {"optim": "grokadamw", "learning_rate": 3e-3, "eval_strategy": "steps", "eval_steps": 2}
    runs = assert_resume_is_exact(6, 3, tmp_path, plugins=["grokadamw"], train=train,
                                  sections={"grokadamw": {"signals": ["loss_gap"]}},
                                  eval_dataset=tiny_dataset(8, seed=1))
    assert {state["step"] for state in runs.resumed.optimizer.state.values()} == {6}
    assert runs.resumed.optimizer.param_groups[0]["grokking_signal_fns"]  # the signal was on


# ---------------------------------------------------------------------------- training and Trainer


def test_loss_falls(tmp_path):
    run = run_steps(15, plugins=["grokadamw"], output_dir=tmp_path,
                    train={"optim": "grokadamw", "learning_rate": 3e-3, "weight_decay": 0.01})
    assert isinstance(run.optimizer, grokadamw.GrokAdamW)
    losses = _losses(run)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2
    assert all(state["step"] == 15 for state in run.optimizer.state.values())


def test_optimizer_matches_trainer(tmp_path):
    """Trainer's class (ours subclasses it to keep its state), groups and hyper-parameters; the same
    weights after two steps."""
    optim_args = "alpha_init=0.9,lamb=1.5,gamma=0.2,grokking_signal_decay_rate=0.3,gradient_clipping=0.5"
    pair = assert_matches_trainer("grokadamw", tmp_path, plugins=["grokadamw"], optim_args=optim_args,
                                  train={"learning_rate": 3e-3, "weight_decay": 0.05}, our_class=GrokAdamW,
                                  ignore=("state",))  # where each keeps its per-parameter state
    assert type(pair.theirs) is grokadamw.GrokAdamW
    assert [g["weight_decay"] for g in pair.ours.param_groups] == [0.05, 0.0]


# ---------------------------------------------------------------------------- signals


def test_loss_gap_is_the_library_formula_on_the_logged_losses():
    run = types.SimpleNamespace(state=engine.TrainState(), strategy=None)
    signal = LossGap(run)
    assert signal() == 0.0  # nothing logged yet
    run.state.log_history += [{"step": 1, "loss": 2.0}, {"step": 2, "eval_loss": 3.0}]
    assert signal() == pytest.approx(1 / 3)
    run.state.log_history.append({"step": 3, "loss": 1.0})
    assert signal() == pytest.approx(2 / 3)
    run.state.log_history.append({"step": 4, "eval_loss": 0.5})  # eval below train: no signal
    assert signal() == 0.0
    run.state.log_history = [{"step": 2, "loss": 1.0}, {"step": 2, "eval_loss": 1.5}]  # a resume replaces it
    assert signal() == pytest.approx(1 / 3)


def test_a_user_signal_function_gets_the_run_and_steers_alpha(tmp_path, monkeypatch):
    calls = []

    def constant(run):
        calls.append(run.state.global_step)
        return 5.0

    monkeypatch.setitem(sys.modules, "my_signals", types.SimpleNamespace(constant=constant))
    train = {"optim": "grokadamw", "learning_rate": 3e-3}
    steered = run_steps(2, plugins=["grokadamw"], output_dir=tmp_path / "a", train=train,
                        sections={"grokadamw": {"signals": ["my_signals:constant"]}})
    plain = run_steps(2, plugins=["grokadamw"], output_dir=tmp_path / "b", train=train)
    assert calls == [0, 0, 1, 1]  # once per parameter group and step
    assert plain.optimizer.param_groups[0]["grokking_signal_fns"] is None  # Trainer's default
    assert not torch.equal(next(steered.model.parameters()), next(plain.model.parameters()))


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("train, section, match", [
    ({"optim_args": "beta1=0.9"}, None, r"train\.optim_args: grokadamw takes alpha_init, .*; got 'beta1'"),
    ({"optim_args": "alpha_init=1.5"}, None, r"train\.optim_args: alpha_init expects float in \[0, 1\], got 1\.5"),
    ({"optim_args": "lamb=big"}, None, r"train\.optim_args: lamb expects float, got 'big'"),
    ({"optim_args": "gradient_clipping=-1"}, None, r"train\.optim_args: gradient_clipping expects float >= 0"),
    ({}, {"signals": ["grokfast"]}, r"grokadamw\.signals\[0\]: unknown signal 'grokfast'; use one of loss_gap"),
    ({}, {"signals": ["loss_gap", "no_such_module_xyz:fn"]},
     r"grokadamw\.signals\[1\]: no module named 'no_such_module_xyz'"),
    ({}, {"signals": "loss_gap"}, r"grokadamw\.signals: expected list of str"),
])
def test_bad_input_is_refused_before_the_model_loads(train, section, match):
    config = {"plugins": ["grokadamw"], "train": {"optim": "grokadamw", **train}}
    if section is not None:
        config["grokadamw"] = section
    with pytest.raises(engine.ConfigError, match=match):
        engine.Run(config)


def test_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "grokadamw", None)  # as if grokadamw were not installed
    monkeypatch.delitem(sys.modules, "engine_grokadamw.optimizer")
    monkeypatch.delattr(engine_grokadamw, "optimizer")
    with pytest.raises(engine.MissingDependencyError, match=r"pip install 'engine\[grokadamw\]'"):
        engine.Run({"plugins": ["grokadamw"], "train": {"optim": "grokadamw"}})


def test_the_name_needs_the_plugin():
    with pytest.raises(engine.ConfigError, match=r"train\.optim: unknown optimizer 'grokadamw'.*'grokadamw'"):
        engine.Run({"train": {"optim": "grokadamw"}})
