"""MLflow tracking for the engine (``plugins = ["mlflow"]``, Trainer's ``report_to``).

The config goes in once as params (flattened, within MLflow's key/value limits, in batches of
100), metrics at their step, and the run ends FINISHED or FAILED. MLflow's client sends each
call over HTTP before it returns, which would stall steps, so metrics are collected and sent
as one batch every ``send_interval`` seconds, from a thread, as are uploads (the cost per
step: benchmarks/trackers.py). Generated samples (``log_samples``) are a table artifact
``samples/step-<step>.json`` (MLflow's ``log_table``: the UI's artifact view shows it as a table).
The run id is kept in checkpoints, so a resumed training run continues the same MLflow run.

MLflow's client retries a request that cannot connect for about 4 minutes (7 retries with
backoff: MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR), with nothing on
screen. So a tracking server is first asked whether it answers, for at most ``connect_timeout``
seconds, with a line saying so; one that does not is a failure of this plugin (switched off, or
the end of the run with ``strict = true``). Marking the MLflow run finished at the end waits as
long at most.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine import hookimpl, option
from engine.tracking import (BackgroundSender, Tracker, call_with_timeout, flatten_config, sample_columns, scalar_metrics,
                             tracker_run_name, wait_for_server)

logger = logging.getLogger("engine")

# mlflow.utils.validation: MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
MAX_KEY_LENGTH = 250
MAX_VALUE_LENGTH = 6000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000  # MAX_METRICS_PER_BATCH


@dataclass
class MLflowOptions:
    tracking_uri: str | None = option(None, help=(
        "tracking server or store; default MLFLOW_TRACKING_URI, else sqlite:///<output_dir>/mlflow.db (uploads in "
        "output_dir/mlartifacts)"))
    experiment_name: str | None = option(None, help=(
        "experiment (created if missing); default MLFLOW_EXPERIMENT_NAME, else 'Default'"))
    run_name: str | None = option(None, help="the MLflow run's name; default train.run_name or output_dir's name")
    tags: dict[str, str] = option(help="tags set on the run", default_factory=dict)
    log_artifacts: Literal["none", "final", "checkpoints"] = option("none", help=(
        "upload the final model at the end ('final'), or every checkpoint as it is saved and the final "
        "model ('checkpoints')"))
    send_interval: float = option(1.0, min=0, help=(
        "seconds between the batches of metrics sent to the tracking server (0: one request per log)"))
    connect_timeout: float = option(20.0, min=1, help=(
        "seconds to wait for a tracking server to answer when the run starts (and when it ends); one that does not "
        "switches the tracker off (strict = true: ends the run)"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


class MLflowTracker(Tracker):
    extra, package, options = 'mlflow', 'mlflow', MLflowOptions

    def __init__(self):
        super().__init__()
        self.client = None
        self.sender: BackgroundSender | None = None
        self.pending: list = []  # metrics not yet handed to the sender
        self.last_sent = 0.0

    def mlflow_options(self, run) -> MLflowOptions:
        """The options this run's MLflow client follows (a subclass for a hosted MLflow derives its own)."""
        return run.config.section("mlflow")

    @hookimpl
    def log_hyperparams(self, run, params):
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunTag

        options = self.mlflow_options(run)
        uri = options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None  # the store's own place (a server's, or what MLflow's config says)
        if not uri:
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            run.output_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(run.output_dir / 'mlflow.db').resolve()}"
            # uploads beside the store, not into ./mlruns of the working directory (MLflow's default root)
            artifacts = (run.output_dir / "mlartifacts").resolve().as_uri()
            SqlAlchemyStore(uri, artifacts)  # creates the store, its Default experiment with that root
        if uri.startswith(("http://", "https://")):
            wait_for_server(uri, options.connect_timeout, self.extra)
        self.client = client = MlflowClient(uri)
        flat = flatten_config(params, max_key_length=MAX_KEY_LENGTH, max_value_length=MAX_VALUE_LENGTH,
                              tracker=self.extra)
        if self.run_id is None:
            name = options.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(
                name, artifact_location=artifacts and f"{artifacts}/{name}")
            self.run_id = client.create_run(experiment_id, run_name=options.run_name or tracker_run_name(run),
                                            tags=options.tags).info.run_id
        else:  # resumed: MLflow refuses to change a logged param, so only new keys go in
            client.update_run(self.run_id, status="RUNNING")
            logged = client.get_run(self.run_id).data.params
            changed = sorted(key for key, value in flat.items() if key in logged and logged[key] != str(value))
            if changed:
                logger.warning("mlflow: run %s keeps the values its params had when it started; changed on "
                               "resume: %s", self.run_id, ", ".join(changed))
            flat = {key: value for key, value in flat.items() if key not in logged}
            if options.tags:
                client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in options.tags.items()])
        items = [Param(key, str(value)) for key, value in flat.items()]
        for start in range(0, len(items), PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=items[start:start + PARAMS_PER_BATCH])
        self.sender = BackgroundSender(self.extra)

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.sender is None:  # evaluate() outside training: no MLflow run is open
            return
        from mlflow.entities import Metric

        now = time.time()
        self.pending += [Metric(key, value, int(now * 1000), step) for key, value in scalar_metrics(metrics).items()]
        if now - self.last_sent >= self.mlflow_options(run).send_interval or len(self.pending) >= METRICS_PER_BATCH:
            self._send_pending()
            self.last_sent = now

    def _send_pending(self):
        client, run_id = self.client, self.run_id
        for start in range(0, len(self.pending), METRICS_PER_BATCH):
            batch = self.pending[start:start + METRICS_PER_BATCH]
            self.sender.submit(lambda batch=batch: client.log_batch(run_id, metrics=batch))
        self.pending = []

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.sender is not None:
            client, run_id = self.client, self.run_id
            table = sample_columns(samples)
            self.sender.submit(lambda: client.log_table(run_id, table, f"samples/step-{step}.json"))

    @hookimpl
    def on_checkpoint_saved(self, run, path):
        if self.sender is not None and self.mlflow_options(run).log_artifacts == "checkpoints":
            client, run_id = self.client, self.run_id
            self.sender.submit(lambda: client.log_artifacts(run_id, path, artifact_path=Path(path).name))

    @hookimpl
    def log_finish(self, run, status):
        if self.sender is None:
            return
        from engine.kit.checkpoint import final_model_files

        self._send_pending()  # (a sender that failed sends nothing more)
        sender, self.sender = self.sender, None
        client, run_id = self.client, self.run_id
        if status == "success" and self.mlflow_options(run).log_artifacts != "none":
            for name in final_model_files(run.output_dir):
                sender.submit(lambda path=run.output_dir / name: client.log_artifact(run_id, str(path), "model"))
        try:
            sender.close()
        finally:
            # from a thread of its own, waited for connect_timeout at most: a server gone since
            # would hold the end of the run for MLflow's minutes of retries
            call_with_timeout(lambda: client.set_terminated(run_id, "FINISHED" if status == "success" else "FAILED"),
                              self.mlflow_options(run).connect_timeout, f"{self.extra}: ending the run")
