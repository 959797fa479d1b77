"""The report at the end of every run: ``report.md``, ``report.html`` and the curves
``report-*.png`` in output_dir (:mod:`engine.builtin.report_writer`; ``engine report`` writes the same on demand).

A builtin, on by default: a run should end in something a person reads, and the report is
written from the run's own files, so a failure to write it costs nothing else. It runs in
``log_finish`` (main process, isolated: a report that fails is reported once and the run's
status is unchanged), so a failed or diverged run gets one too. A run that failed before its
first step (a plugin's ``on_train_start`` refused it, the evaluation at the start failed) gets
none and prints nothing: its error is its only line. ``ENGINE_REPORT`` chooses how much:
``full`` (default: the curves too; about 0.6 s plus matplotlib's import), ``text`` (report.md
and report.html without curves: for CI jobs and test suites that train many short runs) or
``off``.
"""

from __future__ import annotations

import logging
import os

from engine import hookimpl
from engine.errors import ConfigError
from engine.layout import METRICS

REPORT_ENV = "ENGINE_REPORT"
MODES = ("full", "text", "off")
logger = logging.getLogger("engine")


def report_mode() -> str:
    mode = os.environ.get(REPORT_ENV, "full").strip().lower() or "full"
    if mode not in MODES:
        raise ConfigError(f"environment variable {REPORT_ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


class Report:
    """One instance per run (see ``BUILTIN_PLUGINS``): the step this run started training from."""

    def __init__(self):
        self.start_step: int | None = None

    @hookimpl
    def configure(self, run):
        report_mode()  # a bad value is refused before anything loads, not at the end

    @hookimpl
    def log_hyperparams(self, run, params):
        self.start_step = run.state.global_step  # after a resume: the step it resumed from

    @hookimpl
    def log_finish(self, run, status):
        from engine.builtin.report_writer import default_config, write_report

        if status != "success" and run.state.global_step == self.start_step:
            return  # refused before its first step: its error says why; a report would say nothing new
        mode = report_mode()
        if mode == "off":
            return
        if not (run.output_dir / METRICS).is_file() or not (run.output_dir / METRICS).stat().st_size:
            logger.info("no report: nothing was logged to %s", run.output_dir / METRICS)
            return
        defaults = default_config(run.config.plugins, run.plugin_manager.option_schemas())
        path = write_report([run.output_dir], plots=mode == "full", defaults=defaults,
                            status="finished" if status == "success" else status)
        logger.info("report: %s (and report.html)", path)
