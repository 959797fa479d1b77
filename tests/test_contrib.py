"""contrib/: third-party-style plugins, each its own distribution, using the public API only,
and composed together in one run."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from engine.plugins import describe_installed, installed_plugins
from engine.testing import launch_cases, logged_scalars, max_difference, run_steps, tiny_dataset, tiny_model

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p.parent for p in (ROOT / "contrib").glob("*/pyproject.toml"))
# Their imports of the engine: tests/test_public_api.py, with plugins/.


def _csv_scalars(path):
    with open(path, newline="") as handle:
        return {(name, int(row["step"])): float(value) for row in csv.DictReader(handle)
                for name, value in row.items() if name != "step" and value != ""}


def test_contrib_holds_the_examples():
    assert {folder.name for folder in FOLDERS} >= {"lion", "weighted_loss", "csv_tracker", "local_sgd"}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda folder: folder.name)
def test_each_is_an_installed_distribution_of_its_own(folder):
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    name = folder.name
    assert project["name"] == "engine-" + name.replace("_", "-")
    (entry,) = project["entry-points"]["engine.plugins"].items()
    assert entry[0] == name and entry[1].partition(":")[0] == f"engine_{name}", entry
    assert "engine" in project["dependencies"]
    assert (folder / "README.md").is_file() and list((folder / "tests").glob("test_*.py"))
    installed = installed_plugins().get(name)  # ./dev.sh setup installs every contrib folder
    assert installed is not None, f"pip install -e contrib/{name}"
    assert installed.distribution == project["name"]
    assert describe_installed(installed)[2] == []


def test_engine_plugins_lists_them():
    out = subprocess.run([sys.executable, "-m", "engine", "plugins"], capture_output=True, text=True,
                         check=True).stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "engine-weighted-loss 0.1.0" in rows["weighted_loss"] and "compute_loss" in rows["weighted_loss"]
    assert "engine-csv-tracker 0.1.0" in rows["csv_tracker"] and "log_metrics" in rows["csv_tracker"]
    assert "registers optimizer lion" in rows["lion"]
    assert "engine-local-sgd 0.1.0" in rows["local_sgd"] and "registers strategy local_sgd" in rows["local_sgd"]


def test_the_three_compose_in_one_run(tmp_path):
    run = run_steps(12, plugins=["lion", "weighted_loss", "csv_tracker"], output_dir=tmp_path,
                    train={"optim": "lion", "learning_rate": 3e-3},
                    sections={"weighted_loss": {"class_weights": {"3": 2.0, "4": 0.5}, "label_smoothing": 0.1}})
    assert type(run.optimizer).__name__ == "Lion"
    assert run.plugin_manager.call_order("compute_loss")[:2] == ["lion", "weighted_loss"]
    losses = [entry["loss"] for entry in run.state.log_history if "loss" in entry]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    # lion's z-loss is off, so weighted_loss answers: the logged loss is the smoothed one
    batch = run.data_collator([run.train_dataset[i] for i in range(4)])
    run.model.eval()
    with torch.no_grad():
        weighted = run.hook.compute_loss(run=run, model=run.model, batch=batch, num_items_in_batch=None)
        plain = run.model(**batch).loss
    assert weighted > plain
    scalars = logged_scalars(tmp_path)
    assert scalars[("loss", 12)] == losses[-1]
    assert _csv_scalars(tmp_path / "metrics.csv") == scalars


def test_two_processes_with_the_loss_and_the_tracker_match_one_process(tmp_path):
    """weighted_loss keeps the compute_loss contract across processes (2 x 2 rows = 1 x 4 rows, ragged
    data); csv_tracker writes on the main process only (two writers would double the rows)."""
    train = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "logging_steps": 1}
    sections = {"weighted_loss": {"class_weights": [1.0 + i % 4 for i in range(128)], "label_smoothing": 0.1}}
    cases = [{"name": "ddp", "steps": 4, "plugins": ["ddp", "weighted_loss", "csv_tracker"], "ragged": True,
              "train": {**train, "per_device_train_batch_size": 2}, "sections": sections}]
    trained = launch_cases(cases, tmp_path)
    reference = run_steps(4, plugins=["weighted_loss"], model=tiny_model(seed=0), output_dir=tmp_path / "one",
                          dataset=tiny_dataset(size=64, ragged=True), sections=sections,
                          train={**train, "per_device_train_batch_size": 4})
    assert max_difference(trained["ddp"], reference.model) < 1e-6
    assert _csv_scalars(tmp_path / "ddp" / "metrics.csv") == logged_scalars(tmp_path / "ddp")
    with open(tmp_path / "ddp" / "metrics.csv", newline="") as handle:
        assert [row["step"] for row in csv.DictReader(handle)] == ["1", "2", "3", "4", "4"]
