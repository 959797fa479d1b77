"""engine-comet offline (online = false, no account): Comet's offline archives read back.

The online path needs Comet's service; here it is only shown to fail at once, harmlessly, when
nothing answers at the Comet URL.
"""

import json
import zipfile

import pytest

from engine.testing import (assert_not_written, assert_tracker_failure_is_harmless, free_port, logged_scalars,
                            raising_at, run_and_resume, run_steps, tiny_dataset, tiny_model, tiny_tokenizer)
from engine_comet import FAILED_MESSAGE
from engine_comet.offline import read_offline_archives

SECRET = "cometkey0123456789abcdef0123456789"  # stands for a Comet API key
OFFLINE = {"comet": {"online": False}}


@pytest.fixture(autouse=True)
def comet_env(monkeypatch):
    monkeypatch.setenv("COMET_API_KEY", SECRET)
    monkeypatch.setenv("COMET_DISPLAY_SUMMARY_LEVEL", "0")  # no table of every parameter at the end
    # Comet's own system metrics (sys.*) and git patch: not the run's rows, and slow to collect
    for name in ("COMET_AUTO_LOG_ENV_DETAILS", "COMET_AUTO_LOG_GIT_METADATA", "COMET_AUTO_LOG_GIT_PATCH"):
        monkeypatch.setenv(name, "false")
    for name in ("COMET_START_ONLINE", "COMET_OFFLINE_DIRECTORY", "COMET_PROJECT_NAME", "COMET_EXPERIMENT_KEY"):
        monkeypatch.delenv(name, raising=False)


def comet_parameters(params, prefix=""):
    """``params`` as Comet stores nested parameters: keys joined with ``|``, an empty dict as ``"{}"``."""
    flat = {}
    for key, value in params.items():
        name = f"{prefix}|{key}" if prefix else key
        if isinstance(value, dict) and value:
            flat.update(comet_parameters(value, name))
        else:
            flat[name] = "{}" if value == {} else value
    return flat


def test_config_metrics_and_samples_read_back_and_the_key_is_never_written(tmp_path, capfd):
    sections = {"comet": {"online": False, "project_name": "readback", "tags": ["tiny", "test"]},
                "samples": {"prompts": ["the quick", "fox"], "every": "end", "max_new_tokens": 3}}
    run_steps(4, plugins=["comet", "samples"], output_dir=tmp_path, sections=sections, eval_dataset=tiny_dataset(8),
              model=tiny_model(vocab_size=300), tokenizer=tiny_tokenizer(),
              train={"eval_strategy": "steps", "eval_steps": 2, "run_name": "readback-run"})
    (found,) = read_offline_archives(tmp_path / "comet")
    assert (found.name, found.project_name, sorted(found.tags)) == ("readback-run", "readback", ["test", "tiny"])
    assert found.errors == [] and found.archives == 1
    reference = logged_scalars(tmp_path)
    assert {"eval_loss", "loss", "train_runtime"} <= {name for name, _ in reference}
    assert found.scalars == reference
    hyperparams = json.loads((tmp_path / "hyperparams.json").read_text())
    assert found.params == comet_parameters(hyperparams)
    assert found.params["train|learning_rate"] == 0.01 and found.params["plugins"] == ["comet", "samples"]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert found.tables == {"samples-step-4.csv": [["step", "prompt", "completion"]] +
                            [["4", row["prompt"], row["completion"]] for row in rows]}
    captured = capfd.readouterr()
    assert_not_written(SECRET, [tmp_path], captured.out, captured.err)


def test_a_resumed_run_continues_the_same_experiment(tmp_path):
    reference = run_and_resume(["comet"], tmp_path, sections=OFFLINE)
    (found,) = read_offline_archives(tmp_path / "comet")  # two archives, one experiment key
    assert found.archives == 2
    assert found.scalars == reference
    # the second archive names the key as the user's, to get or create: comet upload appends it to the first
    metas = [json.loads(zipfile.ZipFile(path).read("experiment.json")) for path in (tmp_path / "comet").glob("*.zip")]
    assert sorted((m["user_provided_experiment_key"], m["resume_strategy"]) for m in metas) == [
        (False, "get_or_create"), (True, "get_or_create")]


def test_a_run_that_raised_is_reported_crashed_with_what_it_logged(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(5, plugins=["comet"], objects=[raising_at(2)], output_dir=tmp_path, sections=OFFLINE)
    (found,) = read_offline_archives(tmp_path / "comet")
    assert found.errors == [FAILED_MESSAGE]
    assert found.scalars == logged_scalars(tmp_path) and {step for _, step in found.scalars} == {1}


def test_a_client_failing_mid_run_is_harmless(tmp_path, monkeypatch):
    from comet_ml.experiment import CometExperiment

    def log_metrics_raises(*args, **kwargs):
        raise OSError("comet is gone")

    tracked = assert_tracker_failure_is_harmless(
        "comet", tmp_path, lambda: monkeypatch.setattr(CometExperiment, "log_metrics", log_metrics_raises),
        sections=OFFLINE)
    (found,) = read_offline_archives(tmp_path / "tracked" / "comet")  # still ended: what was logged is kept
    assert {step for _, step in found.scalars} == {1, 2}  # the failure came at step 3's log
    assert tracked.state.global_step == 6


def test_online_without_a_server_is_reported_at_once_and_training_goes_on(tmp_path, monkeypatch, capfd):
    closed = f"http://127.0.0.1:{free_port()}/clientlib/"
    monkeypatch.setenv("COMET_URL_OVERRIDE", closed)
    run_steps(2, plugins=["comet"], output_dir=tmp_path, sections={"comet": {"online": True}})
    err = capfd.readouterr().err
    switched_off = [line for line in err.splitlines() if line.startswith("engine: plugin 'comet': ")]
    assert len(switched_off) == 1 and f"comet: cannot reach {closed}" in switched_off[0], err
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["status"] == "finished" and list(record["switched_off"]) == ["comet"]
    assert {step for _, step in logged_scalars(tmp_path)} == {1, 2}
    assert SECRET not in err
