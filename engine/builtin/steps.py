"""The default optimisation step and train/eval mode switches."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from engine import hookimpl
from engine.config import option
from engine.errors import ConfigError
from engine.state import StepOutput

_NO_CONTEXT = contextlib.nullcontext()


@dataclass
class StepOptions:
    """``[train]`` keys of builtin.steps (a plugin stepping in its place, or a layer-wise optimizer, reads
    them too)."""

    max_grad_norm: float = option(1.0, shared=True, min=0, help="clip the global gradient norm to this; 0 disables")


TRAIN_OPTIONS = StepOptions  # the [train] keys it reads: engine.config.TrainConfig has them


@hookimpl
def configure(run):
    if run.config.train.on_nonfinite != "skip":
        return
    # skipping means deciding between backward and the update: only this step can do that
    owners = run.plugin_manager.plugins_answering("training_step")
    if owners:
        raise ConfigError(f"train.on_nonfinite = 'skip': plugin {owners[0]!r} runs its own training step, "
                          "which cannot skip an update; use on_nonfinite = 'stop'")


@hookimpl(trylast=True)
def training_step(run, batches, num_items_in_batch):
    strategy, model, optimizer = run.strategy, run.wrapped_model, run.optimizer
    compute_loss = run.hook.compute_loss
    train = run.config.train
    last = len(batches) - 1
    # a loss over the global batch's item count: processes' gradients are averaged, so scale it
    scale = strategy.world_size if num_items_in_batch is not None and strategy.world_size > 1 else 1
    total = None
    for index, batch in enumerate(batches):
        # gradients are synchronised (DDP) only on the window's last micro-batch
        with strategy.no_sync(model) if index < last else _NO_CONTEXT:
            with strategy.autocast():
                loss = compute_loss(run=run, model=model, batch=batch, num_items_in_batch=num_items_in_batch)
            if num_items_in_batch is None and len(batches) > 1:
                loss = loss / len(batches)
            if scale != 1:
                loss = loss * scale
            strategy.backward(loss)
        total = loss.detach() if total is None else total + loss.detach()
    skip = train.on_nonfinite == "skip"
    max_norm = train.max_grad_norm
    grad_norm = None
    if max_norm > 0 or skip:  # skipping needs the norm even without clipping (inf: measure only)
        grad_norm = strategy.clip_grad_norm(optimizer, max_norm if max_norm > 0 else math.inf)
    if skip and not _finite(total, None if strategy.scales_loss else grad_norm, strategy):  # one host sync
        if strategy.scales_loss:
            strategy.optimizer_step(optimizer)  # the loss scaler skips it and lowers its scale
        optimizer.zero_grad(set_to_none=True)
        return StepOutput(total, grad_norm, skipped=True)
    norm_in_step = strategy.optimizer_step(optimizer)  # DeepSpeed clips inside its step
    if norm_in_step is not None:
        grad_norm = norm_in_step
    optimizer.zero_grad(set_to_none=True)
    return StepOutput(total, grad_norm)


def _finite(loss, grad_norm, strategy) -> bool:
    finite = torch.isfinite(loss)
    if grad_norm is not None:
        finite = finite & torch.isfinite(torch.as_tensor(grad_norm, device=finite.device))
    # decided together: a process that skipped alone would leave the others' weights behind
    return bool(strategy.reduce(finite.float(), "min"))


@hookimpl
def on_train_mode(run):
    run.model.train()


@hookimpl
def on_eval_mode(run):
    run.model.eval()
