"""Tests for engine-local-sgd in 2 real processes (torchrun, gloo, CPU), through the public API only.

One torchrun job trains every case (engine.testing.launch_cases): averaging after every step
equals one process with twice the batch; averaging every 4 steps does not, and leaves the
processes' parameters equal right after each average only; a resume is exact.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from engine.testing import launch_cases, max_difference, run_steps, tiny_dataset, tiny_model, write_run_file

# SGD with momentum is linear in the gradients: averaging the parameters after each step is averaging
# the gradients, so the paths differ by rounding only (~2e-7: the mean is taken of parameters, not of
# gradients); clipping each process's gradients would not be linear
SGD = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "lr_scheduler_type": "linear",
       "max_grad_norm": 0.0, "per_device_train_batch_size": 4}
TOLERANCE = 1e-6
STEPS = 6
RESUMED_AT, RESUME_STEPS = 4, 8  # sync_every = 3: the checkpoint falls between two averages


def _case(name, steps, sync_every, warmup_steps=0, **train):
    return {"name": name, "steps": steps, "plugins": ["local_sgd"], "train": {**SGD, **train},
            "sections": {"local_sgd": {"sync_every": sync_every, "warmup_steps": warmup_steps}}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("local_sgd")
    straight = {"save_strategy": "steps", "save_steps": RESUMED_AT}
    cases = [
        _case("every_step", STEPS, sync_every=1),
        _case("warmup", STEPS, sync_every=4, warmup_steps=STEPS),  # post-local SGD's warmup: every step
        _case("every_4", STEPS, sync_every=4, save_strategy="steps", save_steps=1),
        _case("straight", RESUME_STEPS, sync_every=3, **straight),
        _case("resumed", RESUME_STEPS, sync_every=3, **straight,
              resume_from_checkpoint=str(out / "straight" / f"checkpoint-{RESUMED_AT}")),
    ]
    return out, launch_cases(cases, out)


def _own_parameters(checkpoint):
    return [torch.load(checkpoint / name, weights_only=True) for name in ("local_parameters.pt", "local_parameters_1.pt")]


def _differ(a, b):
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_averaging_every_step_equals_one_process_with_twice_the_batch(trained):
    out, weights = trained
    reference = run_steps(STEPS, model=tiny_model(seed=0), dataset=tiny_dataset(size=64),
                          train={**SGD, "per_device_train_batch_size": 8}, output_dir=out / "one").model
    differences = {name: max_difference(weights[name], reference) for name in ("every_step", "warmup", "every_4")}
    print("max |parameter difference| against one process:", differences)
    assert differences["every_step"] < TOLERANCE and differences["warmup"] < TOLERANCE, differences
    assert differences["every_4"] > 100 * TOLERANCE, differences  # local steps: another path


def test_the_processes_agree_right_after_an_average_only(trained):
    out, _ = trained
    for step in range(1, STEPS + 1):
        checkpoint = out / "every_4" / f"checkpoint-{step}"
        rank_0, rank_1 = _own_parameters(checkpoint)
        if step == 4:
            assert all(torch.equal(rank_0[name], rank_1[name]) for name in rank_0)
        else:
            assert _differ(rank_0, rank_1) > 100 * TOLERANCE, step
        # the checkpoint's weights (what evaluation, from_pretrained and the final model see) are the mean
        mean = load_file(checkpoint / "model.safetensors")
        assert _differ({name: (rank_0[name] + rank_1[name]) / 2 for name in rank_0}, mean) < 1e-7


def test_a_resume_between_two_averages_is_exact(trained):
    out, weights = trained
    rank_0, rank_1 = _own_parameters(out / "straight" / f"checkpoint-{RESUMED_AT}")
    assert _differ(rank_0, rank_1) > 100 * TOLERANCE  # the processes' own parameters were resumed
    assert all(torch.equal(tensor, weights["straight"][name]) for name, tensor in weights["resumed"].items())
    final = f"checkpoint-{RESUME_STEPS}"
    for name in ("model.safetensors", "local_parameters.pt", "local_parameters_1.pt", "optimizer.pt", "optimizer_1.pt"):
        load = load_file if name.endswith(".safetensors") else lambda path: torch.load(path, weights_only=True)
        straight, resumed = load(out / "straight" / final / name), load(out / "resumed" / final / name)
        if name.startswith("optimizer"):
            straight, resumed = straight["state"], resumed["state"]
            straight = {(key, part): value for key, entry in straight.items() for part, value in entry.items()}
            resumed = {(key, part): value for key, entry in resumed.items() for part, value in entry.items()}
        assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight), name

    def losses(case):
        lines = (out / case / "metrics.jsonl").read_text().splitlines()
        return {row["step"]: row["loss"] for row in map(json.loads, lines) if "loss" in row}

    resumed = losses("resumed")
    assert sorted(resumed) == list(range(RESUMED_AT + 1, RESUME_STEPS + 1))
    assert resumed == {step: loss for step, loss in losses("straight").items() if step > RESUMED_AT}


def _engine(*args):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=300)


def test_plan_shows_the_strategy_and_a_too_rare_average_is_refused(tmp_path):
    plan = _engine("plan", str(write_run_file(tmp_path, ["local_sgd"], {"local_sgd": {"sync_every": 2}})))
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "selected 'local_sgd' from local_sgd" in plan.stdout
    assert "local_sgd: each process steps its own optimizer; parameters averaged over the processes every 2 steps" \
        in plan.stdout
    refused = _engine("train", str(write_run_file(tmp_path, ["local_sgd"], {"local_sgd": {"sync_every": 20}})))
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines() == [
        "engine: error: local_sgd.sync_every = 20 is more than train.max_steps = 8: the processes would train "
        "apart and be averaged only at the end; lower local_sgd.sync_every (1 averages after every step)"]
    assert not (tmp_path / "out").exists()
