"""``train.auto_find_batch_size``: after an out-of-memory error in a training step, the run starts
again with a smaller batch, until one fits.

As Trainer does it through accelerate's ``find_executable_batch_size``: the errors that count are
accelerate's (CUDA/XPU/MPS/HPU out of memory, the CPU allocator failing, cuDNN's not-supported); each
retry multiplies ``per_device_train_batch_size`` by 0.9 (rounded down); the evaluation batch is not
changed; the batch size found is kept in checkpoints and a resume continues with it
(:func:`engine.checkpoint.validate`).

Unlike Trainer, which goes on from the weights the failed attempt had reached, a retry starts
exactly where the run started: the trainable weights, buffers and RNG as they were before the first
step (or the resumed checkpoint, loaded again), a fresh optimizer, scheduler and progress, and the
failed attempt's checkpoints removed. The run then equals one started with the batch size that fit.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import checkpoint
from .memory import empty_device_cache
from .errors import ConfigError
from .state import Control, TrainState

if TYPE_CHECKING:
    from .run import Run

logger = logging.getLogger("engine")

# accelerate's should_reduce_batch_size: the messages of the errors a smaller batch may avoid
_OUT_OF_MEMORY = (" out of memory.", "MPS backend out of memory", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                  "DefaultCPUAllocator: can't allocate memory", "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed")
SHRINK = 0.9  # accelerate's factor (its older releases halved)


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and len(exc.args) == 1 and isinstance(exc.args[0], str) and \
        any(statement in exc.args[0] for statement in _OUT_OF_MEMORY)


class StepOutOfMemory(Exception):
    """A training step ran out of memory (the loop raises it so only the training step's errors retry)."""


def check(run: Run) -> None:
    """Refuse what a restart cannot start again; called once the strategy is set up."""
    if not run.config.train.auto_find_batch_size:
        return
    if run.strategy.world_size > 1:
        raise ConfigError("train.auto_find_batch_size runs on one process only: with several, one process running "
                          "out of memory leaves the others waiting; set per_device_train_batch_size to one that fits")
    from .builtin.optimizers import GIVEN

    given = run.plugin_manager.pm.get_plugin(GIVEN)
    if given is not None and given.optimizer is not None:
        raise ConfigError("train.auto_find_batch_size: Run(optimizers=(optimizer, scheduler)) objects keep their "
                          "state, so the run cannot start again with them; pass optimizer_cls_and_kwargs instead")


class Restart:
    """What the run was before its first step, kept to start it again with a smaller batch."""

    def __init__(self, run: Run, resume_from: Path | None):
        self.run, self.resume_from = run, resume_from
        self.start_step = run.state.global_step
        self.rng = checkpoint.rng_state()
        # trainable weights and buffers only (the rest cannot change): for an adapter, a small copy
        self.tensors = {name: t.detach().to("cpu", copy=True) for name, t in _changing(run.model)}

    def with_smaller_batch(self, error: BaseException) -> None:
        run = self.run
        train = run.config.train
        size = train.per_device_train_batch_size
        smaller = int(size * SHRINK)
        if smaller == 0:
            raise ConfigError(f"train.auto_find_batch_size: no batch size fits, even 1 ran out of memory ({error})")
        logger.warning("train.auto_find_batch_size: per_device_train_batch_size %d ran out of memory at step %d; "
                       "starting again with %d", size, run.state.global_step + 1, smaller)
        run.optimizer.zero_grad(set_to_none=True)
        run.optimizer = run.scheduler = None
        gc.collect()
        empty_device_cache()
        for path in checkpoint.list_checkpoints(run.output_dir, run.run_id):
            if checkpoint.saved_progress(path)[0] > self.start_step:  # made with the batch that did not fit
                logger.info("train.auto_find_batch_size: removing %s of the failed attempt", path.name)
                checkpoint.delete_folder(path)
        with torch.no_grad():
            for name, tensor in _changing(run.model):
                tensor.copy_(self.tensors[name])
        train.per_device_train_batch_size = smaller
        _reset(run.state, TrainState())
        _reset(run.control, Control())
        run.prepare_training()
        run.state.max_steps = run.num_training_steps
        if self.resume_from is not None:
            checkpoint.load(run, self.resume_from)  # weights, optimizer, scheduler, RNG, progress
        else:
            checkpoint.set_rng_state(self.rng)


def _changing(model: torch.nn.Module):
    yield from ((name, p) for name, p in model.named_parameters() if p.requires_grad)
    yield from model.named_buffers()


def _reset(record: object, fresh: object) -> None:
    """Set a record's fields to a fresh one's, in place (the loop and plugins hold the object)."""
    vars(record).update(vars(fresh))
