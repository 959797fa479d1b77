"""engine-trackio: runs read back from trackio's local store (TRACKIO_DIR, a temporary folder:
see the root conftest.py)."""

import json

from trackio.sqlite_storage import SQLiteStorage

from engine.testing import logged_scalars, run_steps, tiny_dataset


def test_config_and_metrics_read_back_from_the_local_store(tmp_path):
    sections = {"trackio": {"project": "trackio-readback", "group": "g1"}}
    run_steps(6, plugins=["trackio"], output_dir=tmp_path, sections=sections, eval_dataset=tiny_dataset(8),
              train={"eval_strategy": "steps", "eval_steps": 3, "run_name": "readback-run"})
    assert SQLiteStorage.get_runs("trackio-readback") == ["readback-run"]
    stored = {}
    for row in SQLiteStorage.get_logs("trackio-readback", "readback-run"):
        for name, value in row.items():
            if name not in ("step", "timestamp") and isinstance(value, (int, float)):
                stored[name, row["step"]] = float(value)
    reference = logged_scalars(tmp_path)
    assert {"eval_loss", "loss", "train_runtime"} <= {name for name, _ in reference}
    assert stored == reference
    config = SQLiteStorage.get_run_config("trackio-readback", "readback-run")
    hyperparams = json.loads((tmp_path / "hyperparams.json").read_text())
    assert {key: value for key, value in config.items() if not key.startswith("_")} == hyperparams


def test_bucket_and_static_space_need_a_space():
    import pytest

    from engine import ConfigError, Run

    for key in ("bucket_id", "static_space_id"):
        with pytest.raises(ConfigError, match=f"trackio.{key} is a Hugging Face Space's: set trackio.space_id too"):
            Run({"plugins": ["trackio"], "trackio": {key: "me/metrics"}})
    # with a Space named, the run composes (creating the Space and Bucket needs the Hub: not run here)
    Run({"plugins": ["trackio"], "trackio": {"space_id": "me/dash", "bucket_id": "me/metrics",
                                             "static_space_id": "me/dash-static"}})
