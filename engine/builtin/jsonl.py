"""``output_dir/metrics.jsonl``: one JSON object per log event; ``hyperparams.json``."""

from __future__ import annotations

import json
import math

from engine import hookimpl


def _json_value(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlLogger:
    """One instance per run (see ``BUILTIN_PLUGINS``)."""

    def __init__(self):
        self.handle = None

    def _open(self, run, mode):
        run.output_dir.mkdir(parents=True, exist_ok=True)
        self.handle = open(run.output_dir / "metrics.jsonl", mode, encoding="utf-8")

    @hookimpl
    def log_hyperparams(self, run, params):
        # a fresh run starts a fresh file; a resumed one continues the history it resumed from
        self._open(run, "a" if run.state.global_step > 0 else "w")
        (run.output_dir / "hyperparams.json").write_text(json.dumps(params, indent=2))

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.handle is None:  # evaluation outside training
            self._open(run, "a")
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    @hookimpl
    def log_finish(self, run, status):
        if self.handle is not None:
            self.handle.close()
            self.handle = None
