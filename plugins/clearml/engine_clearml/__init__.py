"""ClearML tracking for the engine (``plugins = ["clearml"]``, Trainer's ``report_to``).

One training run is one ClearML task (``Task.init``) in a project: the composed config is its
hyperparameter section ``engine`` (flattened, ``train.learning_rate``), every number of a log a
scalar at its optimizer step, grouped as Trainer's ``ClearMLCallback`` does (``eval_loss`` is
series ``loss`` of the plot ``eval``, ``test_*`` of ``test``, the rest of ``train``), and generated
samples (``log_samples``) a table ``samples`` at their step. ClearML's own reporter (a thread, or
a subprocess on Linux) sends, so steps never wait on the network. The task is closed at the end,
which marks it completed; a run that raised is marked failed after. Closing waits for the
reporter ``connect_timeout`` seconds at most, from a thread.

``offline = true`` (or ``CLEARML_OFFLINE_MODE=1``) needs no server: the session is written to
ClearML's cache folder (``offline/<task id>`` and its zip; ``CLEARML_CACHE_DIR``), and
``clearml-task --import-offline-session`` (``Task.import_offline_session``) uploads it later. An
offline session keeps no status: it is set when imported. The task id is kept in checkpoints: a
resumed training run continues the same task (``continue_last_task``; offline, the same session
folder on this machine), its steps unchanged (the initial iteration stays 0). A server is first
asked whether it answers, for ``connect_timeout`` seconds at most. The credentials are ClearML's
business (``clearml.conf``, ``CLEARML_API_ACCESS_KEY`` / ``CLEARML_API_SECRET_KEY``): this plugin
never reads, logs or stores them. ClearML's task is one per process: the plugin closes it at the
end, so the next run in the same process starts a task of its own. Models are not uploaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine import hookimpl, option
from engine.tracking import (SAMPLE_COLUMNS, BackgroundSender, Tracker, flatten_config, sample_rows, scalar_metrics,
                             tracker_run_name, wait_for_server)

SECTION = "engine"  # the hyperparameter section of the config
PLOTS = ("eval", "test")  # metrics named <plot>_<series>; the others are series of the plot "train"


def plot_and_series(name: str) -> tuple[str, str]:
    """``eval_loss`` -> ``("eval", "loss")``, ``loss`` -> ``("train", "loss")`` (Trainer's grouping)."""
    plot, _, series = name.partition("_")
    return (plot, series) if plot in PLOTS and series else ("train", name)


@dataclass
class ClearMLOptions:
    project_name: str | None = option(None, help="ClearML project; default CLEARML_PROJECT, else 'engine'")
    task_name: str | None = option(None, help=(
        "the task's name; default CLEARML_TASK, else train.run_name or output_dir's name"))
    tags: list[str] = option(help="tags of the task", default_factory=list)
    offline: bool = option(False, help=(
        "write an offline session to ClearML's cache folder instead of a server (also CLEARML_OFFLINE_MODE=1)"))
    detect_repository: bool = option(True, help=(
        "record the git repository, its uncommitted changes and the installed packages with the task (ClearML's "
        "repository detection; closing the task waits for it)"))
    auto_connect_streams: bool = option(True, help="capture the console output into the task's log (ClearML's)")
    connect_timeout: float = option(30.0, min=1, help=(
        "seconds the ClearML server has to answer when the run starts, and the most closing the task waits for "
        "the reporter; a server that does not answer switches the tracker off (strict = true: ends the run)"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


class ClearMLTracker(Tracker):
    extra, package, options = 'clearml', 'clearml', ClearMLOptions

    def __init__(self):
        super().__init__()  # run_id: the ClearML task's id
        self.task = None

    @hookimpl
    def log_hyperparams(self, run, params):
        from clearml import Task

        options = run.config.section("clearml")
        if options.offline:
            Task.set_offline(True)
        if not Task.is_offline():  # ClearML's session retries a server that does not answer
            from clearml.backend_api import Session

            wait_for_server(Session.get_api_server_host(), options.connect_timeout, "clearml")
        self.task = Task.init(
            project_name=options.project_name or os.environ.get("CLEARML_PROJECT") or "engine",
            task_name=options.task_name or os.environ.get("CLEARML_TASK") or tracker_run_name(run),
            tags=options.tags or None, reuse_last_task_id=False, continue_last_task=self.run_id or False,
            # as Trainer: the engine logs (no TensorBoard events twice), no patched torch.save registering models
            auto_connect_frameworks={"tensorboard": False, "pytorch": False,
                                     "detect_repository": options.detect_repository},
            auto_connect_streams=options.auto_connect_streams)
        if self.run_id:
            self.task.set_initial_iteration(0)  # continuing offsets iterations by the last one; steps are absolute
        self.run_id = self.task.id
        self.task.set_parameters({f"{SECTION}/{key}": value for key, value in flatten_config(params).items()})

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.task is not None:  # None: evaluate() outside training
            logger = self.task.get_logger()
            for name, value in scalar_metrics(metrics).items():
                logger.report_scalar(*plot_and_series(name), value=value, iteration=step)

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.task is not None:
            self.task.get_logger().report_table("samples", "samples", iteration=step,
                                                table_plot=[SAMPLE_COLUMNS, *sample_rows(samples)])

    @hookimpl
    def log_finish(self, run, status):
        if self.task is not None:
            task, self.task = self.task, None

            def close():
                task.close()  # marks it completed
                if status != "success":
                    task.mark_failed(status_reason="training raised", force=True)

            # from a thread, waited for connect_timeout at most: closing waits for the reporter to send
            ending = BackgroundSender("clearml-end")
            ending.submit(close)
            ending.close(timeout=run.config.section("clearml").connect_timeout)
