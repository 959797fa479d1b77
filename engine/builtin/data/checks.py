"""Rows of token ids checked before training: ids within the model's vocabulary, lengths within its
positions, labels of the right shape, examples with a token to learn.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, NamedTuple

import torch

from engine.errors import ConfigError
from engine.kit.models import max_positions
from engine.loss import IGNORE_INDEX

from .collators import LABEL_KEYS
from .sources import BadRow, _a, column_names, logger


MAP_BATCH_SIZE = 1000  # Dataset.map's default batch: concatenate-packing cuts within one


class ModelLimits(NamedTuple):
    """What token rows must fit: ids below ``vocab_size`` (the model's embedding rows) and at most
    ``positions`` tokens (with the config attribute that says so); None: not known."""

    vocab_size: int | None
    positions: tuple[int, str] | None


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _described(value: Any) -> str:
    if value is None:
        return "nothing (null, or the row lacks it)"
    if isinstance(value, list):
        odd = next((v for v in value if not isinstance(v, int) or isinstance(v, bool)), None)
        return f"{_a(odd)} ({odd!r}) among its values"
    return _a(value)


def token_row_problem(row: dict[str, Any], task: str, limits: ModelLimits | None = None) -> str | None:
    """Why a row of token ids cannot be trained on (None: it can). The labels (under the first of
    :data:`LABEL_KEYS` the row has, as the collators read them) of a causal LM or token classifier are
    one per token (-100: no loss); seq2seq labels are target ids of any length; a sequence
    classifier's are one class id (or float) per row."""
    ids = row.get("input_ids")
    if not _int_list(ids):
        return f"'input_ids' holds {_described(ids)}, expected a list of token ids (ints)"
    if not ids:
        return "'input_ids' is empty"
    if min(ids) < 0:
        return f"'input_ids' holds the negative id {min(ids)}; token ids start at 0"
    for name in ("attention_mask", "position_ids"):
        if row.get(name) is not None and (not isinstance(row[name], list) or len(row[name]) != len(ids)):
            return f"{name!r} does not hold one value per token of 'input_ids' ({len(ids)})"
    label_key = next((key for key in LABEL_KEYS if key in row), None)
    labels = row.get(label_key)
    if task == "sequence-classification":
        if label_key and (labels is None or isinstance(labels, (str, bool))):
            return f"{label_key!r} holds {_described(labels)}, expected a class id (or a float for regression)"
    elif label_key:
        problem = _token_labels_problem(labels, label_key, len(ids), task)
        if problem:
            return problem
    if limits is None:
        return None
    if limits.positions and len(ids) > limits.positions[0]:
        positions, name = limits.positions
        return (f"{len(ids)} tokens, but the model has {positions} positions ({name}); shorten the row, or "
                f"raise train.model_config.{name}")
    vocab_size = limits.vocab_size
    for name in ("input_ids", label_key) if task in ("causal-lm", "seq2seq") and label_key else ("input_ids",):
        if vocab_size and max(row[name], default=0) >= vocab_size:
            return (f"{name!r} holds the id {max(row[name])}, but the model's embedding has {vocab_size} rows "
                    f"(ids 0 to {vocab_size - 1}); give ids of the model's tokenizer, or a model with that vocabulary")
    return None


def _token_labels_problem(labels: Any, key: str, length: int, task: str) -> str | None:
    if isinstance(labels, (int, float)) and task == "causal-lm":
        return (f"{key!r} holds one value per row, but a causal LM learns a label per token; give a list of them, "
                "or set train.task = \"sequence-classification\" to learn one per row")
    if not _int_list(labels):
        return f"{key!r} holds {_described(labels)}, expected a list of token ids (ints, -100 for no loss)"
    if task != "seq2seq" and len(labels) != length:
        return f"{key!r} holds {len(labels)} values, 'input_ids' {length}: give one label per token (-100 for no loss)"
    negative = next((label for label in labels if label < 0 and label != IGNORE_INDEX), None)
    if negative is not None:
        return f"{key!r} holds {negative}; a label is a token id, or -100 for no loss"
    return None


def check_token_rows(rows: Any, task: str, key: str, limits: ModelLimits | None = None) -> Any:
    """``rows`` of token ids, each checked with :func:`token_row_problem`; the first bad one is refused
    as a :class:`BadRow`. A stream's rows are checked as they are read."""
    import datasets

    if isinstance(rows, datasets.IterableDataset):
        return rows.map(_check_token_batch, batched=True, with_indices=True,
                        fn_kwargs={"task": task, "key": key, "limits": limits})
    if not isinstance(rows, datasets.Dataset) or _token_columns_fit(rows, task, limits):
        return rows
    for start, batch in zip(itertools.count(0, MAP_BATCH_SIZE), rows.iter(batch_size=MAP_BATCH_SIZE)):
        _check_token_batch(batch, range(start, start + len(batch["input_ids"])), task=task, key=key, limits=limits)
    return rows


def _check_token_batch(batch: dict[str, list], indices: Iterable[int], *, task: str, key: str,
                       limits: ModelLimits | None) -> dict[str, list]:
    for position, index in enumerate(indices):
        problem = token_row_problem({name: values[position] for name, values in batch.items()}, task, limits)
        if problem:
            raise BadRow(key, index, problem)
    return batch


def _token_columns_fit(rows: Any, task: str, limits: ModelLimits | None) -> bool:
    """Whether every row of a ``datasets.Dataset`` passes :func:`token_row_problem`, found over its
    Arrow columns at once (False: a row may not; the rows are then checked one by one)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def int_lists(name: str) -> Any:
        column = rows.data.column(name).combine_chunks()  # a select()ed dataset: all its table's rows, a superset
        fits = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
        return column if fits and pa.types.is_integer(column.type.value_type) and column.null_count == 0 \
            and column.flatten().null_count == 0 else None

    ids = int_lists("input_ids")
    if ids is None or len(ids) == 0:
        return ids is not None
    lengths, flat = pc.list_value_length(ids), ids.flatten()
    if pc.min(lengths).as_py() == 0 or pc.min(flat).as_py() < 0:
        return False
    for name in ("attention_mask", "position_ids"):
        if name in rows.column_names:
            other = rows.data.column(name).combine_chunks()
            if other.null_count or not pa.types.is_list(other.type) or \
                    not pc.all(pc.equal(pc.list_value_length(other), lengths)).as_py():
                return False
    label_key = next((key for key in LABEL_KEYS if key in rows.column_names), None)
    if task == "sequence-classification" and label_key:  # a class id or float per row (floats per row: multi-label)
        column = rows.data.column(label_key)
        value_type = column.type.value_type if pa.types.is_list(column.type) else column.type
        if column.null_count or not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
            return False
    labels = int_lists(label_key) if label_key and task != "sequence-classification" else ids
    if labels is None:
        return False
    label_values = labels.flatten()
    if labels is not ids and (
            task != "seq2seq" and not pc.all(pc.equal(pc.list_value_length(labels), lengths)).as_py()
            or pc.any(pc.and_(pc.less(label_values, 0), pc.not_equal(label_values, IGNORE_INDEX))).as_py()):
        return False
    if limits is None:
        return True
    if limits.positions and pc.max(lengths).as_py() > limits.positions[0]:
        return False
    largest = max(pc.max(flat).as_py(), (pc.max(label_values).as_py() or 0) if task in ("causal-lm", "seq2seq") else 0)
    return not limits.vocab_size or largest < limits.vocab_size


def _learnable(examples: Any, key: str, why: str) -> Any:
    """Causal-LM examples that keep a token to learn: a label other than -100 after the first (the
    model shifts labels by one). Truncation can cut every answer of an example away: such examples
    are dropped and counted (``why`` says how it came to be and what to change), and none left is
    refused, so that no step's loss is nan from an empty set of labels."""
    import datasets
    import numpy as np

    if "labels" not in column_names(examples):
        return examples
    if isinstance(examples, datasets.IterableDataset):
        return examples.filter(_has_label_token, input_columns="labels")
    first = first_learnt(examples)
    empty = int((first < 0).sum())
    if empty == 0:
        return examples
    if empty == len(first):
        raise ConfigError(f"{key}: none of the {empty} examples has a token to learn (a label other than -100 after "
                          f"the first): {why}")
    logger.info("%s: dropped %d of %d examples with no token to learn (a label other than -100 after the first): %s",
                key, empty, len(first), why)
    return examples.select(np.flatnonzero(first >= 0))


def first_learnt(examples: Any) -> Any:
    """Each example's position of its first token to learn (a label other than -100 after the first); -1 for
    none. An example truncated to ``max_length`` keeps one when this is below ``max_length``."""
    import numpy as np
    import pyarrow.compute as pc

    labels = examples.with_format("arrow")["labels"].combine_chunks()
    values = labels.flatten().to_numpy(zero_copy_only=False)
    offsets = labels.offsets.to_numpy()
    learnt = values != IGNORE_INDEX
    starts = offsets[:-1]
    learnt[starts[starts < len(values)]] = False  # each example's first label: nothing predicts it
    parents = pc.list_parent_indices(labels).to_numpy(zero_copy_only=False)
    at = np.flatnonzero(learnt)  # ascending, so each example's first learnt label is where its index changes
    owners = parents[at]
    firsts = np.flatnonzero(np.diff(owners, prepend=-1))
    first = np.full(len(labels), -1, dtype=np.int64)
    first[owners[firsts]] = at[firsts] - offsets[owners[firsts]]
    return first


def _has_label_token(labels: list[int]) -> bool:
    return any(label != IGNORE_INDEX for label in labels[1:])


def input_limits(model_or_config: Any) -> Any:
    """What rows of token ids must fit in a model, or the model a config builds (:class:`ModelLimits`):
    ids below its input embedding's rows (the config's vocab_size), lengths within its positions."""
    config = getattr(model_or_config, "config", model_or_config)
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(model_or_config, torch.nn.Module):
        try:
            vocab_size = model_or_config.get_input_embeddings().num_embeddings
        except (AttributeError, NotImplementedError):
            pass
    return ModelLimits(vocab_size if isinstance(vocab_size, int) else None, max_positions(config))
