"""engine-csv-tracker: every metric of a run in one CSV file, as an engine plugin.

Enable with ``plugins = ["csv_tracker"]``. The file (``[csv_tracker] path``, default
``output_dir/metrics.csv``) has one row per ``log_metrics`` call, like ``metrics.jsonl``: a
``step`` column, then one column per metric name in the order the names first appeared; a cell
is empty where that call did not log the name. Uses only engine's public plugin API.

A name that first appears later (``eval_loss`` at the first evaluation, ``train_runtime`` at
the end) rewrites the file once with the wider header (written to a temporary file and renamed,
so the file is never half-written); every other row is appended and flushed. A wide file is
what a spreadsheet or ``pandas.read_csv`` plots directly, which a long (step, name, value) file
would need pivoting for; the price is one rewrite per new name, a handful per run.

The config goes once into ``<stem>.config.json`` beside the CSV (``metrics.config.json``),
rewritten when a resumed run starts (its config may differ).

Resume: a resumed run (``run.state.global_step > 0`` when ``log_hyperparams`` fires) keeps the
rows up to the step it resumed from, drops what the interrupted run logged after that checkpoint
(and a last line a kill cut short), and appends after them: a run interrupted any number of times
ends with the rows of one that never was (timings aside), as ``metrics.jsonl`` does. A fresh run
starts the file anew. The logging hooks fire on the main process only, so one process writes.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine
from engine import hookimpl
from engine.tracking import scalar_metrics

__version__ = "0.1.0"

PLUGIN = "csv_tracker"  # the entry-point name; also the name of the options section
STEP = "step"


@dataclass
class CsvTrackerOptions:
    """``[csv_tracker]``: where the CSV goes."""

    path: str | None = engine.option(None, nonempty=True, help=(
        "the CSV file (a relative path is relative to the working directory, like output_dir); default "
        "output_dir/metrics.csv. The config goes beside it, in <stem>.config.json"))
    strict: bool = engine.option(False, help="a failure to write ends the run (default: reported, then switched off)")


def csv_path(run: Any) -> Path:
    path = run.config.section(PLUGIN).path
    return Path(path) if path else run.output_dir / "metrics.csv"


def read_rows(path: Path, up_to_step: int | None = None) -> list[dict[str, str]]:
    """The rows of a CSV this plugin wrote, as {name: text} without empty cells; a last line without
    its newline (cut short by a kill) is left out, and with ``up_to_step`` every row after that step."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    text = text[: text.rfind("\n") + 1]
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    rows = []
    for cells in reader:
        row = {name: value for name, value in zip(header, cells) if value != ""}
        try:
            step = int(row[STEP])
        except (KeyError, ValueError):
            continue  # not a row this plugin wrote whole
        if up_to_step is None or step <= up_to_step:
            rows.append(row)
    return rows


def metric_names(rows: list[dict[str, str]]) -> list[str]:
    """The metric names of ``rows`` in the order they first appear."""
    names = {name: None for row in rows for name in row if name != STEP}
    return list(names)


def write_rows(path: Path, names: list[str], rows: list[dict[str, str]]) -> None:
    """Write the whole file (a temporary file renamed into place: never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow([STEP, *names])
        writer.writerows([row[STEP], *(row.get(name, "") for name in names)] for row in rows)
    os.replace(tmp, path)


class CsvTracker:
    """The plugin; the entry point names this class, so each run gets its own open file."""

    name = PLUGIN  # so engine.Run(plugins=[CsvTracker()]) files it under "csv_tracker" too

    def __init__(self):
        self.path: Path | None = None
        self.names: list[str] = []  # the metric columns of the file, in order
        self.handle = None
        self.writer = None

    @hookimpl
    def plugin_options(self):
        return CsvTrackerOptions

    @hookimpl
    def configure(self, run):
        path = csv_path(run)
        if path.is_dir():
            raise engine.ConfigError(f"{PLUGIN}.path: {str(path)!r} is a folder; name the CSV file, e.g. "
                                     f"{str(path / 'metrics.csv')!r}")

    @hookimpl
    def log_hyperparams(self, run, params):
        self.path = path = csv_path(run)
        path.parent.mkdir(parents=True, exist_ok=True)
        step = run.state.global_step
        # fresh: a new file; resumed: the rows up to the checkpoint's step, the rest dropped
        rows = read_rows(path, up_to_step=step) if step > 0 else []
        self.names = metric_names(rows)
        write_rows(path, self.names, rows)
        self._open_for_appending()
        config = path.with_name(f"{path.stem}.config.json")
        tmp = config.with_name(f".{config.name}.tmp")
        tmp.write_text(json.dumps(params, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, config)

    @hookimpl
    def log_metrics(self, run, metrics, step):
        outside_training = self.handle is None  # Run.evaluate() after train(): append, then close
        if outside_training:
            self.path = csv_path(run)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            rows = read_rows(self.path)
            self.names = metric_names(rows)
            write_rows(self.path, self.names, rows)
            self._open_for_appending()
        row = {STEP: str(step), **{name: repr(value) for name, value in scalar_metrics(metrics).items()}}
        new = [name for name in row if name != STEP and name not in self.names]
        if new:  # a wider header: rewrite the file once with it
            self.handle.close()
            self.names += new
            write_rows(self.path, self.names, [*read_rows(self.path), row])
            self._open_for_appending()
        else:
            self.writer.writerow([row[STEP], *(row.get(name, "") for name in self.names)])
            self.handle.flush()  # a kill loses at most the row being written
        if outside_training:
            self.log_finish(run, "success")

    @hookimpl
    def log_finish(self, run, status):
        if self.handle is not None:
            handle, self.handle, self.writer = self.handle, None, None
            handle.close()

    def _open_for_appending(self) -> None:
        self.handle = open(self.path, "a", newline="", encoding="utf-8")
        self.writer = csv.writer(self.handle, lineterminator="\n")
