"""TensorBoard event files for the engine (``plugins = ["tensorboard"]``, Trainer's ``report_to``).

Numbers are scalars at their step; the composed config is a text summary ``config`` (JSON) and
the hparams of the run (flattened); generated samples (``log_samples``) a markdown table ``samples``
at their step. The writer's own thread writes the events (flushing a log
would make the step wait for it: 3.5 ms on the tiny model); an error it met (a full disk) is
raised by the next log, where the engine reports it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime

from engine import dumps_json, hookimpl, option
from engine.tracking import Tracker, flatten_config, samples_table, scalar_metrics


@dataclass
class TensorBoardOptions:
    logging_dir: str | None = option(None, help=(
        "where the event files go (TrainingArguments.logging_dir); default output_dir/runs/<time>_<host>"))
    strict: bool = option(False, help="a failure to write ends the run (default: reported, then switched off)")


def default_logging_dir(output_dir) -> str:
    """``output_dir/runs/Dec01_21-50-03_host``, as Trainer names it."""
    return str(output_dir / "runs" / f"{datetime.now():%b%d_%H-%M-%S}_{socket.gethostname()}")


class TensorBoardTracker(Tracker):
    extra, package, options = 'tensorboard', 'tensorboard', TensorBoardOptions

    def __init__(self):
        super().__init__()  # no run id: a resumed run writes on into a log dir of its own
        self.writer = None

    @hookimpl
    def log_hyperparams(self, run, params):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        options = run.config.section("tensorboard")
        step = run.state.global_step
        # on resume, TensorBoard drops what an interrupted run wrote after the checkpoint's step
        self.writer = SummaryWriter(options.logging_dir or default_logging_dir(run.output_dir),
                                    purge_step=step + 1 if step > 0 else None)
        # indented: a code block in TensorBoard's markdown text view
        text = "\n".join("    " + line for line in dumps_json(params, indent=2).splitlines())
        self.writer.add_text("config", text, global_step=step)
        file_writer = self.writer._get_file_writer()
        for summary in hparams(flatten_config(params, tracker="tensorboard"), {}):
            file_writer.add_summary(summary, step)
        self.writer.flush()

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.writer is None:  # evaluate() outside training: nothing opened a log dir
            return
        for key, value in scalar_metrics(metrics).items():
            self.writer.add_scalar(key, value, step)

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.writer is not None:
            self.writer.add_text("samples", samples_table(samples), global_step=step)

    @hookimpl
    def log_finish(self, run, status):
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()

    @hookimpl
    def trainer_argument_mappings(self):
        from .mappings import TRAINER_ARGUMENTS  # for engine migrate only: runs do not load it

        return TRAINER_ARGUMENTS
