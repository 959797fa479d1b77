"""One behaviour test per hook: what a plugin implementing it can rely on."""

import json
from dataclasses import dataclass

import pytest
import torch

from engine import ConfigError, PluginError, Run, StepOutput, Strategy, hookimpl, option
from engine.testing import run_steps, tiny_dataset


def plugin(name, **hooks):
    """A plugin object named ``name`` whose hooks are the given functions."""
    cls = type(name, (), {key: hookimpl(staticmethod(fn)) for key, fn in hooks.items()})
    cls.name = name
    return cls()


def test_plugin_options_validates_and_exposes_the_section(tmp_path):
    @dataclass
    class Options:
        scale: float = option(1.0, help="a scale")

    seen = []
    p = plugin("scaler", plugin_options=lambda: Options,
               on_train_start=lambda run: seen.append(run.config.section("scaler").scale))
    run_steps(1, objects=[p], output_dir=tmp_path, sections={"scaler": {"scale": 3}})
    assert seen == [3.0]
    with pytest.raises(ConfigError, match="scaler.scale: expected float, got str 'big'"):
        run_steps(1, objects=[p], output_dir=tmp_path, sections={"scaler": {"scale": "big"}})


def test_configure_refuses_before_the_model_is_built():
    def refuse(run):
        assert run.model is None or run.wrapped_model is None
        if run.config.train.gradient_accumulation_steps > 1:
            raise ConfigError("fused: gradient_accumulation_steps must be 1")

    built = []
    with pytest.raises(ConfigError, match="fused: gradient_accumulation_steps must be 1"):
        Run({"train": {"gradient_accumulation_steps": 2}},
            plugins=[plugin("fused", configure=refuse, patch_model=lambda run, model: built.append(1))])
    assert built == []


def test_register_schedulers_adds_a_name(tmp_path):
    def register_schedulers(register):
        register("halving", lambda optimizer, num_warmup_steps, num_training_steps:
                 torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))

    run = run_steps(3, objects=[plugin("sched", register_schedulers=register_schedulers)], output_dir=tmp_path,
                    train={"lr_scheduler_type": "halving", "learning_rate": 0.8})
    assert [e["learning_rate"] for e in run.state.log_history if "loss" in e] == [0.8, 0.4, 0.2]


def test_register_strategies_and_create_strategy_choose_the_strategy(tmp_path):
    class CountingStrategy(Strategy):
        name = "counting"
        backward_calls = 0

        def backward(self, loss):
            CountingStrategy.backward_calls += 1
            super().backward(loss)

    registering = plugin("counting", register_strategies=lambda register: register("counting", CountingStrategy))
    run = run_steps(2, objects=[registering], output_dir=tmp_path / "a", train={"gradient_accumulation_steps": 2})
    assert isinstance(run.strategy, CountingStrategy) and CountingStrategy.backward_calls == 4

    created = plugin("direct", create_strategy=lambda run: CountingStrategy(run))
    run = run_steps(1, objects=[created], output_dir=tmp_path / "b")
    assert isinstance(run.strategy, CountingStrategy)


def test_create_optimizer_and_create_scheduler_can_bypass_the_registries(tmp_path):
    p = plugin("custom",
               create_optimizer=lambda run: torch.optim.SGD(run.model.parameters(), lr=0.5),
               create_scheduler=lambda run, optimizer: torch.optim.lr_scheduler.ConstantLR(optimizer, 0.5, 100))
    run = run_steps(2, objects=[p], output_dir=tmp_path)
    assert type(run.optimizer) is torch.optim.SGD
    assert [e["learning_rate"] for e in run.state.log_history if "loss" in e] == [0.25, 0.25]


def test_on_epoch_start_and_on_epoch_end_bracket_each_epoch(tmp_path):
    events = []
    p = plugin("epochs", on_epoch_start=lambda run: events.append(("start", run.state.epoch)),
               on_epoch_end=lambda run: events.append(("end", run.state.epoch)))
    run_steps(-1, objects=[p], output_dir=tmp_path, dataset=tiny_dataset(8),
              train={"num_train_epochs": 2, "per_device_train_batch_size": 4})
    assert events == [("start", 0.0), ("end", 1.0), ("start", 1.0), ("end", 2.0)]


def test_on_train_mode_and_on_eval_mode_switch_around_evaluation(tmp_path):
    """What Schedule-Free needs: optimizer.train()/eval() at every boundary."""
    modes = []
    p = plugin("modes", on_train_mode=lambda run: modes.append(("train", run.model.training)),
               on_eval_mode=lambda run: modes.append(("eval", run.model.training)))
    run_steps(2, objects=[p], output_dir=tmp_path, eval_dataset=tiny_dataset(4),
              train={"eval_strategy": "steps", "eval_steps": 1})
    # enabled plugins run before the builtin switch: model.training shows the previous mode
    assert [m for m, _ in modes] == ["train", "eval", "train", "eval", "train", "eval"]


# the fused step never calls optimizer.step(), which torch's scheduler notices
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_training_step_can_own_the_whole_step(tmp_path):
    """A fused step (as LOMO does): the plugin computes, applies and returns the loss."""
    def training_step(run, batches, num_items_in_batch):
        (batch,) = batches
        loss = run.wrapped_model(**batch).loss
        grads = torch.autograd.grad(loss, list(run.model.parameters()))
        with torch.no_grad():
            for param, grad in zip(run.model.parameters(), grads):
                param.sub_(0.1 * grad)
        return StepOutput(loss.detach(), None)

    run = run_steps(20, objects=[plugin("fused", training_step=training_step)], output_dir=tmp_path)
    losses = [e["loss"] for e in run.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    assert all(s.get("exp_avg") is None for s in run.optimizer.state.values())  # builtin step never ran


def test_compute_loss_wrapper_adjusts_the_loss(tmp_path):
    class Half:
        name = "half"

        @hookimpl(wrapper=True)
        def compute_loss(self, run, model, batch, num_items_in_batch):
            loss = yield
            return loss * 0.5

    plain = run_steps(1, output_dir=tmp_path / "a", train={"learning_rate": 0.0})
    halved = run_steps(1, objects=[Half()], output_dir=tmp_path / "b", train={"learning_rate": 0.0})
    assert halved.state.log_history[0]["loss"] == pytest.approx(plain.state.log_history[0]["loss"] / 2)


def test_on_evaluate_gets_metrics_and_can_stop_training(tmp_path):
    seen = []

    def on_evaluate(run, metrics):
        seen.append(metrics["eval_loss"])
        run.control.request_stop("early stopping")

    run = run_steps(10, objects=[plugin("early", on_evaluate=on_evaluate)], output_dir=tmp_path,
                    eval_dataset=tiny_dataset(4), train={"eval_strategy": "steps", "eval_steps": 3})
    assert run.state.global_step == 3 and len(seen) == 1


def test_log_hooks_receive_config_metrics_and_final_status(tmp_path):
    log = []
    p = plugin("tracker", log_hyperparams=lambda run, params: log.append(("params", params["train"]["max_steps"])),
               log_metrics=lambda run, metrics, step: log.append(("metrics", step, "loss" in metrics)),
               log_finish=lambda run, status: log.append(("finish", status)))
    run_steps(2, objects=[p], output_dir=tmp_path)
    assert log[0] == ("params", 2)
    assert log[1:3] == [("metrics", 1, True), ("metrics", 2, True)]
    assert log[-1] == ("finish", "success")


def test_log_finish_reports_failure_and_on_train_end_is_skipped(tmp_path):
    log = []

    def explode(run):
        raise RuntimeError("boom")

    p = plugin("tracker", on_step_end=explode, on_train_end=lambda run: log.append("end"),
               log_finish=lambda run, status: log.append(status))
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(2, objects=[p], output_dir=tmp_path)
    assert log == ["failed"]


def test_on_train_end_fires_once_after_the_last_step(tmp_path):
    steps = []
    p = plugin("end", on_train_end=lambda run: steps.append(run.state.global_step))
    run_steps(3, objects=[p], output_dir=tmp_path)
    assert steps == [3]


def test_on_checkpoint_saved_gets_a_complete_checkpoint(tmp_path):
    saved = []

    def on_checkpoint_saved(run, path):
        from pathlib import Path

        saved.append(sorted(p.name for p in Path(path).iterdir()))

    run_steps(2, objects=[plugin("hub", on_checkpoint_saved=on_checkpoint_saved)], output_dir=tmp_path,
              train={"save_strategy": "steps", "save_steps": 1})
    assert len(saved) == 2
    assert {"checkpoint_complete", "model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(saved[0])
    assert not list(tmp_path.glob(".tmp-*"))


# ---------------------------------------------------------------------------- isolated hooks


class Flaky:
    """A tracker whose log_metrics raises from step ``fails_at`` on; records what it was sent."""

    name = "flaky"

    def __init__(self, fails_at, strict=False):
        self.fails_at, self.strict = fails_at, strict
        self.steps, self.finished = [], None

    @hookimpl
    def plugin_options(self):
        @dataclass
        class Options:
            strict: bool = option(self.strict, help="a failure ends the run")

        return Options

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if step >= self.fails_at:
            raise ConnectionError("tracking server went away")
        self.steps.append(step)

    @hookimpl
    def log_finish(self, run, status):
        self.finished = status


def test_a_tracker_that_raises_is_switched_off_and_training_goes_on(tmp_path, caplog):
    plain = run_steps(6, output_dir=tmp_path / "plain")
    flaky = Flaky(fails_at=3)
    with caplog.at_level("WARNING", logger="engine"):
        run = run_steps(6, objects=[flaky], output_dir=tmp_path / "flaky")
    assert flaky.steps == [1, 2] and flaky.finished == "success"  # closed, though switched off
    failures = [m for m in caplog.messages if "flaky" in m]
    assert failures == [
        "plugin 'flaky': log_metrics raised ConnectionError: tracking server went away at step 3; it is switched off "
        "for the rest of the run, training goes on (set strict = true in [flaky] to stop instead)",
        "plugin 'flaky' was switched off after log_metrics raised ConnectionError: tracking server went away at step 3"]
    for name, value in plain.model.named_parameters():
        assert torch.equal(dict(run.model.named_parameters())[name], value), name
    record = json.loads((tmp_path / "flaky" / "run.json").read_text())
    assert record["status"] == "finished" and list(record["switched_off"]) == ["flaky"]
    assert len([line for line in (tmp_path / "flaky" / "metrics.jsonl").read_text().splitlines()]) == 7


def test_a_strict_tracker_that_raises_ends_the_run(tmp_path):
    with pytest.raises(PluginError, match=r"plugin 'flaky' \(flaky.strict = true\) failed in log_metrics at step 3: "
                                          r"ConnectionError: tracking server went away"):
        run_steps(6, objects=[Flaky(fails_at=3, strict=True)], output_dir=tmp_path)


def test_an_upload_that_raises_never_ends_the_run(tmp_path):
    uploads = plugin("upload", on_checkpoint_saved=lambda run, path: 1 / 0)
    run = run_steps(4, objects=[uploads], output_dir=tmp_path, train={"save_strategy": "steps", "save_steps": 1})
    assert run.state.global_step == 4 and "upload" in run.isolated_hooks.failed


def test_isolated_hooks_refuse_wrappers():
    class Wrapping:
        @hookimpl(wrapper=True)
        def log_metrics(self, run, metrics, step):
            return (yield)

    with pytest.raises(PluginError, match="log_metrics is called plugin by plugin \\(isolated\\), so it cannot be a "
                                          "wrapper"):
        Run({}, plugins=[Wrapping()])
