"""``train.auto_find_batch_size``, as a builtin plugin: after an out-of-memory error in a training
step, the run starts again with a smaller batch, until one fits.

As Trainer does it through accelerate's ``find_executable_batch_size``: the errors that count are
accelerate's (CUDA/XPU/MPS/HPU out of memory, the CPU allocator failing, cuDNN's not-supported); each
retry multiplies ``per_device_train_batch_size`` by 0.9 (rounded down); the evaluation batch is not
changed; the batch size found is kept in checkpoints and a resume continues with it
(:func:`engine.builtin.resume.check_checkpoint`).

Unlike Trainer, which goes on from the weights the failed attempt had reached, a retry starts
exactly where the run started: the step sets the smaller batch size and raises
:class:`engine.errors.RestartTraining`; the loop resets the run's progress, makes a fresh loader,
optimizer and scheduler, and every plugin puts its own state back (``on_restart``): here the
trainable weights, buffers and RNG as they were before the first step, the failed attempt's
checkpoints removed; a resumed checkpoint is then loaded again. The run then equals one started
with the batch size that fit.

``[train]`` keys read: ``auto_find_batch_size``, ``per_device_train_batch_size``.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

import torch

from engine import hookimpl
from engine.builtin.memory import empty_device_cache
from engine.builtin.optimizers import GIVEN
from engine.checkpoint import delete_folder, list_checkpoints, rng_state, saved_progress, set_rng_state
from engine.config import option
from engine.errors import ConfigError, RestartTraining
from engine.rundir import env_rank

logger = logging.getLogger("engine")

# accelerate's should_reduce_batch_size: the messages of the errors a smaller batch may avoid
_OUT_OF_MEMORY = (" out of memory.", "MPS backend out of memory", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                  "DefaultCPUAllocator: can't allocate memory", "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed")
SHRINK = 0.9  # accelerate's factor (its older releases halved)


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and len(exc.args) == 1 and isinstance(exc.args[0], str) and \
        any(statement in exc.args[0] for statement in _OUT_OF_MEMORY)


class Start:
    """What the run was before its first step, kept to start it again with a smaller batch."""

    def __init__(self, run):
        self.step = run.state.global_step
        self.rng = rng_state()
        # trainable weights and buffers only (the rest cannot change): for an adapter, a small copy
        self.tensors = {name: t.detach().to("cpu", copy=True) for name, t in _changing(run.model)}

    def restore(self, run) -> None:
        for path in list_checkpoints(run.output_dir, run.run_id):
            if saved_progress(path)[0] > self.step:  # made with the batch that did not fit
                logger.info("train.auto_find_batch_size: removing %s of the failed attempt", path.name)
                delete_folder(path)
        with torch.no_grad():
            for name, tensor in _changing(run.model):
                tensor.copy_(self.tensors[name])
        set_rng_state(self.rng)  # a resumed run's checkpoint, loaded again, sets its own


@dataclass
class AutoBatchOptions:
    """``[train]`` keys of builtin.autobatch: retrying with a smaller batch on out-of-memory."""

    auto_find_batch_size: bool = option(False, help=(
        "on an out-of-memory error in a training step, start the run again with per_device_train_batch_size "
        "x 0.9 (as Trainer through accelerate), until one fits; one process only"))


class AutoBatch:
    """One instance per run: the run as it started."""

    TRAIN_OPTIONS = AutoBatchOptions  # the [train] keys it reads: engine.config.TrainConfig has them

    def __init__(self):
        self.start: Start | None = None

    @hookimpl
    def configure(self, run):
        """Refuse what a restart cannot start again."""
        if not run.config.train.auto_find_batch_size:
            return
        world = env_rank("WORLD_SIZE") if "WORLD_SIZE" in os.environ else 1
        if world > 1:
            raise ConfigError("train.auto_find_batch_size runs on one process only: with several, one process "
                              "running out of memory leaves the others waiting; set per_device_train_batch_size "
                              "to one that fits")
        given = run.plugin_manager.pm.get_plugin(GIVEN)
        if given is not None and given.optimizer is not None:
            raise ConfigError("train.auto_find_batch_size: Run(optimizers=(optimizer, scheduler)) objects keep "
                              "their state, so the run cannot start again with them; pass optimizer_cls_and_kwargs "
                              "instead")

    @hookimpl(tryfirst=True)  # before the first step and any plugin's use of the RNG in it
    def on_epoch_start(self, run):
        if run.config.train.auto_find_batch_size and self.start is None:
            self.start = Start(run)

    @hookimpl(wrapper=True)
    def training_step(self, run, batches, num_items_in_batch):
        try:  # free unless raised (zero-cost exceptions)
            return (yield)
        except RuntimeError as exc:
            if self.start is None or not is_out_of_memory(exc):
                raise
            train = run.config.train
            size = train.per_device_train_batch_size
            smaller = int(size * SHRINK)
            if smaller == 0:
                raise ConfigError(f"train.auto_find_batch_size: no batch size fits, even 1 ran out of memory "
                                  f"({exc})") from exc
            logger.warning("train.auto_find_batch_size: per_device_train_batch_size %d ran out of memory at step "
                           "%d; starting again with %d", size, run.state.global_step + 1, smaller)
            train.per_device_train_batch_size = smaller  # the loader the loop makes again takes it
            raise RestartTraining(f"per_device_train_batch_size {size} ran out of memory") from exc

    @hookimpl
    def on_restart(self, run):
        if self.start is not None:
            gc.collect()  # the failed attempt's tensors
            empty_device_cache()
            self.start.restore(run)

    @hookimpl
    def on_train_exit(self, run, status):
        self.start = None


def _changing(model: torch.nn.Module):
    yield from ((name, p) for name, p in model.named_parameters() if p.requires_grad)
    yield from model.named_buffers()
