"""engine-flyte inside real flytekit tasks run locally (a task called as a function): the deck.html flytekit
writes into its local sandbox is read back, and the task's Flyte checkpoint is a local folder."""

import contextlib
import json
import logging
from html.parser import HTMLParser
from pathlib import Path

import flytekit
import pytest
from flytekit.core import data_persistence
from flytekit.core.checkpointer import SyncCheckpoint
from flytekit.core.context_manager import FlyteContextManager

from engine.testing import (assert_not_written, assert_tracker_failure_is_harmless, logged_scalars, raising_at,
                            run_steps, tiny_model, tiny_tokenizer)
from engine.tracking import flatten_config

SECRET = "flyte-client-secret-0123456789"


@pytest.fixture(autouse=True)
def no_report(monkeypatch):
    monkeypatch.setenv("ENGINE_REPORT", "off")  # the root conftest's setting, also when run from this folder


class Tables(HTMLParser):
    """Every <table> of a page as lists of cell texts, header row first."""

    def __init__(self, page):
        super().__init__()
        self.tables, self.cell = [], None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data

    def headed(self, *columns):
        (table,) = [table for table in self.tables if table and table[0][:len(columns)] == list(columns)]
        return table


@contextlib.contextmanager
def engine_warnings():
    """The engine's warnings while the block runs (a handler on its logger, as the engine's own checks do)."""
    found = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: found.append(record.getMessage())
    logging.getLogger("engine").addHandler(handler)
    try:
        yield found
    finally:
        logging.getLogger("engine").removeHandler(handler)


def deck_files():
    return set(Path(data_persistence.flyte_tmp_dir).rglob("deck.html"))


def in_task(body, checkpoint_src=None):
    """Run ``body()`` in a local Flyte task with decks on; returns (its result, the deck page, the task's
    checkpoint folder). ``checkpoint_src``: a previous attempt's checkpoint, as Flyte hands a retried attempt."""
    found = {}

    @flytekit.task(enable_deck=True, deck_fields=())  # no default decks (one runs pip freeze: seconds)
    def train() -> None:
        context = FlyteContextManager.current_context()
        params = context.user_space_params
        if checkpoint_src is not None:  # a retry: the attempt's checkpoint restores the previous one's
            builder = params.new_builder(params)
            builder.checkpoint = SyncCheckpoint(params.checkpoint._checkpoint_dest, checkpoint_src)
            params = builder.build()
        with FlyteContextManager.with_context(context.with_execution_state(
                context.execution_state.with_params(user_space_params=params))):
            found["result"] = body()
        found["checkpoint"] = Path(params.checkpoint._checkpoint_dest)

    before = deck_files()
    train()
    (deck,) = deck_files() - before
    return found["result"], deck.read_text(), found["checkpoint"]


def deck_scalars(tables):
    header, *rows = tables.headed("step", "loss")
    return {(name, int(row[0])): float(value) for row in rows for name, value in zip(header[1:], row[1:]) if value}


def test_decks_hold_the_logged_rows_samples_and_config_and_checkpoints_reach_the_task(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("FLYTE_CREDENTIALS_CLIENT_SECRET", SECRET)  # the platform's credential: never written
    out = tmp_path / "out"
    sections = {"samples": {"prompts": ["the quick", "fox"], "every": "end", "max_new_tokens": 3}}
    _, page, checkpoint = in_task(lambda: run_steps(
        4, plugins=["flyte", "samples"], output_dir=out, model=tiny_model(vocab_size=300), tokenizer=tiny_tokenizer(),
        sections=sections, train={"save_strategy": "steps", "save_steps": 2, "save_total_limit": 1}))
    tables = Tables(page)
    assert "<p>training: success</p>" in page
    reference = logged_scalars(out)
    assert {"loss", "train_runtime"} <= {name for name, _ in reference}
    assert deck_scalars(tables) == reference
    hyperparams = json.loads((out / "hyperparams.json").read_text())
    assert dict(tables.headed("key", "value")[1:]) == {k: str(v) for k, v in flatten_config(hyperparams).items()}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert tables.headed("step", "prompt", "completion")[1:] == [["4", s["prompt"], s["completion"]] for s in samples]
    # the task's checkpoint holds the newest checkpoint's files (checkpoint-2 was rotated away meanwhile)
    saved = {p.relative_to(out / "checkpoint-4") for p in (out / "checkpoint-4").rglob("*") if p.is_file()}
    assert {p.relative_to(checkpoint) for p in checkpoint.rglob("*") if p.is_file()} == saved
    assert all((checkpoint / p).read_bytes() == (out / "checkpoint-4" / p).read_bytes() for p in saved)
    assert not (out / ".tmp-flyte-upload").exists() or not any((out / ".tmp-flyte-upload").iterdir())
    captured = capfd.readouterr()
    assert_not_written(SECRET, [out, checkpoint], captured.out, captured.err, page)


def test_a_retried_attempt_resumes_from_the_previous_attempts_checkpoint_and_its_deck_holds_every_row(tmp_path):
    save = {"save_strategy": "steps", "save_steps": 2}
    _, _, first = in_task(lambda: run_steps(2, plugins=["flyte"], output_dir=tmp_path / "attempt-1", train=save))
    resume = {**save, "resume_from_checkpoint": True}
    resumed, page, _ = in_task(lambda: run_steps(4, plugins=["flyte"], output_dir=tmp_path / "attempt-2",
                                                 model=tiny_model(seed=1), train=resume), checkpoint_src=str(first))
    assert resumed.state.global_step == 4 and not (tmp_path / "attempt-2" / "checkpoint-2").exists()
    first_rows = {key: value for key, value in logged_scalars(tmp_path / "attempt-1").items() if key[1] <= 2
                  and not key[0].startswith("train_")}  # the first attempt's summary is not in the log history
    assert deck_scalars(Tables(page)) == {**first_rows, **logged_scalars(tmp_path / "attempt-2")}
    assert {step for _, step in deck_scalars(Tables(page))} == {1, 2, 3, 4}
    # an attempt after one that ended before its first checkpoint (nothing at the source) starts over
    fresh, _, _ = in_task(lambda: run_steps(1, plugins=["flyte"], output_dir=tmp_path / "attempt-3", train=resume),
                          checkpoint_src=str(tmp_path / "never-written"))
    assert fresh.state.global_step == 1


def test_a_failed_deck_or_upload_never_stops_training(tmp_path, monkeypatch):
    def broken_deck():
        monkeypatch.setattr(flytekit, "Deck", None)  # Deck(...) raises TypeError

    in_task(lambda: assert_tracker_failure_is_harmless("flyte", tmp_path / "deck", broken_deck))
    monkeypatch.undo()

    def bucket_gone(self, path):
        raise OSError("the bucket is gone")

    monkeypatch.setattr(SyncCheckpoint, "save", bucket_gone)
    with engine_warnings() as warnings:
        run, page, _ = in_task(lambda: run_steps(4, plugins=["flyte"], output_dir=tmp_path / "upload",
                                                 train={"save_strategy": "steps", "save_steps": 1}))
    assert run.state.global_step == 4
    (warning,) = [m for m in warnings if m.startswith("plugin 'flyte': ")]
    assert "the bucket is gone" in warning
    # switched off after step 2's upload failed: the deck is still written, with the rows logged until then
    assert {step for _, step in deck_scalars(Tables(page))} == {1, 2}


def test_a_run_that_raised_shows_failed_and_outside_a_task_it_is_switched_off_at_once(tmp_path):
    def raising():
        with pytest.raises(RuntimeError, match="boom"):
            run_steps(4, plugins=["flyte"], objects=[raising_at(2)], output_dir=tmp_path / "raised")

    _, page, _ = in_task(raising)
    assert "<p>training: failed</p>" in page
    assert {step for _, step in deck_scalars(Tables(page))} == {1}
    with engine_warnings() as warnings:
        run_steps(1, plugins=["flyte"], output_dir=tmp_path / "outside")
    (warning,) = [m for m in warnings if m.startswith("plugin 'flyte': ")]
    assert "not inside a Flyte task" in warning
