"""engine-weighted-loss: class-weighted and label-smoothed cross-entropy, as an engine plugin.

Enable with ``plugins = ["weighted_loss"]`` and set ``[weighted_loss]``::

    [weighted_loss]
    class_weights = [1.0, 4.0, 2.0]     # one weight per class id; or {2 = 4.0} (others 1.0); or "balanced"
    label_smoothing = 0.1

It answers the ``compute_loss`` hook for causal LMs (logits [B, T, V], labels [B, T], shifted
by ``run.label_shift``) and classifiers (logits [B, C], labels [B]). Uses only engine's public
plugin API.

Normalisation. The ``compute_loss`` contract is "sum of per-item losses / num_items_in_batch"
(the number of label items in the whole accumulation window, over all processes), so that
micro-batches add up to the loss of one big batch. This plugin keeps that contract: each item's
loss is multiplied by its class's weight and the sum is divided by the number of items, not by
the sum of the weights of the targets as ``torch.nn.functional.cross_entropy(weight=...,
reduction="mean")`` does. Torch's weighted mean is a ratio whose denominator depends on which
classes a batch happens to hold: it cannot be split over micro-batches or processes (the
window's weight total is not known while its first micro-batch is computed), and it changes the
gradient's scale from batch to batch. Dividing by the item count optimises one fixed objective,
the mean of ``weight[y] * CE``, exactly the same however the window is split. The scale of the
weights matters (all weights x2 is the learning rate x2, as in Keras' ``class_weight``);
``"balanced"`` weights average 1 over the training labels, so the loss keeps the scale of the
unweighted one.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

import engine
from engine import hookimpl
from engine.loss import IGNORE_INDEX, count_items, logits_of

__version__ = "0.1.0"

PLUGIN = "weighted_loss"  # the entry-point name; also the name of the options section
KEY = f"{PLUGIN}.class_weights"

logger = logging.getLogger("engine")


# ---------------------------------------------------------------------------- options


@dataclass
class WeightedLossOptions:
    """``[weighted_loss]``: per-class weights and label smoothing of the cross-entropy."""

    class_weights: list[float] | dict[str, float] | Literal["balanced"] | None = engine.option(None, help=(
        "a weight per class: a list indexed by class id (as long as the model's classes or vocabulary), a "
        "table {id = weight} (other classes 1.0), or 'balanced' (n_items / (n_classes_present * count) from "
        "the training labels, 1.0 for absent classes); none: no weights"))
    label_smoothing: float = engine.option(0.0, min=0, below=1, help=(
        "share of each target's probability spread over all classes (torch's label_smoothing; with weights, "
        "each class's share is weighted by its own weight)"))
    apply_to_eval: bool = engine.option(True, help=(
        "also compute eval_loss with the weights and smoothing, as Trainer's compute_loss does; false: eval_loss "
        "is the plain cross-entropy, comparable across runs with different weights"))


def parse_class_weights(spec: Any) -> list[float] | dict[int, float] | str | None:
    """The validated ``class_weights`` option (table keys as ints); refuses what no model could use."""
    if spec is None or spec == "balanced":
        return spec
    if isinstance(spec, list):
        values = dict(enumerate(spec))
        if not spec:
            raise engine.ConfigError(f"{KEY}: expected one weight per class, got an empty list")
    else:
        values = {}
        for key, value in spec.items():
            text = str(key)
            if not text.isdigit():
                raise engine.ConfigError(f"{KEY}: table keys are class ids (0, 1, ...), got {key!r}")
            values[int(text)] = value
    for key, value in values.items():
        where = f"{KEY}[{key}]"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise engine.ConfigError(f"{where}: expected float, got {type(value).__name__} {value!r}")
        if not math.isfinite(value) or value < 0:
            raise engine.ConfigError(f"{where}: expected a finite float >= 0, got {value}")
    if isinstance(spec, list):
        if not any(spec):
            raise engine.ConfigError(f"{KEY}: every weight is 0, so nothing would be learned")
        return [float(value) for value in spec]
    return {key: float(value) for key, value in values.items()}


def number_of_classes(model: torch.nn.Module) -> int | None:
    """How many classes the model's logits have: its output embeddings' rows (LMs), else the
    config's ``num_labels`` (classifiers); None when the model says neither."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if output is not None and getattr(output, "weight", None) is not None:
        return int(output.weight.shape[0])
    num_labels = getattr(getattr(model, "config", None), "num_labels", None)
    return int(num_labels) if isinstance(num_labels, int) else None


def weight_vector(spec: list[float] | dict[int, float], num_classes: int) -> torch.Tensor:
    """One float32 weight per class from a list or a table, checked against ``num_classes``."""
    if isinstance(spec, list):
        if len(spec) != num_classes:
            raise engine.ConfigError(f"{KEY}: {len(spec)} weights, but the model has {num_classes} classes "
                                     f"(logits of size {num_classes}); give one weight per class id, or a table")
        return torch.tensor(spec, dtype=torch.float32)
    weights = torch.ones(num_classes, dtype=torch.float32)
    for class_id, value in spec.items():
        if class_id >= num_classes:
            raise engine.ConfigError(f"{KEY}: class id {class_id}, but the model has {num_classes} classes "
                                     f"(ids 0 to {num_classes - 1})")
        weights[class_id] = value
    if not weights.any():
        raise engine.ConfigError(f"{KEY}: every weight is 0, so nothing would be learned")
    return weights


def check_countable(dataset: Any) -> None:
    """'balanced' reads every training label once: refuse a dataset without a length (streaming)."""
    if not hasattr(type(dataset), "__len__"):
        raise engine.ConfigError(f"{KEY} = 'balanced' counts the training labels, which a dataset without a "
                                 "length (streaming) cannot give; set the weights as a list or a table")


def balanced_weights(dataset: Any, num_classes: int, shift: bool) -> torch.Tensor:
    """sklearn's "balanced" weights from the training labels: ``n / (k * count[c])`` for the ``k``
    classes present (their mean over the training labels is 1), 1.0 for absent classes."""
    check_countable(dataset)
    size = len(dataset)
    counts = torch.zeros(num_classes, dtype=torch.long)
    for index in range(size):
        row = dataset[index]
        labels = row.get("labels", row.get("label")) if isinstance(row, dict) else None
        if labels is None:
            raise engine.ConfigError(f"{KEY} = 'balanced': training row {index} has no 'labels' or 'label' to "
                                     "count; set the weights as a list or a table")
        labels = torch.as_tensor(labels)
        if labels.is_floating_point():
            raise engine.ConfigError(f"{KEY} = 'balanced': the labels are floats, not class ids")
        if shift:
            labels = labels[..., 1:]
        labels = labels[labels != IGNORE_INDEX].reshape(-1)
        if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
            raise engine.ConfigError(f"{KEY} = 'balanced': training row {index} has a label outside 0 to "
                                     f"{num_classes - 1} (the model's classes)")
        counts += torch.bincount(labels, minlength=num_classes)
    present = counts > 0
    if not present.any():
        raise engine.ConfigError(f"{KEY} = 'balanced': the training data has no labels to count")
    weights = torch.ones(num_classes, dtype=torch.float32)
    weights[present] = counts.sum() / (present.sum() * counts[present].float())
    return weights


# ---------------------------------------------------------------------------- the loss


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None,
                           label_smoothing: float, shift: bool, num_items_in_batch: Any = None) -> torch.Tensor:
    """``sum(weight[y] * CE) / num_items_in_batch`` (else / this batch's label count), as the
    ``compute_loss`` contract asks. ``shift``: labels are unshifted (position i predicts i+1)."""
    denominator = num_items_in_batch if num_items_in_batch is not None else count_items(labels, shift)
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), weight=weight,
        ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing, reduction="sum")
    return total / denominator


class WeightedLoss:
    """The plugin; the entry point names this class, so each run gets its own weights."""

    name = PLUGIN  # so engine.Run(plugins=[WeightedLoss()]) files it under "weighted_loss" too

    def __init__(self):
        self.spec: list[float] | dict[int, float] | str | None = None
        self.weight: torch.Tensor | None = None  # per class; None: unweighted (or not known yet)
        self.active = False  # False: nothing to weight or smooth, the builtin loss answers
        self.label_smoothing = 0.0
        self.apply_to_eval = True

    @hookimpl
    def plugin_options(self):
        return WeightedLossOptions

    @hookimpl
    def configure(self, run):
        options = run.config.section(PLUGIN)
        if run.config.train.label_smoothing_factor:
            raise engine.ConfigError(
                f"train.label_smoothing_factor: the {PLUGIN} plugin computes the loss; set "
                f"{PLUGIN}.label_smoothing = {run.config.train.label_smoothing_factor} instead (and "
                "train.label_smoothing_factor = 0)")
        self.spec = parse_class_weights(options.class_weights)
        self.label_smoothing, self.apply_to_eval = options.label_smoothing, options.apply_to_eval
        uniform = self.spec is None or (self.spec != "balanced" and all(
            value == 1.0 for value in (self.spec if isinstance(self.spec, list) else self.spec.values())))
        self.active = not uniform or options.label_smoothing > 0
        if self.spec == "balanced" and run.train_dataset is not None:  # given to Run(train_dataset=...)
            check_countable(run.train_dataset)
        if run.model is not None:  # given to Run(model=...): check the weights against it now
            self._fit(run.model)

    @hookimpl
    def patch_model(self, run, model):
        """The model built from the config is known from here on: fit the weights to it."""
        self._fit(model)
        if self.spec == "balanced":
            num_classes = number_of_classes(model)
            if num_classes is None:
                raise engine.ConfigError(f"{KEY} = 'balanced' needs the number of classes, which the model "
                                         "does not say (no output embeddings, no config.num_labels); set the "
                                         "weights as a list")
            self.weight = balanced_weights(run.train_dataset, num_classes, run.label_shift)
            shown = [round(w, 4) for w in self.weight.tolist()]
            logger.info("%s: balanced class weights %s", PLUGIN, shown if len(shown) <= 16 else
                        f"from {min(shown)} to {max(shown)} over {len(shown)} classes")
        return None  # nothing to undo

    def _fit(self, model: torch.nn.Module) -> None:
        num_classes = number_of_classes(model)
        if num_classes is not None and isinstance(self.spec, (list, dict)):
            self.weight = weight_vector(self.spec, num_classes)

    @hookimpl
    def compute_loss(self, run, model, batch, num_items_in_batch):
        labels = batch.get("labels")
        if not self.active or labels is None:
            return None  # the builtin loss answers
        if not model.training and not self.apply_to_eval:
            return None
        if labels.is_floating_point():
            raise engine.ConfigError(f"{PLUGIN}: the labels are floats (regression or multi-label targets); "
                                     "class weights and label smoothing need class ids")
        outputs = model(**{key: value for key, value in batch.items() if key != "labels"})
        logits = logits_of(outputs)
        num_classes = logits.shape[-1]
        if self.weight is None and isinstance(self.spec, (list, dict)):  # a model that did not say
            self.weight = weight_vector(self.spec, num_classes)
        weight = self.weight
        if weight is not None:
            if weight.numel() != num_classes:
                raise engine.ConfigError(f"{KEY}: {weight.numel()} weights, but the model's logits have "
                                         f"{num_classes} classes")
            if weight.device != logits.device:
                self.weight = weight = weight.to(logits.device)
        return weighted_cross_entropy(logits, labels, weight, self.label_smoothing, run.label_shift,
                                      num_items_in_batch)
