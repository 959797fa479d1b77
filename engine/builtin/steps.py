"""The default optimisation step and train/eval mode switches."""

from __future__ import annotations

import contextlib

from engine import hookimpl
from engine.run import StepOutput

_NO_CONTEXT = contextlib.nullcontext()


@hookimpl(trylast=True)
def training_step(run, batches, num_items_in_batch):
    strategy, model, optimizer = run.strategy, run.wrapped_model, run.optimizer
    compute_loss = run.hook.compute_loss
    last = len(batches) - 1
    total = None
    for index, batch in enumerate(batches):
        # gradients are synchronised (DDP) only on the window's last micro-batch
        with strategy.no_sync(model) if index < last else _NO_CONTEXT:
            with strategy.autocast():
                loss = compute_loss(run=run, model=model, batch=batch, num_items_in_batch=num_items_in_batch)
            if num_items_in_batch is None and len(batches) > 1:
                loss = loss / len(batches)
            strategy.backward(loss)
        total = loss.detach() if total is None else total + loss.detach()
    max_norm = run.config.train.max_grad_norm
    grad_norm = strategy.clip_grad_norm(optimizer, max_norm) if max_norm > 0 else None
    strategy.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return StepOutput(total, grad_norm)


@hookimpl
def on_train_mode(run):
    run.model.train()


@hookimpl
def on_eval_mode(run):
    run.model.eval()
