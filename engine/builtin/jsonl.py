"""``output_dir/metrics.jsonl``: one JSON object per log event; ``hyperparams.json``;
``samples.jsonl``: one JSON object per generated sample (``log_samples``).

A fresh run starts the files anew. A resumed run keeps the records up to the step it resumed
from and appends after them, so a run interrupted any number of times ends with the same
records as one that never was (timings aside).
"""

from __future__ import annotations

import json
import math
import os

from engine import hookimpl
from engine.layout import METRICS, SAMPLES
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
        self.samples = None  # samples.jsonl, opened on the first log_samples

    def _open(self, run, mode):
        run.output_dir.mkdir(parents=True, exist_ok=True)
        self.handle = open(run.output_dir / METRICS, mode, encoding="utf-8")

    @hookimpl
    def log_hyperparams(self, run, params):
        # a fresh run starts a fresh file; a resumed one continues the history it resumed
        # from, without what the interrupted run logged after its checkpoint
        step = run.state.global_step
        if step > 0:
            _drop_records_after(run.output_dir / METRICS, step)
            _drop_records_after(run.output_dir / SAMPLES, step)
        else:
            (run.output_dir / SAMPLES).unlink(missing_ok=True)
        self._open(run, "a" if step > 0 else "w")
        write_json(run.output_dir / "hyperparams.json", params)

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.handle is None:  # evaluation outside training
            self._open(run, "a")
        self.handle.write(dumps_json({"step": step, **metrics}) + "\n")
        self.handle.flush()

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.samples is None:
            run.output_dir.mkdir(parents=True, exist_ok=True)
            self.samples = open(run.output_dir / SAMPLES, "a", encoding="utf-8")
        # one write per round: a kill cuts at most its last line, which a resume drops
        self.samples.write("".join(dumps_json(row, ensure_ascii=False) + "\n" for row in samples))
        self.samples.flush()

    @hookimpl
    def log_finish(self, run, status):
        for handle in (self.handle, self.samples):
            if handle is not None:
                handle.close()
        self.handle = self.samples = None
