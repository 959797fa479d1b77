"""Azure ML tracking for the engine (``plugins = ["azureml"]``, Trainer's ``report_to="azure_ml"``), with the
v1 SDK (azureml-core) as Trainer's AzureMLCallback uses it: ``Run.get_context()``.

Inside an Azure ML job that run is the job's own: the composed config goes on it once as tags
(flattened, ``train.learning_rate``, with ``tags`` of the run file), every number of a log as a metric at
its optimizer step (``run.log(name, value, step=step)``: a metric of the run's chart, x = the step),
generated samples (``log_samples``) as a table metric ``samples``. At the end ``run.complete()`` sends
what is queued, or ``run.fail(error_details=...)`` when training raised; the job's status itself is
Azure ML's to set from the process's exit (the SDK does not set a submitted run's status).

Outside a job, ``Run.get_context()`` is an offline run that keeps nothing: it prints each call to
stdout ("Attempted to log scalar metric loss:" and the value), which is what a local try-out of a
job's script shows; its ``log`` takes no step, so values go without one there.

The SDK queues metrics and sends them in batches from its own thread; the other calls (tags, the end)
are HTTP requests, so every call goes through a thread of this plugin and the end of the run waits
``connect_timeout`` at most. The run id is kept in checkpoints, but a resumed training is a new job,
hence a new Azure ML run: it gets a tag ``engine.resumed_from`` naming the run it continues. The
job's token (AZUREML_RUN_TOKEN) is the SDK's business: this plugin never reads it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine import hookimpl, option
from engine.tracking import BackgroundSender, Tracker, flatten_config, sample_columns, scalar_metrics

logger = logging.getLogger("engine")


@dataclass
class AzureMLOptions:
    tags: dict[str, str] = option(help="tags set on the run, besides the config's", default_factory=dict)
    connect_timeout: float = option(60.0, min=1, help=(
        "seconds the end of the run waits for the SDK to send what is queued and close the run"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


class AzureMLTracker(Tracker):
    extra, package, distribution, options = "azureml", "azureml.core", "azureml-core", AzureMLOptions

    def __init__(self):
        super().__init__()
        self.azure_run = None
        self.offline = False  # the offline run's log takes no step
        self.sender: BackgroundSender | None = None

    @hookimpl
    def log_hyperparams(self, run, params):
        tags = {key: str(value) for key, value in flatten_config(params, tracker="azureml").items()}
        tags.update(run.config.section("azureml").tags)
        continued = self.run_id

        def start():  # Run.get_context() asks the service for the job's run: from the thread too
            from azureml.core.run import Run, _OfflineRun

            self.azure_run = Run.get_context()
            self.offline = isinstance(self.azure_run, _OfflineRun)
            if self.offline:
                logger.info("azureml: not inside an Azure ML job: the offline run prints what it would log")
            self.run_id = self.azure_run.id
            if continued and continued != self.run_id:
                tags["engine.resumed_from"] = continued
            self.azure_run.set_tags(tags)

        self.sender = BackgroundSender("azureml")
        self.sender.submit(start)

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.sender is None:  # evaluate() outside training
            return

        def send(values=scalar_metrics(metrics)):
            for name, value in values.items():
                if self.offline:
                    self.azure_run.log(name, value)
                else:
                    self.azure_run.log(name, value, step=step)

        self.sender.submit(send)

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.sender is not None:
            table = sample_columns(samples)
            self.sender.submit(lambda: self.azure_run.log_table("samples", table))

    @hookimpl
    def log_finish(self, run, status):
        if self.sender is None:
            return
        sender, self.sender = self.sender, None
        if status == "success":
            sender.submit(lambda: self.azure_run.complete())
        else:
            sender.submit(lambda: self.azure_run.fail(error_details="training raised (see the job's log)"))
        sender.close(timeout=run.config.section("azureml").connect_timeout)
