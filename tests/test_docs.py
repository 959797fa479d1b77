"""The README's examples run as written."""

import re
from pathlib import Path

import torch

from engine.cli import main
from engine.testing import run_steps

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _block(lang: str, after: str) -> str:
    start = README.index(after)
    return re.search(rf"```{lang}\n(.*?)```", README[start:], re.S).group(1)


def plan(words, cwd, monkeypatch, capsys):
    """`engine plan WORDS` run in ``cwd`` (in this process: the command line is the same, without the start-up
    of a new interpreter for each of the README's lines); its exit status and output."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    status = main(["plan", *words])
    out, err = capsys.readouterr()
    return status, out, err


def test_readme_plugin_in_20_lines_works(entry_point_plugin, tmp_path):
    source = _block("python", "## A plugin in 20 lines")
    assert len(source.strip().splitlines()) <= 22
    entry_point_plugin("gradnoise", source)
    torch.manual_seed(0)
    quiet = run_steps(2, output_dir=tmp_path / "a", train={"learning_rate": 0.0, "optim": "sgd"})
    noisy = run_steps(2, plugins=["gradnoise"], output_dir=tmp_path / "b",
                      sections={"gradnoise": {"std": 0.5}}, train={"learning_rate": 0.0, "optim": "sgd"})
    assert noisy.state.log_history[0]["grad_norm"] > quiet.state.log_history[0]["grad_norm"] * 2
    assert all(not p._backward_hooks for p in noisy.model.parameters())  # undone at the end


def test_readme_composed_run_plans(tmp_path, monkeypatch, capsys):
    run_file = tmp_path / "run.toml"
    run_file.write_text(_block("toml", "## A composed run"))
    status, out, err = plan([str(run_file)], tmp_path, monkeypatch, capsys)
    assert status == 0, err
    assert "optimizer  selected 'lion' from lion" in out


def test_readme_command_lines_compose(tmp_path, monkeypatch, capsys):
    """Each `engine train ...` line of the README composes (checked with `engine plan`)."""
    (tmp_path / "run.toml").write_text(_block("toml", "## A composed run"))
    commands = [line.split("#")[0].split() for line in _block("bash", "## A composed run").splitlines()
                if line.startswith("engine train")]
    assert len(commands) == 2
    for words in commands:
        status, _, err = plan(words[2:], tmp_path, monkeypatch, capsys)
        assert status == 0, (words, err)


def test_readme_checkpoint_commands_compose(tmp_path, monkeypatch, capsys):
    (tmp_path / "checkpoints.toml").write_text(_block("toml", "## Checkpoints, resume and the best model"))
    lines = [line.split("#")[0].split() for line in
             _block("bash", "## Checkpoints, resume and the best model").splitlines() if line.startswith("engine ")]
    assert [words[1] for words in lines] == ["train", "train", "evaluate"]
    for words in lines:
        args = [w for w in words[2:] if not w.startswith("--checkpoint") and "checkpoint-" not in w]
        status, out, err = plan(args, tmp_path, monkeypatch, capsys)
        assert status == 0, (words, err)
        assert "early_stopping" in out


def test_readme_run_folder_commands_compose(tmp_path, monkeypatch, capsys):
    (tmp_path / "run.toml").write_text(_block("toml", "## A composed run"))
    lines = [line.split("#")[0].replace("&", "").split()
             for line in _block("bash", "## A run owns its folder").splitlines() if line.startswith("engine ")]
    assert len(lines) == 4
    for words in lines:
        status, _, err = plan(words[2:], tmp_path, monkeypatch, capsys)
        assert status == 0, (words, err)
