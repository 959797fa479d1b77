"""The engine plugin the benchmarks time runs with: when each optimizer step ended, and the losses
the run logged. ``synchronize`` (e.g. ``torch.cuda.synchronize``) runs before each timestamp so
that queued GPU work is counted in its step. ``cpu_stamps``, when given, also gets this thread's CPU
time at each step's end (``time.thread_time``: time the host took from the process is not in it)."""

from __future__ import annotations

import time
from typing import Callable

import engine


class StepClock:
    name = "step_clock"

    def __init__(self, stamps: list[float] | None = None, synchronize: Callable[[], None] | None = None,
                 cpu_stamps: list[float] | None = None):
        self.stamps = [] if stamps is None else stamps
        self.cpu_stamps = cpu_stamps
        self.losses: list[float] = []
        self.synchronize = synchronize

    @engine.hookimpl
    def on_step_end(self, run):
        if self.synchronize is not None:
            self.synchronize()
        self.stamps.append(time.perf_counter())
        if self.cpu_stamps is not None:
            self.cpu_stamps.append(time.thread_time())

    @engine.hookimpl
    def log_metrics(self, run, metrics):
        if "loss" in metrics:
            self.losses.append(metrics["loss"])
