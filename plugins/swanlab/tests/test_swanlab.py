"""engine-swanlab offline (mode "offline", no account): the run files read back with SwanLab's own
record reader (engine_swanlab.offline)."""

import json

import pytest

from engine.testing import (LogSamples, assert_not_written, assert_tracker_failure_is_harmless, free_port,
                            logged_scalars, raising_at, run_and_resume, run_steps, tiny_dataset)
from engine_swanlab.offline import read_offline_runs

SECRET = "sk-engine-test-0123456789abcdefghijklmnopqrstuv"  # an API key that must go nowhere


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-root"))  # SwanLab's user folder, not ~/.swanlab
    monkeypatch.setenv("SWANLAB_API_KEY", SECRET)
    for name in ("SWANLAB_LOG_DIR", "SWANLAB_PROJECT", "SWANLAB_PROJ_NAME", "SWANLAB_RUN_ID", "SWANLAB_RESUME"):
        monkeypatch.delenv(name, raising=False)




def test_config_metrics_and_samples_read_back_and_the_key_is_never_written(tmp_path, capfd):
    run_steps(4, plugins=["swanlab"], objects=[LogSamples()], output_dir=tmp_path / "out",
              sections={"swanlab": {"project": "readback", "tags": ["tiny", "test"]}}, eval_dataset=tiny_dataset(8),
              train={"eval_strategy": "steps", "eval_steps": 2, "run_name": "readback-run"})
    (found,) = read_offline_runs(tmp_path / "out" / "swanlog")
    assert (found.project, found.name, found.tags, found.state) == ("readback", "readback-run", ["tiny", "test"],
                                                                     "finished")
    reference = logged_scalars(tmp_path / "out")
    assert {"eval_loss", "loss", "train_runtime"} <= {name for name, _ in reference}
    assert found.scalars == reference
    assert found.config == json.loads((tmp_path / "out" / "hyperparams.json").read_text())
    assert found.texts == {("samples", 3): [("the quick", " brown fox"), ("user: Hi!", "Hello | there")]}
    captured = capfd.readouterr()
    assert_not_written(SECRET, [tmp_path], captured.out, captured.err)


def test_a_resumed_run_continues_the_same_experiment(tmp_path):
    reference = run_and_resume(["swanlab"], tmp_path)
    first, resumed = read_offline_runs(tmp_path / "swanlog")  # offline: a folder per process, one experiment id
    assert first.id == resumed.id and (first.resumed, resumed.resumed) == (False, True)
    assert (first.state, resumed.state) == ("finished", "finished")
    assert {**first.scalars, **resumed.scalars} == reference
    assert {step for _, step in resumed.scalars} == {3, 4}


def test_a_client_failure_mid_run_changes_nothing_in_training(tmp_path, monkeypatch):
    from swanlab.sdk.internal.run import Run

    def refuse(self, data, step=None):
        raise RuntimeError("swanlab is gone")

    assert_tracker_failure_is_harmless("swanlab", tmp_path, lambda: monkeypatch.setattr(Run, "log", refuse), at=2,
                                       steps=4)  # from step 2's log on
    (found,) = read_offline_runs(tmp_path / "tracked" / "swanlog")
    assert {step for _, step in found.scalars} == {1} and found.state == "finished"


def test_a_run_that_raised_ends_crashed(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(4, plugins=["swanlab"], objects=[raising_at(2)], output_dir=tmp_path)
    (found,) = read_offline_runs(tmp_path / "swanlog")
    assert found.state == "crashed"
    assert found.scalars == logged_scalars(tmp_path)


def test_a_service_that_is_not_there_switches_the_plugin_off_at_once(tmp_path, monkeypatch, caplog):
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("SWANLAB_API_HOST", closed)
    with caplog.at_level("WARNING", logger="engine"):
        run_steps(2, plugins=["swanlab"], output_dir=tmp_path, sections={"swanlab": {"mode": "online"}})
    (switched_off,) = [m for m in caplog.messages if m.startswith("plugin 'swanlab': ")]
    assert f"swanlab: cannot reach {closed}" in switched_off
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["status"] == "finished" and list(record["switched_off"]) == ["swanlab"]
