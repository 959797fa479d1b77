"""engine sweep: trials are ordinary runs in the sweep folder; a seeded sweep is repeatable, survives kill -9,
prunes a diverging trial, and refuses a bad space before writing anything.

Each trial is a real ``engine train`` process (a few seconds each): the sweeps here are small."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.cli import main
from engine.testing import write_evaluated_run_file as base_run
from engine.tooling.space import as_overrides, read_space
from engine.tooling.sweep import best_trials, trial_objective

pytest.importorskip("optuna")

SPACE = """\
seed = 3
[train]
learning_rate = { low = 1e-3, high = 3e-2, log = true }
warmup_steps = { low = 0, high = 4 }
"""


def space_file(folder: Path, text: str = SPACE) -> Path:
    path = folder / "space.toml"
    path.write_text(text)
    return path


def sweep_command(run_file: Path, space: Path, out: Path, *extra: str) -> list[str]:
    return ["sweep", str(run_file), "--space", str(space), "--out", str(out), *extra]


def read_sweep(out: Path) -> dict:
    return json.loads((out / "sweep.json").read_text())


def trials_of(summary: dict) -> list[tuple]:
    return [(trial["number"], trial["params"], trial["status"], trial["objective"], trial["step"])
            for trial in summary["trials"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A sweep of 4 trials, two at a time (TPE's first trials are its seeded random ones: the order the
    trials end in does not change what they try)."""
    folder = tmp_path_factory.mktemp("reference")
    run_file, space = base_run(folder / "base"), space_file(folder)
    assert main(sweep_command(run_file, space, folder / "sweep", "--trials", "4", "--jobs", "2")) == 0
    return run_file, space, folder / "sweep"


def test_every_trial_is_an_ordinary_run_and_the_best_one_repeats_exactly(reference, tmp_path):
    run_file, space, out = reference
    summary = read_sweep(out)
    assert [trial["status"] for trial in summary["trials"]] == ["finished"] * 4
    assert (out / "study.db").is_file() and (out / "space.toml").read_text() == SPACE
    for trial in summary["trials"]:
        folder = out / trial["folder"]
        assert json.loads((folder / "run.json").read_text())["status"] == "finished"
        params = trial["params"]
        assert 1e-3 <= params["train.learning_rate"] <= 3e-2 and params["train.warmup_steps"] in range(5)
        text = (folder / "run.toml").read_text()
        assert f"learning_rate = {params['train.learning_rate']!r}" in text
        assert trial_objective(folder, None) == (trial["objective"], 8)
    objectives = {trial["number"]: trial["objective"] for trial in summary["trials"]}
    assert len(set(objectives.values())) == 4  # the parameters made a difference
    assert summary["best"] == [min(objectives, key=objectives.get)]

    best = out / f"trial-{summary['best'][0]}"
    again = tmp_path / "again"
    assert main(["train", str(best / "run.toml"), "--set", f"train.output_dir={json.dumps(str(again))}"]) == 0
    assert trial_objective(again, None) == (objectives[summary["best"][0]], 8)


def test_a_sweep_killed_mid_trial_continues_to_the_same_trials_and_best(reference, tmp_path):
    """Killed (kill -9) in its second trial, after that trial's first checkpoint, and run again: the sweep ends
    with the trials of the uninterrupted reference (whose first two trials are what a 2-trial sweep tries)."""
    run_file, space, reference_out = reference
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "engine", *sweep_command(run_file, space, out, "--trials", "2")]
    sweep = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoint = out / "trial-1" / "checkpoint-4"
    deadline = time.monotonic() + 300
    while not checkpoint.is_dir() and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checkpoint.is_dir(), sweep.stderr.read() if sweep.poll() is not None else "no checkpoint in time"
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.wait()
    assert [trial["status"] for trial in read_sweep(out)["trials"]] == ["finished", "running"]

    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    expected = read_sweep(reference_out)["trials"][:2]
    assert trials_of(read_sweep(out)) == trials_of({"trials": expected})
    assert read_sweep(out)["best"] == best_trials(expected, ["minimize"])
    starts = json.loads((out / "trial-1" / "run.json").read_text())["starts"]
    assert len(starts) == 2 and starts[-1]["resumed_from"].endswith("checkpoint-4")


def test_a_diverging_trial_is_pruned_at_its_first_evaluation(tmp_path):
    space = space_file(tmp_path, """\
sampler = "grid"
pruner = { type = "median", n_startup_trials = 1 }
[train]
learning_rate = { values = [1e-2, 5.0] }
""")
    out = tmp_path / "sweep"
    assert main(sweep_command(base_run(tmp_path / "base"), space, out, "--trials", "2")) == 0
    first, second = read_sweep(out)["trials"]
    assert (first["status"], second["status"]) == ("finished", "pruned")
    assert second["params"] == {"train.learning_rate": 5.0} and second["step"] == 4
    assert json.loads((out / "trial-1" / "run.json").read_text())["status"] == "pruned"
    evaluations = [row["step"] for row in map(json.loads, (out / "trial-1" / "metrics.jsonl").read_text().splitlines())
                   if "eval_loss" in row]
    assert evaluations == [4] and second["objective"] > first["objective"]
    assert read_sweep(out)["best"] == [0]


@pytest.mark.parametrize(("space", "message"), [
    ("[train]\nnot_a_key = { low = 1, high = 2 }", "space.toml: train.not_a_key = 1: "),
    ("[train]\nlearning_rate = { low = 1e-2, high = 1e-3 }", "train.learning_rate: the range is empty"),
    ("[train]\nlearning_rate = { low = 0.0, high = 1e-3, log = true }", "log = true needs low > 0"),
    ("[train]\nlr_scheduler_type = { values = [] }", "a categorical needs values"),
    ("[train]\nlr_scheduler_type = { values = ['linear', 'no-such'] }", "lr_scheduler_type = \"no-such\""),
    ("direction = 'down'\n[train]\nseed = { values = [1, 2] }", "direction: expected"),
    ("sampler = 'grid'\n[train]\nseed = { low = 1, high = 2 }", "sampler = \"grid\" needs values"),
    ("[train]\noutput_dir = { values = ['a'] }", "train.output_dir: the sweep sets it"),
])
def test_a_bad_space_is_one_line_and_writes_nothing(tmp_path, capsys, space, message):
    out = tmp_path / "sweep"
    assert main(sweep_command(base_run(tmp_path / "base"), space_file(tmp_path, space), out)) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("engine: error: ") and message in error, error
    assert not out.exists()


def test_a_missing_space_file_is_named_as_the_space(tmp_path, capsys):
    assert main(sweep_command(base_run(tmp_path / "base"), tmp_path / "nope.toml", tmp_path / "sweep")) == 2
    assert capsys.readouterr().err == f"engine: error: --space: space file not found: {tmp_path / 'nope.toml'}\n"
    assert not (tmp_path / "sweep").exists()


def test_an_objective_without_evaluations_is_refused(tmp_path, capsys):
    out = tmp_path / "sweep"
    run_file = base_run(tmp_path / "base", eval_strategy="no")
    assert main(sweep_command(run_file, space_file(tmp_path), out)) == 2
    assert "train.eval_strategy = \"no\": the objective eval_loss" in capsys.readouterr().err
    assert not out.exists()


def test_a_folder_holding_another_sweep_is_refused(reference, tmp_path, capsys):
    run_file, _, out = reference
    other = space_file(tmp_path, "[train]\nlearning_rate = { values = [1e-3] }")
    assert main(sweep_command(run_file, other, out, "--trials", "4")) == 2
    assert "holds another sweep (its space, seed differ)" in capsys.readouterr().err


def test_the_space_file_reads_types_and_settings(tmp_path):
    space = read_space(space_file(tmp_path, """\
objective = ["eval_loss", "accuracy"]
direction = ["minimize", "maximize"]
pruner = "none"
[train]
learning_rate = { low = 1e-5, high = 1e-3, log = true }
warmup_steps = { low = 0, high = 10, step = 2 }
weight_decay = { low = 0, high = 0.1 }
[peft]
r = { values = [4, 8] }
"""))
    kinds = {parameter.key: parameter.type for parameter in space.parameters}
    assert kinds == {"train.learning_rate": "float", "train.warmup_steps": "int", "train.weight_decay": "float",
                     "peft.r": "categorical"}
    assert space.objective == ["eval_loss", "accuracy"] and space.directions == ["minimize", "maximize"]
    assert as_overrides({"train.learning_rate": 1e-4, "warmup_steps": 2, "peft.r": 8, "train.lr_scheduler_type": "cosine"}) \
        == ["train.learning_rate=0.0001", "train.warmup_steps=2", "peft.r=8", 'train.lr_scheduler_type="cosine"']
    trials = [{"number": 0, "status": "finished", "objective": [1.0, 0.5]},
              {"number": 1, "status": "finished", "objective": [0.9, 0.4]},
              {"number": 2, "status": "finished", "objective": [1.1, 0.4]},
              {"number": 3, "status": "pruned", "objective": [0.1, 0.9]}]
    assert best_trials(trials, ["minimize", "maximize"]) == [0, 1]
