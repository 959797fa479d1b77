"""engine-codecarbon with the real CodeCarbon (offline: no network, no RAPL, no sudo), read back
from its ``emissions.csv`` with pandas and compared with the final metrics in ``metrics.jsonl``."""

import json

import pandas as pd
import pytest

from engine.testing import (assert_not_written, assert_tracker_failure_is_harmless, logged_scalars, raising_at,
                            run_and_resume, run_steps)
from engine_codecarbon import METRICS

SECRET = "codecarbon-api-key-never-written"
SECTIONS = {"codecarbon": {"country_iso_code": "FRA"}}


@pytest.fixture(autouse=True)
def codecarbon_config_from_the_run_file_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # codecarbon reads ./.codecarbon.config
    monkeypatch.setenv("HOME", str(tmp_path))  # and ~/.codecarbon.config


def final_metrics(output_dir):
    *_, last = (json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines())
    return last


def test_emissions_go_to_the_csv_and_into_the_final_metrics(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CODECARBON_API_KEY", SECRET)
    run_steps(3, plugins=["codecarbon"], output_dir=tmp_path / "out", sections=SECTIONS,
                    train={"run_name": "emissions-run"})
    (row,) = pd.read_csv(tmp_path / "out" / "emissions.csv").to_dict("records")
    assert (row["project_name"], row["country_iso_code"], row["country_name"]) == ("emissions-run", "FRA", "France")
    assert row["emissions"] > 0 and row["energy_consumed"] > 0
    final = final_metrics(tmp_path / "out")
    assert final["step"] == 3 and "train_runtime" in final
    assert {name: final[name] for name in METRICS} == {name: row[column] for name, column in METRICS.items()}
    out, err = capfd.readouterr()
    assert "[codecarbon INFO" not in err  # its log is cut to warnings
    assert_not_written(SECRET, [tmp_path], out, err)


def test_a_resume_appends_its_own_row_to_the_same_csv(tmp_path):
    reference = run_and_resume(["codecarbon"], tmp_path / "run", sections=SECTIONS)
    rows = pd.read_csv(tmp_path / "run" / "emissions.csv").to_dict("records")
    assert len(rows) == 2 and rows[0]["run_id"] != rows[1]["run_id"]
    assert rows[0]["project_name"] == rows[1]["project_name"] == "run"
    for row, step in zip(rows, (2, 4)):  # each part's summary holds its own row's figures
        assert {name: reference[name, step] for name in METRICS} == {name: row[c] for name, c in METRICS.items()}


def test_codecarbon_failing_mid_run_never_stops_training(tmp_path, monkeypatch):
    from codecarbon.output_methods.file import FileOutput

    def fail():
        def broken(self, total, delta):
            raise OSError("No space left on device")

        monkeypatch.setattr(FileOutput, "out", broken)

    assert_tracker_failure_is_harmless("codecarbon", tmp_path, fail, sections=SECTIONS)
    assert not set(METRICS) & set(final_metrics(tmp_path / "tracked"))


def test_a_run_that_raised_still_writes_its_emissions_row(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(5, plugins=["codecarbon"], objects=[raising_at(2)], output_dir=tmp_path / "out", sections=SECTIONS)
    (row,) = pd.read_csv(tmp_path / "out" / "emissions.csv").to_dict("records")
    assert row["energy_consumed"] > 0  # CodeCarbon has no run status: the row is all there is
    assert not {name for name, _ in logged_scalars(tmp_path / "out")} & set(METRICS)
