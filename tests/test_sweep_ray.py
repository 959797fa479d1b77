"""engine sweep --backend ray: Ray Tune on a local cluster (127.0.0.1 only) runs the same trials as Optuna.

A 2x2 grid of learning rate and warmup: each trial a deterministic CPU run, so the Ray sweep's objectives
equal the Optuna sweep's for each parameter set, exactly. Each trial is a real ``engine train`` process."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.cli import main
from engine.testing import write_evaluated_run_file as base_run
from engine.tooling.space import read_space
from engine.tooling.ray_trial import TuneExchange, domain

pytest.importorskip("ray")
pytest.importorskip("optuna")

GRID = """\
sampler = "grid"
pruner = "none"
[train]
learning_rate = { values = [1e-3, 1e-2] }
warmup_steps = { values = [0, 2] }
"""


def sweep_command(run_file: Path, space: Path, out: Path, backend: str) -> list[str]:
    return ["sweep", str(run_file), "--space", str(space), "--out", str(out), "--trials", "4", "--jobs", "2",
            "--backend", backend]


def trials_of(out: Path) -> list[tuple]:
    summary = json.loads((out / "sweep.json").read_text())
    return [(trial["number"], trial["params"], trial["status"], trial["objective"], trial["step"])
            for trial in summary["trials"]]


def test_ray_runs_the_grid_as_optuna_does_with_the_same_objectives(tmp_path):
    run_file = base_run(tmp_path / "base")
    space = tmp_path / "space.toml"
    space.write_text(GRID)
    ray_out, optuna_out = tmp_path / "ray-sweep", tmp_path / "optuna-sweep"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # a local cluster, loopback
    ray = subprocess.run([sys.executable, "-m", "engine", *sweep_command(run_file, space, ray_out, "ray")],
                         capture_output=True, text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "1"})
    assert ray.returncode == 0, ray.stdout + ray.stderr
    assert main(sweep_command(run_file, space, optuna_out, "optuna")) == 0

    trials = trials_of(ray_out)
    assert trials == trials_of(optuna_out)  # same numbers, parameters, statuses, objectives, steps
    assert sorted(tuple(params.values()) for _, params, *_ in trials) == [(1e-3, 0), (1e-3, 2), (1e-2, 0), (1e-2, 2)]
    assert len({objective for *_, objective, _ in trials}) == 4 and all(step == 8 for *_, step in trials)
    summary = json.loads((ray_out / "sweep.json").read_text())
    assert summary["backend"] == "ray" and summary["best"] == json.loads((optuna_out / "sweep.json").read_text())["best"]
    for number, *_ in trials:
        assert json.loads((ray_out / f"trial-{number}" / "run.json").read_text())["status"] == "finished"
    reported = [json.loads(line) for line in (ray_out / "ray" / "tune" / "trial-0" / "result.json").read_text().splitlines()]
    assert [(row["step"], row.get("status")) for row in reported] == [(4, None), (8, None), (8, "finished")]
    assert reported[1]["objective"] == trials[0][3]  # each evaluation reached Tune as it happened
    lines = ray.stdout.splitlines()  # the sweep's own lines only: Ray's console stays out of it
    assert len(lines) == 5 and all(line.startswith("trial ") for line in lines[:4]) and lines[4].startswith("best:")


def test_the_space_maps_onto_tune_domains(tmp_path):
    space = tmp_path / "space.toml"
    space.write_text("""\
[train]
learning_rate = { low = 1e-4, high = 1e-2, log = true }
warmup_steps = { low = 0, high = 4 }
weight_decay = { low = 0.0, high = 0.1, step = 0.05 }
lr_scheduler_type = { values = ["linear", "cosine"] }
""")
    domains = {parameter.key: domain(parameter) for parameter in read_space(space).parameters}
    samples = {key: [value.sample() for _ in range(200)] for key, value in domains.items()}
    assert all(1e-4 <= value <= 1e-2 for value in samples["train.learning_rate"])
    assert set(samples["train.warmup_steps"]) == {0, 1, 2, 3, 4}  # the high bound included, as in Optuna
    assert {round(value, 6) for value in samples["train.weight_decay"]} == {0.0, 0.05, 0.1}
    assert set(samples["train.lr_scheduler_type"]) == {"linear", "cosine"}



def test_a_run_and_its_actor_agree_on_each_evaluation_through_the_exchange(tmp_path):
    run, actor = TuneExchange(tmp_path), TuneExchange(tmp_path)
    answers = []
    asking = threading.Thread(target=lambda: answers.extend([run.ask(2.5, 4), run.ask(2.0, 8)]))
    asking.start()
    assert _next(actor) == {"objective": 2.5, "step": 4}
    actor.answer(prune=False)
    assert _next(actor) == {"objective": 2.0, "step": 8}
    actor.answer(prune=True)
    asking.join(10)
    assert answers == [False, True] and actor.next_ask() is None
    assert run.ask(float("nan"), 12) is True and actor.next_ask() is None  # nan: pruned without asking


def _next(exchange: TuneExchange) -> dict:
    deadline = time.monotonic() + 10
    while (ask := exchange.next_ask()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return ask


@pytest.mark.parametrize(("settings", "message"), [
    ('objective = ["eval_loss", "eval_accuracy"]', "--backend ray optimises one metric"),
    ('pruner = { type = "median", n_startup_trials = 2 }', "n_startup_trials: with --backend ray the pruner is "
                                                             "Ray's ASHA scheduler"),
    ('pruner = { type = "median", grace_period = 0 }', "see ray.tune.schedulers.ASHAScheduler"),
])
def test_what_ray_cannot_do_is_refused_before_anything_is_written(tmp_path, capsys, settings, message):
    space = tmp_path / "space.toml"
    space.write_text(f"{settings}\n[train]\nlearning_rate = {{ values = [1e-3] }}\n")
    out = tmp_path / "sweep"
    assert main(sweep_command(base_run(tmp_path / "base"), space, out, "ray")) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and message in error, error
    assert not out.exists()
