"""The loop's logging interval: each step's loss and gradient norm kept on the device until the loop reads
them anyway, their sums over the interval and the run, the input tokens seen, skipped updates, and
the divergence check (a nan or inf found there stops the run with ``TrainingDiverged``)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from .checkpoint import diverged
from .errors import PluginError
from .state import RunView

logger = logging.getLogger("engine")


class Interval:
    """Sums over the current logging interval, and the divergence check.

    Each step's loss and gradient norm stay on the device (no host sync per step) until the loop
    reads them anyway: a log step, an evaluation, a save, the end (or every ``READ_EVERY``
    steps). They are copied into one preallocated buffer each: keeping every step's own small
    tensor alive instead pinned a fresh spot of the heap per step, and the allocator then paid
    about a hundred page faults a step on the CPU (1.5 ms of a 27 ms step). At a read they
    are read in one go and checked: the first nan or inf is kept, and
    :meth:`stop_if_diverged` raises it. With fp16 loss scaling, non-finite gradient norms are
    the scaler's business (it skips those steps), so only the loss counts then.
    """

    READ_EVERY = 1000  # a long logging interval keeps no long list of tensors

    def __init__(self, run: RunView):
        self.run = run
        self.state = run.state
        self.check_grad_norm = not run.strategy.scales_loss
        self.log_skipped = run.config.train.on_nonfinite == "skip"
        self.log_tokens_seen = run.config.train.include_num_input_tokens_seen != "no"
        self.non_padding = run.config.train.include_num_input_tokens_seen == "non_padding"  # a tensor sum: no host sync
        self.pending_steps: list[int] = []
        self.pending_norms: list[Any] = []  # a number, None, or _ON_DEVICE (the norm is in self.norms)
        self.losses: torch.Tensor | None = None  # READ_EVERY slots, allocated at the first step
        self.norms: torch.Tensor | None = None
        self.divergence: tuple[str, int] | None = None
        self.count = 0  # steps since the last flush, skipped ones included
        self.loss = 0.0
        self.steps = 0  # steps read and summed into self.loss
        self.tokens = 0
        self.grad_norm: float | None = None
        self.started = time.perf_counter()
        self.total_loss = 0.0
        self.total_steps = 0
        self.skipped_in_a_row = 0  # updates skipped (train.on_nonfinite = "skip")

    def add(self, out: Any) -> None:
        self.count += 1
        if out.skipped:  # its loss is nan or inf: not part of the interval's mean
            self.skipped_in_a_row += 1
            _note_skipped(self.run, out, self.skipped_in_a_row)
            return
        self.skipped_in_a_row = 0
        slot = len(self.pending_steps)
        self.losses = _slots(self.losses, out.loss, self.READ_EVERY)
        self.losses[slot].copy_(out.loss.detach())
        norm = out.grad_norm
        if isinstance(norm, torch.Tensor):
            self.norms = _slots(self.norms, norm, self.READ_EVERY)
            self.norms[slot].copy_(norm.detach())
            norm = _ON_DEVICE
        self.pending_steps.append(self.state.global_step)
        self.pending_norms.append(norm)
        if slot + 1 >= self.READ_EVERY:
            self.read()

    def read(self) -> None:
        """Move the pending values to the host (one sync) and look for the first non-finite one."""
        count = len(self.pending_steps)
        if not count:
            return
        steps, norms = self.pending_steps, self.pending_norms
        self.pending_steps, self.pending_norms = [], []
        # the mean over processes: every process logs and decides on the same numbers
        loss_values = self.run.strategy.reduce(self.losses[:count].clone(), "mean").tolist()
        on_device = self.norms[:count].tolist() if _ON_DEVICE in norms else None
        norm_values = [on_device[i] if norm is _ON_DEVICE else None if norm is None else float(norm)
                       for i, norm in enumerate(norms)]
        for step, loss, norm in zip(steps, loss_values, norm_values):
            if self.divergence is not None:
                break
            if not math.isfinite(loss):
                self.divergence = (f"the loss is {loss}", step)
            elif self.check_grad_norm and norm is not None and not math.isfinite(norm):
                self.divergence = (f"the gradient norm is {norm}", step)
        self.loss += sum(loss_values)
        self.steps += len(loss_values)
        if norm_values[-1] is not None:
            self.grad_norm = norm_values[-1]

    def stop_if_diverged(self) -> None:
        self.read()
        if self.divergence is not None:
            what, step = self.divergence
            raise diverged(self.run, what, step)

    def flush(self, lr: float) -> dict[str, float]:
        self.read()
        now = time.perf_counter()
        elapsed = now - self.started
        loss = self.loss / self.steps if self.steps else math.nan
        self.total_loss += self.loss
        self.total_steps += self.steps
        tokens = self.count_tokens()
        metrics = {"loss": round(loss, 6), "learning_rate": lr}
        if self.grad_norm is not None:
            metrics["grad_norm"] = round(self.grad_norm, 6)
        metrics.update({
            "tokens_per_second": round(tokens / elapsed, 1) if elapsed else 0.0,
            "step_time": round(elapsed / max(self.count, 1), 6),
            "epoch": round(self.state.epoch, 4),
        })
        if self.log_tokens_seen:
            metrics["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        if self.log_skipped:
            metrics["skipped_steps"] = self.state.num_skipped_steps
        metrics.update(collected_metrics(self.run, ""))
        self.state.log_history.append({"step": self.state.global_step, **metrics})
        self.loss, self.steps, self.count, self.started = 0.0, 0, 0, now
        return metrics

    def count_tokens(self) -> int:
        """Move this interval's input tokens (every process's) to ``state.num_input_tokens_seen``."""
        tokens = self.tokens
        if self.run.strategy.world_size > 1:  # a sync, where the loop syncs anyway
            tokens = self.run.strategy.reduce(torch.as_tensor(tokens, dtype=torch.float64), "sum")
        self.tokens = 0
        self.state.num_input_tokens_seen += int(tokens)
        return int(tokens)

    @property
    def mean_loss(self) -> float:
        steps = self.total_steps + self.steps  # with the steps read but not logged (logging_strategy "no")
        return round((self.total_loss + self.loss) / steps, 6) if steps else float("nan")


def collected_metrics(run: RunView, prefix: str) -> dict[str, float]:
    """The plugins' ``collect_metrics`` for a row, merged under ``prefix`` (``eval_<key>``); a key twice refused."""
    rows = [{f"{prefix}_{k}" if prefix else k: v for k, v in found.items()}
            for found in run.hook.collect_metrics(run=run, prefix=prefix)]
    merged = {key: value for row in rows for key, value in row.items()}
    if len(merged) < sum(map(len, rows)):
        raise PluginError(f"two plugins log one key ({rows}, collect_metrics); enable one of them")
    return merged


_ON_DEVICE = object()  # a pending gradient norm that is in Interval.norms


def _slots(buffer: torch.Tensor | None, value: torch.Tensor, size: int) -> torch.Tensor:
    """``buffer``, or (at the first step) ``size`` float32 slots on ``value``'s device."""
    return torch.empty(size, dtype=torch.float32, device=value.device) if buffer is None else buffer


def _note_skipped(run: RunView, out: Any, in_a_row: int) -> None:
    """Count a skipped update (``on_nonfinite = "skip"``); stop after too many in a row."""
    state, limit = run.state, run.config.train.max_skipped_in_a_row
    state.num_skipped_steps += 1
    norm = "-" if out.grad_norm is None else float(out.grad_norm)
    logger.warning("step %d: loss %s, gradient norm %s: update skipped (%d in a row, %d in total)",
                   state.global_step, float(out.loss), norm, in_a_row, state.num_skipped_steps)
    if in_a_row >= limit:
        raise diverged(run, f"{in_a_row} updates in a row had a nan or inf loss or gradient norm "
                                       f"(train.max_skipped_in_a_row = {limit})")
