"""The default loss: the model's own loss, else token cross-entropy with label smoothing.

Normalisation follows the ``compute_loss`` contract: summed over label tokens and divided by
``num_items_in_batch`` when given (gradient accumulation then adds up exactly to the mean over
the whole window), else the mean over this batch.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from engine import hookimpl
from engine.config import option
from engine.loss import IGNORE_INDEX, count_items, logits_of


@dataclass
class LossOptions:
    """``[train]`` keys of builtin.loss: the default loss."""

    label_smoothing_factor: float = option(0.0, shared=True, min=0, below=1,
                                           help="label smoothing for the default loss")


TRAIN_OPTIONS = LossOptions  # the [train] keys it reads: engine.config.TrainConfig has them


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
    if labels is None and _loss_of(outputs) is not None:  # e.g. question answering's start/end_positions
        return _loss_of(outputs)
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


PLUGIN_LOSS_FUNC = "builtin.compute_loss_func"


class ComputeLossFunc:
    """``Run(compute_loss_func=...)``: Trainer's ``compute_loss_func(outputs, labels, num_items_in_batch)``.

    Called as Trainer calls it: the labels are taken out of the batch, the model runs on the rest,
    and the function gets its outputs, the labels and the label count of the window (of this batch
    when the engine passes none). Registered only when given; it answers ``compute_loss`` first.
    """

    def __init__(self, function):
        self.function = function

    @hookimpl
    def compute_loss(self, run, model, batch, num_items_in_batch):
        if "labels" not in batch:
            return None  # as Trainer: the model's own loss
        inputs = dict(batch)
        labels = inputs.pop("labels")
        if num_items_in_batch is None:
            num_items_in_batch = count_items(labels, run.label_shift)
        return self.function(model(**inputs), labels, num_items_in_batch=num_items_in_batch)
