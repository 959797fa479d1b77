"""Tests for engine-csv-tracker, through the engine's public API only (no mocks): real runs, the
CSV read back with the csv module and compared with metrics.jsonl."""

from __future__ import annotations

import csv
import json

import pytest
from engine_csv_tracker import CsvTracker

import engine
import engine.plugins
from engine import hookimpl
from engine.testing import logged_scalars, run_steps, tiny_dataset

# metrics that differ between any two runs (times), and train_loss, which the engine averages over the
# steps this process trained (after a resume: since the checkpoint), in metrics.jsonl too
NOT_REPEATABLE = {"tokens_per_second", "step_time", "eval_runtime", "eval_samples_per_second", "train_runtime",
                  "train_steps_per_second", "train_tokens_per_second", "train_loss"}
EVALUATED = {"eval_strategy": "steps", "eval_steps": 3}


def _eval_data():
    return tiny_dataset(size=8, seed=1)


def _rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, list(reader)


def _csv_scalars(path):
    """{(name, step): value} of the CSV, the shape engine.testing.logged_scalars gives metrics.jsonl."""
    found = {}
    for row in _rows(path)[1]:
        step = int(row.pop("step"))
        found.update({(name, step): float(value) for name, value in row.items() if value != ""})
    return found


def _records(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_as_jsonl(output_dir, path=None):
    path = path or output_dir / "metrics.csv"
    assert _csv_scalars(path) == logged_scalars(output_dir)
    # row for row: one row per log_metrics call, like metrics.jsonl's records
    header, rows = _rows(path)
    assert header[0] == "step" and len(rows) == len(_records(output_dir))
    for row, record in zip(rows, _records(output_dir)):
        assert {name: float(value) for name, value in row.items() if value != ""} == \
            {name: float(value) for name, value in record.items() if isinstance(value, (int, float))}


class Crash:
    """Raises in on_step_end of step ``at_step`` (None: never): a run that dies mid-training.
    Enabled in every run of a comparison, since a checkpoint resumes only with the same plugins."""

    name = "crash"

    def __init__(self, at_step=None):
        self.at_step = at_step

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.at_step:
            raise RuntimeError(f"crashed at step {self.at_step}")


# ---------------------------------------------------------------------------- discovery


def test_plugin_is_installed_and_each_run_gets_its_own_instance():
    installed = engine.plugins.installed_plugins()["csv_tracker"]
    assert (installed.distribution, installed.value) == ("engine-csv-tracker", "engine_csv_tracker:CsvTracker")
    first, second = installed.load(), installed.load()
    assert isinstance(first, CsvTracker) and first is not second


# ---------------------------------------------------------------------------- the file


def test_csv_holds_what_metrics_jsonl_holds(tmp_path):
    run_steps(7, plugins=["csv_tracker"], output_dir=tmp_path, train=EVALUATED, eval_dataset=_eval_data())
    _assert_same_as_jsonl(tmp_path)
    header, rows = _rows(tmp_path / "metrics.csv")
    # eval_* first appeared at step 3 and train_* at the end: the header grew, earlier rows are intact
    assert header.index("eval_loss") > header.index("loss") and header[-1] == "train_loss"
    assert [row["step"] for row in rows if row["eval_loss"]] == ["3", "6"]
    assert all(len(row) == len(header) and None not in row for row in rows)
    config = json.loads((tmp_path / "metrics.config.json").read_text())
    assert config == json.loads((tmp_path / "hyperparams.json").read_text())
    assert config["plugins"] == ["csv_tracker"]


def test_a_path_of_its_own(tmp_path):
    path = tmp_path / "tables" / "run-1.csv"
    run_steps(3, plugins=["csv_tracker"], output_dir=tmp_path / "out", sections={"csv_tracker": {"path": str(path)}})
    _assert_same_as_jsonl(tmp_path / "out", path)
    assert json.loads((tmp_path / "tables" / "run-1.config.json").read_text())["csv_tracker"]["path"] == str(path)
    assert not (tmp_path / "out" / "metrics.csv").exists()


def test_a_folder_as_path_is_refused(tmp_path):
    with pytest.raises(engine.ConfigError, match=r"^csv_tracker\.path: '.*' is a folder; name the CSV file"):
        engine.Run({"plugins": ["csv_tracker"], "csv_tracker": {"path": str(tmp_path)}})
    with pytest.raises(engine.ConfigError, match=r"^csv_tracker\.path: expected a non-empty string"):
        engine.Run({"plugins": ["csv_tracker"], "csv_tracker": {"path": ""}})


def test_evaluate_after_training_appends_and_closes_the_file(tmp_path):
    tracker = CsvTracker()
    run = run_steps(4, objects=[tracker], output_dir=tmp_path, eval_dataset=_eval_data())
    assert "eval_loss" not in _rows(tmp_path / "metrics.csv")[0]
    run.evaluate()
    assert tracker.handle is None
    _assert_same_as_jsonl(tmp_path)
    assert _rows(tmp_path / "metrics.csv")[1][-1]["step"] == "4"


def test_a_failing_write_is_isolated_unless_strict(tmp_path):
    (tmp_path / "blocker").write_text("a file where the CSV's folder should be")
    path = str(tmp_path / "blocker" / "metrics.csv")
    run = run_steps(2, plugins=["csv_tracker"], output_dir=tmp_path / "a", sections={"csv_tracker": {"path": path}})
    assert run.state.global_step == 2 and "csv_tracker" in run.isolated_hooks.failed
    with pytest.raises(engine.PluginError, match=r"^plugin 'csv_tracker' \(csv_tracker\.strict = true\) failed in "
                                                 r"log_hyperparams"):
        run_steps(2, plugins=["csv_tracker"], output_dir=tmp_path / "b",
                  sections={"csv_tracker": {"path": path, "strict": True}})


# ---------------------------------------------------------------------------- resume


def _train(output_dir, steps=8, crash_at=None, resume=False):
    return run_steps(steps, plugins=["csv_tracker"], objects=[Crash(crash_at)], output_dir=output_dir,
                     eval_dataset=_eval_data(),
                     train={**EVALUATED, "save_strategy": "steps", "save_steps": 4,
                            "resume_from_checkpoint": resume or None})


def _repeatable(path):
    header, rows = _rows(path)
    keep = [name for name in header if name not in NOT_REPEATABLE]
    return keep, [{name: row[name] for name in keep} for row in rows]


def test_a_resumed_run_ends_with_the_csv_of_an_uninterrupted_one(tmp_path):
    _train(tmp_path / "whole")

    interrupted = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="crashed at step 7"):
        _train(interrupted, crash_at=7)
    steps = [row["step"] for row in _rows(interrupted / "metrics.csv")[1]]
    assert steps[-3:] == ["5", "6", "6"]  # logged after the checkpoint of step 4: to be dropped
    with open(interrupted / "metrics.csv", "a", encoding="utf-8") as handle:
        handle.write("3")  # and a row a kill cut short (of step 3x: read whole, it would look like step 3)
    _train(interrupted, resume=True)

    assert _repeatable(interrupted / "metrics.csv") == _repeatable(tmp_path / "whole" / "metrics.csv")
    _assert_same_as_jsonl(interrupted)


# Only the main process writes: tests/test_contrib.py trains a 2-process DDP run with this plugin.
