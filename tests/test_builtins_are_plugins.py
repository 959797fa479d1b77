"""Builtins are plugins in every respect: the same checks, listed by ``engine plugins`` and ``engine
plan`` with the hooks they answer, blockable by name; what plugins tell the engine goes through
hooks (``checkpoint_weights``, ``plan_lines``) that ``engine plan`` shows with who answers."""

import re
import types
from pathlib import Path

import pytest

import engine
from engine import ConfigError, ModelWeights, PluginError, Run, hookimpl
from engine.cli import main
from engine.plugins import builtin_specs, inspect_plugin, load_builtin, plugin_problems
from engine.testing import run_steps, tiny_dataset, tiny_model, write_run_file

ROOT = Path(__file__).resolve().parents[1]
NAME_TEST = re.compile(r"""(startswith\(\s*|[!=]=\s*)["']builtin\.""")


def _cli(capfd, *argv):
    capfd.readouterr()
    status = main(list(argv))
    out, err = capfd.readouterr()
    return types.SimpleNamespace(returncode=status, stdout=out, stderr=err)


def test_no_code_recognises_a_builtin_by_its_name():
    sources = [*ROOT.glob("engine/**/*.py"), *ROOT.glob("plugins/*/engine_*/**/*.py")]
    found = [f"{path.relative_to(ROOT)}:{number}" for path in sources
             for number, line in enumerate(path.read_text().splitlines(), 1) if NAME_TEST.search(line)]
    assert found == []


@pytest.mark.parametrize("name", sorted(builtin_specs()))
def test_every_builtin_passes_the_plugin_checks(name):
    assert plugin_problems(load_builtin(builtin_specs()[name]), name) == []


def test_a_builtin_with_a_problem_is_refused_like_any_plugin(monkeypatch):
    broken = types.ModuleType("engine.builtin.broken_for_a_test")
    exec("def on_step_end(run):\n    pass\n", vars(broken))  # no @hookimpl: pluggy would skip it silently
    monkeypatch.setitem(__import__("sys").modules, broken.__name__, broken)
    specs = {**builtin_specs(), "builtin.broken_for_a_test": broken.__name__}
    monkeypatch.setattr(engine.plugins, "builtin_specs", lambda: specs)
    with pytest.raises(PluginError, match="defines on_step_end without @engine.hookimpl"):
        Run({})


def test_a_builtin_is_known_by_where_it_was_registered_not_by_its_name():
    class Named:  # an object calling itself like a builtin is still the caller's plugin
        @hookimpl
        def compute_loss(self, run, model, batch, num_items_in_batch):
            return None

    run = Run({}, plugins={"builtin.lookalike": Named()})
    assert not run.plugin_manager.is_builtin("builtin.lookalike") and run.plugin_manager.is_builtin("builtin.loss")
    assert run.plugin_manager.plugins_answering("compute_loss") == ["builtin.lookalike"]
    assert not run.uses_builtin_loss
    # what a builtin registers for a Trainer-style argument is a builtin too
    given = Run({}, compute_loss_func=lambda outputs, labels, num_items_in_batch: outputs.loss)
    assert given.plugin_manager.is_builtin("builtin.compute_loss_func") and given.uses_builtin_loss


def test_what_a_plugin_registers_for_an_argument_is_its_own_not_a_builtin():
    class Extra:
        @hookimpl
        def on_train_end(self, run):
            pass

    class Registers:
        @hookimpl
        def register_argument_plugins(self, register, arguments):
            register("extra", Extra())

    run = Run({}, plugins={"registers": Registers()}, compute_loss_func=lambda outputs, labels, n: outputs.loss)
    pm = run.plugin_manager
    assert isinstance(pm.pm.get_plugin("extra"), Extra) and not pm.is_builtin("extra")
    assert pm.is_builtin("builtin.compute_loss_func")


def test_plan_lists_every_builtin_with_the_hooks_it_answers(capfd):
    plan = _cli(capfd, "plan")
    assert plan.returncode == 0, plan.stderr
    for name, spec in builtin_specs().items():
        hooks, _, _ = inspect_plugin(load_builtin(spec), name)
        line = next(line for line in plan.stdout.splitlines() if line.startswith(f"  {name} "))
        listed = line.split("; hooks: ")[1].split(", ")
        assert sorted(listed) == sorted(hooks), line
    assert "checkpoint weights: ModelWeights from builtin.weights" in plan.stdout


def test_engine_plugins_lists_every_builtin_and_what_the_run_blocks(capfd):
    listing = _cli(capfd, "plugins", "--plugins", "-builtin.console")
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line for line in listing.stdout.splitlines() if line.startswith("  ")}
    assert set(builtin_specs()) <= set(rows)
    assert " blocked " in rows["builtin.console"] and " on " in rows["builtin.report"]
    assert "registers optimizer adafactor" in rows["builtin.optimizers"]


def test_a_run_file_that_blocks_the_console_and_the_report_trains_without_them(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("ENGINE_REPORT", "text")  # the suite's conftest turns the report off
    (tmp_path / "kept").mkdir()
    (tmp_path / "blocked").mkdir()
    kept = write_run_file(tmp_path / "kept", [], max_steps=2, save_steps=100)
    assert _cli(capfd, "train", str(kept)).returncode == 0
    assert (tmp_path / "kept" / "out" / "report.md").is_file()
    blocked = write_run_file(tmp_path / "blocked", ["-builtin.console", "-builtin.report", "-early_stopping"],
                             max_steps=2, save_steps=100)
    result = _cli(capfd, "train", str(blocked))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "blocked" / "out"
    assert (out / "model.safetensors").is_file() and (out / "metrics.jsonl").is_file()
    assert not (out / "report.md").exists()
    assert "step 2: loss=" not in result.stdout + result.stderr  # the console's lines
    plan = _cli(capfd, "plan", str(blocked))
    assert "blocked by the run: builtin.console, builtin.report, early_stopping" in plan.stdout
    assert not re.search(r"^  builtin\.console ", plan.stdout, re.M)


def test_a_blocked_plugins_options_are_refused_naming_the_key_and_the_block():
    with pytest.raises(ConfigError, match=r"early_stopping.patience: plugin 'early_stopping' is blocked "
                                          r"\('-early_stopping' in plugins\)"):
        Run({"plugins": ["-early_stopping"], "early_stopping": {"patience": 2}})


def test_the_command_line_blocks_a_builtin_and_lifts_a_block():
    assert Run({}, plugin_edits=["-builtin.console"]).plugin_manager.blocked == ["builtin.console"]
    lifted = Run({"plugins": ["-builtin.console"]}, plugin_edits=["+builtin.console"])
    assert lifted.plugin_manager.blocked == [] and lifted.plugin_manager.is_builtin("builtin.console")
    with pytest.raises(ConfigError, match="'missing' is not enabled"):  # not a builtin: nothing to block
        Run({}, plugin_edits=["-missing"])


@pytest.mark.parametrize("plugins, message", [
    (["-builtin.steps"], "plugins: '-builtin.steps' leaves no plugin answering training_step, which every run needs; "
                         "remove the block or enable a plugin that implements training_step"),
    (["-builtin.optimizers"], "'-builtin.optimizers' leaves no plugin answering create_optimizer"),
    (["-builtin.strategies"], "'-builtin.strategies' leaves no plugin answering create_strategy"),
    (["-builtin.data"], "'-builtin.data' leaves no plugin answering create_datasets"),
    # Run.evaluate would answer None instead of metrics
    (["-builtin.evaluation"], "'-builtin.evaluation' leaves no plugin answering evaluate"),
    (["-builtin.nothing"], "unknown plugin 'builtin.nothing'"),
    (["lion", "-lion"], "plugins: 'lion' is both enabled and blocked ('-lion'); keep one"),
])
def test_blocks_that_leave_a_run_unable_to_train_are_refused(plugins, message):
    with pytest.raises(engine.EngineError, match=re.escape(message)):
        Run({"plugins": plugins})


def test_a_blocked_slot_answered_by_another_plugin_trains(tmp_path):
    class PlainStep:
        steps = 0

        @hookimpl
        def training_step(self, run, batches, num_items_in_batch):
            PlainStep.steps += 1
            loss = sum(run.wrapped_model(**batch).loss for batch in batches)
            loss.backward()
            run.optimizer.step()
            run.optimizer.zero_grad()
            return engine.StepOutput(loss.detach())

    run = run_steps(2, ["-builtin.steps"], objects=[PlainStep()], output_dir=tmp_path)
    assert PlainStep.steps == 2 and run.state.global_step == 2


class Weights(ModelWeights):
    pass


class AnswersWeights:
    @hookimpl
    def checkpoint_weights(self, run):
        return Weights()


class Notes:
    @hookimpl
    def plan_lines(self, run):
        return ["noise on the embeddings", "alpha 5"]


def test_checkpoint_weights_is_the_answer_of_the_one_plugin_that_gives_it():
    run = Run({}, plugins={"weights": AnswersWeights(), "notes": Notes()})
    assert type(run.weights) is Weights
    plan = run.plan()
    assert "checkpoint weights: Weights from weights" in plan
    assert "plugin notes:\n  notes: noise on the embeddings\n  notes: alpha 5" in plan
    assert type(Run({}).weights) is ModelWeights


def test_two_plugins_answering_checkpoint_weights_are_refused_naming_both():
    with pytest.raises(PluginError, match="plugins 'first' and 'second' both answer checkpoint_weights, which takes "
                                          "one answer"):
        Run({}, plugins={"first": AnswersWeights(), "second": AnswersWeights()})


def test_plan_of_a_lora_run_shows_the_weights_answered_by_peft(tmp_path, capfd):
    pytest.importorskip("engine_peft")
    pytest.importorskip("peft")
    run_file = write_run_file(tmp_path, ["peft"], {"peft": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
    plan = _cli(capfd, "plan", str(run_file))
    assert plan.returncode == 0, plan.stderr
    assert "checkpoint weights: AdapterWeights from peft" in plan.stdout
    assert re.search(r"^  checkpoint_weights +firstresult +peft, builtin\.weights$", plan.stdout, re.M)
    assert "  peft: LORA adapter on 4 modules" in plan.stdout


class _SetsAttributes:
    """A plugin written before the hooks: it sets run.weights, run.model_load_kwargs and run.plan_notes."""

    name = "old_style"

    @hookimpl
    def configure(self, run):
        run.weights = Narrowed()
        run.model_load_kwargs["low_cpu_mem_usage"] = True
        run.plan_notes.append("kept from configure")


class Narrowed(ModelWeights):
    pass


def test_attributes_plugins_set_before_the_hooks_are_honoured_with_a_warning():
    with pytest.warns(DeprecationWarning, match="run.weights in configure: answer the checkpoint_weights hook"):
        run = Run({"train": {"max_steps": 1}}, plugins=[_SetsAttributes()])
    assert isinstance(run.weights, Narrowed)
    assert "run.plan_notes: kept from configure" in run.plan()
    from engine.builtin.models import load_kwargs

    assert load_kwargs(run) == {"low_cpu_mem_usage": True}


@pytest.mark.parametrize("block, key", [("builtin.flow", "eval_steps"), ("builtin.best_model", "load_best_model_at_end"),
                                        ("builtin.sigterm", "enable_jit_checkpoint"),
                                        ("builtin.memory", "torch_empty_cache_steps")])
def test_a_train_key_of_a_blocked_builtin_is_refused_naming_the_key_and_the_block(block, key):
    """Nothing would read it: a run that blocks the flow schedule and sets eval_steps would silently never evaluate."""
    with pytest.raises(ConfigError, match=re.escape(f"train.{key} is read by {block}, which this run blocks")):
        Run({"plugins": [f"-{block}"], "train": {key: 1}})


class _ConstantSchedule:
    """Answers create_scheduler in builtin.schedulers' place."""

    @hookimpl
    def create_scheduler(self, run, optimizer):
        import torch

        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_a_blocked_builtins_own_train_key_is_refused_and_a_shared_one_accepted():
    """Only builtin.schedulers reads lr_scheduler_kwargs; engine.kit.models reads model_config for any plugin."""
    with pytest.raises(ConfigError, match=re.escape("train.lr_scheduler_kwargs is read by builtin.schedulers, "
                                                    "which this run blocks")):
        Run({"plugins": ["-builtin.schedulers"], "train": {"lr_scheduler_kwargs": {"power": 2.0}}},
            plugins=[_ConstantSchedule()])
    Run({"plugins": ["-builtin.models"], "train": {"model_config": {"hidden_size": 32}}})


def test_every_owned_train_key_is_a_key_and_has_one_owner():
    import dataclasses

    from engine.config import TrainConfig, builtin_options

    owners = {}
    for name, options in builtin_options("train").items():
        for key in (field.name for field in dataclasses.fields(options)):
            assert key not in owners, f"train.{key} declared by {owners.get(key)} and {name}"
            owners[key] = name
    assert set(owners) <= {field.name for field in dataclasses.fields(TrainConfig)}
    assert len(owners) >= 20
