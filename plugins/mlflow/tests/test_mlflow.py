"""engine-mlflow against a real ``mlflow server`` (sqlite backend, HTTP on a free port), read back
with MlflowClient; also the test that runs all four trackers at once and resumes."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from engine import PluginError, hookimpl
from engine.testing import (free_port, logged_scalars, raising_at, run_steps, same_weights, tiny_dataset, tiny_model,
                            tiny_tokenizer)
from engine.tracking import flatten_config
from engine_mlflow.server import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = Server(tmp_path_factory.mktemp("mlflow-server"))
    yield running
    running.kill()


@pytest.fixture(autouse=True)
def fail_fast(monkeypatch):
    """A server that is gone fails the next call at once instead of after minutes of retries."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def only_run(client, experiment_name):
    experiment = client.get_experiment_by_name(experiment_name)
    (found,) = client.search_runs([experiment.experiment_id])
    return found


def server_scalars(client, mlflow_run):
    return {(key, m.step): m.value for key in mlflow_run.data.metrics
            for m in client.get_metric_history(mlflow_run.info.run_id, key)}


def test_config_metrics_and_model_reach_the_server(server, tmp_path):
    sections = {"mlflow": {"tracking_uri": server.uri, "experiment_name": "readback", "tags": {"team": "engine"},
                           "log_artifacts": "final"}}
    run_steps(6, plugins=["mlflow"], output_dir=tmp_path, sections=sections, eval_dataset=tiny_dataset(8),
              train={"eval_strategy": "steps", "eval_steps": 3, "run_name": "readback-run"})
    client = MlflowClient(server.uri)
    found = only_run(client, "readback")
    assert found.info.status == "FINISHED" and found.info.run_name == "readback-run"
    assert found.data.tags["team"] == "engine"
    reference = logged_scalars(tmp_path)
    assert {"eval_loss", "loss", "train_runtime"} <= {name for name, _ in reference}
    assert server_scalars(client, found) == reference
    hyperparams = json.loads((tmp_path / "hyperparams.json").read_text())
    assert found.data.params == {key: str(value) for key, value in flatten_config(hyperparams).items()}
    assert found.data.params["train.learning_rate"] == "0.01" and found.data.params["plugins"] == '["mlflow"]'
    uploaded = {item.path for item in client.list_artifacts(found.info.run_id, "model")}
    assert "model/model.safetensors" in uploaded


def test_long_config_values_are_cut_to_mlflows_limit(server, tmp_path):
    sections = {"mlflow": {"tracking_uri": server.uri, "experiment_name": "limits"}}
    run_steps(1, plugins=["mlflow"], output_dir=tmp_path, sections=sections,
              train={"model_config": {"note": "x" * 7000}})
    params = only_run(MlflowClient(server.uri), "limits").data.params
    assert len(params["train.model_config.note"]) == 6000 and params["train.model_config.note"].endswith("...")


def test_a_run_that_raised_ends_failed_with_what_it_logged(server, tmp_path):
    sections = {"mlflow": {"tracking_uri": server.uri, "experiment_name": "raised"}}
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(5, plugins=["mlflow"], objects=[raising_at(2)], output_dir=tmp_path, sections=sections)
    client = MlflowClient(server.uri)
    found = only_run(client, "raised")
    assert found.info.status == "FAILED"
    assert server_scalars(client, found) == logged_scalars(tmp_path)


def test_without_a_tracking_uri_the_run_goes_into_a_local_store_in_output_dir_with_samples_as_a_table(
        tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_steps(3, plugins=["mlflow", "samples"], output_dir=tmp_path, model=tiny_model(vocab_size=300),
              tokenizer=tiny_tokenizer(), sections={"samples": {"prompts": ["the quick", "fox"], "every": "end",
                                                                 "max_new_tokens": 3}})
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = only_run(client, "Default")
    assert found.info.run_name == tmp_path.name and found.info.status == "FINISHED"
    assert server_scalars(client, found) == logged_scalars(tmp_path)
    assert found.info.artifact_uri.startswith((tmp_path / "mlartifacts").resolve().as_uri())  # not ./mlruns
    table = json.loads(open(client.download_artifacts(found.info.run_id, "samples/step-3.json", str(tmp_path))).read())
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert table["columns"] == ["step", "prompt", "completion"]
    assert table["data"] == [[3, row["prompt"], row["completion"]] for row in rows]


class KillServer:
    """Kills the tracking server after optimizer step ``at``: a real outage in the middle of a run."""

    name = "killer"

    def __init__(self, server, at):
        self.server, self.at = server, at

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.at:
            self.server.kill()


def test_a_server_killed_mid_run_never_stops_training(tmp_path, caplog):
    own = Server(tmp_path / "server")
    plain = run_steps(10, output_dir=tmp_path / "plain")
    sections = {"mlflow": {"tracking_uri": own.uri, "experiment_name": "outage"}}
    try:
        with caplog.at_level("WARNING", logger="engine"):
            tracked = run_steps(10, plugins=["mlflow"], objects=[KillServer(own, at=3)], output_dir=tmp_path / "out",
                                sections=sections)
    finally:
        own.kill()
    assert same_weights(plain.model, tracked.model) == []
    switched_off = [m for m in caplog.messages if m.startswith("plugin 'mlflow': ")]
    assert len(switched_off) == 1 and "API request to " in switched_off[0], caplog.messages
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["status"] == "finished" and list(record["switched_off"]) == ["mlflow"]
    assert len(logged_scalars(tmp_path / "out")) == len(logged_scalars(tmp_path / "plain"))


def test_a_server_that_is_not_there_is_reported_at_once_and_a_silent_one_after_connect_timeout(
        tmp_path, capfd, monkeypatch):
    """MLflow's client retried a closed port for about 4 minutes before the first step, saying nothing,
    and waits 120 s per try for a server that never answers."""
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):  # MLflow's own defaults
        monkeypatch.delenv(name)
    closed = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    capfd.readouterr()
    run_steps(3, plugins=["mlflow"], output_dir=tmp_path / "out", sections={"mlflow": {"tracking_uri": closed}})
    assert time.monotonic() - started < 60
    shown = capfd.readouterr().err.splitlines()
    switched_off = [line for line in shown if line.startswith("engine: plugin 'mlflow': ")]
    assert len(switched_off) == 1, switched_off
    assert (f"log_hyperparams raised ConnectionError: mlflow: cannot reach {closed}: [Errno 111] Connection refused "
            "at step 0") in switched_off[0]
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["status"] == "finished" and list(record["switched_off"]) == ["mlflow"]
    assert {step for _, step in logged_scalars(tmp_path / "out")} == {1, 2, 3}

    silent = socket.socket()  # connections queue up in its backlog; nothing ever answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
    sections = {"mlflow": {"tracking_uri": uri, "connect_timeout": 2, "strict": True}}
    try:
        with pytest.raises(PluginError, match=r"plugin 'mlflow' \(mlflow.strict = true\) failed in log_hyperparams at "
                                              rf"step 0: ConnectionError: mlflow: {uri} did not answer within 2 s "
                                              r"\(mlflow.connect_timeout\)"):
            run_steps(3, plugins=["mlflow"], output_dir=tmp_path / "strict", sections=sections)
    finally:
        silent.close()
    assert f"engine: mlflow: connecting to {uri} (timeout 2 s)" in capfd.readouterr().err.splitlines()
    assert not (tmp_path / "strict" / "metrics.jsonl").exists()  # it stopped before the first step


def test_strict_makes_a_server_outage_end_the_run(tmp_path):
    """The real command: the server dies while ``engine train`` runs; strict = true stops it with one line."""
    own = Server(tmp_path / "server")
    out = tmp_path / "out"
    (tmp_path / "run.toml").write_text(
        f'plugins = ["mlflow"]\n[train]\noutput_dir = "{out}"\nmax_steps = 3000\nlogging_steps = 1\n'
        'eval_strategy = "no"\nsave_strategy = "no"\nload_best_model_at_end = false\nsave_final_model = false\n'
        'per_device_train_batch_size = 2\n[data]\neval_split = 0.0\n'
        f'[mlflow]\ntracking_uri = "{own.uri}"\nstrict = true\n')
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    job = subprocess.Popen([sys.executable, "-m", "engine", "train", str(tmp_path / "run.toml")], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 3):
            assert job.poll() is None and time.monotonic() < deadline, "training ended before the outage"
            time.sleep(0.05)
        own.kill()
        _, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
        own.kill()
    assert job.returncode == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("engine: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("engine: error: plugin 'mlflow' (mlflow.strict = true) failed in log_metrics at step ")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] < 3000  # it stopped, not trained on


# ---------------------------------------------------------------------------- all four trackers


def test_all_four_trackers_at_once_and_resume_continues_the_same_runs(server, tmp_path, monkeypatch):
    from engine_wandb.offline import read_offline_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = ["tensorboard", "mlflow", "wandb", "trackio"]
    sections = {"mlflow": {"tracking_uri": server.uri, "experiment_name": "all-four", "log_artifacts": "checkpoints"},
                "tensorboard": {"logging_dir": str(tmp_path / "tb")}, "trackio": {"project": "all-four"}}
    plan = subprocess.run([sys.executable, "-m", "engine", "plan", "--set", f'plugins={json.dumps(trackers)}'],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    for name in trackers:
        assert f"engine-{name}" in plan.stdout, plan.stdout
    save = {"save_strategy": "steps", "save_steps": 2}
    first = run_steps(2, plugins=trackers, output_dir=tmp_path / "run", sections=sections, train=save)
    resumed = run_steps(4, plugins=trackers, output_dir=tmp_path / "run", sections=sections, model=tiny_model(),
                        train={**save, "resume_from_checkpoint": str(tmp_path / "run" / "checkpoint-2")})
    assert resumed.state.global_step == 4 and first.state.global_step == 2
    reference = logged_scalars(tmp_path / "run")
    assert {step for _, step in reference} == {1, 2, 3, 4}

    client = MlflowClient(server.uri)
    found = only_run(client, "all-four")  # one MLflow run: the resumed run continued it
    assert found.info.status == "FINISHED"
    assert server_scalars(client, found) == reference
    uploaded = {item.path for item in client.list_artifacts(found.info.run_id)}
    assert uploaded == {"checkpoint-2", "checkpoint-4", "model"}
    assert "checkpoint-4/model.safetensors" in {i.path for i in client.list_artifacts(found.info.run_id, "checkpoint-4")}

    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*"))) == 2  # one per process
    (wandb_run,) = read_offline_runs(tmp_path / "run" / "wandb")  # both hold the same run id
    assert wandb_run.scalars == reference

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(e.step for e in events.Scalars("loss")) == [1, 2, 3, 4]

    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_runs("all-four") == ["run"]
    assert sorted(row["step"] for row in SQLiteStorage.get_logs("all-four", "run") if "loss" in row) == [1, 2, 3, 4]
