"""trackio tracking for the engine (``plugins = ["trackio"]``, Trainer's ``report_to``).

The local-first tracker: runs go into trackio's local store (``TRACKIO_DIR``, default
``~/.cache/huggingface/trackio``; ``trackio show`` opens its dashboard) or to a Hugging Face
Space (``space_id``, its data in a Hugging Face Bucket: ``bucket_id``, default derived from the
Space). ``static_space_id``: after a successful run, a read-only static snapshot of the project is
made from that Space (``trackio.freeze``), as Trainer's ``trackio_static_space_id`` does. Generated
samples (``log_samples``) are a ``trackio.Table`` ``samples`` at their step. trackio's
own thread batches and writes the logs, so steps never wait. The run's name is kept in checkpoints,
so a resumed training run continues the same run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine import ConfigError, hookimpl, option
from engine.tracking import SAMPLE_COLUMNS, Tracker, sample_rows, scalar_metrics, tracker_run_name, wait_for_server


@dataclass
class TrackioOptions:
    project: str = option("engine", nonempty=True, help="the trackio project (TrainingArguments.project)")
    run_name: str | None = option(None, help="the run's name; default train.run_name or output_dir's name")
    space_id: str | None = option(None, help=(
        "log to this Hugging Face Space instead of the local store (TrainingArguments.trackio_space_id)"))
    bucket_id: str | None = option(None, help=(
        "the Hugging Face Bucket the Space keeps its data in; default: derived from space_id "
        "(TrainingArguments.trackio_bucket_id)"))
    static_space_id: str | None = option(None, help=(
        "after a successful run, a static read-only snapshot Space of the project made from space_id "
        "(trackio.freeze; TrainingArguments.trackio_static_space_id)"))
    group: str | None = option(None, help="group runs together in the dashboard")
    connect_timeout: float = option(20.0, min=1, help=(
        "logging to a Space or a trackio server: seconds to wait for it to answer when the run starts; one that "
        "does not switches the tracker off (strict = true: ends the run)"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


class TrackioTracker(Tracker):
    extra, package, options = 'trackio', 'trackio', TrackioOptions

    def __init__(self):
        super().__init__()  # run_id: the trackio run's name (trackio resumes runs by name)
        self.trackio_run = None

    @hookimpl
    def configure(self, run):
        super().configure(run)
        options = run.config.section("trackio")
        for key in ("bucket_id", "static_space_id"):
            if getattr(options, key) is not None and options.space_id is None:
                # trackio would only warn and log locally
                raise ConfigError(f"trackio.{key} is a Hugging Face Space's: set trackio.space_id too, or remove {key}")

    @hookimpl
    def log_hyperparams(self, run, params):
        import trackio

        options = run.config.section("trackio")
        remote = _remote_url(options)
        if remote is not None:  # its client waits forever for a server that never answers
            wait_for_server(remote, options.connect_timeout, "trackio")
        resuming = self.run_id is not None
        self.trackio_run = trackio.init(
            project=options.project, name=self.run_id or options.run_name or tracker_run_name(run),
            space_id=options.space_id, bucket_id=options.bucket_id, group=options.group, config=params, embed=False,
            resume="allow" if resuming else "never")
        self.run_id = self.trackio_run.name

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.trackio_run is not None:  # None: evaluate() outside training
            self.trackio_run.log(scalar_metrics(metrics), step=step)

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.trackio_run is not None:
            import trackio

            self.trackio_run.log({"samples": trackio.Table(columns=SAMPLE_COLUMNS, data=sample_rows(samples))},
                                 step=step)

    @hookimpl
    def log_finish(self, run, status):
        if self.trackio_run is not None:
            trackio_run, self.trackio_run = self.trackio_run, None
            trackio_run.finish()
            options = run.config.section("trackio")
            if status == "success" and options.static_space_id is not None:
                import trackio

                trackio.freeze(space_id=options.space_id, project=options.project,
                               new_space_id=options.static_space_id, bucket_id=options.bucket_id)

    @hookimpl
    def trainer_argument_mappings(self):
        from .mappings import TRAINER_ARGUMENTS  # for engine migrate only: runs do not load it

        return TRAINER_ARGUMENTS


def _remote_url(options: TrackioOptions) -> str | None:
    """The server trackio logs to: the Hub's for a Space (space_id, or TRACKIO_SPACE_ID as trackio
    reads it), TRACKIO_SERVER_URL; None for the local store."""
    if options.space_id or os.environ.get("TRACKIO_SPACE_ID"):
        from huggingface_hub import constants

        return constants.ENDPOINT
    return os.environ.get("TRACKIO_SERVER_URL")
