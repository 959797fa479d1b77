""":func:`build_datasets`: ``[data]`` made into the run's train and eval data (sources read, split,
tokenized, packed; streamed with ``data.streaming``), and datasets given to Run prepared the same way.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from torch.utils.data import Dataset as TorchDataset, IterableDataset as TorchIterableDataset, Subset

from engine.errors import ConfigError
from engine.state import Datasets
from engine.util import call_user, is_callable_spec, is_datasets_object, load_callable

from .checks import ModelLimits, check_token_rows
from .collators import collator_for
from .mixture import kept_rows, log_source, mixed_examples, mixture_rows, mixture_sources
from .prepare import prepare, shape_examples
from .sources import (
    BadRow, _is_saved_dataset, _name_row, column_names, data_kind, load_source, named_rows, read_error, source_files,
)
from .streaming import ResumableStream, raise_explained
from .task_rows import _Pipeline

if TYPE_CHECKING:
    from engine.config import DataConfig  # assembled from the builtins' options: not at import
    from transformers import PreTrainedTokenizerBase


def _call_source(spec: str, key: str, tokenizer: PreTrainedTokenizerBase) -> Any:
    dataset = call_user(key, spec, load_callable(spec, key), tokenizer)
    if not isinstance(dataset, TorchDataset) and not is_datasets_object(dataset):  # IterableDataset is one too
        raise ConfigError(f"{key}: {spec!r} returned a {type(dataset).__name__}, "
                          "expected a torch.utils.data.Dataset or IterableDataset, or a datasets.Dataset")
    return dataset


def schedules_evaluation(train: Any) -> bool:
    """Whether the run evaluates while it trains (``train.eval_strategy``, ``train.eval_on_start``)."""
    return train.eval_strategy != "no" or train.eval_on_start


def no_evaluation_data(train: Any) -> ConfigError:
    """The refusal of a run whose schedule evaluates but that has no evaluation data."""
    key = f"train.eval_strategy = {train.eval_strategy!r}" if train.eval_strategy != "no" else "train.eval_on_start"
    return ConfigError(f"{key} evaluates, but the run has no evaluation data: set data.eval or data.eval_split "
                       "(or pass eval_dataset), or set train.eval_strategy = 'no'")


def check_config(data: DataConfig) -> None:
    if data.max_length < 2:
        raise ConfigError(f"data.max_length: must be at least 2, got {data.max_length}")
    if not 0 <= data.eval_split < 1:
        raise ConfigError(f"data.eval_split: must be in [0, 1), got {data.eval_split}")
    if data.mixture is not None:
        mixture_sources(data)


def build_datasets(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, *, shuffle: bool = True,
                   rank: int = 0, world_size: int = 1, task: str = "causal-lm",
                   label2id: dict[str, int] | None = None, limits: ModelLimits | None = None) -> Datasets:
    """The train dataset, the eval dataset (or None) and the collator for ``data``, tokenized for
    ``task`` (string labels mapped with ``label2id``; rows of token ids checked against the
    model's ``limits``). A row that cannot be used is refused naming it as in its source file.

    With ``data.streaming`` the train data is a :class:`ResumableStream` over this process's
    shard (``rank`` of ``world_size``), shuffled through a buffer of
    ``data.shuffle_buffer_size`` examples seeded by ``seed`` (``shuffle``).
    """
    check_config(data)

    def prepared(rows: Any, key: str, source: str, source_key: str, source_rows: Any = None) -> Any:
        with named_rows(source, source_key, data, source_rows):
            return prepare(rows, data, tokenizer, key, task, label2id, limits)

    def from_source(source: str, key: str, split: str | None = None) -> Any:
        if is_callable_spec(source):
            return prepare_given(_call_source(source, key, tokenizer), data, tokenizer, key, task, label2id, limits)
        rows = load_source(source, data, key, split)
        if not data.streaming:
            return prepared(rows, key, source, key)
        if world_size > 1:
            from datasets.distributed import split_dataset_by_node

            rows = split_dataset_by_node(rows, rank=rank, world_size=world_size)
        try:  # its first rows are read here; the others as it trains (ResumableStream)
            return prepare(rows, data, tokenizer, key, task, label2id, limits)
        except Exception as exc:
            raise_explained(exc, stream_errors(source, key, split))

    def stream_errors(source: str, key: str, split: str | None) -> Callable[[Exception], Exception]:
        """What a stream of ``source`` raised as one line naming the row in its file: a row refused is
        looked up again from the start of the files, in their order (not shuffled, not this process's share)."""
        def explain(error: Exception) -> Exception:
            if isinstance(error, BadRow):
                try:
                    for _ in prepare(load_source(source, data, key, split), data, tokenizer, key, task, label2id,
                                     limits):
                        pass
                    return error
                except BadRow as first:
                    return ConfigError(f"{key}: {_name_row(source, key, first.index, data)}: {first.reason}")
                except Exception as unreadable:  # a file that cannot be read before the row
                    error = unreadable
            files = source_files(source, key)
            return read_error(error, files, key, source) if files and _reading_error(error) else error
        return explain

    if data.mixture is not None:
        if task != "causal-lm":
            raise ConfigError(f"data.mixture: mixes causal-LM rows (text, chat, prompt/completion), but train.task is "
                              f"{task!r}; read its rows with data.train")
        examples = _mixture_examples(data, tokenizer, seed, limits)
        if data.eval is not None or data.eval_split == 0:
            train = _shaped(examples, data, tokenizer, "data.mixture")
            evaluation = None if data.eval is None else from_source(data.eval, "data.eval", data.eval_dataset_split)
        else:  # the handbook's test_split_size: held out of the mixed examples
            train_rows, eval_rows = _split(len(examples), data.eval_split, seed, "data.mixture")
            train = _shaped(examples.select(train_rows).flatten_indices(), data, tokenizer, "data.mixture")
            evaluation = _shaped(examples.select(eval_rows).flatten_indices(), data, tokenizer, "data.eval_split")
    elif data.eval is not None or data.eval_split == 0:
        train = from_source(data.train, "data.train")
        if data.streaming and is_datasets_object(train):
            train = ResumableStream(train.shuffle(seed=seed, buffer_size=data.shuffle_buffer_size) if shuffle
                                    else train, "data.train", stream_errors(data.train, "data.train", None))
        evaluation = None if data.eval is None else from_source(data.eval, "data.eval", data.eval_dataset_split)
    elif data.streaming:
        raise ConfigError("data.eval_split: holds out documents of a dataset with a length, but data.streaming "
                          "is true; set data.eval instead")
    elif is_callable_spec(data.train):  # the function's rows held out as a file's are
        given = _call_source(data.train, "data.train", tokenizer)
        train_rows, eval_rows = _split(_length(given, data.train), data.eval_split, seed)
        train = prepare_given(_subset(given, train_rows), data, tokenizer, "data.train", task, label2id, limits)
        evaluation = prepare_given(_subset(given, eval_rows), data, tokenizer, "data.eval_split", task, label2id, limits)
    else:
        rows = load_source(data.train, data, "data.train")
        train_rows, eval_rows = _split(len(rows), data.eval_split, seed)
        train = prepared(rows.select(train_rows), "data.train", data.train, "data.train", train_rows)
        evaluation = prepared(rows.select(eval_rows), "data.eval_split", data.train, "data.train", eval_rows)
    collator = collator_for(data, tokenizer) if task == "causal-lm" else None  # the run's task collator
    return Datasets(train, evaluation, collator)


def _reading_error(error: Exception) -> bool:
    """Whether datasets raised ``error`` reading a file (not parseable, not of the columns' types)."""
    import pyarrow as pa
    from datasets.exceptions import DatasetGenerationError

    return isinstance(error, (pa.ArrowException, DatasetGenerationError, UnicodeDecodeError, json.JSONDecodeError))


def prepare_given(dataset: Any, data: DataConfig, tokenizer: PreTrainedTokenizerBase | None, key: str,
                  task: str = "causal-lm", label2id: dict[str, int] | None = None,
                  limits: ModelLimits | None = None) -> Any:
    """A dataset given to Run or returned by a data hook: a datasets object is checked and
    tokenized like data.train (one with input_ids is used as is, once checked); anything else is used as is."""
    if isinstance(dataset, dict):
        return {name: prepare_given(d, data, tokenizer, f"{key}[{name!r}]", task, label2id, limits)
                for name, d in dataset.items()}
    return prepare(dataset, data, tokenizer, key, task, label2id, limits) if is_datasets_object(dataset) else dataset


def tokenized_max_length(data: DataConfig, given: Any, task: str = "causal-lm") -> int | None:
    """``data.max_length`` where the engine tokenizes the train rows (it bounds their lengths), None
    where they come as token ids (``given`` to Run, or a local data.train whose first row is read):
    their own lengths are checked against the model then (:func:`check_token_rows`)."""
    if given is not None:
        return data.max_length if needs_tokenizer(given, data, task) else None
    try:
        if source_files(data.train, "data.train") is None and not _is_saved_dataset(Path(data.train).expanduser()):
            return data.max_length  # embedded, a callable, a dataset name: not read before they load
        peek = load_source(data.train, dataclasses.replace(data, streaming=True), "data.train")
        return None if "input_ids" in column_names(peek) else data.max_length
    except Exception:  # an unreadable source is refused, with its reason, where it loads
        return data.max_length


def check_examples(dataset: Any, task: str, key: str, limits: ModelLimits) -> None:
    """Refuse rows of token ids (a ``datasets.Dataset``, or a dict of them) that do not fit the model
    (``limits``): the last check of rows given to Run or made by a data plugin, named by their index."""
    import datasets

    if isinstance(dataset, dict):
        for name, each in dataset.items():
            check_examples(each, task, f"{key}[{name!r}]", limits)
    elif isinstance(dataset, datasets.Dataset) and "input_ids" in dataset.column_names:
        check_token_rows(dataset, task, key, limits)


def needs_tokenizer(dataset: Any, data: DataConfig, task: str = "causal-lm") -> bool:
    """Whether ``dataset`` (given to Run) holds rows that the engine tokenizes."""
    if isinstance(dataset, dict):
        return any(needs_tokenizer(d, data, task) for d in dataset.values())
    if not is_datasets_object(dataset):
        return False
    if task != "causal-lm":
        return "input_ids" not in column_names(dataset)
    return data_kind(dataset, data, "train_dataset") != "tokens"


def _split(total: int, fraction: float, seed: int, key: str = "data.train") -> tuple[Any, Any]:
    """The indices of (train, eval) rows of ``total`` (of the data ``key``): a seeded random ``fraction`` held out,
    at least one each side, each side in the file's order (the sampler shuffles training examples)."""
    import numpy as np

    if total < 2:
        raise ConfigError(f"data.eval_split: {key} has {total} document(s); holding out "
                          "eval documents needs at least 2; set data.eval instead")
    count = min(max(1, round(total * fraction)), total - 1)
    order = list(range(total))
    random.Random(seed).shuffle(order)
    held_out = np.zeros(total, dtype=bool)
    held_out[order[:count]] = True
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)


def _length(dataset: Any, spec: str) -> int:
    """The rows of what data.train's function ``spec`` returned; one without a length (a stream) refused."""
    import datasets

    if isinstance(dataset, (datasets.IterableDataset, TorchIterableDataset)) \
            or not hasattr(dataset, "__len__"):
        raise ConfigError(f"data.eval_split: holds out rows of a dataset with a length, but data.train's function "
                          f"{spec!r} returned a {type(dataset).__name__}, which has none; set data.eval instead")
    return len(dataset)


def _subset(dataset: Any, indices: Any) -> Any:
    """The rows ``indices`` of a datasets.Dataset or a torch Dataset."""
    if is_datasets_object(dataset):
        return dataset.select(indices)
    return Subset(dataset, indices.tolist())


def _mixture_examples(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int,
                      limits: ModelLimits | None) -> Any:
    """The examples of ``data.mixture``: each source read, the rows its weight keeps drawn with ``seed``, tokenized
    with its own format keys (unshaped), then all mixed (:func:`mixed_examples`)."""
    import datasets

    parts = []
    for index, source in enumerate(mixture_sources(data)):
        spec = source.entry.source
        if is_callable_spec(spec):
            rows = _call_source(spec, f"{source.key}.source", tokenizer)
            if not isinstance(rows, datasets.Dataset):
                raise ConfigError(f"{source.key}.source: {spec!r} returned a {type(rows).__name__}; a mixture samples "
                                  "and tokenizes rows: return a datasets.Dataset")
        else:
            rows = load_source(spec, source.data, source.key, source.entry.split)
        rows = mixture_rows(source, rows)
        kept = kept_rows(len(rows), source, index, seed)
        with named_rows(None if is_callable_spec(spec) else spec, source.key, source.data, kept):
            examples = prepare(rows.select(kept) if len(kept) < len(rows) else rows, source.data, tokenizer,
                               source.key, limits=limits, shape=False)
        log_source(source, len(rows), len(kept), examples)
        parts.append(examples)
    return mixed_examples(parts, seed)


def _shaped(examples: Any, data: DataConfig, tokenizer: PreTrainedTokenizerBase, key: str) -> Any:
    """Tokenized examples (of several sources) shaped once, per ``data.packing``."""
    pipeline = _Pipeline(data, tokenizer, key)
    shaped = shape_examples(examples, data, key, pipeline)
    pipeline.report()
    return shaped
