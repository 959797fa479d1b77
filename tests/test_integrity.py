"""Run integrity: an output_dir belongs to one run, divergence is caught, resume honours what
changed, and nothing half-written is ever loaded.

Where processes are involved (two runs at once, a killed holder, exit statuses, a save that
fails for lack of space) the tests start real ``engine train`` processes.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.checkpoint as ckpt
from engine import CheckpointError, ConfigError, Run, TrainingDiverged, hookimpl
from engine.config import to_toml
from engine.kit.checkpoint import check_model_folder, verify_manifest
from engine.builtin.data.collators import DataCollator
from engine.layout import FINAL_MARKER, FINAL_TMP, LOCK, MARKER, RECORD
from engine.testing import tiny_dataset, tiny_model

CORPUS = "\n".join(f"record {i}: the quick brown fox {i % 7} jumps over {i % 13} lazy dogs" for i in range(400))


def _strict_json(text):
    """json.loads that refuses NaN / Infinity, which are not JSON."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _run_file(tmp_path, out, name="run.toml", plugins=(), sections=None, **train):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    mapping = {
        "plugins": list(plugins),
        "train": {"model": "tiny-llama", "output_dir": str(out), "max_steps": 6, "per_device_train_batch_size": 4,
                  "learning_rate": 1e-2, "logging_steps": 1, "save_strategy": "steps", "save_steps": 3,
                  "disable_tqdm": True, "model_config": {"hidden_size": 32, "intermediate_size": 64}, **train},
        "data": {"train": str(corpus), "max_length": 32, "tokenizer": "train", "tokenizer_vocab_size": 300},
        **(sections or {}),
    }
    path = tmp_path / name
    path.write_text(to_toml(mapping))
    return path


def _engine(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _start(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "engine", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _errors(stderr):
    return [line for line in stderr.splitlines() if line.startswith("engine: error:")]


def _wait_for(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _metrics(out):
    return [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(out, train=None, objects=(), **kwargs):
    """An in-process run of the tiny model (fast); ``train`` adds [train] keys."""
    config = {"train": {"max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1,
                        "save_strategy": "no", "disable_tqdm": True, "output_dir": str(out), **(train or {})}}
    kwargs.setdefault("model", tiny_model())
    kwargs.setdefault("train_dataset", tiny_dataset())
    return Run(config, data_collator=DataCollator(0), plugins=list(objects), **kwargs)


def _config_run(tmp_path, out, **train):
    """A run that builds tokenizer, data and model from its config (so 'nothing loaded' is visible)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    return Run({"train": {"max_steps": 4, "output_dir": str(out), "disable_tqdm": True, "logging_steps": 1,
                          "save_steps": 2, "model_config": {"hidden_size": 32, "intermediate_size": 64}, **train},
                "data": {"train": str(corpus), "max_length": 16, "tokenizer": "train", "tokenizer_vocab_size": 300}})


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------- one run per folder


def test_the_run_record_names_the_run_and_its_starts(tmp_path):
    _run(tmp_path, {"save_strategy": "steps", "save_steps": 2}).train()
    record = _strict_json((tmp_path / RECORD).read_text())
    assert record["status"] == "finished" and record["config_fingerprint"].startswith("sha256:")
    assert {"engine", "python", "torch", "transformers", "plugins"} <= set(record["versions"])
    assert [s["resumed_from"] for s in record["starts"]] == [None]
    for folder in (tmp_path / "checkpoint-2", tmp_path / "checkpoint-4"):
        assert ckpt.read_manifest(folder)["run_id"] == record["run_id"]
    assert ckpt.read_manifest(tmp_path, FINAL_MARKER)["run_id"] == record["run_id"]
    assert (tmp_path / LOCK).read_text() == ""  # released

    _run(tmp_path, {"max_steps": 6, "save_strategy": "steps", "save_steps": 2, "resume_from_checkpoint": True}).train()
    resumed = _strict_json((tmp_path / RECORD).read_text())
    assert resumed["run_id"] == record["run_id"] and resumed["created"] == record["created"]
    assert [s["resumed_from"] for s in resumed["starts"]] == [None, str(tmp_path / "checkpoint-4")]
    assert resumed["starts"][1]["step"] == 4


def test_a_fresh_run_into_another_runs_folder_is_refused_before_anything_loads(tmp_path):
    out = tmp_path / "out"
    _config_run(tmp_path, out, learning_rate=1e-2).train()
    other = _strict_json((out / RECORD).read_text())["run_id"]
    def contents():  # besides the lock file, which the refused run held while it looked
        return {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != LOCK}

    before = contents()
    run = _config_run(tmp_path, out, learning_rate=1e-3)
    with pytest.raises(ConfigError) as refused:
        run.train()
    assert str(refused.value) == (
        f"train.output_dir: {out} holds run {other} (2 checkpoints up to checkpoint-4, a final model); continue it "
        "with train.resume_from_checkpoint = true, choose another train.output_dir, or set "
        "train.overwrite_output_dir = true to remove it first")
    assert run.model is None and run.tokenizer is None  # refused before anything loaded
    assert contents() == before  # and nothing touched


def test_resume_continues_the_folders_run_and_says_what_changed(tmp_path, caplog):
    out = tmp_path / "out"
    _config_run(tmp_path, out, max_steps=2, learning_rate=1e-2).train()
    run_id = _strict_json((out / RECORD).read_text())["run_id"]
    resumed = _config_run(tmp_path, out, learning_rate=1e-3, resume_from_checkpoint=True)
    with caplog.at_level("INFO", logger="engine"):
        resumed.train()
    assert resumed.run_id == run_id
    assert (f"resumed from {out / 'checkpoint-2'} (step 2); changed since the checkpoint: "
            "train.learning_rate 0.01 -> 0.001, train.max_steps 2 -> 4") in caplog.messages


def test_resume_into_a_folder_with_nothing_of_its_own_to_resume_is_refused(tmp_path):
    _run(tmp_path).train()  # a final model, no checkpoint
    other = _strict_json((tmp_path / RECORD).read_text())["run_id"]
    with pytest.raises(ConfigError, match=rf"holds run {other} \(a final model\) but none of its checkpoints to "
                                          r"resume; choose another train.output_dir, or set "):
        _run(tmp_path, {"resume_from_checkpoint": True}).train()


def test_overwrite_output_dir_removes_only_what_the_engine_wrote(tmp_path):
    _run(tmp_path, {"save_strategy": "steps", "save_steps": 1, "learning_rate": 1e-2}).train()
    (tmp_path / "notes.txt").write_text("mine")
    run = _run(tmp_path, {"max_steps": 2, "save_strategy": "steps", "save_steps": 1, "overwrite_output_dir": True})
    run.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert {ckpt.read_manifest(p)["run_id"] for p in tmp_path.glob("checkpoint-*")} == {run.run_id}
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert [r["step"] for r in _metrics(tmp_path) if "loss" in r] == [1, 2]


def test_overwrite_while_resuming_removes_the_other_run_and_keeps_this_ones(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, {"save_strategy": "steps", "save_steps": 2, "max_steps": 2}).train()
    _run(b, {"save_strategy": "steps", "save_steps": 3, "max_steps": 3}).train()
    shutil.copytree(b / "checkpoint-3", a / "checkpoint-3")  # another run's
    run = _run(a, {"resume_from_checkpoint": str(a / "checkpoint-2"), "overwrite_output_dir": True,
                   "save_strategy": "steps", "save_steps": 2})
    run.train()
    assert sorted(p.name for p in a.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert [r["step"] for r in _metrics(a) if "loss" in r] == [1, 2, 3, 4]  # this run's history kept
    record = _strict_json((a / RECORD).read_text())
    assert record["run_id"] == run.run_id and len(record["starts"]) == 2


def test_a_model_no_engine_run_wrote_is_never_deleted(tmp_path):
    tiny_model().save_pretrained(tmp_path)  # somebody's model, no run record, no manifest
    with pytest.raises(ConfigError, match=r"holds files of an unknown run \(model files\)"):
        _run(tmp_path).train()
    with pytest.raises(ConfigError, match="that no engine run claims; the engine deletes only what it wrote"):
        _run(tmp_path, {"overwrite_output_dir": True}).train()
    assert (tmp_path / "model.safetensors").is_file()


def test_resume_and_rotation_see_only_this_runs_checkpoints(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, {"save_strategy": "steps", "save_steps": 1, "max_steps": 2}).train()
    _run(b, {"save_strategy": "steps", "save_steps": 1, "max_steps": 3}).train()
    shutil.copytree(b / "checkpoint-3", a / "checkpoint-3")  # another run's, newer
    run_a = _strict_json((a / RECORD).read_text())["run_id"]
    assert [p.name for p in ckpt.list_checkpoints(a, run_a)] == ["checkpoint-1", "checkpoint-2"]
    run_b = ckpt.read_manifest(b / "checkpoint-3")["run_id"]
    with pytest.raises(ConfigError, match=f"holds run {run_b} \\(1 checkpoint up to checkpoint-3\\)"):
        _run(a, {"resume_from_checkpoint": True, "max_steps": 4}).train()


def test_two_runs_started_at_once_exactly_one_runs(tmp_path):
    out = tmp_path / "out"
    run_file = _run_file(tmp_path, out, max_steps=5)
    processes = [_start("train", run_file), _start("train", run_file)]
    results = [(p, *p.communicate(timeout=300)) for p in processes]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [(p.returncode, err) for p, _, err in results]
    winner = next(p for p, _, _ in results if p.returncode == 0)
    loser_err = next(err for p, _, err in results if p.returncode == 2)
    assert _errors(loser_err) == loser_err.strip().splitlines()
    assert f"is in use by another run (PID {winner.pid} on " in loser_err
    assert [r["step"] for r in _metrics(out) if "loss" in r] == [1, 2, 3, 4, 5]
    record = _strict_json((out / RECORD).read_text())
    assert record["status"] == "finished" and [s["pid"] for s in record["starts"]] == [winner.pid]


def test_a_busy_folder_is_refused_within_a_second_and_a_killed_holder_leaves_no_lock(tmp_path):
    out = tmp_path / "out"
    run_file = _run_file(tmp_path, out, max_steps=100000, save_steps=5)
    holder = _start("train", run_file)
    try:
        _wait_for(lambda: (out / "checkpoint-5").is_dir() and holder.poll() is None)
        started = time.monotonic()
        second = _engine("train", run_file)
        elapsed = time.monotonic() - started
        print(f"refused after {elapsed:.2f} s")
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"engine: error: train.output_dir: {out} is in use by another run (PID {holder.pid} on "
            + second.stderr.split(f"(PID {holder.pid} on ", 1)[1].strip()]
        assert elapsed < 1.0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    newest = ckpt.list_checkpoints(out)[-1]
    step = int(newest.name.split("-")[1])
    resumed = _engine("train", run_file, "--set", "train.resume_from_checkpoint=true",
                      "--set", f"train.max_steps={step + 2}")
    assert resumed.returncode == 0, resumed.stderr
    assert f"engine: resumed from {newest} (step {step})" in resumed.stderr
    assert _strict_json((out / RECORD).read_text())["status"] == "finished"


# ---------------------------------------------------------------------------- divergence


def _all_finite(tensors):
    return all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


@pytest.mark.parametrize("learning_rate", ["1e10", "1e30"])
def test_a_diverged_run_stops_with_status_3_and_leaves_no_nan_on_disk(tmp_path, learning_rate):
    out = tmp_path / "out"
    run_file = _run_file(tmp_path, out, max_steps=40, save_steps=2, logging_steps=5)
    result = _engine("train", run_file, "--set", f"train.learning_rate={learning_rate}")
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    (error,) = _errors(result.stderr)
    assert error.startswith("engine: error: training diverged at step ")
    assert "Lower train.learning_rate" in error and "train.on_nonfinite = 'skip'" in error
    print(error)
    assert not (out / FINAL_MARKER).exists() and not (out / "model.safetensors").exists()
    for folder in ckpt.list_checkpoints(out):
        verify_manifest(folder)
        assert _all_finite(load_file(folder / "model.safetensors")), folder
        _strict_json((folder / "trainer_state.json").read_text())
    assert _strict_json((out / RECORD).read_text())["status"] == "diverged"
    _metrics(out)  # every line valid JSON (a nan loss is null)


class Poison:
    """Turns the training loss into nan at the given steps (1-based): an injected divergence."""

    name = "poison"

    def __init__(self, steps, value=math.nan):
        self.steps, self.value = set(steps), value
        self.params = {}

    @hookimpl(wrapper=True)
    def compute_loss(self, run, model, batch, num_items_in_batch):
        loss = yield
        if model.training and run.state.global_step + 1 in self.steps:
            return loss * self.value
        return loss

    @hookimpl
    def on_step_end(self, run):
        self.params[run.state.global_step] = _params(run.model)


def test_the_first_nonfinite_step_is_named_and_nothing_after_it_is_saved(tmp_path):
    run = _run(tmp_path, {"max_steps": 8, "logging_steps": 4, "save_strategy": "steps", "save_steps": 1},
               objects=[Poison([3])])
    with pytest.raises(TrainingDiverged, match=r"training diverged at step 3: the loss is nan; the last checkpoint, "
                                               rf"{tmp_path / 'checkpoint-2'}, was saved before"):
        run.train()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]


def test_losses_kept_on_the_device_are_read_the_same_in_several_rounds(tmp_path, monkeypatch):
    """The interval's buffer read every 3 steps (its slots reused) logs what one read at the log step logs, and
    names the same first non-finite step when it lies in a later round."""
    from engine.interval import Interval

    train = {"max_steps": 8, "logging_steps": 4, "save_strategy": "no"}
    once = _run(tmp_path / "once", train)
    once.train()
    monkeypatch.setattr(Interval, "READ_EVERY", 3)
    rounds = _run(tmp_path / "rounds", train)
    rounds.train()
    logged = [(e["step"], e["loss"], e["grad_norm"]) for e in rounds.state.log_history if "loss" in e]
    assert logged == [(e["step"], e["loss"], e["grad_norm"]) for e in once.state.log_history if "loss" in e]
    assert len(logged) == 2
    poisoned = _run(tmp_path / "poisoned", train, objects=[Poison([5, 7])])
    with pytest.raises(TrainingDiverged, match=r"training diverged at step 5: the loss is nan"):
        poisoned.train()


def test_skip_policy_trains_through_nonfinite_steps_and_counts_them(tmp_path):
    poison = Poison([3, 5])
    run = _run(tmp_path, {"max_steps": 8, "on_nonfinite": "skip", "optim": "adamw_torch"}, objects=[poison])
    run.train()
    assert run.state.num_skipped_steps == 2
    for step in (3, 5):  # a skipped update leaves the weights and the optimizer's step count alone
        for name, value in poison.params[step - 1].items():
            assert torch.equal(poison.params[step][name], value), (step, name)
    assert run.optimizer.state_dict()["state"][0]["step"] == 6
    assert _all_finite(dict(run.model.named_parameters()))
    losses = [r for r in _metrics(tmp_path) if "loss" in r]
    assert [r["skipped_steps"] for r in losses] == [0, 0, 1, 1, 2, 2, 2, 2]
    assert losses[-1]["loss"] < losses[0]["loss"]


def test_skip_policy_without_clipping_still_sees_an_infinite_gradient(tmp_path):
    run = _run(tmp_path, {"max_steps": 4, "on_nonfinite": "skip", "max_grad_norm": 0.0},
               objects=[Poison([2], value=1e38)])  # a finite loss whose gradients overflow
    run.train()
    assert run.state.num_skipped_steps == 1 and _all_finite(dict(run.model.named_parameters()))


def test_skip_policy_stops_after_too_many_in_a_row(tmp_path):
    run = _run(tmp_path, {"max_steps": 8, "on_nonfinite": "skip", "max_skipped_in_a_row": 2},
               objects=[Poison([3, 4])])
    with pytest.raises(TrainingDiverged, match=r"at step 4: 2 updates in a row had a nan or inf loss"):
        run.train()


def test_skip_policy_needs_the_builtin_step(tmp_path):
    from engine import StepOutput

    class OwnStep:
        name = "own_step"

        @hookimpl
        def training_step(self, run, batches, num_items_in_batch):
            return StepOutput(torch.zeros(()))

    with pytest.raises(ConfigError, match="plugin 'own_step' runs its own training step, which cannot skip"):
        _run(tmp_path, {"on_nonfinite": "skip"}, objects=[OwnStep()])


class Scores:
    def __init__(self, scores):
        self.scores, self.calls = list(scores), 0

    def __call__(self, prediction):
        self.calls += 1
        return {"score": self.scores[self.calls - 1]}


def test_best_model_never_picks_a_nan_metric(tmp_path):
    run = _run(tmp_path, {"max_steps": 3, "eval_strategy": "steps", "eval_steps": 1, "save_strategy": "steps",
                          "save_steps": 1, "metric_for_best_model": "score", "load_best_model_at_end": True},
               eval_dataset=tiny_dataset(size=8), compute_metrics=Scores([math.nan, 2.0, 1.0]))
    run.train()
    assert run.state.best_global_step == 2 and run.state.best_metric == 2.0
    state = _strict_json((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert [h["eval_score"] for h in state["log_history"] if "eval_score" in h] == [None, 2.0, 1.0]


def test_engine_evaluate_prints_valid_json_for_a_nan_loss(tmp_path):
    out = tmp_path / "out"
    run_file = _run_file(tmp_path, out, max_steps=2, save_steps=2)
    assert _engine("train", run_file).returncode == 0
    broken = tmp_path / "broken"  # a model folder (not the engine's) whose weights are nan
    shutil.copytree(out / "checkpoint-2", broken)
    (broken / MARKER).unlink()
    weights = load_file(broken / "model.safetensors")
    save_file({k: torch.full_like(v, math.nan) for k, v in weights.items()}, broken / "model.safetensors")
    result = _engine("evaluate", run_file, "--checkpoint", broken, "--set", "data.eval_split=0.1")
    assert result.returncode == 0, result.stderr
    assert _strict_json(result.stdout.strip().splitlines()[-1])["eval_loss"] is None


# ---------------------------------------------------------------------------- resume honours changes


def test_resume_with_a_new_learning_rate_logs_it_from_the_first_resumed_step(tmp_path):
    out = tmp_path / "out"
    run_file = _run_file(tmp_path, out, lr_scheduler_type="constant", learning_rate=1e-2, max_steps=6, save_steps=3)
    assert _engine("train", run_file, "--set", "train.max_steps=3").returncode == 0
    result = _engine("train", run_file, "--set", "train.resume_from_checkpoint=true",
                     "--set", "train.learning_rate=1e-3")
    assert result.returncode == 0, result.stderr
    assert (f"engine: resumed from {out / 'checkpoint-3'} (step 3); changed since the checkpoint: "
            "train.learning_rate 0.01 -> 0.001, train.max_steps 3 -> 6") in result.stderr.splitlines()
    lrs = [(r["step"], r["learning_rate"]) for r in _metrics(out) if "loss" in r]
    assert lrs == [(1, 1e-2), (2, 1e-2), (3, 1e-2), (4, 1e-3), (5, 1e-3), (6, 1e-3)]


def test_resume_with_another_optimizer_is_refused_in_one_line_before_setup(tmp_path):
    out = tmp_path / "out"
    run_file = _run_file(tmp_path, out, max_steps=3)
    assert _engine("train", run_file).returncode == 0
    result = _engine("train", run_file, "--set", "train.resume_from_checkpoint=true", "--set", "train.optim=sgd",
                     "--set", "train.max_steps=6")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"engine: error: resume_from_checkpoint: {out / 'checkpoint-3'} was trained with train.optim = "
        "'adamw_torch', this run asks for 'sgd', whose state cannot be restored from it; resume with "
        "train.optim = 'adamw_torch', or keep the weights and start 'sgd' fresh with train.reset_optimizer = true"]
    run = _config_run(tmp_path, out, optim="sgd", resume_from_checkpoint=True, save_steps=3, max_steps=6)
    with pytest.raises(CheckpointError):
        run.train()
    assert run.model is None  # refused before setup


def test_reset_optimizer_switches_optimizer_and_the_schedule_continues(tmp_path, caplog):
    common = {"max_steps": 8, "lr_scheduler_type": "linear", "warmup_steps": 2, "save_strategy": "steps",
              "save_steps": 4}
    straight = _run(tmp_path / "straight", {**common, "optim": "sgd"})
    straight.train()
    _run(tmp_path / "switched", {**common, "max_steps": 4}).train()
    switched = _run(tmp_path / "switched", {**common, "optim": "sgd", "resume_from_checkpoint": True,
                                             "reset_optimizer": True})
    with caplog.at_level("INFO", logger="engine"):
        switched.train()
    assert isinstance(switched.optimizer, torch.optim.SGD)
    assert any("optimizer sgd and scheduler built fresh (train.reset_optimizer)" in m for m in caplog.messages)
    def lrs(run):
        return [h["learning_rate"] for h in run.state.log_history if "loss" in h and h["step"] > 4]
    assert lrs(switched) == lrs(straight)  # the fresh scheduler was advanced to step 4


def test_changed_optimizer_hyperparameters_are_applied_on_resume(tmp_path):
    common = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "weight_decay": 0.0}
    _run(tmp_path, {**common, "max_steps": 2}).train()
    resumed = _run(tmp_path, {**common, "resume_from_checkpoint": True, "weight_decay": 0.1, "adam_beta1": 0.8,
                              "adam_beta2": 0.99, "adam_epsilon": 1e-6})
    resumed.train()
    decay, no_decay = resumed.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.99) and decay["eps"] == 1e-6
    assert resumed.optimizer.state_dict()["state"][0]["step"] == 4  # the state was restored, not reset


def test_a_longer_schedule_on_resume_follows_the_new_total(tmp_path):
    common = {"lr_scheduler_type": "linear", "save_strategy": "steps", "save_steps": 3}
    straight = _run(tmp_path / "straight", {**common, "max_steps": 12})
    straight.train()
    _run(tmp_path / "extended", {**common, "max_steps": 6, "save_steps": 3}).train()
    extended = _run(tmp_path / "extended", {**common, "max_steps": 12, "resume_from_checkpoint": True})
    extended.train()
    def lrs(run):
        return [h["learning_rate"] for h in run.state.log_history if "loss" in h and h["step"] > 6]
    assert lrs(extended) == lrs(straight)


# ---------------------------------------------------------------------------- checksums and the final model


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_a_same_size_bit_flip_is_refused_naming_the_file(tmp_path, name):
    """optimizer.pt too: a save writes it without torch's CRC32 (which torch.load never checks)."""
    _run(tmp_path, {"max_steps": 2, "save_strategy": "steps", "save_steps": 2}).train()
    assert torch.serialization.get_crc32_options()  # the user's torch.save is as it was
    damaged = tmp_path / "checkpoint-2" / name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the tensors' bytes
    damaged.write_bytes(bytes(data))
    torch.load(damaged, weights_only=True)  # torch reads it without a word: only the manifest knows
    run = _run(tmp_path, {"max_steps": 4, "resume_from_checkpoint": True})
    with pytest.raises(CheckpointError, match=rf"checkpoint {tmp_path / 'checkpoint-2'}: {name} does not "
                                              "match its checksum"):
        run.train()
    assert run.optimizer is None


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"model.safetensors is truncated or padded \(\d+ bytes, saved with \d+\)"),
    ("delete", "model.safetensors is missing"),
])
def test_a_damaged_final_model_is_refused_as_train_model(tmp_path, damage, message):
    out = tmp_path / "out"
    _config_run(tmp_path, out, max_steps=2, save_strategy="no").train()
    weights = out / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        weights.unlink()
    with pytest.raises(CheckpointError, match=f"train.model: {out}: {message}"):  # when the run is composed
        _config_run(tmp_path, tmp_path / "next", model=str(out)).train()


def test_a_model_folder_without_weights_is_refused_with_the_config_file_hint(tmp_path):
    folder = tmp_path / "model"
    tiny_model().config.save_pretrained(folder)
    with pytest.raises(ConfigError, match=rf"has config.json but no weights .*train.model = '{folder / 'config.json'}'"):
        _config_run(tmp_path, tmp_path / "out", model=str(folder)).train()


FSIZE_PLUGIN = '''
import resource, signal
from dataclasses import dataclass
from engine import hookimpl, option


@dataclass
class Options:
    after_step: int = option(0, help="from this step's saved checkpoint on, files may not exceed `limit` bytes")
    limit: int = option(100_000, help="RLIMIT_FSIZE (the tiny model's weights take 150 kB)")


@hookimpl
def plugin_options():
    return Options


@hookimpl
def on_checkpoint_saved(run, path):
    options = run.config.section("fsize")
    if options.after_step and run.state.global_step >= options.after_step:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (options.limit, resource.RLIM_INFINITY))
'''


@pytest.mark.parametrize("after_step, what", [(2, "checkpoint-4"), (6, "the final model")])
def test_a_save_that_runs_out_of_space_fails_clearly_and_keeps_what_was_saved(
        tmp_path, entry_point_plugin, site_dir, after_step, what):
    entry_point_plugin("fsize", FSIZE_PLUGIN)
    out = tmp_path / "out"
    run_file = _run_file(tmp_path, out, plugins=["fsize"], sections={"fsize": {"after_step": after_step}},
                         max_steps=6, save_steps=2)
    env = {"PYTHONPATH": f"{site_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = _engine("train", run_file, env=env)
    assert result.returncode == 2, result.stderr
    (error,) = _errors(result.stderr)
    assert error.startswith(f"engine: error: cannot write {what} in {out}: File too large (")
    assert error.endswith("MB free there; the checkpoints saved before are intact")
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    assert not (out / FINAL_MARKER).exists()
    for folder in ckpt.list_checkpoints(out):
        verify_manifest(folder)
    assert ckpt.list_checkpoints(out)[-1].name == f"checkpoint-{after_step}"
    refused = _engine("train", _run_file(tmp_path, tmp_path / "next", name="next.toml", model=str(out)))
    assert refused.returncode == 2
    if what == "the final model":
        assert "holds no complete final model (the run's save did not finish); use one of its checkpoints" \
            in refused.stderr
    resumed = _engine("train", run_file, "--set", "train.resume_from_checkpoint=true", "--set", "fsize.after_step=0",
                      env=env)
    assert resumed.returncode == 0, resumed.stderr
    verify_manifest(out, FINAL_MARKER)


def _mount_tmpfs(folder, size):
    folder.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    settings = {"save_steps": 1, "save_total_limit": 1, "save_final_model": False}
    sizing = tmp_path / "sizing"  # how much one checkpoint takes
    assert _engine("train", _run_file(tmp_path, sizing, name="sizing.toml", max_steps=1, **settings)).returncode == 0
    one = sum(p.stat().st_size for p in (sizing / "checkpoint-1").iterdir())
    disk = tmp_path / "disk"  # room for one checkpoint and a half: the second save runs out of space
    _mount_tmpfs(disk, int(one * 1.5))
    try:
        out = disk / "out"
        result = _engine("train", _run_file(tmp_path, out, max_steps=4, **settings))
        assert result.returncode == 2, result.stderr
        (error,) = _errors(result.stderr)
        assert error.startswith(f"engine: error: cannot write checkpoint-2 in {out}: No space left on device; ")
        assert [p.name for p in out.iterdir() if p.is_dir()] == ["checkpoint-1"]
        verify_manifest(out / "checkpoint-1")
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_final_save_killed_half_way_is_rolled_back(tmp_path):
    _run(tmp_path, {"max_steps": 2, "save_strategy": "steps", "save_steps": 2}).train()
    # what a kill while moving the final model in leaves: the manifest gone from the top, some
    # files moved, the rest and the new manifest still in the temporary folder
    tmp = tmp_path / FINAL_TMP
    tmp.mkdir()
    for name in ckpt.final_model_files(tmp_path):
        shutil.copy(tmp_path / name, tmp / name)
    shutil.move(tmp_path / FINAL_MARKER, tmp / FINAL_MARKER)
    (tmp / "model.safetensors").unlink()  # this one had been moved
    with pytest.raises(ConfigError, match="holds no complete final model"):
        check_model_folder(tmp_path, "train.model")
    _run(tmp_path, {"max_steps": 2, "resume_from_checkpoint": True, "save_final_model": False}).train()
    assert not tmp.exists() and not (tmp_path / "model.safetensors").exists()


def test_every_json_the_engine_writes_is_valid_json(tmp_path):
    run = _run(tmp_path, {"max_steps": 2, "eval_strategy": "steps", "eval_steps": 1, "save_strategy": "steps",
                          "save_steps": 1, "metric_for_best_model": "score"},
               eval_dataset=tiny_dataset(size=4), compute_metrics=Scores([math.inf, math.nan]))
    run.train()
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")]
    written += [p for p in tmp_path.rglob(MARKER)] + [tmp_path / FINAL_MARKER]
    assert len(written) >= 8
    for path in written:
        for line in path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]:
            _strict_json(line)
