"""The engine command, run as a real process."""

import json
import subprocess
import sys
import tempfile

import pytest

from engine.testing import assert_one_line_error


def engine(*args, cwd=None, timeout=300):
    """``engine ARGS`` in a process; by default in a folder of its own, so that runs of parallel tests never share
    the default output_dir (one would find it locked by the other)."""
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          cwd=cwd or tempfile.mkdtemp(prefix="engine-cli-"), timeout=timeout)


@pytest.fixture
def run_file(tmp_path):
    def write(text):
        path = tmp_path / "run.toml"
        path.write_text(text)
        return str(path)

    return write


def test_missing_run_file(tmp_path):
    assert_one_line_error(engine("train", str(tmp_path / "absent.toml")), "run file not found")


def test_toml_syntax_error(run_file):
    assert_one_line_error(engine("train", run_file("[train\n")), "TOML syntax error")


def test_unknown_plugin(run_file, first_party):
    plugin, _ = first_party(installed=False)
    assert_one_line_error(engine("plan", run_file(f'plugins = ["{plugin}"]\n')),
                           f"unknown plugin '{plugin}'; it comes from engine-{plugin}: pip install 'engine[{plugin}]'")


def test_unknown_optimizer(run_file):
    assert_one_line_error(engine("train", run_file('[train]\noptim = "adamw_8bit"\n')),
                           "train.optim: unknown optimizer 'adamw_8bit'; it comes from ")


def test_wrong_type(run_file):
    assert_one_line_error(engine("train", run_file('[train]\nlearning_rate = "high"\n')),
                           "train.learning_rate: expected float, got str 'high'")


def test_unknown_key_from_the_command_line():
    assert_one_line_error(engine("train", "--set", "train.max_step=3"),
                           "train.max_step: unknown key; did you mean 'max_steps'?")


def test_bad_model_name_is_refused_before_training(run_file):
    assert_one_line_error(engine("train", run_file('[train]\nmodel = "gpt-17"\n')),
                           "train.model: 'gpt-17' is not a folder")


def test_argparse_errors_exit_2():
    result = engine("fly")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_version_and_help_work_without_heavy_imports():
    assert engine("--version").stdout.startswith("engine ")
    assert "plan" in engine("--help").stdout


def test_plan_shows_overrides_and_defaults():
    result = engine("plan", "--set", "train.learning_rate=1e-4", "--set", "data.max_length=32")
    assert result.returncode == 0, result.stderr
    assert "learning_rate = 0.0001" in result.stdout and "max_length = 32" in result.stdout
    assert "compute_loss             firstresult  builtin.loss" in result.stdout


def test_plugins_lists_builtins_and_hooks():
    result = engine("plugins")
    assert result.returncode == 0, result.stderr
    assert "optimizer  adafactor, adagrad, adamw_torch, adamw_torch_fused, rmsprop, sgd" in result.stdout
    assert "hooks: plugin_options, register_optimizers" in result.stdout


def test_default_run_trains_and_the_loss_falls(tmp_path):
    """The embedded default run (shortened): tiny Llama, tokenizer trained on Python's docstrings. Its console
    holds the engine's lines only: nothing a library prints while it loads or saves."""
    result = engine("train", "--set", f"train.output_dir={tmp_path}", "--set", "train.max_steps=150",
                    "--set", "train.eval_steps=75", "--set", "train.save_steps=75", "--set", "train.logging_steps=10")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-150", "checkpoint-75"]
    assert "engine: loaded the best model from" in result.stderr
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "tokenizer.json").is_file()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert losses[0] > 6.0 and losses[-1] < losses[0] - 1.0, losses
    assert len(evals) == 2 and evals[-1] < evals[0]
    assert "step 150: loss=" in result.stdout
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    foreign = [line for line in lines if not line.startswith(("engine: ", "step "))]
    assert foreign == [], foreign
