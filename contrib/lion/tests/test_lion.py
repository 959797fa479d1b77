"""Tests for engine-lion, through the engine's public API only (no mocks)."""

from __future__ import annotations

import engine_lion
import pytest
import torch
from engine_lion import Lion

import engine
import engine.plugins
from engine.testing import run_steps, tiny_dataset, tiny_model


def _losses(run):
    return [h["loss"] for h in run.state.log_history if "loss" in h]


def _run(sections=None, train=None, tmp_path=None):
    """A composed and set-up run of the tiny model (no training)."""
    config = {"plugins": ["lion"],
              "train": {"max_steps": 1, "save_strategy": "no", "disable_tqdm": True,
                        "output_dir": str(tmp_path), **(train or {})},
              **({"lion": sections} if sections else {})}
    run = engine.Run(config, model=tiny_model(), train_dataset=tiny_dataset())
    run.setup()
    return run


def _batch(n=4):
    rows = torch.stack([tiny_dataset()[i]["input_ids"] for i in range(n)])
    return {"input_ids": rows, "labels": rows.clone()}


# ---------------------------------------------------------------------------- discovery


def test_plugin_is_installed():
    installed = engine.plugins.installed_plugins()
    assert "lion" in installed
    assert installed["lion"].distribution == "engine-lion"
    assert installed["lion"].value == "engine_lion"
    assert installed["lion"].load() is engine_lion


def test_module_passed_as_object_is_named_lion(tmp_path):
    run = run_steps(1, objects=[engine_lion], train={"optim": "lion"},
                    sections={"lion": {"beta1": 0.5}}, output_dir=tmp_path)
    assert isinstance(run.optimizer, Lion)
    assert run.optimizer.param_groups[0]["betas"] == (0.5, 0.99)


# ---------------------------------------------------------------------------- optimizer


def test_run_uses_lion_and_loss_falls(tmp_path):
    run = run_steps(20, plugins=["lion"], train={"optim": "lion", "learning_rate": 1e-2,
                                                 "weight_decay": 0.1}, output_dir=tmp_path)
    assert isinstance(run.optimizer, Lion)
    assert run.state.global_step == 20
    groups = run.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]  # engine.param_groups split
    assert all(g["betas"] == (0.9, 0.99) and g["lr"] >= 0 for g in groups)
    assert all("exp_avg" in run.optimizer.state[p] for g in groups for p in g["params"])
    losses = _losses(run)
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_betas_come_from_the_lion_section(tmp_path):
    run = run_steps(1, plugins=["lion"], train={"optim": "lion"},
                    sections={"lion": {"beta1": 0.8, "beta2": 0.95}}, output_dir=tmp_path)
    assert all(g["betas"] == (0.8, 0.95) for g in run.optimizer.param_groups)


def test_lion_step_matches_hand_computed_reference():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)

    # step 1: m = 0 -> c = 0.1*g; update = sign(g); p = p*(1 - 0.1*0.5) - 0.1*sign(g)
    p.grad = torch.tensor([0.2, -0.4, 0.0, -1.0])
    opt.step()
    expected = torch.tensor([1.0 * 0.95 - 0.1, -2.0 * 0.95 + 0.1, 0.5 * 0.95, 3.0 * 0.95 + 0.1])
    torch.testing.assert_close(p.detach(), expected)
    m1 = torch.tensor([0.002, -0.004, 0.0, -0.01])  # 0.01 * g
    torch.testing.assert_close(opt.state[p]["exp_avg"], m1)

    # step 2: c = 0.9*m1 + 0.1*g2 = [0.0018-0.01, -0.0036+0.03, 0+0.001, -0.009+0.0005]
    #       = [-0.0082, 0.0264, 0.001, -0.0085] -> sign = [-1, 1, 1, -1]
    p.grad = torch.tensor([-0.1, 0.3, 0.01, 0.005])
    before = p.detach().clone()
    opt.step()
    expected = before * 0.95 - 0.1 * torch.tensor([-1.0, 1.0, 1.0, -1.0])
    torch.testing.assert_close(p.detach(), expected)
    torch.testing.assert_close(opt.state[p]["exp_avg"],
                               0.99 * m1 + 0.01 * torch.tensor([-0.1, 0.3, 0.01, 0.005]))


def test_lion_skips_params_without_grad_and_round_trips_state():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    opt = Lion([a, b], lr=0.1)
    a.grad = torch.ones(3)
    opt.step()
    torch.testing.assert_close(b.detach(), torch.ones(3))
    assert b not in opt.state
    clone = Lion([a, b], lr=0.1)
    clone.load_state_dict(opt.state_dict())
    torch.testing.assert_close(clone.state[a]["exp_avg"], opt.state[a]["exp_avg"])


# ---------------------------------------------------------------------------- z-loss


def _reference(model, batch, z_loss, num_items=None):
    """CE + z_loss * mean(lse^2), over shifted label tokens, computed from the logits directly."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits.float()
    logits, labels = logits[:, :-1, :], batch["labels"][:, 1:]
    keep = labels.ne(-100)
    logits, labels = logits[keep], labels[keep]
    log_probs = torch.log_softmax(logits, dim=-1)
    ce = -log_probs.gather(1, labels[:, None]).sum()
    lse = torch.logsumexp(logits, dim=-1)
    denom = num_items if num_items is not None else labels.numel()
    return (ce + z_loss * (lse ** 2).sum()) / denom


def test_z_loss_value(tmp_path):
    run = _run({"z_loss": 1e-2}, tmp_path=tmp_path)
    assert run.label_shift
    batch = _batch()
    batch["labels"][0, :5] = -100  # ignored tokens are left out of both terms
    with torch.no_grad():
        loss = run.hook.compute_loss(run=run, model=run.wrapped_model, batch=batch, num_items_in_batch=None)
        own = run.model(**batch).loss
    torch.testing.assert_close(loss, _reference(run.model, batch, 1e-2))
    assert loss > own + 1e-4  # the z term is really there

    # with num_items_in_batch: sum / num_items (gradient-accumulation contract)
    with torch.no_grad():
        loss = run.hook.compute_loss(run=run, model=run.wrapped_model, batch=batch,
                                     num_items_in_batch=torch.tensor(100))
    torch.testing.assert_close(loss, _reference(run.model, batch, 1e-2, num_items=100))


def test_z_loss_trains(tmp_path):
    run = run_steps(20, plugins=["lion"], train={"optim": "lion"},
                    sections={"lion": {"z_loss": 1e-3}}, output_dir=tmp_path)
    losses = _losses(run)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_without_z_loss_the_builtin_loss_answers(tmp_path):
    run = _run(tmp_path=tmp_path)
    assert engine_lion.compute_loss(run, run.wrapped_model, _batch(), None) is None
    batch = _batch()
    with torch.no_grad():
        loss = run.hook.compute_loss(run=run, model=run.wrapped_model, batch=batch, num_items_in_batch=None)
        own = run.model(**batch).loss
    torch.testing.assert_close(loss, own)


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("key, value", [
    ("beta1", 1.0), ("beta1", -0.1), ("beta2", 1.0), ("beta2", 1.5), ("z_loss", -1e-4),
])
def test_bad_options_are_refused(key, value, tmp_path):
    with pytest.raises(engine.ConfigError, match=rf"lion\.{key}"):
        engine.Run({"plugins": ["lion"], "lion": {key: value},
                    "train": {"output_dir": str(tmp_path)}})


def test_unknown_and_mistyped_options_are_refused(tmp_path):
    with pytest.raises(engine.ConfigError, match=r"lion\.beta3"):
        engine.Run({"plugins": ["lion"], "lion": {"beta3": 0.5}})
    with pytest.raises(engine.ConfigError, match=r"lion\.z_loss"):
        engine.Run({"plugins": ["lion"], "lion": {"z_loss": "big"}})


def test_optim_args_are_refused_for_lion():
    with pytest.raises(engine.ConfigError, match=r"train\.optim_args"):
        engine.Run({"plugins": ["lion"], "train": {"optim": "lion", "optim_args": "beta1=0.5"}})


def test_lion_name_needs_the_plugin():
    with pytest.raises(engine.ConfigError, match=r"train\.optim: unknown optimizer 'lion'"):
        run_steps(1, train={"optim": "lion"})
