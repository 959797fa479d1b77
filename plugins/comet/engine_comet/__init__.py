"""Comet tracking for the engine (``plugins = ["comet"]``, Trainer's ``report_to = ["comet_ml"]``).

One training run is one Comet experiment (``comet_ml.start``): the composed config goes in once
as its parameters (nested, which Comet stores flat with ``|`` and shows as a tree), every number
of a log at its optimizer step, generated samples (``log_samples``) as a CSV table asset
``samples-step-<step>.csv``. Comet's own streamer thread writes or sends what is logged, so
steps do not wait on the network.

Offline (``online = false`` or ``COMET_START_ONLINE=false``) the experiment is written as a zip
archive into ``offline_directory`` (default ``output_dir/comet``); ``comet upload <zip>`` sends it
later, and :mod:`engine_comet.offline` reads it back. The experiment key is kept in checkpoints:
a resumed training run continues the same experiment (online: Comet's ``get_or_create`` finds it;
offline: a second archive with the same key, which ``comet upload`` appends to the first).

Comet has no finished/failed state of its own to set; a run that raised is reported the way
Comet's exception hook reports an uncaught exception (``has_crashed``): the experiment shows as
crashed online, and offline the archive's ``experiment.json`` carries the error message, which
``comet upload`` reports. The API key is Comet's business (``comet login``, ``COMET_API_KEY``):
this plugin never reads, logs or stores it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from engine import hookimpl, option
from engine.tracking import (SAMPLE_COLUMNS, Tracker, call_with_timeout, sample_rows, scalar_metrics, tracker_run_name,
                             wait_for_server)

logger = logging.getLogger("engine")

FAILED_MESSAGE = "engine: training raised; the run ended failed"


@dataclass
class CometOptions:
    project_name: str | None = option(None, help="Comet project; default COMET_PROJECT_NAME, else Comet's default")
    workspace: str | None = option(None, help="Comet workspace; default COMET_WORKSPACE, else your default workspace")
    experiment_name: str | None = option(None, help="the experiment's name; default train.run_name or output_dir's name")
    tags: list[str] = option(help="tags of the experiment", default_factory=list)
    online: bool | None = option(None, help=(
        "false: write an offline archive (comet upload sends it later); default COMET_START_ONLINE, else true"))
    offline_directory: str | None = option(None, help=(
        "folder of offline archives; default COMET_OFFLINE_DIRECTORY, else output_dir/comet"))
    connect_timeout: float = option(30.0, min=1, help=(
        "seconds the Comet server has to answer when the run starts, and the end of the run waits for Comet to "
        "finish sending or writing; a server that does not answer switches the tracker off (strict = true: "
        "ends the run)"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


class CometTracker(Tracker):
    extra, package, options = 'comet', 'comet_ml', CometOptions

    def __init__(self):
        super().__init__()
        self.experiment = None

    @hookimpl
    def log_hyperparams(self, run, params):
        import comet_ml
        from comet_ml.config import get_backend_address, get_config

        options = run.config.section("comet")
        online = options.online if options.online is not None else get_config().get_bool(None, "comet.start.online")
        if online is not False:  # Comet retries a server that does not answer, saying nothing
            wait_for_server(get_backend_address(), options.connect_timeout, "comet")
        offline_directory = (options.offline_directory or os.environ.get("COMET_OFFLINE_DIRECTORY")
                             or str(run.output_dir / "comet"))
        self.experiment = comet_ml.start(
            project_name=options.project_name, workspace=options.workspace, experiment_key=self.run_id,
            online=online, experiment_config=comet_ml.ExperimentConfig(
                name=options.experiment_name or tracker_run_name(run), tags=options.tags or None,
                offline_directory=offline_directory,
                # the engine logs the config and metrics itself; Comet's own would add sys.argv and framework hooks
                auto_param_logging=False, auto_metric_logging=False, parse_args=False,
                auto_log_co2=False))  # the engine's codecarbon plugin measures emissions
        if not self.experiment.alive:  # Comet logs why (a refused key, ...) and drops what is logged
            raise ConnectionError("comet: the experiment could not be started (see Comet's message above)")
        self.run_id = self.experiment.get_key()
        self.experiment.log_parameters(params)

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.experiment is not None:  # None: evaluate() outside training
            self.experiment.log_metrics(scalar_metrics(metrics), step=step)

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.experiment is not None:
            self.experiment.log_table(f"samples-step-{step}.csv", tabular_data=sample_rows(samples),
                                      headers=SAMPLE_COLUMNS)

    @hookimpl
    def log_finish(self, run, status):
        if self.experiment is None:
            return
        experiment, self.experiment = self.experiment, None
        if status != "success":  # what Comet's exception hook does with an uncaught exception
            experiment._report_experiment_error(FAILED_MESSAGE, has_crashed=True)
        # end() waits for Comet's streamer (uploads, or the archive written); a server gone since
        # would hold the end of the run for Comet's own timeouts
        call_with_timeout(experiment.end, run.config.section("comet").connect_timeout, "comet: ending the experiment")
