"""Other tasks' rows (``train.task``: classification, token classification, seq2seq) tokenized as
transformers' example scripts do, and the map pipeline that fingerprints every step.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import xxhash

from engine.errors import ConfigError
from engine.loss import IGNORE_INDEX

from .sources import (
    BadRow, LARGE_ROWS, _a, _check_strings, _progress, column_names, logger, missing_pair, text_batches,
)

if TYPE_CHECKING:
    from engine.config import DataConfig, TrainConfig  # assembled from the builtins' options: not at import
    from transformers import PreTrainedTokenizerBase


EXAMPLE_COLUMNS = ("input_ids", "labels", "position_ids")  # what the tokenizing steps write
PIPELINE_VERSION = 3  # part of every cache fingerprint: bump when a map step's output changes
DEFAULT_LABEL_COLUMNS = {"sequence-classification": ("label", "labels"),
                         "token-classification": ("tags", "ner_tags", "labels")}


def _label_ids(values: list[Any], indices: list[int], label2id: dict[str, int] | None, column: str,
               key: str) -> list[Any]:
    """Labels (of the rows ``indices``) as class ids: strings through ``label2id`` (``train.label2id``)."""
    for value, index in zip(values, indices):
        if value is None or isinstance(value, bool) or not isinstance(value, (str, int, float)):
            what = "is missing or null" if value is None else f"holds {_a(value)} ({value!r})"
            raise BadRow(key, index, f"label column {column!r} {what}, expected a class id or name")
    if not any(isinstance(v, str) for v in values):
        return values
    if label2id is None:
        raise ConfigError(f"{key}: column {column!r} holds strings; set train.label2id = {{name = id, ...}}")
    for value, index in zip(values, indices):
        if value not in label2id:
            raise BadRow(key, index, f"label {value!r} is not in train.label2id ({', '.join(label2id)})")
    return [label2id[v] for v in values]


def _encode_sequences(batch: dict[str, list], indices: list[int], *, tokenizer: Any, text: str, pair: str | None,
                      label: str, label2id: dict[str, int] | None, max_length: int, key: str) -> dict[str, list]:
    if not batch[text]:
        return {"input_ids": [], "labels": []}
    texts = [_check_strings(batch[column], indices, column, key) for column in (text, pair) if column]
    encoded = dict(tokenizer(*texts, truncation=True, max_length=max_length))
    encoded["labels"] = _label_ids(batch[label], indices, label2id, label, key)
    return encoded


def _begin_to_inside(label2id: dict[str, int] | None) -> dict[int, int]:
    """run_ner's b_to_i_label: the id of each B-X tag -> the id of I-X (others unchanged)."""
    if not label2id:
        return {}
    return {i: label2id.get("I-" + name[2:], i) for name, i in label2id.items() if name.startswith("B-")}


def _encode_words(batch: dict[str, list], indices: list[int], *, tokenizer: Any, tokens: str, tags: str,
                  label2id: dict[str, int] | None, label_all_tokens: bool, max_length: int,
                  key: str) -> dict[str, list]:
    if not batch[tokens]:
        return {"input_ids": [], "labels": []}
    for words, word_tags, index in zip(batch[tokens], batch[tags], indices):
        if not isinstance(words, list) or not isinstance(word_tags, list) or len(words) != len(word_tags):
            raise BadRow(key, index, f"columns {tokens!r} and {tags!r} must hold lists of equal length "
                                     "(one tag per word)")
        word = next((w for w in words if not isinstance(w, str)), "")
        if not isinstance(word, str):
            raise BadRow(key, index, f"column {tokens!r} holds {_a(word)} among its words, expected strings")
    encoding = tokenizer(batch[tokens], truncation=True, max_length=max_length, is_split_into_words=True)
    inside = _begin_to_inside(label2id)
    labels = []
    for row, word_tags in enumerate(batch[tags]):
        ids = _label_ids(word_tags, [indices[row]] * len(word_tags), label2id, tags, key)
        previous, aligned = None, []
        for word in encoding.word_ids(batch_index=row):
            if word is None:
                aligned.append(IGNORE_INDEX)
            elif word != previous:
                aligned.append(ids[word])
            else:
                aligned.append(inside.get(ids[word], ids[word]) if label_all_tokens else IGNORE_INDEX)
            previous = word
        labels.append(aligned)
    return {**encoding, "labels": labels}


def _encode_pairs(batch: dict[str, list], indices: list[int], *, tokenizer: Any, source: str, target: str,
                  max_length: int, max_target_length: int, append_eos: bool, key: str) -> dict[str, list]:
    if not batch[source]:
        return {"input_ids": [], "labels": []}
    encoded = dict(tokenizer(_check_strings(batch[source], indices, source, key), truncation=True,
                             max_length=max_length))
    targets = _check_strings(batch[target], indices, target, key)
    if append_eos:  # a tokenizer that adds no eos itself: the model must still learn where targets end
        ids = tokenizer(text_target=targets, truncation=True, max_length=max_target_length - 1)["input_ids"]
        encoded["labels"] = [row + [tokenizer.eos_token_id] for row in ids]
    else:
        encoded["labels"] = tokenizer(text_target=targets, truncation=True, max_length=max_target_length)["input_ids"]
    return encoded


def check_columns(rows: Any, task: str, data: DataConfig, key: str) -> None:
    """Refuse rows without the columns ``task`` reads, naming the option and the columns there are."""
    if task != "seq2seq":
        label_column(rows, task, data, key)
    options = {"sequence-classification": ["text_column", *(["text_pair_column"] if data.text_pair_column else [])],
               "token-classification": ["tokens_column"], "seq2seq": ["source_column", "target_column"]}[task]
    names = column_names(rows)
    for option in options:
        column = getattr(data, option)
        if column not in names:
            raise ConfigError(f"data.{option}: {key} has no column {column!r} for {task}; "
                              f"its columns: {', '.join(names) or 'none'}")


def prepare_task_rows(rows: Any, task: str, data: DataConfig, tokenizer: Any, key: str, pipeline: _Pipeline,
            label2id: dict[str, int] | None) -> Any:
    """Rows of a classification or seq2seq task (``train.task``, engine/builtin/tasks.py) tokenized as
    transformers' example scripts do (run_glue, run_ner, run_summarization): classification text
    with the tokenizer's special tokens, truncated to ``data.max_length``; each word's tag on its
    first sub-word (every sub-word with ``data.label_all_tokens``), -100 on the others; seq2seq
    targets as ``labels``, ending with eos. The class names of a ClassLabel label column stay with
    the ``labels``."""
    check_columns(rows, task, data, key)
    if task == "seq2seq":
        eos = tokenizer.eos_token_id
        append_eos = eos is not None and tokenizer(text_target="x")["input_ids"][-1:] != [eos]
        return pipeline.map(rows, _encode_pairs, "tokenize source and target", with_indices=True, tokenizer=tokenizer,
                            source=data.source_column, target=data.target_column, max_length=data.max_length,
                            max_target_length=data.max_target_length or data.max_length, append_eos=append_eos,
                            key=key)
    label = label_column(rows, task, data, key)
    if task == "sequence-classification":
        encoded = pipeline.map(rows, _encode_sequences, "tokenize for sequence classification", with_indices=True,
                               tokenizer=tokenizer,
                               text=data.text_column, pair=data.text_pair_column, label=label, label2id=label2id,
                               max_length=data.max_length, key=key)
    else:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{key}: token classification needs a fast tokenizer (word_ids align the tags)")
        encoded = pipeline.map(rows, _encode_words, "tokenize and align tags", with_indices=True, tokenizer=tokenizer,
                               tokens=data.tokens_column, tags=label, label2id=label2id,
                               label_all_tokens=data.label_all_tokens, max_length=data.max_length, key=key)
    feature = rows.features[label] if rows.features else None
    return encoded.cast_column("labels", feature) if class_names(feature, task) else encoded


def tokenizer_texts(rows: Any, task: str, data: DataConfig) -> Iterator[list[str]]:
    """Batches of the task's text, for training a tokenizer on it."""
    if task == "sequence-classification":
        yield from text_batches(rows, data.text_column)
        if data.text_pair_column:
            yield from text_batches(rows, data.text_pair_column)
    elif task == "token-classification":
        for batch in rows.iter(batch_size=1000):
            yield [" ".join(map(str, words)) for words in batch[data.tokens_column]]
    else:
        yield from text_batches(rows, data.source_column)
        yield from text_batches(rows, data.target_column)


def label_column(rows: Any, task: str, data: DataConfig, key: str) -> str:
    """The label column of ``rows`` (``data.label_column`` or the task's usual names)."""
    names = column_names(rows)
    wanted = (data.label_column,) if data.label_column else DEFAULT_LABEL_COLUMNS[task]
    found = next((name for name in wanted if name in names), None)
    if found is None:
        if missing_pair(names, key):  # one side of a preference pair (a reward model's rows): say so
            raise ConfigError(missing_pair(names, key))
        what = f"{data.label_column!r} (data.label_column)" if data.label_column else " or ".join(map(repr, wanted))
        raise ConfigError(f"data.label_column: {key} has no label column {what} for {task}; "
                          f"its columns: {', '.join(names) or 'none'}")
    return found


def class_names(feature: Any, task: str) -> list[str] | None:
    """The names of a ``ClassLabel`` feature (a list of them for tags), else None."""
    if task == "token-classification":
        feature = getattr(feature, "feature", None)
    return list(feature.names) if hasattr(feature, "names") else None


def _tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    if getattr(tokenizer, "is_fast", False):
        return tokenizer.backend_tokenizer.to_str() + str(getattr(tokenizer, "chat_template", None))
    from datasets.fingerprint import Hasher

    return Hasher.hash(tokenizer)


class _Pipeline:
    """Dataset.map steps of one source, each fingerprinted from its input and its settings, so a
    second start with the same data and settings reads the cached Arrow files; says which it did."""

    def __init__(self, data: DataConfig, tokenizer: PreTrainedTokenizerBase, key: str):
        self.data, self.tokenizer, self.key = data, tokenizer, key
        self.identity = xxhash.xxh64(_tokenizer_identity(tokenizer).encode()).hexdigest() if tokenizer else ""
        self.cached: list[str] = []  # steps read from the cache
        self.folder: Path | None = None
        self.rows = 0

    def num_proc(self, rows: Any) -> int | None:
        if self.data.num_proc is not None:
            procs = self.data.num_proc
        else:  # worker start-up costs more than it saves on small data
            procs = min(os.cpu_count() or 1, 8) if len(rows) >= LARGE_ROWS else 1
        if procs > 1:  # tokenizers in forked workers: one thread each, and no fork warning
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return procs if procs > 1 else None

    def map(self, rows: Any, function: Callable, step: str, *, with_indices: bool = False,
            arrow: bool = False, **fn_kwargs: Any) -> Any:
        import datasets

        remove = column_names(rows)
        if isinstance(rows, datasets.IterableDataset):
            source = rows.with_format("arrow") if arrow else rows
            # here remove_columns also drops the function's output columns of those names
            return source.map(function, batched=True, with_indices=with_indices, fn_kwargs=fn_kwargs,
                              remove_columns=[c for c in remove if c not in EXAMPLE_COLUMNS]).with_format(None)
        settings = {k: v for k, v in fn_kwargs.items() if k != "tokenizer"}
        fingerprint = xxhash.xxh64(json.dumps([PIPELINE_VERSION, rows._fingerprint, step, self.identity, settings],
                                              sort_keys=True).encode()).hexdigest()
        folder = Path(rows.cache_files[0]["filename"]).parent if rows.cache_files else None
        cached = folder is not None and any(folder.glob(f"cache-{fingerprint}*.arrow"))
        source = rows.with_format("arrow") if arrow else rows
        with _progress(len(rows) >= LARGE_ROWS):
            mapped = source.map(function, batched=True, with_indices=with_indices, fn_kwargs=fn_kwargs,
                                remove_columns=remove, num_proc=self.num_proc(rows), new_fingerprint=fingerprint,
                                desc=f"{self.key}: {step}").with_format(None)
        self.rows = len(rows)
        if cached:
            self.cached.append(step)
            self.folder = folder
        return mapped

    def report(self) -> None:
        if self.cached:
            logger.log(logging.INFO if self.rows >= LARGE_ROWS else logging.DEBUG, "%s: %s from the cache in %s",
                       self.key, " + ".join(self.cached), self.folder)


def configured_id2label(train: TrainConfig) -> dict[int, str] | None:
    """``train.id2label`` with int keys (TOML keys are strings), or inverted ``label2id``; checked."""
    if train.id2label is not None:
        try:
            mapping = {int(key): str(name) for key, name in train.id2label.items()}
        except ValueError:
            raise ConfigError(f"train.id2label: keys are class ids (0, 1, ...), got {list(train.id2label)}") from None
        if sorted(mapping) != list(range(len(mapping))):
            raise ConfigError(f"train.id2label: expected ids 0 to {len(mapping) - 1}, got {sorted(mapping)}")
        return mapping
    if train.label2id is not None:
        mapping = {int(i): name for name, i in train.label2id.items()}
        if sorted(mapping) != list(range(len(train.label2id))):
            raise ConfigError(f"train.label2id: expected ids 0 to {len(train.label2id) - 1} once each, "
                              f"got {sorted(train.label2id.values())}")
        return mapping
    return None


def label_ids_by_name(train: TrainConfig) -> dict[str, int] | None:
    """The class ids that string labels in the data map to (``train.label2id`` or ``id2label``)."""
    id2label = configured_id2label(train)
    return None if id2label is None else {name: i for i, name in id2label.items()}
