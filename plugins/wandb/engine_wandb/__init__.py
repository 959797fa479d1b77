"""Weights & Biases tracking for the engine (``plugins = ["wandb"]``, Trainer's ``report_to``).

``wandb.init`` gets the composed config (nested, as W&B shows it), metrics go in at their step,
generated samples (``log_samples``) as a ``wandb.Table`` ``samples`` at theirs, and the run
finishes with exit code 0 or 1. W&B's own service process buffers and sends, so steps never
wait on the network; ``run.log`` itself costs 1-3 ms of Python per row (a hand-off to W&B's own
asyncio thread, waited for), which a thread of this plugin spends: the training thread no longer
waits for it (stall ratio 0.99x at logging_steps 10), but the CPU and the GIL it takes still cost
the tiny CPU model ~5 % of its step time at logging_steps 10 (benchmarks/trackers.py). ``WANDB_MODE=offline`` writes the run under
``output_dir/wandb`` without a key (``wandb sync`` uploads it later). The run id is kept in
checkpoints, so a resumed training run continues the same W&B run (``resume="allow"``). The
API key is W&B's business: this plugin never reads, logs or stores it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine import hookimpl, option
from engine.tracking import (SAMPLE_COLUMNS, BackgroundSender, Tracker, first_line, sample_rows, scalar_metrics,
                             tracker_run_name)

logger = logging.getLogger("engine")


@dataclass
class WandbOptions:
    project: str | None = option(None, help="W&B project; default WANDB_PROJECT, else 'engine'")
    entity: str | None = option(None, help="team or user; default WANDB_ENTITY, else your default entity")
    name: str | None = option(None, help="the W&B run's name; default train.run_name or output_dir's name")
    tags: list[str] = option(help="tags of the run", default_factory=list)
    group: str | None = option(None, help="group runs together (e.g. the runs of one sweep)")
    connect_timeout: float = option(30.0, min=1, help=(
        "seconds wandb.init may take (its init_timeout; W&B's default is 90): a server that does not answer in "
        "time switches the tracker off (strict = true: ends the run)"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


class WandbTracker(Tracker):
    extra, package, options = 'wandb', 'wandb', WandbOptions

    def __init__(self):
        super().__init__()
        self.wandb_run = None
        self.sender: BackgroundSender | None = None

    @hookimpl
    def log_hyperparams(self, run, params):
        import os

        import wandb

        options = run.config.section("wandb")
        run.output_dir.mkdir(parents=True, exist_ok=True)
        logger.info("wandb: starting the W&B run (timeout %g s)", options.connect_timeout)
        try:
            self.wandb_run = wandb.init(
                settings=wandb.Settings(init_timeout=options.connect_timeout),
                project=options.project or os.environ.get("WANDB_PROJECT") or "engine", entity=options.entity,
                name=options.name or tracker_run_name(run), tags=options.tags or None, group=options.group,
                config=params, dir=str(run.output_dir), id=self.run_id, resume="allow" if self.run_id else None,
                reinit="create_new")
        except wandb.errors.CommError as exc:  # its message goes on with advice about init_timeout, lines of it
            raise ConnectionError(f"wandb: {first_line(exc)} (within wandb.connect_timeout = "
                                  f"{options.connect_timeout:g} s)") from None
        self.run_id = self.wandb_run.id
        self.sender = BackgroundSender("wandb")

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.sender is not None:  # None: evaluate() outside training
            self.sender.submit(lambda log=self.wandb_run.log, row=scalar_metrics(metrics): log(row, step=step))

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.sender is not None:
            import wandb

            table = wandb.Table(columns=SAMPLE_COLUMNS, data=sample_rows(samples))
            self.sender.submit(lambda log=self.wandb_run.log: log({"samples": table}, step=step))

    @hookimpl
    def log_finish(self, run, status):
        if self.wandb_run is not None:
            wandb_run, self.wandb_run = self.wandb_run, None
            sender, self.sender = self.sender, None
            import wandb

            try:
                try:
                    sender.close()  # what is queued is logged first (an error it met is raised after finish)
                finally:
                    wandb_run.finish(exit_code=0 if status == "success" else 1)
            finally:
                # finish() returns before W&B's service process has written (offline) or sent
                # everything; teardown waits for it, so the run is complete when training returns
                wandb.teardown()
