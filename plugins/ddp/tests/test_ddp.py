"""DDP in real processes (gloo, CPU, torchrun): equal to one process with the whole batch,
checkpoints and resume (also under another number of processes), two nodes, failures."""

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.testing import (
    launch_cases,
    max_difference,
    run_steps,
    tiny_dataset,
    tiny_model,
    torchrun,
    write_run_file,
)

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the helper modules the launched processes import (PYTHONPATH there)
from stop_on_log import StopOnLogAt3  # noqa: E402
# SGD with momentum in fp32: the paths agree to ~1e-8 (the only difference is the order of the sums)
SGD = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "lr_scheduler_type": "linear"}
TOLERANCE = 1e-6
STEPS = 6


def _reference(train, ragged=False, objects=()):
    """One process with the whole global batch."""
    return run_steps(STEPS, model=tiny_model(seed=0), dataset=tiny_dataset(size=64, ragged=ragged),
                     train={**SGD, **train}, objects=objects).model


def _launch_cases(tmp_path, cases):
    return launch_cases(cases, tmp_path, env={"PYTHONPATH": str(HERE)})


def test_two_processes_make_the_updates_of_one_with_twice_the_batch(tmp_path):
    cases = [
        {"name": "ddp", "steps": STEPS, "plugins": ["ddp"], "train": {**SGD, "per_device_train_batch_size": 4}},
        {"name": "accumulation", "steps": STEPS, "plugins": ["ddp"],
         "train": {**SGD, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}},
        {"name": "ragged", "steps": STEPS, "plugins": ["ddp"], "ragged": True,
         "train": {**SGD, "per_device_train_batch_size": 4}},
        {"name": "unsynced", "steps": STEPS, "plugins": ["ddp"], "objects": ["unsynced:plugin"],
         "train": {**SGD, "per_device_train_batch_size": 4, "strategy": "unsynced"}},
        # a TrainerCallback stops the run in on_log (main process only) at step 3: both processes stop there
        {"name": "callback_stop", "steps": STEPS, "plugins": ["ddp"], "objects": ["stop_on_log:StopOnLogAt3"],
         "train": {**SGD, "per_device_train_batch_size": 4}},
    ]
    trained = _launch_cases(tmp_path, cases)
    references = {"ddp": _reference({"per_device_train_batch_size": 8}),
                  "callback_stop": _reference({"per_device_train_batch_size": 8}, objects=[StopOnLogAt3()]),
                  "accumulation": _reference({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}),
                  "ragged": _reference({"per_device_train_batch_size": 8}, ragged=True)}
    differences = {name: max_difference(trained[name], model) for name, model in references.items()}
    differences["unsynced"] = max_difference(trained["unsynced"], references["ddp"])
    print("max |parameter difference| against one process:", differences)
    assert all(differences[name] < TOLERANCE for name in references), differences
    assert differences["unsynced"] > 100 * TOLERANCE  # the check sees unsynchronised gradients


def test_two_nodes_on_one_machine_train_like_one_process(tmp_path):
    cases = [{"name": "ddp", "steps": STEPS, "plugins": ["ddp"], "train": {**SGD, "per_device_train_batch_size": 4}}]
    weights = launch_cases(cases, tmp_path, nproc=1, nnodes=2)["ddp"]
    assert max_difference(weights, _reference({"per_device_train_batch_size": 8})) < TOLERANCE


# ---------------------------------------------------------------------------- the command line under torchrun


def _run_file(folder, **train):
    return write_run_file(folder, ["ddp"], **train)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_only_the_main_process_writes_and_resume_is_exact(tmp_path):
    straight = _run_file(tmp_path, lr_scheduler_type="constant")  # max_steps changes nothing else then
    result = torchrun(["-m", "engine", "train", str(straight)])
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert [r["step"] for r in _metrics(out) if "loss" in r] == list(range(1, 9))  # logged once, by rank 0
    record = json.loads((out / "run.json").read_text())
    assert len(record["starts"]) == 1 and record["status"] == "finished"
    assert {p.name for p in (out / "checkpoint-4").glob("rng_state*.pt")} == {"rng_state.pt", "rng_state_1.pt"}
    expected = load_file(out / "model.safetensors")

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    run_file = _run_file(resumed, lr_scheduler_type="constant")
    first = torchrun(["-m", "engine", "train", str(run_file), "--set", "train.max_steps=4"])
    assert first.returncode == 0, first.stderr[-3000:]
    again = torchrun(["-m", "engine", "train", str(run_file), "--set", "train.resume_from_checkpoint=true"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("engine: resumed from") == 1  # said by the main process only
    for name, tensor in load_file(resumed / "out" / "model.safetensors").items():
        assert torch.equal(tensor, expected[name]), name
    assert [r["loss"] for r in _metrics(resumed / "out") if "loss" in r] == [r["loss"] for r in _metrics(out)
                                                                             if "loss" in r]


def test_a_ddp_checkpoint_resumes_in_one_process_with_the_same_global_batch(tmp_path):
    run_file = _run_file(tmp_path)
    assert torchrun(["-m", "engine", "train", str(run_file), "--set", "train.max_steps=4"]).returncode == 0
    single = torchrun(["-m", "engine", "train", str(run_file), "--set", "train.resume_from_checkpoint=true",
                       "--set", "train.per_device_train_batch_size=8"], nproc=1)
    assert single.returncode == 0, single.stderr[-3000:]
    assert [r["step"] for r in _metrics(tmp_path / "out") if "loss" in r] == list(range(1, 9))
    refused = torchrun(["-m", "engine", "train", str(run_file), "--set", "train.resume_from_checkpoint=true",
                        "--set", "train.max_steps=10"], nproc=1)
    assert refused.returncode != 0
    assert "the global batch (per_device_train_batch_size x processes) = 4 (checkpoint: 8)" in refused.stderr


def test_bad_input_is_reported_once(tmp_path):
    result = torchrun(["-m", "engine", "train", str(_run_file(tmp_path)), "--set", "train.learning_rate=nan"])
    assert result.returncode != 0
    assert result.stderr.count("engine: error: train.learning_rate: expected a finite float, got nan") == 1
    assert not (tmp_path / "out").exists()


FAILING_PLUGIN = '''
from engine import hookimpl

@hookimpl
def on_step_end(run):
    if run.strategy.rank == 1 and run.state.global_step == 3:
        raise RuntimeError("rank 1 lost its data shard")
'''


def test_a_process_that_raises_ends_the_job_quickly(tmp_path, entry_point_plugin, site_dir):
    entry_point_plugin("failing", FAILING_PLUGIN)
    run_file = _run_file(tmp_path, max_steps=500, save_steps=1000)
    started = time.monotonic()
    result = torchrun(["-m", "engine", "train", str(run_file), "--plugins", "+failing"],
                      env={"PYTHONPATH": str(site_dir)}, timeout=300)
    elapsed = time.monotonic() - started
    print(f"the job ended {elapsed:.1f} s after it started")
    assert result.returncode != 0
    assert result.stderr.count("[rank 1] plugin 'failing' raised RuntimeError: rank 1 lost its data shard") == 1
    assert elapsed < 60  # not the collective timeout (1800 s): torchrun stops the job
    # torchrun stopped rank 0 with SIGTERM, which torch's elastic agent turns into an exception: its
    # cleanup ran and recorded the run as failed
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "failed"


def test_sigkill_of_the_job_then_resume_ends_like_an_uninterrupted_run(tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    for folder in (reference, killed):
        folder.mkdir()
        _run_file(folder, max_steps=20, save_steps=1, save_total_limit=2)
    assert torchrun(["-m", "engine", "train", str(reference / "run.toml")]).returncode == 0
    kills = 0
    while True:
        job = torchrun(["-m", "engine", "train", str(killed / "run.toml"), "--set",
                        "train.resume_from_checkpoint=true"], popen=True)
        deadline = time.monotonic() + 300
        checkpoints = lambda: sorted(int(p.name.split("-")[1]) for p in (killed / "out").glob("checkpoint-*"))
        target = (checkpoints() or [0])[-1] + 4
        while job.poll() is None and (checkpoints() or [0])[-1] < target and time.monotonic() < deadline:
            time.sleep(0.01)
        if job.poll() is None and kills < 3:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            kills += 1
            continue
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]
        assert re.search(r"engine: resumed from \S+checkpoint-\d+ \(step \d+\)", err)
        break
    assert kills == 3
    expected = load_file(reference / "out" / "model.safetensors")
    for name, tensor in load_file(killed / "out" / "model.safetensors").items():
        assert torch.equal(tensor, expected[name]), name


def test_ddp_refuses_layerwise_optimizers_at_configure(tmp_path):
    from engine import ConfigError, Run

    with pytest.raises(ConfigError, match="runs in a single process only"):
        Run({"plugins": ["ddp", "galore"], "train": {"optim": "galore_adamw_layerwise",
                                                   "optim_target_modules": "all-linear", "max_grad_norm": 0.0,
                                                   "output_dir": str(tmp_path)}})
