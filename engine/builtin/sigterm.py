"""The SIGTERM checkpoint (``train.enable_jit_checkpoint``), as a builtin plugin.

What preemptible clusters send before they kill a job: a SIGTERM asks for a checkpoint at the end
of the current step. The step's log, evaluation and save happen as scheduled, the checkpoint is
written, and the run ends with :class:`engine.errors.TrainingPreempted` (exit status 143); it
continues from there with ``train.resume_from_checkpoint = true``.

With several processes, the flag is summed over them every step (one small all-reduce), so all
save the same step even when the signal reaches them at different moments.

``[train]`` key read: ``enable_jit_checkpoint``.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from typing import Any

import torch

from engine import hookimpl
from engine.config import option
from engine.errors import TrainingPreempted


@dataclass
class SigtermOptions:
    """``[train]`` keys of builtin.sigterm: a checkpoint on SIGTERM."""

    enable_jit_checkpoint: bool = option(False, help=(
        "a SIGTERM saves a checkpoint at the end of the current step and stops the run (exit status 143), "
        "resumable with resume_from_checkpoint = true"))


class Sigterm:
    """One instance per run: the handler installed for training, and whether the signal came."""

    TRAIN_OPTIONS = SigtermOptions  # the [train] keys it reads: engine.config.TrainConfig has them

    def __init__(self):
        self.installed = False
        self.received = False
        self.previous: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    @hookimpl
    def on_train_start(self, run):
        if not run.config.train.enable_jit_checkpoint:
            return
        self.installed, self.received = True, False
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self.previous = signal.signal(signal.SIGTERM, self._handle)

    @hookimpl
    def on_step_end(self, run):
        if self.installed and self._received_anywhere(run.strategy):
            step = run.state.global_step
            run.control.request_abort(TrainingPreempted(
                f"stopped by SIGTERM at step {step} (train.enable_jit_checkpoint): saved "
                f"{run.output_dir / f'checkpoint-{step}'}; resume with train.resume_from_checkpoint = true"))

    def _received_anywhere(self, strategy: Any) -> bool:
        if strategy.world_size == 1:
            return self.received
        return bool(strategy.reduce(torch.tensor(float(self.received), device=strategy.device), "sum") > 0)

    @hookimpl
    def on_train_exit(self, run, status):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
        self.installed, self.previous = False, None
