"""``output_dir/metrics.jsonl``: one JSON object per log event; ``hyperparams.json``.

A fresh run starts the file anew. A resumed run keeps the records up to the step it resumed
from and appends after them, so a run interrupted any number of times ends with the same
records as one that never was (timings aside).
"""

from __future__ import annotations

import json
import math
import os

from engine import hookimpl
from engine.util import dumps_json, write_json


def _drop_records_after(path, step):
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and _complete_record_step(line) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _complete_record_step(line):
    """The step of a record; a line cut short by a kill counts as after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return math.inf


class JsonlLogger:
    """One instance per run (see ``BUILTIN_PLUGINS``)."""

    def __init__(self):
        self.handle = None

    def _open(self, run, mode):
        run.output_dir.mkdir(parents=True, exist_ok=True)
        self.handle = open(run.output_dir / "metrics.jsonl", mode, encoding="utf-8")

    @hookimpl
    def log_hyperparams(self, run, params):
        # a fresh run starts a fresh file; a resumed one continues the history it resumed
        # from, without what the interrupted run logged after its checkpoint
        step = run.state.global_step
        if step > 0:
            _drop_records_after(run.output_dir / "metrics.jsonl", step)
        self._open(run, "a" if step > 0 else "w")
        write_json(run.output_dir / "hyperparams.json", params)

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.handle is None:  # evaluation outside training
            self._open(run, "a")
        self.handle.write(dumps_json({"step": step, **metrics}) + "\n")
        self.handle.flush()

    @hookimpl
    def log_finish(self, run, status):
        if self.handle is not None:
            self.handle.close()
            self.handle = None
