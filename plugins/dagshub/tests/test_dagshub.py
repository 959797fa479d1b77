"""engine-dagshub against a local stand-in for dagshub.com (tests/fake_dagshub.py): DagsHub's repository API
for the model commit, and the repository's MLflow server passed on to a real ``mlflow server`` (one for
the module), read back with MlflowClient."""

import base64
import json
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from engine.checkpoint import final_model_files
from engine.errors import ConfigError
from engine.testing import (assert_not_written, assert_tracker_failure_is_harmless, logged_scalars, raising_at,
                            run_and_resume, run_steps, tiny_model, tiny_tokenizer)
from engine.tracking import flatten_config
from engine_mlflow.server import Server

sys.path.insert(0, str(Path(__file__).parent))  # the fake next to this file (importlib mode)
from fake_dagshub import FakeDagsHub, serve  # noqa: E402

SECRET = "dagshub-token-never-written"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    running = Server(tmp_path_factory.mktemp("mlflow-server"))
    yield running
    running.kill()


@pytest.fixture
def dagshub(mlflow_server, monkeypatch):
    """dagshub.com as the client and the plugin see it: the fake, with a token in DagsHub's and MLflow's variables."""
    from dagshub.common import config

    fake = FakeDagsHub("owner", "repo", mlflow=mlflow_server.uri)
    server, url = serve(fake)
    monkeypatch.setattr(config, "host", url)  # DAGSHUB_CLIENT_HOST, read when dagshub is imported
    monkeypatch.setattr(config, "token", SECRET)  # DAGSHUB_USER_TOKEN, likewise
    monkeypatch.setenv("DAGSHUB_USER_TOKEN", SECRET)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "owner")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # an outage fails the next call at once
    yield fake
    server.shutdown()


def only_run(client, experiment_name):
    experiment = client.get_experiment_by_name(experiment_name)
    (found,) = client.search_runs([experiment.experiment_id])
    return found


def mlflow_scalars(client, mlflow_run):
    return {(key, m.step): m.value for key, _ in mlflow_run.data.metrics.items()
            for m in client.get_metric_history(mlflow_run.info.run_id, key)}


def test_config_metrics_samples_reach_the_repositorys_mlflow_and_the_final_model_its_files(
        dagshub, mlflow_server, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("HF_DAGSHUB_LOG_ARTIFACTS", "true")  # Trainer's switch for the commit (upload_to_repo)
    sections = {"dagshub": {"repo_owner": "owner", "repo_name": "repo", "experiment_name": "readback"},
                "samples": {"prompts": ["the quick", "fox"], "every": "end", "max_new_tokens": 3}}
    run_steps(3, plugins=["dagshub", "samples"], output_dir=tmp_path, model=tiny_model(vocab_size=300),
              tokenizer=tiny_tokenizer(), sections=sections)

    client = MlflowClient(mlflow_server.uri)  # what <fake dagshub>/owner/repo.mlflow stored
    found = only_run(client, "readback")
    assert found.info.status == "FINISHED" and found.info.run_name == tmp_path.name
    assert mlflow_scalars(client, found) == logged_scalars(tmp_path)
    hyperparams = json.loads((tmp_path / "hyperparams.json").read_text())
    assert found.data.params == {key: str(value) for key, value in flatten_config(hyperparams).items()}
    table = json.loads(open(client.download_artifacts(found.info.run_id, "samples/step-3.json", str(tmp_path / "dl")))
                       .read())
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert table["data"] == [[3, row["prompt"], row["completion"]] for row in rows]

    final = final_model_files(tmp_path)
    assert "model.safetensors" in final
    assert dagshub.files["main"] == {f"artifacts/{name}": (tmp_path / name).read_bytes() for name in final}
    assert dagshub.messages == [f"engine: final model of {tmp_path.name}"]
    # each client sent the credentials from its own variables (MLflow: basic, DagsHub's: bearer), and
    # the plugin wrote them nowhere
    basic = "Basic " + base64.b64encode(f"owner:{SECRET}".encode()).decode()
    assert {basic, f"Bearer {SECRET}"} <= set(dagshub.authorizations)
    assert_not_written(SECRET, [tmp_path], *capfd.readouterr())


def test_a_resumed_training_continues_the_same_run(dagshub, mlflow_server, tmp_path):
    sections = {"dagshub": {"repo_owner": "owner", "repo_name": "repo", "experiment_name": "resume"}}
    reference = run_and_resume(["dagshub"], tmp_path, sections=sections)
    client = MlflowClient(mlflow_server.uri)
    found = only_run(client, "resume")
    assert found.info.status == "FINISHED"
    assert mlflow_scalars(client, found) == reference


def test_the_repositorys_mlflow_going_away_mid_run_is_harmless(dagshub, mlflow_server, tmp_path):
    sections = {"dagshub": {"repo_owner": "owner", "repo_name": "repo", "experiment_name": "outage",
                            "send_interval": 0}}

    def go_away():
        dagshub.mlflow_down = True

    assert_tracker_failure_is_harmless("dagshub", tmp_path, go_away, sections=sections)
    client = MlflowClient(mlflow_server.uri)
    sent = {m.step for m in client.get_metric_history(only_run(client, "outage").info.run_id, "loss")}
    assert sent and sent <= {1, 2, 3}  # what went before the outage stays; nothing after it


def test_a_run_that_raised_ends_failed_and_commits_nothing_with_a_tracking_uri_of_its_own(
        dagshub, mlflow_server, tmp_path, monkeypatch):
    # the repository from MLFLOW_TRACKING_URI as Trainer reads it; tracking_uri, given, wins for MLflow
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://dagshub.com/owner/repo.mlflow")
    sections = {"dagshub": {"tracking_uri": mlflow_server.uri, "experiment_name": "raised", "upload_to_repo": True}}
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(5, plugins=["dagshub"], objects=[raising_at(2)], output_dir=tmp_path, sections=sections)
    client = MlflowClient(mlflow_server.uri)
    found = only_run(client, "raised")
    assert found.info.status == "FAILED"
    assert mlflow_scalars(client, found) == logged_scalars(tmp_path)
    assert dagshub.files == {"main": {}} and dagshub.authorizations == []  # nothing went to the fake


def test_without_a_repository_the_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=r"dagshub: set dagshub.repo_owner and dagshub.repo_name"):
        run_steps(1, plugins=["dagshub"], output_dir=tmp_path, sections={"dagshub": {"repo_name": "repo"}})
