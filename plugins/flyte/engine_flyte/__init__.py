"""Flyte for the engine (``plugins = ["flyte"]``, Trainer's ``report_to "flyte"``), for training inside a Flyte task.

Flyte has no tracking server: a task shows what it reports as Flyte Decks (HTML pages next to its
execution), and keeps one intra-task checkpoint per attempt, which the next attempt of a retried
task can restore. So, as Trainer's FlyteCallback does:

* the end of the run adds three decks to the task: "Log History" (every row ``log_metrics`` got,
  one column per metric, and how the run ended), "Samples" (``log_samples``' rows) and "Config"
  (the composed config, flattened). Flyte renders them when the task returns; only a task with
  ``@task(enable_deck=True)`` shows decks (the plugin says so once when they are off). Run
  locally (the task called as a function), flytekit writes ``deck.html`` into its local sandbox
  and logs the path.
* ``sync_checkpoints``: each checkpoint is uploaded into the task's Flyte checkpoint
  (``current_context().checkpoint.save``) from a thread, from hard links of its files (rotation may
  delete the folder meanwhile), so steps never wait for the blob store; the end of the run waits
  ``connect_timeout`` at most for an upload still running. Like Trainer's, the files go to the
  checkpoint's root, so it holds the newest checkpoint.
* resume: with ``train.resume_from_checkpoint = true``, a retried attempt whose output_dir holds
  no checkpoint restores the previous attempt's (``checkpoint.prev_exists()`` / ``restore()``)
  and continues from it, checked like any checkpoint (a half-uploaded one is refused by its
  checksums). The first attempt, or one after an attempt that saved none, starts fresh.

Flyte has no run of its own to continue (an attempt's decks are its own; the resumed attempt's
"Log History" holds the rows before the checkpoint too, from the restored log history) and no
status to set (the task fails when training raises; the deck names the status). Outside a Flyte
task there is nothing to report to: the first logging hook says so once and the plugin is switched
off. flytekit takes about 2 s to import: it is imported in the hooks only.
"""

from __future__ import annotations

import html
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import hookimpl, option
from engine.kit.checkpoint import TMP, snapshot_files
from engine.tracking import SAMPLE_COLUMNS, BackgroundSender, Tracker, flatten_config, sample_rows, scalar_metrics

logger = logging.getLogger("engine")

RESTORED = TMP + "flyte-checkpoint"  # output_dir/.tmp-flyte-checkpoint/: the previous attempt's, restored
UPLOADING = TMP + "flyte-upload"  # output_dir/.tmp-flyte-upload/<step>/: hard links being uploaded
# (both removed with the other .tmp- leftovers when the next run starts)


@dataclass
class FlyteOptions:
    save_log_history: bool = option(True, help=(
        "add the decks 'Log History' (every logged row), 'Samples' and 'Config' to the task at the end of the run "
        "(shown when the task has enable_deck=True)"))
    sync_checkpoints: bool = option(True, help=(
        "upload each checkpoint into the task's Flyte checkpoint, so that a retried attempt resumes from it "
        "(train.resume_from_checkpoint = true)"))
    connect_timeout: float = option(300.0, min=1, help=(
        "seconds the end of the run waits for a checkpoint upload still running; then it is given up"))
    strict: bool = option(False, help="a failure (deck, upload) ends the run (default: reported, then switched off)")


def html_table(columns: list[str], rows: list[list[Any]]) -> str:
    """An HTML table, every cell escaped (a float as its repr: the deck shows the value logged)."""
    def cell(value: Any) -> str:
        return "" if value is None else html.escape(repr(value) if isinstance(value, float) else str(value))

    head = "".join(f"<th>{html.escape(column)}</th>" for column in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(value)}</td>" for value in row) + "</tr>" for row in rows)
    return f'<table border="1"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def log_history_table(rows: list[dict[str, Any]]) -> str:
    """``{"step": 1, "loss": ...}`` rows as one table: a column per metric, blank where a row has none."""
    columns = list(dict.fromkeys(name for row in rows for name in row))
    return html_table(columns, [[row.get(column) for column in columns] for row in rows])


def task_context():
    """flytekit's execution parameters of the Flyte task this runs in; RuntimeError outside a task."""
    import flytekit
    from flytekit.core.context_manager import FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    if state is None or state.mode is None:
        raise RuntimeError("flyte: not inside a Flyte task (@flytekit.task), so there are no decks or "
                           "checkpoints to report to")
    return flytekit.current_context()


class FlyteTracker(Tracker):
    extra, package, distribution, options = "flyte", "flytekit", "flytekit", FlyteOptions

    def __init__(self):
        super().__init__()
        self.rows: list[dict[str, Any]] | None = None  # None: not in a Flyte task (or not started)
        self.samples: list[dict[str, Any]] = []
        self.config: dict[str, Any] = {}
        self.decks = False
        self.checkpoint = None  # the task's flytekit Checkpoint, with sync_checkpoints
        self.sender: BackgroundSender | None = None
        self.context = None  # the Flyte context, for the uploading thread (a contextvar does not follow threads)

    @hookimpl
    def resolve_checkpoint(self, run, run_id):
        """A retried attempt (resume_from_checkpoint = true, no checkpoint in output_dir) continues from the
        previous attempt's Flyte checkpoint; None lets the builtin answer (output_dir's, or fresh)."""
        from engine.kit.checkpoint import list_checkpoints
        from engine import CheckpointError

        if run.config.train.resume_from_checkpoint is not True or not run.config.section("flyte").sync_checkpoints:
            return None
        if list_checkpoints(run.output_dir, run_id):
            return None
        try:
            checkpoint = task_context().checkpoint
        except (RuntimeError, NotImplementedError):  # not in a task, or a platform without checkpoints
            return None
        if not checkpoint.prev_exists():
            return None
        local = run.output_dir / RESTORED
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        from flytekit.exceptions.user import FlyteDataNotFoundException

        try:
            checkpoint.restore(local)
        except FlyteDataNotFoundException:  # the previous attempt ended before its first checkpoint
            pass
        except Exception as exc:  # a retry that silently started over would lose the attempts before it
            raise CheckpointError(f"flyte: cannot restore the previous attempt's Flyte checkpoint: {exc}") from exc
        if not any(local.iterdir()):
            local.rmdir()
            logger.info("flyte: the previous attempt saved no checkpoint; starting from scratch")
            return None
        logger.info("flyte: resuming from the previous attempt's checkpoint (restored into %s)", local)
        return local

    @hookimpl
    def log_hyperparams(self, run, params):
        import contextvars

        options = run.config.section("flyte")
        context = task_context()
        self.decks = options.save_log_history and context.enable_deck
        if options.save_log_history and not self.decks:
            logger.info("flyte: the task's decks are off; @task(enable_deck=True) shows the run's Log History")
        if options.sync_checkpoints:
            try:
                self.checkpoint = context.checkpoint
            except NotImplementedError:
                logger.info("flyte: this Flyte platform offers no intra-task checkpoint; checkpoints stay local")
        if self.checkpoint is not None:
            self.context = contextvars.copy_context()
            self.sender = BackgroundSender("flyte")
        self.config = flatten_config(params, tracker="flyte")
        # a resumed run starts with the rows before its checkpoint
        self.rows = [dict(row) for row in run.state.log_history]

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.rows is not None:
            self.rows.append({"step": step, **scalar_metrics(metrics)})

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.rows is not None:
            self.samples += samples

    @hookimpl
    def on_checkpoint_saved(self, run, path):
        if self.sender is not None:
            snapshot = snapshot_files(Path(path), run.output_dir / UPLOADING / Path(path).name)
            checkpoint, context = self.checkpoint, self.context

            def upload():
                try:
                    context.run(checkpoint.save, snapshot)
                finally:
                    shutil.rmtree(snapshot, ignore_errors=True)

            self.sender.submit(upload)

    @hookimpl
    def log_finish(self, run, status):
        if self.rows is None:
            return
        rows, self.rows = self.rows, None
        sender, self.sender = self.sender, None
        try:
            if sender is not None:
                sender.close(timeout=run.config.section("flyte").connect_timeout)
        finally:
            if self.decks:
                self._write_decks(rows, status)

    def _write_decks(self, rows, status):
        from flytekit import Deck

        Deck("Log History", f"<p>training: {html.escape(status)}</p>" + log_history_table(rows))
        if self.samples:
            Deck("Samples", html_table(SAMPLE_COLUMNS, sample_rows(self.samples)))
        Deck("Config", html_table(["key", "value"], [[key, value] for key, value in self.config.items()]))
