"""engine-wandb offline (WANDB_MODE=offline, no account): the run files read back in W&B's sync format."""

import json

import pytest

from engine.testing import logged_scalars, raising_at, run_steps, tiny_dataset, tiny_model, tiny_tokenizer
from engine_wandb.offline import read_offline_runs

SECRET = "0123456789abcdef0123456789abcdef01234567"  # the shape of a W&B API key


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)


def test_config_and_metrics_read_back_and_the_key_is_never_stored(tmp_path, capfd):
    sections = {"wandb": {"project": "readback", "tags": ["tiny", "test"], "group": "g1"}}
    run_steps(6, plugins=["wandb"], output_dir=tmp_path, sections=sections, eval_dataset=tiny_dataset(8),
              train={"eval_strategy": "steps", "eval_steps": 3, "run_name": "readback-run"})
    (found,) = read_offline_runs(tmp_path / "wandb")
    assert (found.name, found.project, found.group, found.tags) == ("readback-run", "readback", "g1", ["tiny", "test"])
    assert found.exit_code == 0
    reference = logged_scalars(tmp_path)
    assert {"eval_loss", "loss", "train_runtime"} <= {name for name, _ in reference}
    assert found.scalars == reference
    hyperparams = json.loads((tmp_path / "hyperparams.json").read_text())
    assert {key: value for key, value in found.config.items() if key != "_wandb"} == hyperparams
    captured = capfd.readouterr()
    assert SECRET not in captured.out + captured.err
    for path in (tmp_path / "wandb").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_failed_run_ends_with_a_failure_exit_code(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(5, plugins=["wandb"], objects=[raising_at(2)], output_dir=tmp_path)
    (found,) = read_offline_runs(tmp_path / "wandb")
    assert found.exit_code == 1
    assert {step for _, step in found.scalars} == {1}


def test_samples_are_a_table_at_their_step(tmp_path):
    run_steps(2, plugins=["wandb", "samples"], output_dir=tmp_path, model=tiny_model(vocab_size=300),
              tokenizer=tiny_tokenizer(), sections={"samples": {"prompts": ["the quick", "fox"], "every": "end",
                                                                 "max_new_tokens": 3}})
    (found,) = read_offline_runs(tmp_path / "wandb")
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    table = found.tables["samples", 2]
    assert table["columns"] == ["step", "prompt", "completion"]
    assert table["data"] == [[2, row["prompt"], row["completion"]] for row in rows]
    assert found.scalars == logged_scalars(tmp_path)
