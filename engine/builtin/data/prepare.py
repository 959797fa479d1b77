""":func:`prepare`: rows read from a source made into training examples (tokenized, packed, checked),
fingerprinted and cached beside the source's Arrow files, so a second start reads the cache.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError

from .checks import MAP_BATCH_SIZE, ModelLimits, _learnable, check_token_rows, first_learnt
from .packing import (
    _encode_and_pack, _encode_chat, _encode_completion, _encode_text, _pack_best_fit, _pack_concatenated,
    _pack_documents, _truncate,
)
from .formats import format_encoder, no_chat_template
from .preference import PREFERENCE, encode_pairs, encode_unpaired, tokenized_kind
from .sources import column_names, data_kind, logger, preference_kind
from .task_rows import _Pipeline, prepare_task_rows

if TYPE_CHECKING:
    from engine.config import DataConfig  # assembled from the builtins' options: not at import
    from transformers import PreTrainedTokenizerBase


def prepare(rows: Any, data: DataConfig, tokenizer: PreTrainedTokenizerBase | None, key: str,
            task: str = "causal-lm", label2id: dict[str, int] | None = None, limits: ModelLimits | None = None,
            *, shape: bool = True) -> Any:
    """Examples for training from a datasets object: tokenized (text, chat or prompt/completion
    rows) and shaped per ``data.packing`` (unless not ``shape``: a mixture shapes its sources'
    examples together, :func:`shape_examples`); rows that already hold ``input_ids`` are used as they
    are, once checked (:func:`check_token_rows`, against the model's ``limits`` when known).
    Other tasks' rows by :func:`prepare_task_rows` (string labels mapped with ``label2id``).
    Steps read from the cache are logged in one line (at debug level for small data). A row that
    cannot be used is refused as a :class:`BadRow`."""
    names = column_names(rows)
    if tokenized_kind(names) is not None:
        return rows  # preference examples, tokenized already (by the data builtin, or given so)
    if preference_kind(names) is not None and "input_ids" not in names:  # any task: DPO, KTO, reward models
        return _encode_preference(rows, preference_kind(names), data, tokenizer, key)
    if task != "causal-lm":
        if "input_ids" in names:
            return check_token_rows(rows, task, key, limits)
        if tokenizer is None:
            raise ConfigError(f"{key}: {task} rows need a tokenizer; pass tokenizer= or set data.tokenizer")
        pipeline = _Pipeline(data, tokenizer, key)
        examples = prepare_task_rows(rows, task, data, tokenizer, key, pipeline, label2id)
        pipeline.report()
        return examples
    kind = data_kind(rows, data, key)
    if kind == "tokens":
        return _learnable(check_token_rows(rows, task, key, limits), key,
                          "give each row one, or leave the row out")
    if tokenizer is None:
        raise ConfigError(f"{key}: {kind} rows need a tokenizer; pass tokenizer= or set data.tokenizer")
    pipeline = _Pipeline(data, tokenizer, key)
    examples = _tokenize_and_shape(rows, kind, data, tokenizer, key, pipeline, shape)
    pipeline.report()
    return examples


def _encode_preference(rows: Any, kind: str, data: DataConfig, tokenizer: PreTrainedTokenizerBase | None,
                       key: str) -> Any:
    """Preference rows tokenized (:mod:`.preference`); their collator cuts them to data.max_length."""
    if tokenizer is None:
        raise ConfigError(f"{key}: {kind} rows need a tokenizer; pass tokenizer= or set data.tokenizer")
    if data.packing:
        raise ConfigError(f"data.packing: {key} holds {kind} rows, whose completions are compared one by one and "
                          "never packed; set data.packing = false")
    pipeline = _Pipeline(data, tokenizer, key)
    encode = encode_pairs if kind == PREFERENCE else encode_unpaired
    examples = pipeline.map(rows, encode, f"tokenize {kind} rows", with_indices=True, tokenizer=tokenizer,
                            special_tokens=data.add_special_tokens, max_length=data.max_length, key=key)
    pipeline.report()
    return examples


def _tokenize_and_shape(rows: Any, kind: str, data: DataConfig, tokenizer: PreTrainedTokenizerBase, key: str,
                        pipeline: _Pipeline, shape: bool = True) -> Any:
    if kind == "text":
        feature = rows.features[data.text_column] if rows.features else None
        if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ConfigError(f"data.text_column: {key} column {data.text_column!r} holds {feature}, expected strings")
        if data.packing in (True, "wrapped") and shape:
            return _nonempty(pipeline.map(rows, _encode_and_pack, "tokenize + pack", with_indices=True,
                                          tokenizer=tokenizer, column=data.text_column, eos=_eos_id(tokenizer),
                                          length=data.max_length, key=key, keep_tail=data.packing == "wrapped",
                                          special_tokens=data.add_special_tokens),
                             data, key)
        encoded = pipeline.map(rows, _encode_text, "tokenize", with_indices=True, tokenizer=tokenizer,
                               column=data.text_column, eos=_eos_id(tokenizer), key=key,
                               special_tokens=data.add_special_tokens)
    else:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{key}: {kind} data needs a fast tokenizer (character offsets find the "
                              "tokens to learn); this one is slow")
        if kind == "chat" and not getattr(tokenizer, "chat_template", None):
            raise no_chat_template(key, data)
        all_tokens = data.train_on_all_tokens is True or (data.train_on_all_tokens == "chat" and kind == "chat")
        step = format_encoder(kind, data, functools.partial(_eos_id, tokenizer))  # a prompt format's rows
        if step is not None:
            function, name, settings = step
            encoded = pipeline.map(rows, function, name, with_indices=True, tokenizer=tokenizer,
                                   all_tokens=all_tokens, key=key, **settings)
        elif kind == "chat":
            encoded = pipeline.map(rows, _encode_chat, "render chat and tokenize", with_indices=True,
                                   tokenizer=tokenizer, all_tokens=all_tokens, key=key)
        else:
            encoded = pipeline.map(rows, _encode_completion, "tokenize prompt/completion", with_indices=True,
                                   tokenizer=tokenizer, all_tokens=all_tokens,
                                   eos=_eos_id(tokenizer), key=key, special_tokens=data.add_special_tokens)
    return shape_examples(encoded, data, key, pipeline) if shape else encoded


def shape_examples(encoded: Any, data: DataConfig, key: str, pipeline: _Pipeline) -> Any:
    """Tokenized examples shaped per ``data.packing``: packed, or cut to (or dropped beyond) ``data.max_length``;
    those left with no token to learn dropped."""
    import datasets

    if tokenized_kind(column_names(encoded)) is not None:
        return encoded  # preference pairs: their collator cuts them (a mixture of them comes here)
    streaming = isinstance(encoded, datasets.IterableDataset)
    length = data.max_length
    # text rows learn every token; the answers of chat and prompt/completion rows may be cut away
    why = _answers_cut(data, length)
    if data.packing in (True, "wrapped"):
        return _learnable(_nonempty(pipeline.map(encoded, _pack_concatenated, "pack", arrow=True, length=length,
                                                 keep_tail=data.packing == "wrapped"), data, key), key, why)
    if data.packing == "bfd_split":  # nothing cut away: an example longer than max_length packed in pieces
        return pipeline.map(_learnable(encoded, key, why), _pack_best_fit, "pack documents best-fit", length=length,
                            split=True)
    if not streaming:
        encoded = _fit(encoded, data, key, pipeline, why)
    elif data.truncation == "drop":
        encoded = _learnable(encoded.filter(lambda ids: len(ids) <= length, input_columns="input_ids"), key, why)
    else:
        encoded = _learnable(pipeline.map(encoded, _truncate, "truncate", length=length), key, why)
    if data.packing == "document":
        return pipeline.map(encoded, _pack_documents, "pack documents", length=length)
    if data.packing == "bfd":
        return pipeline.map(encoded, _pack_best_fit, "pack documents best-fit", length=length)
    return encoded


def _answers_cut(data: DataConfig, length: int, encoded: Any = None) -> str:
    """Why examples have no token to learn left: ``data.max_length`` cut their answers away, and what to change.
    Given the ``encoded`` examples before truncation, also how many it empties, where their answers start and the
    max_length that keeps one in every example."""
    import numpy as np

    counts = ""
    if encoded is not None and "labels" in encoded.column_names:
        first = first_learnt(encoded)
        cut = first[first >= length]
        if len(cut):
            where = f"{cut.min()}" if cut.min() == cut.max() else f"{cut.min()} to {cut.max()}"
            counts = (f" in {len(cut)} of {len(first)} examples (their first answer token is at position {where}; "
                      f"data.max_length = {np.max(first) + 1} keeps one in every example)")
    return (f"data.max_length = {length} cuts the answers away{counts}; raise it" +
            ("" if data.packing in (True, "wrapped") or data.truncation == "drop" else
             ", or set data.truncation = \"drop\" to leave out examples longer than it"))


def _nonempty(packed: Any, data: DataConfig, key: str) -> Any:
    import datasets

    if not isinstance(packed, datasets.IterableDataset) and len(packed) == 0:
        raise ConfigError(f"{key}: fewer tokens than data.max_length = {data.max_length} in any batch of "
                          f"{MAP_BATCH_SIZE} examples, so packing yields no example; lower data.max_length "
                          "or set data.packing = false")
    return packed


def _fit(encoded: Any, data: DataConfig, key: str, pipeline: _Pipeline, why: str) -> Any:
    """Examples longer than ``data.max_length`` truncated or dropped (``data.truncation``), then
    those left with no token to learn dropped (:func:`_learnable`, ``why``); counted."""
    import numpy as np
    import pyarrow.compute as pc

    lengths = pc.list_value_length(encoded.data.column("input_ids")).to_numpy()
    if len(lengths) == 0:
        raise ConfigError(f"{key}: no examples")
    too_long = int((lengths > data.max_length).sum())
    if too_long == 0:
        return _learnable(encoded, key, why)
    if data.truncation == "drop":
        if too_long == len(lengths):
            raise ConfigError(f"{key}: all {too_long} examples are longer than data.max_length = "
                              f"{data.max_length}; raise it or set data.truncation = \"truncate\"")
        fitted, done = _learnable(encoded.select(np.flatnonzero(lengths <= data.max_length)), key, why), "dropped"
    else:
        fitted, done = _learnable(pipeline.map(encoded, _truncate, "truncate", length=data.max_length), key,
                                  _answers_cut(data, data.max_length, encoded)), "truncated"
    logger.info("%s: %s %d of %d examples longer than data.max_length = %d", key, done, too_long, len(lengths),
                data.max_length)
    return fitted


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ConfigError("data.tokenizer: the tokenizer has no eos token; "
                          "documents need one to mark where they end")
    return tokenizer.eos_token_id
