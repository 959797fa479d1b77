"""Memory: Trainer's memory metrics (``train.skip_memory_metrics = false``) and
``train.torch_empty_cache_steps``, as a builtin plugin.

For a stage (train, eval, test) run outside another one: ``{stage}_mem_cpu_alloc_delta``, the
process's resident memory at the end minus at the start, and ``{stage}_mem_cpu_peaked_delta``, how
far above the end it peaked (their sum is what the stage needed); ``_gpu_`` the same for the
accelerator's allocated memory. Names and measures are transformers' ``TrainerMemoryTracker``'s.
Training is measured from ``on_train_start`` to ``on_train_summary``; the evaluation builtin
measures its own stages with :func:`track` / :func:`finish`.

``[train]`` keys read: ``skip_memory_metrics``, ``torch_empty_cache_steps``.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine import hookimpl
from engine.config import option
from engine.util import require

_active: set[int] = set()  # runs with a stage being measured: an evaluation during training is not one


class MemoryTracker:
    def __init__(self, stage: str, process: Any) -> None:
        self.stage, self.process = stage, process
        self.accelerator = torch.accelerator.is_available()
        gc.collect()
        if self.accelerator:
            torch.accelerator.reset_peak_memory_stats()
            torch.accelerator.empty_cache()
            self.gpu_begin = torch.accelerator.memory_allocated()
        self.cpu_begin = self.cpu_peak = process.memory_info().rss
        self.watching = True
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        """Sample the resident size until stopped (the operating system keeps no resettable peak everywhere)."""
        while self.watching:
            self.cpu_peak = max(self.cpu_peak, self.process.memory_info().rss)
            time.sleep(0.0005)

    def stop(self, metrics: dict[str, Any]) -> None:
        self.watching = False
        self.watcher.join()
        gc.collect()
        cpu_now = self.process.memory_info().rss
        metrics[f"{self.stage}_mem_cpu_alloc_delta"] = cpu_now - self.cpu_begin
        metrics[f"{self.stage}_mem_cpu_peaked_delta"] = max(0, self.cpu_peak - cpu_now)
        if self.accelerator:
            torch.accelerator.empty_cache()
            gpu_now = torch.accelerator.memory_allocated()
            metrics[f"{self.stage}_mem_gpu_alloc_delta"] = gpu_now - self.gpu_begin
            metrics[f"{self.stage}_mem_gpu_peaked_delta"] = max(0, torch.accelerator.max_memory_allocated() - gpu_now)


def empty_device_cache() -> None:
    """Return the accelerator's cached, unused memory to it (torch_empty_cache_steps, a smaller batch after an
    out-of-memory error); nothing on the CPU."""
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()
        if torch.backends.mps.is_available() and hasattr(torch.mps, "clear_graph_cache"):
            torch.mps.clear_graph_cache()  # as Trainer


def track(run: Any, stage: str) -> MemoryTracker | None:
    """A tracker measuring ``stage`` from now; None when the run skips memory metrics or measures a stage already."""
    if run.config.train.skip_memory_metrics or id(run) in _active:
        return None
    psutil = require("psutil", feature="train.skip_memory_metrics = false")
    _active.add(id(run))
    return MemoryTracker(stage, psutil.Process())


def finish(run: Any, tracker: MemoryTracker | None, metrics: dict[str, Any] | None = None) -> None:
    """Stop ``tracker`` (from :func:`track`; once) and add its figures to ``metrics``."""
    if tracker is not None and tracker.watching:
        tracker.stop(metrics if metrics is not None else {})
        _active.discard(id(run))


@dataclass
class MemoryOptions:
    """``[train]`` keys of builtin.memory: memory figures and emptying the device cache."""

    torch_empty_cache_steps: int | None = option(None, min=1, help=(
        "empty the accelerator's memory cache (torch.accelerator.empty_cache) in steps 1, N+1, 2N+1 ...: less "
        "peak memory, slower steps (as Trainer's; nothing on the CPU)"))
    skip_memory_metrics: bool = option(True, help=(
        "false: train/eval/test metrics get Trainer's memory figures ({stage}_mem_cpu_alloc_delta, "
        "_peaked_delta, and _gpu_ ones on an accelerator; needs psutil; sampling the memory slows the run)"))


class Memory:
    """One instance per run: the training stage's tracker, and how often to empty the device cache."""

    TRAIN_OPTIONS = MemoryOptions  # the [train] keys it reads: engine.config.TrainConfig has them

    def __init__(self):
        self.tracker: MemoryTracker | None = None
        self.empty_cache_every = 0

    @hookimpl(tryfirst=True)  # before other plugins' on_train_start, whose allocations the stage counts
    def on_train_start(self, run):
        self.tracker = track(run, "train")
        self.empty_cache_every = run.config.train.torch_empty_cache_steps or 0

    @hookimpl(wrapper=True)
    def training_step(self, run, batches, num_items_in_batch):
        out = yield
        if self.empty_cache_every and run.state.global_step % self.empty_cache_every == 0:
            empty_device_cache()  # before the step is counted: Trainer's steps 0, N, 2N ...
        return out

    @hookimpl
    def on_train_summary(self, run, metrics):
        finish(run, self.tracker, metrics)

    @hookimpl
    def on_train_exit(self, run, status):
        finish(run, self.tracker)  # a failed run: the watcher stops
        self.tracker = None
