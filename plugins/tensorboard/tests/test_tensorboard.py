"""engine-tensorboard: event files read back with TensorBoard's EventAccumulator; a full disk."""

import json
import os
import re
import subprocess

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from engine import hookimpl
from engine.testing import logged_scalars, run_steps, same_weights, tiny_dataset, tiny_model, tiny_tokenizer
from engine.tracking import flatten_config, samples_table


def read_events(logdir):
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_scalars_config_and_hparams_read_back(tmp_path):
    run_steps(6, plugins=["tensorboard"], output_dir=tmp_path, eval_dataset=tiny_dataset(8),
              train={"eval_strategy": "steps", "eval_steps": 3})
    (logdir,) = (tmp_path / "runs").iterdir()  # Trainer's default: output_dir/runs/<time>_<host>
    events = read_events(logdir)
    scalars = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    reference = logged_scalars(tmp_path)
    assert {"eval_loss", "loss", "train_runtime"} <= {name for name, _ in reference}
    assert scalars.keys() == reference.keys()
    for key, value in reference.items():  # event files hold float32
        assert scalars[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    hyperparams = json.loads((tmp_path / "hyperparams.json").read_text())
    (text,) = events.Tensors("config/text_summary")
    assert json.loads(text.tensor_proto.string_val[0].decode()) == hyperparams
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["train.learning_rate"].number_value == 0.01
    assert start.hparams["train.optim"].string_value == hyperparams["train"]["optim"]
    assert set(start.hparams) == set(flatten_config(hyperparams))


def test_samples_are_a_text_table_at_their_step(tmp_path):
    run_steps(2, plugins=["tensorboard", "samples"], output_dir=tmp_path, model=tiny_model(vocab_size=300),
              tokenizer=tiny_tokenizer(), sections={"samples": {"prompts": ["the | quick", "fox"], "every": "end",
                                                                 "max_new_tokens": 3}})
    (logdir,) = (tmp_path / "runs").iterdir()
    (text,) = read_events(logdir).Tensors("samples/text_summary")
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert text.step == 2 and [row["prompt"] for row in rows] == ["the | quick", "fox"]
    assert text.tensor_proto.string_val[0].decode() == samples_table(rows)
    assert "| 2 | the \\| quick | " in samples_table(rows)


class FillDisk:
    """Fills the file system of ``folder`` after optimizer step ``at``: the log dir's disk is full."""

    name = "filler"

    def __init__(self, folder, at):
        self.folder, self.at = folder, at

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.at:
            with open(self.folder / "filler", "wb", buffering=0) as handle:
                try:
                    while True:
                        handle.write(b"\0" * 4096)
                except OSError:  # ENOSPC: full
                    pass


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root: mount). A full disk is how a log dir stops taking writes."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


# TensorBoard's writer thread re-raises the error it hands over to the caller
THREAD_ERROR = "ignore::pytest.PytestUnhandledThreadExceptionWarning"


@pytest.mark.filterwarnings(THREAD_ERROR)
def test_a_full_log_dir_never_stops_training(tmp_path, small_disk, caplog):
    plain = run_steps(30, output_dir=tmp_path / "plain")
    with caplog.at_level("WARNING", logger="engine"):
        tracked = run_steps(30, plugins=["tensorboard"], objects=[FillDisk(small_disk, at=3)],
                            output_dir=tmp_path / "out", sections={"tensorboard": {"logging_dir": str(small_disk / "tb")}})
    assert same_weights(plain.model, tracked.model) == []
    switched_off = [m for m in caplog.messages if m.startswith("plugin 'tensorboard': ")]
    assert len(switched_off) == 1 and "No space left on device" in switched_off[0], caplog.messages
    # the event file's last page still takes a few steps' events after the disk is full
    failed_at = int(re.search(r"at step (\d+);", switched_off[0]).group(1))
    assert 3 <= failed_at <= 30
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["status"] == "finished" and list(record["switched_off"]) == ["tensorboard"]


@pytest.mark.filterwarnings(THREAD_ERROR)
def test_strict_makes_a_full_log_dir_end_the_run(tmp_path, small_disk):
    from engine import PluginError

    with pytest.raises(PluginError, match=r"plugin 'tensorboard' \(tensorboard.strict = true\) failed in log_metrics "
                                          r"at step \d+: OSError: .*No space left on device"):
        run_steps(30, plugins=["tensorboard"], objects=[FillDisk(small_disk, at=3)], output_dir=tmp_path / "out",
                  sections={"tensorboard": {"logging_dir": str(small_disk / "tb"), "strict": True}})
