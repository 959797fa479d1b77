"""Metrics for ``train.compute_metrics`` (``"engine.metrics:accuracy"``), one per task.

Each takes what Trainer's ``compute_metrics`` takes, an :class:`EvalPrediction` of numpy arrays
(predictions, label_ids; also ``engine.EvalPrediction``), and returns a dict of floats; labels of
-100 are not counted.
"""

from __future__ import annotations

from typing import Any

IGNORE_INDEX = -100


class EvalPrediction(tuple):
    """``(predictions, label_ids)`` as numpy arrays, like transformers.EvalPrediction; then ``inputs`` and
    ``losses`` when train.include_for_metrics asks for them."""

    def __new__(cls, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None):
        prediction = super().__new__(cls, (predictions, label_ids, *(v for v in (inputs, losses) if v is not None)))
        prediction.inputs, prediction.losses = inputs, losses
        return prediction

    @property
    def predictions(self) -> Any:
        return self[0]

    @property
    def label_ids(self) -> Any:
        return self[1]


def accuracy(prediction: Any) -> dict[str, float]:
    """Sequence classification: the share of examples whose highest logit is their label."""
    predicted = prediction.predictions.argmax(-1)
    labels = prediction.label_ids
    keep = labels != IGNORE_INDEX
    return {"accuracy": float((predicted[keep] == labels[keep]).mean())}


def token_f1(prediction: Any) -> dict[str, float]:
    """Token classification, per sub-word with a label: micro precision, recall and F1 of the tags
    other than class 0 (the outside tag, O), and the accuracy over all labelled tokens."""
    predicted = prediction.predictions.argmax(-1)
    labels = prediction.label_ids
    keep = labels != IGNORE_INDEX
    predicted, labels = predicted[keep], labels[keep]
    hits = float(((predicted == labels) & (labels != 0)).sum())
    found, wanted = float((predicted != 0).sum()), float((labels != 0).sum())
    precision = hits / found if found else 0.0
    recall = hits / wanted if wanted else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1,
            "token_accuracy": float((predicted == labels).mean()) if len(labels) else 0.0}


def exact_match(prediction: Any) -> dict[str, float]:
    """Seq2seq with ``predict_with_generate``: the share of examples whose generated ids, after the
    decoder's start token, begin with the whole target (its eos included)."""
    generated, labels = prediction.predictions, prediction.label_ids
    matches = 0
    for row, target in zip(generated, labels):
        target = target[target != IGNORE_INDEX]
        matches += len(row) > len(target) and bool((row[1 : 1 + len(target)] == target).all())
    return {"exact_match": matches / len(labels) if len(labels) else 0.0}
