"""engine-neptune offline (mode = "offline", no account): Neptune's offline queue read back.

The async and sync modes need Neptune's service (its API token names the server); they are not
run here, only a start that never returns (bounded by connect_timeout).
"""

import csv
import io
import json
import threading

import pytest
import torch

from engine.testing import (assert_not_written, assert_tracker_failure_is_harmless, logged_scalars, raising_at,
                            run_and_resume, run_steps, tiny_dataset, tiny_model, tiny_tokenizer)
from engine.tracking import flatten_config
from engine_neptune.offline import read_offline_runs

SECRET = "neptunetoken0123456789abcdef0123456789"  # stands for a Neptune API token
OFFLINE = {"neptune": {"mode": "offline"}}


@pytest.fixture(autouse=True)
def neptune_env(monkeypatch):
    monkeypatch.setenv("NEPTUNE_API_TOKEN", SECRET)
    for name in ("NEPTUNE_MODE", "NEPTUNE_PROJECT", "NEPTUNE_DATA_DIRECTORY", "NEPTUNE_CUSTOM_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def scalars(found, base="finetuning"):
    """The run's float series as ``{(name, step): value}``, the shape of ``logged_scalars``."""
    return {(name.removeprefix(f"{base}/"), step): value for name, points in found.series.items()
            if name.startswith(f"{base}/") for step, value in points.items()}


def test_config_metrics_and_samples_read_back_and_the_token_is_never_written(tmp_path, capfd):
    sections = {"neptune": {"mode": "offline", "tags": ["tiny", "test"]},
                "samples": {"prompts": ["the quick", "fox"], "every": "end", "max_new_tokens": 3}}
    run_steps(4, plugins=["neptune", "samples"], output_dir=tmp_path, sections=sections, eval_dataset=tiny_dataset(8),
              model=tiny_model(vocab_size=300), tokenizer=tiny_tokenizer(),
              train={"eval_strategy": "steps", "eval_steps": 2, "run_name": "readback-run"})
    (found,) = read_offline_runs(tmp_path / ".neptune")
    assert found.fields["sys/name"] == "readback-run" and found.fields["sys/failed"] is False
    reference = logged_scalars(tmp_path)
    assert {"eval_loss", "loss", "train_runtime"} <= {name for name, _ in reference}
    assert scalars(found) == reference
    hyperparams = json.loads((tmp_path / "hyperparams.json").read_text())
    config = {name.removeprefix("finetuning/config/").replace("/", "."): value
              for name, value in found.fields.items() if name.startswith("finetuning/config/")}
    assert config == flatten_config(hyperparams)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    table = list(csv.reader(io.StringIO(found.files["finetuning/samples/step_4"])))
    assert table == [["step", "prompt", "completion"]] + [["4", row["prompt"], row["completion"]] for row in rows]
    captured = capfd.readouterr()
    assert_not_written(SECRET, [tmp_path], captured.out, captured.err)


def test_a_resume_keeps_the_custom_run_id_and_offline_makes_a_second_run(tmp_path):
    reference = run_and_resume(["neptune"], tmp_path, sections=OFFLINE)
    kept = [torch.load(tmp_path / f"checkpoint-{step}" / "engine_state.pt", weights_only=True)["plugins"]["neptune"]
            for step in (2, 4)]
    assert kept[0] == kept[1] and len(kept[0]["run_id"]) == 32  # the resumed run started with the same custom_run_id
    first, second = read_offline_runs(tmp_path / ".neptune")  # offline runs do not record it: two runs
    assert scalars(first) | scalars(second) == reference
    assert {step for _, step in scalars(second)} == {3, 4}


def test_a_run_that_raised_ends_failed_with_what_it_logged(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(5, plugins=["neptune"], objects=[raising_at(2)], output_dir=tmp_path, sections=OFFLINE)
    (found,) = read_offline_runs(tmp_path / ".neptune")
    assert found.fields["sys/failed"] is True
    assert scalars(found) == logged_scalars(tmp_path)


def test_a_client_failing_mid_run_is_harmless(tmp_path, monkeypatch):
    from neptune.handler import Handler

    append = Handler.append

    def append_raises_from_step_3(self, value, *, step=None, **kwargs):
        # keyed on the step, not on when the sender thread gets to a row: rows 1 and 2 may still be queued at step 3
        if step is not None and step >= 3:
            raise OSError("neptune is gone")
        return append(self, value, step=step, **kwargs)

    assert_tracker_failure_is_harmless(
        "neptune", tmp_path, lambda: monkeypatch.setattr(Handler, "append", append_raises_from_step_3),
        sections=OFFLINE)
    (found,) = read_offline_runs(tmp_path / "tracked" / ".neptune")  # still stopped: what was logged is kept
    assert {step for _, step in scalars(found)} == {1, 2}  # the failure came at step 3's log


def test_a_start_that_never_returns_is_given_up_after_connect_timeout(tmp_path, monkeypatch, capfd):
    import neptune

    never = threading.Event()
    monkeypatch.setattr(neptune, "init_run", lambda **kwargs: never.wait())  # a server that never answers
    try:
        run_steps(2, plugins=["neptune"], output_dir=tmp_path, sections={"neptune": {"connect_timeout": 1}})
    finally:
        never.set()
    err = capfd.readouterr().err
    switched_off = [line for line in err.splitlines() if line.startswith("engine: plugin 'neptune': ")]
    assert len(switched_off) == 1 and "neptune: init_run did not return within 1 s" in switched_off[0], err
    assert {step for _, step in logged_scalars(tmp_path)} == {1, 2}


def test_a_missing_token_is_reported_in_one_line_and_training_goes_on(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("NEPTUNE_API_TOKEN")
    run_steps(2, plugins=["neptune"], output_dir=tmp_path, sections={"neptune": {"project": "team/project"}})
    err = capfd.readouterr().err
    switched_off = [line for line in err.splitlines() if line.startswith("engine: plugin 'neptune': ")]
    assert len(switched_off) == 1, err
    assert ("log_hyperparams raised RuntimeError: neptune: NeptuneMissingApiTokenException: The Neptune client "
            "couldn't find your API token. at step 0") in switched_off[0]
    assert {step for _, step in logged_scalars(tmp_path)} == {1, 2}
