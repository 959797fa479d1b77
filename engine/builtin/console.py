"""Console output: a progress line while training and one line per log event."""

from __future__ import annotations

import sys
import time

from engine import hookimpl


def format_metrics(metrics: dict) -> str:
    parts = []
    for key, value in metrics.items():
        if isinstance(value, float):
            value = f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
        parts.append(f"{key}={value}")
    return " ".join(parts)


class Console:
    """One instance per run (see ``BUILTIN_PLUGINS``)."""

    def __init__(self):
        self.started = 0.0
        self.last_draw = 0.0
        self.drawn = False
        self.interactive = False

    def _clear_line(self) -> None:
        if self.drawn:
            sys.stderr.write("\r\033[K")
            self.drawn = False

    @hookimpl
    def on_train_start(self, run):
        self.started = time.perf_counter()
        self.interactive = (sys.stderr.isatty() and not run.config.train.disable_tqdm
                            and run.strategy.is_main_process)

    @hookimpl
    def on_step_end(self, run):
        if not self.interactive:
            return
        now = time.perf_counter()
        step, total = run.state.global_step, run.state.max_steps
        if now - self.last_draw < 0.2 and step < total:
            return  # redraw at most five times a second: this runs every step
        self.last_draw = now
        filled = 30 * step // max(total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {step}/{total} {now - self.started:.0f}s")
        sys.stderr.flush()
        self.drawn = True

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if run.config.train.disable_tqdm:
            return
        self._clear_line()
        print(f"step {step}: {format_metrics(metrics)}", flush=True)

    @hookimpl
    def on_train_end(self, run):
        self._clear_line()
