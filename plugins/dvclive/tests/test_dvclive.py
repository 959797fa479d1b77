"""engine-dvclive with the real DVCLive, read back from the files it writes (DVC's formats):
``plots/metrics/*.tsv``, ``metrics.json``, ``params.yaml``, ``dvc.yaml``. Every test runs in its
own tmp_path as the working directory, outside any Git repository, as DVCLive looks for one
there (in one, it would make it a DVC repository)."""

import json
import subprocess
from pathlib import Path

import pytest
from dvclive.serialize import load_yaml  # DVC's YAML 1.2 reader ('no' stays a string)

from engine.testing import (assert_not_written, assert_tracker_failure_is_harmless, logged_scalars, raising_at,
                            run_and_resume, run_steps, tiny_dataset, tiny_model)

SECRET = "dvc-studio-token-never-written"


@pytest.fixture(autouse=True)
def outside_any_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("DVC_EXP_NAME", "DVCLIVE_RESUME", "HF_DVCLIVE_LOG_MODEL", "DVC_ROOT", "DVC_STUDIO_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def tsv_scalars(folder):
    """Every row of DVCLive's metric files, by ``(name, step)`` (a name with '/' is a sub-folder)."""
    found = {}
    for path in (Path(folder) / "plots" / "metrics").rglob("*.tsv"):
        name = path.relative_to(Path(folder) / "plots" / "metrics").with_suffix("").as_posix()
        header, *rows = path.read_text().splitlines()
        columns = header.split("\t")
        for row in rows:
            values = dict(zip(columns, row.split("\t")))
            key, value = (name, int(values["step"])), float(values[name.rsplit("/", 1)[-1]])
            # two rows at one step (a log and an evaluation both hold epoch) must agree
            assert found.setdefault(key, value) == value, f"step {key[1]} of {name}: {found[key]} and {value}"
    return found


def test_config_and_metrics_reach_dvclives_files_at_their_steps(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DVC_STUDIO_TOKEN", SECRET)  # no Git remote: DVCLive posts nothing, and writes it nowhere
    run_steps(6, plugins=["dvclive"], output_dir=tmp_path / "out", eval_dataset=tiny_dataset(8),
              train={"eval_strategy": "steps", "eval_steps": 3})
    folder = tmp_path / "out" / "dvclive"
    reference = logged_scalars(tmp_path / "out")
    assert {"loss", "eval_loss", "train_runtime"} <= {name for name, _ in reference}
    assert tsv_scalars(folder) == reference
    assert load_yaml(folder / "params.yaml") == json.loads(
        (tmp_path / "out" / "hyperparams.json").read_text())
    summary = json.loads((folder / "metrics.json").read_text())
    assert summary["step"] == 6 and summary["loss"] == reference["loss", 6]
    assert load_yaml(tmp_path / "out" / "dvc.yaml") == {
        "params": ["dvclive/params.yaml"], "metrics": ["dvclive/metrics.json"],
        "plots": [{"dvclive/plots/metrics": {"x": "step"}}]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing beside output_dir (no .dvc, no dvc.yaml)
    assert not (Path(__file__).parents[3] / ".dvc").exists()
    out, err = capfd.readouterr()
    assert_not_written(SECRET, [tmp_path], out, err)


def test_resume_continues_the_same_files(tmp_path):
    reference = run_and_resume(["dvclive"], tmp_path / "run")
    assert tsv_scalars(tmp_path / "run" / "dvclive") == reference
    assert json.loads((tmp_path / "run" / "dvclive" / "metrics.json").read_text())["step"] == 4


def test_a_resume_drops_what_the_interrupted_run_logged_after_its_checkpoint(tmp_path):
    save = {"save_strategy": "steps", "save_steps": 2}
    run_steps(3, plugins=["dvclive"], output_dir=tmp_path / "run", train=save)  # step 3 is logged, not saved
    run_steps(4, plugins=["dvclive"], output_dir=tmp_path / "run", model=tiny_model(seed=1),
              train={**save, "resume_from_checkpoint": str(tmp_path / "run" / "checkpoint-2")})
    reference = logged_scalars(tmp_path / "run")
    assert {step for _, step in reference} == {1, 2, 3, 4}
    assert tsv_scalars(tmp_path / "run" / "dvclive") == reference  # step 3 once: the resumed run's


def test_dvclive_failing_mid_run_never_stops_training(tmp_path, monkeypatch):
    from dvclive import Live

    def fail():
        def broken(self, name, val, **kwargs):
            raise OSError("No space left on device")

        monkeypatch.setattr(Live, "log_metric", broken)

    tracked = assert_tracker_failure_is_harmless("dvclive", tmp_path, fail)
    rows, reference = tsv_scalars(tmp_path / "tracked" / "dvclive"), logged_scalars(tmp_path / "tracked")
    assert rows and rows == {key: reference[key] for key in rows}
    assert max(step for _, step in rows) <= 3  # those the thread wrote before the failure; nothing after it
    assert tracked.state.global_step == 6


def test_a_run_that_raised_still_ends_dvclive_with_what_it_logged(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(5, plugins=["dvclive"], objects=[raising_at(2)], output_dir=tmp_path / "out")
    folder = tmp_path / "out" / "dvclive"
    assert tsv_scalars(folder) == logged_scalars(tmp_path / "out")
    assert json.loads((folder / "metrics.json").read_text())["step"] == 1  # DVCLive has no run status


def test_log_model_tracks_checkpoints_and_the_final_model_with_dvc(tmp_path, monkeypatch):
    git = ["git", "-c", "user.name=engine", "-c", "user.email=engine@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)  # DVCLive makes it a DVC repository
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "start"], check=True)  # DVC needs a commit
    monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path / "dvc-site-cache"))  # not /var/tmp/dvc
    monkeypatch.setenv("HF_DVCLIVE_LOG_MODEL", "all")
    run_steps(2, plugins=["dvclive"], output_dir=tmp_path / "out", train={"save_strategy": "steps", "save_steps": 2})
    assert (tmp_path / ".dvc").is_dir() and (tmp_path / "out" / "checkpoint-2.dvc").is_file()
    run_steps(2, plugins=["dvclive"], output_dir=tmp_path / "final", sections={"dvclive": {"log_model": True}})
    assert (tmp_path / "final" / "dvclive" / "artifacts" / "last.dvc").is_file()
    artifacts = load_yaml(tmp_path / "final" / "dvc.yaml")["artifacts"]
    assert artifacts == {"last": {"path": "dvclive/artifacts/last", "type": "model"}}
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], capture_output=True, text=True,
                          check=True).stdout.split()
    assert len([ref for ref in refs if "/exec/" not in ref]) == 2  # save_dvc_exp: a DVC experiment per run
