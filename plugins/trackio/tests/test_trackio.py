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


def test_samples_are_a_table_at_their_step(tmp_path):
    from engine.testing import tiny_model, tiny_tokenizer

    run_steps(2, plugins=["trackio", "samples"], output_dir=tmp_path, model=tiny_model(vocab_size=300),
              tokenizer=tiny_tokenizer(), sections={"trackio": {"project": "trackio-samples"},
                                                    "samples": {"prompts": ["the quick", "fox"], "every": "end",
                                                                "max_new_tokens": 3}})
    (logged,) = [row for row in SQLiteStorage.get_logs("trackio-samples", tmp_path.name) if "samples" in row]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert logged["step"] == 2 and logged["samples"]["_type"] == "trackio.table"
    assert logged["samples"]["_value"] == [{"step": 2, "prompt": row["prompt"], "completion": row["completion"]}
                                           for row in rows]
