"""The default loss: the model's own loss, else token cross-entropy with label smoothing.

Normalisation follows the ``compute_loss`` contract: summed over label tokens and divided by
``num_items_in_batch`` when given (gradient accumulation then adds up exactly to the mean over
the whole window), else the mean over this batch.
"""

from __future__ import annotations

import functools
import inspect

import torch

from engine import hookimpl
from engine.loss import IGNORE_INDEX, count_items, logits_of


@functools.lru_cache(maxsize=None)
def _accepts_labels(model_type: type) -> bool:
    params = inspect.signature(model_type.forward).parameters.values()
    return any(p.name == "labels" or p.kind is p.VAR_KEYWORD for p in params)


def _loss_of(outputs):
    if isinstance(outputs, torch.Tensor):
        return None
    return outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)


@hookimpl(trylast=True)
def compute_loss(run, model, batch, num_items_in_batch):
    smoothing = run.config.train.label_smoothing_factor
    labels = batch.get("labels")
    own_loss = labels is not None and smoothing == 0 and _accepts_labels(type(run.model))
    if own_loss:
        outputs = model(**batch)
        loss = _loss_of(outputs)
        if loss is not None:
            if num_items_in_batch is None:
                return loss
            # the model's loss is a mean over this batch's items: rescale to sum / window items
            return loss * (count_items(labels, run.label_shift) / num_items_in_batch)
    else:
        outputs = model(**{k: v for k, v in batch.items() if k != "labels"})
    if labels is None:
        raise ValueError("the batch has no 'labels' and the model returned no loss; "
                         "add labels to the data or a loss plugin")
    logits = logits_of(outputs)
    if run.label_shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
        ignore_index=IGNORE_INDEX, label_smoothing=smoothing, reduction="sum")
    denominator = num_items_in_batch if num_items_in_batch is not None else labels.ne(IGNORE_INDEX).sum()
    return loss / denominator
