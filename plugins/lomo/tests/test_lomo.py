"""Tests for engine-lomo: real runs of the tiny model on CPU, no mocks."""

from __future__ import annotations

import sys

import engine_lomo
import lomo_optim
import pytest
import torch
from engine_lomo import fused

import engine
import engine.plugins
from engine import hookimpl
from engine.testing import assert_matches_trainer, assert_resume_is_exact, run_steps, tiny_dataset, tiny_model


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


def _batch(n=4):
    rows = torch.stack([tiny_dataset()[i]["input_ids"] for i in range(n)])
    return {"input_ids": rows, "labels": rows.clone()}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def cuda_free_library(monkeypatch):
    """lomo_optim.AdaLomo as released, made constructible on CPU (its .cuda() calls become no-ops):
    the reference our CPU AdaLomo is compared with."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    return lomo_optim.AdaLomo


def test_plugin_is_installed():
    installed = engine.plugins.installed_plugins()
    assert installed["lomo"].distribution == "engine-lomo"
    assert installed["lomo"].load() is engine_lomo


# ---------------------------------------------------------------------------- training


@pytest.mark.parametrize("optim, lr", [("lomo", 0.5), ("adalomo", 0.1)])
def test_loss_falls(tmp_path, optim, lr):
    run = run_steps(15, plugins=["lomo"], output_dir=tmp_path,
                    train={"optim": optim, "learning_rate": lr, "lr_scheduler_type": "constant"})
    assert isinstance(run.optimizer, getattr(lomo_optim, "AdaLomo" if optim == "adalomo" else "Lomo"))
    losses = _losses(run)
    assert len(losses) == 15 and all(h["grad_norm"] > 0 for h in run.state.log_history if "loss" in h)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    assert all(p.grad is None for p in run.model.parameters())  # nothing held between steps


def test_lomo_is_sgd_with_global_clipping_and_the_scheduled_lr(tmp_path):
    """LOMO = SGD applied in backward: same weights, loss and pre-clip grad norm as the builtin
    step with sgd, clip_grad_norm_ and the linear schedule (the lr fused_backward gets each step)."""
    train = {"learning_rate": 0.5, "max_grad_norm": 0.5, "warmup_steps": 2}
    lomo = run_steps(6, plugins=["lomo"], output_dir=tmp_path / "lomo", train={"optim": "lomo", **train})
    sgd = run_steps(6, output_dir=tmp_path / "sgd", train={"optim": "sgd", **train})
    assert _losses(lomo) == pytest.approx(_losses(sgd), abs=1e-5)
    norms = [[h["grad_norm"] for h in run.state.log_history if "loss" in h] for run in (lomo, sgd)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5) and max(norms[1]) > 0.5  # clipping was active
    for name, value in _params(lomo.model).items():
        torch.testing.assert_close(value, dict(sgd.model.named_parameters())[name].detach(), atol=1e-6, rtol=0)


def test_without_clipping_one_backward_and_no_grad_norm(tmp_path):
    run = run_steps(3, plugins=["lomo"], output_dir=tmp_path, train={"optim": "lomo", "max_grad_norm": 0.0})
    assert run.optimizer.clip_grad_norm is None
    assert all("grad_norm" not in h for h in run.state.log_history)


def test_adalomo_runs_on_cpu_with_the_library_update(cuda_free_library):
    """Same weights after three clipped steps as lomo_optim.AdaLomo itself (built on CPU here
    by turning its .cuda() calls into no-ops); state on the parameters' device."""
    ours_model, theirs_model = tiny_model(), tiny_model()
    ours = fused.AdaLomo(ours_model, lr=0.05, clip_grad_norm=1.0, weight_decay=0.01)
    theirs = cuda_free_library(theirs_model, lr=0.05, clip_grad_norm=1.0, weight_decay=0.01)
    assert ours.defaults == theirs.defaults
    for step in range(3):
        batch = _batch()
        for model, optimizer in ((ours_model, ours), (theirs_model, theirs)):
            loss = model(**batch).loss
            optimizer.grad_norm(loss)
            optimizer.fused_backward(loss, 0.05)
    assert ours.step_num == theirs.step_num == 3
    for name, value in _params(ours_model).items():
        assert torch.equal(value, dict(theirs_model.named_parameters())[name])
    for key in fused._ADALOMO_STATE:
        for name, tensor in getattr(ours, key).items():
            assert tensor.device == torch.device("cpu")
            assert torch.equal(tensor, getattr(theirs, key)[name])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_the_released_adalomo_calls_cuda():
    """Why the plugin builds AdaLomo itself: lomo-optim 0.1.1 fails on a CPU-only torch."""
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        lomo_optim.AdaLomo(tiny_model(), lr=1e-3)


def test_a_backward_outside_the_step_does_not_update(tmp_path):
    """lomo_optim hooks every parameter for good; ours updates only inside the fused step."""
    run = run_steps(2, plugins=["lomo"], output_dir=tmp_path, train={"optim": "adalomo"})
    before = _params(run.model)
    run.model(**_batch()).loss.backward()
    assert all(torch.equal(before[n], p) for n, p in run.model.named_parameters())
    assert all(p.grad is not None for p in run.model.parameters())  # plain accumulation instead


# ---------------------------------------------------------------------------- Trainer parity


def _fused_step(model, optimizer, batch):
    """One LOMO step as Trainer takes it: the update inside backward, at the optimizer's learning rate."""
    optimizer.fused_backward(model(**batch).loss, optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
def test_optimizer_matches_trainer(tmp_path, optim, cuda_free_library):
    """Trainer's class (ours subclasses it), groups and hyper-parameters; the same weights after two fused steps."""
    pair = assert_matches_trainer(optim, tmp_path, plugins=["lomo"],
                                  train={"learning_rate": 3e-3, "max_grad_norm": 0.0},
                                  our_class=getattr(fused, "AdaLomo" if optim == "adalomo" else "Lomo"),
                                  step=_fused_step)
    assert type(pair.ours).__name__ == type(pair.theirs).__name__
    for attribute in ("lr", "weight_decay", "clip_grad_norm", "clip_grad_value", "loss_scale", "eps",
                      "clip_threshold", "decay_rate"):
        assert getattr(pair.ours, attribute, None) == getattr(pair.theirs, attribute, None)


def test_clipping_and_optim_args_reach_the_library(tmp_path):
    run = engine.Run({"plugins": ["lomo"], "train": {
        "optim": "adalomo", "max_grad_norm": 2.0, "max_steps": 1, "output_dir": str(tmp_path),
        "optim_args": "weight_decay=0.1,clip_threshold=2,decay_rate=-0.5,clip_grad_value=3"}},
        model=tiny_model(), train_dataset=tiny_dataset())
    run.setup()
    opt = run.optimizer
    assert (opt.clip_grad_norm, opt.weight_decay, opt.clip_threshold, opt.decay_rate, opt.clip_grad_value) == \
           (2.0, 0.1, 2.0, -0.5, 3.0)


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
def test_resume_gives_the_uninterrupted_run(tmp_path, optim):
    """6 steps straight == 3 steps, checkpoint, resume to 6: logged values, weights, optimizer state."""
    runs = assert_resume_is_exact(6, 3, tmp_path, plugins=["lomo"], train={"optim": optim, "learning_rate": 0.1})
    full, resumed = runs.straight, runs.resumed
    if optim == "adalomo":  # its second moments and step count are in the state the helper compared
        assert resumed.optimizer.step_num == full.optimizer.step_num == 6
        for key in fused._ADALOMO_STATE:
            for name, tensor in getattr(full.optimizer, key).items():
                assert torch.equal(tensor, getattr(resumed.optimizer, key)[name])
        # the library's own state_dict holds none of it: a plain round trip would reset AdaLomo
        assert torch.optim.Optimizer.state_dict(full.optimizer)["state"] == {}
        with pytest.raises(ValueError, match="no 'adalomo' entry"):
            resumed.optimizer.load_state_dict(torch.optim.Optimizer.state_dict(full.optimizer))


# ---------------------------------------------------------------------------- refusals


def _refused(match, train=None, plugins=None, **config):
    with pytest.raises(engine.EngineError, match=match):
        engine.Run({"plugins": ["lomo"], "train": {"optim": "lomo", **(train or {})}, **config},
                   plugins=plugins)


@pytest.mark.parametrize("train, match", [
    ({"gradient_accumulation_steps": 2}, (r"train\.gradient_accumulation_steps: lomo updates the weights inside "
                                          r"backward.*set gradient_accumulation_steps = 1")),
    ({"fp16": True}, r"train\.fp16: lomo cannot use fp16 loss scaling.*use bf16 = true"),
    ({"weight_decay": 0.01}, r"train\.weight_decay: lomo cannot exclude biases.*optim_args = 'weight_decay=0\.01'"),
    ({"strategy": "ddp"}, r"train\.strategy: unknown strategy 'ddp'"),
    ({"optim_args": "momentum=0.9"}, r"train\.optim_args: lomo takes clip_grad_value, weight_decay; got 'momentum'"),
    ({"optim": "adalomo", "optim_args": "decay_rate=fast"}, r"train\.optim_args: decay_rate expects float < 0 .*, got 'fast'"),
    ({"optim_args": "clip_grad_value=0"}, r"train\.optim_args: clip_grad_value expects float > 0, got 0"),
    ({"optim_args": "weight_decay"}, r"train\.optim_args: expected 'key=value"),
])
def test_bad_combinations_are_refused_before_the_model_loads(train, match):
    _refused(match, train)


def test_a_strategy_plugin_under_auto_is_refused():
    class DDP:
        name = "fake_ddp"

        @hookimpl
        def register_strategies(self, register):
            register("ddp", engine.Strategy)

    _refused(r"train\.strategy: .*got 'ddp'", plugins=[DDP()])


def test_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lomo_optim", None)  # as if lomo-optim were not installed
    monkeypatch.delitem(sys.modules, "engine_lomo.fused")
    monkeypatch.delattr(engine_lomo, "fused")
    _refused(r"'lomo-optim' is needed for train.optim = 'lomo'.*pip install 'engine\[lomo\]'")


def test_names_need_the_plugin():
    with pytest.raises(engine.ConfigError, match=r"train\.optim: unknown optimizer 'adalomo'.*'lomo'"):
        engine.Run({"train": {"optim": "adalomo"}})


def test_other_optimizers_keep_the_builtin_step(tmp_path):
    run = run_steps(3, plugins=["lomo"], output_dir=tmp_path, train={"optim": "adamw_torch"})
    assert isinstance(run.optimizer, torch.optim.AdamW) and run.optimizer.state
