"""engine-clearml offline (``offline = true``, no server): the session read back from the files
ClearML wrote (engine_clearml.offline)."""

import json

import pytest

from engine.testing import (LogSamples, assert_not_written, assert_tracker_failure_is_harmless, free_port,
                            logged_scalars, raising_at, run_and_resume, run_steps, tiny_dataset)
from engine.tracking import flatten_config

from clearml import Task

from engine_clearml import plot_and_series
from engine_clearml.offline import read_offline_session

SECRET = "engine-test-secret-0123456789abcdefghijklmnop"  # credentials that must go nowhere
# no scan of the test process; no console capture (ClearML's stream patches hang under pytest's capture)
QUIET = {"detect_repository": False, "auto_connect_streams": False}
OFFLINE = {"clearml": {"offline": True, **QUIET}}


@pytest.fixture(autouse=True)
def clearml_home(monkeypatch, tmp_path):
    """ClearML's folders in the test's tmp folder: its session cache (~/.clearml), its offline sessions, and a
    config file that reports from a thread (its default subprocess makes closing a task wait about 10 s)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "clearml.conf").write_text("sdk.development.report_use_subprocess: false\n")
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(tmp_path / "clearml.conf"))
    monkeypatch.setenv("CLEARML_API_ACCESS_KEY", SECRET)
    monkeypatch.setenv("CLEARML_API_SECRET_KEY", SECRET)
    for name in ("CLEARML_PROJECT", "CLEARML_TASK", "CLEARML_OFFLINE_MODE"):
        monkeypatch.delenv(name, raising=False)


def only_session(tmp_path):
    (found,) = (tmp_path / "cache" / "offline").glob("*.zip")
    return read_offline_session(found)


def scalars_by_name(session):
    return {(name if plot == "train" else f"{plot}_{name}", step): value
            for (plot, name, step), value in session.scalars.items()}




# first: ClearML's offline mode is process-wide once a run set it, and going back online connects to a
# server (retried for minutes where there is none)
def test_a_server_that_is_not_there_switches_the_plugin_off_at_once(tmp_path, monkeypatch, capfd):
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("CLEARML_API_HOST", closed)
    run_steps(2, plugins=["clearml"], output_dir=tmp_path, sections={"clearml": QUIET})
    shown = capfd.readouterr().err.splitlines()
    (switched_off,) = [line for line in shown if line.startswith("engine: plugin 'clearml': ")]
    assert f"clearml: cannot reach {closed}" in switched_off
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["status"] == "finished" and list(record["switched_off"]) == ["clearml"]


def test_metrics_are_grouped_as_trainers():
    assert [plot_and_series(name) for name in ("loss", "eval_loss", "test_accuracy", "train_runtime", "eval_")] == [
        ("train", "loss"), ("eval", "loss"), ("test", "accuracy"), ("train", "train_runtime"), ("train", "eval_")]


def test_config_metrics_and_samples_read_back_and_the_credentials_are_never_written(tmp_path, capfd):
    sections = {"clearml": {**OFFLINE["clearml"], "project_name": "readback", "tags": ["tiny", "test"]}}
    run_steps(4, plugins=["clearml"], objects=[LogSamples()], output_dir=tmp_path / "out", sections=sections,
              eval_dataset=tiny_dataset(8), train={"eval_strategy": "steps", "eval_steps": 2, "run_name": "readback-run"})
    found = only_session(tmp_path)
    assert (found.project, found.name, sorted(found.tags)) == ("readback", "readback-run", ["test", "tiny"])
    reference = logged_scalars(tmp_path / "out")
    assert {"eval_loss", "loss", "train_runtime"} <= {name for name, _ in reference}
    assert scalars_by_name(found) == reference
    hyperparams = json.loads((tmp_path / "out" / "hyperparams.json").read_text())
    assert found.params == {key: str(value) for key, value in flatten_config(hyperparams).items()}
    assert found.tables == {("samples", "samples", 3): {
        "columns": ["step", "prompt", "completion"],
        "data": [[3, "the quick", " brown fox"], [3, "user: Hi!", "Hello | there"]]}}
    captured = capfd.readouterr()
    assert_not_written(SECRET, [tmp_path], captured.out, captured.err)


def test_a_resumed_run_continues_the_same_task(tmp_path):
    reference = run_and_resume(["clearml"], tmp_path / "out", sections=OFFLINE)
    assert scalars_by_name(only_session(tmp_path)) == reference  # one session: the task continued, steps unchanged


def test_a_client_failure_mid_run_changes_nothing_in_training(tmp_path, monkeypatch):
    from clearml import Logger

    report_scalar = Logger.report_scalar

    def refuse_from_step_2(self, title, series, value, iteration, **kwargs):
        # keyed on the step, not on when the sender thread gets to a row: row 1 may still be queued at step 2
        if iteration >= 2:
            raise RuntimeError("clearml is gone")
        return report_scalar(self, title, series, value=value, iteration=iteration, **kwargs)

    assert_tracker_failure_is_harmless("clearml", tmp_path,
                                       lambda: monkeypatch.setattr(Logger, "report_scalar", refuse_from_step_2),
                                       at=2, steps=4, sections=OFFLINE)
    assert {step for _, step in scalars_by_name(only_session(tmp_path))} == {1}


def test_a_run_that_raised_is_marked_failed(tmp_path, monkeypatch):
    """An offline session keeps no status (ClearML sets it on import), so the call is what can be seen here."""
    failed = []
    mark_failed = Task.mark_failed
    monkeypatch.setattr(Task, "mark_failed", lambda task, **kwargs: (failed.append(kwargs), mark_failed(task, **kwargs)))

    with pytest.raises(RuntimeError, match="boom"):
        run_steps(4, plugins=["clearml"], objects=[raising_at(2)], output_dir=tmp_path / "out", sections=OFFLINE)
    assert failed == [{"status_reason": "training raised", "force": True}]
    assert scalars_by_name(only_session(tmp_path)) == logged_scalars(tmp_path / "out")
