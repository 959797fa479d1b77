"""Rows tokenized and shaped with ``Dataset.map(batched=True)``: text, chats, prompt/completion;
concatenate-packing, truncation and document packing.

Examples carry unshifted ``labels`` (or none: every token is learnt): Hugging Face causal LMs shift
them inside.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from engine.loss import IGNORE_INDEX

from .chat import render_chat
from .sources import _check_strings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _labelled(tokenizer: PreTrainedTokenizerBase, text: str, spans: list[tuple[int, int]],
              all_tokens: bool, eos: int | None) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` (plus ``eos``) and labels: the ids of tokens starting inside ``spans``
    (every token with ``all_tokens``), -100 elsewhere; an appended eos counts as inside."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [token if all_tokens or any(lo <= start < hi for lo, hi in spans) else IGNORE_INDEX
              for token, (start, _) in zip(ids, encoded["offset_mapping"])]
    if eos is not None:
        ids, labels = ids + [eos], labels + [eos]
    return ids, labels


def _encode_text(batch: dict[str, list], indices: list[int], *, tokenizer: Any, column: str, eos: int,
                 key: str) -> dict[str, list]:
    texts = batch[column]
    if not texts:
        return {"input_ids": []}  # transformers fails on an empty batch
    _check_strings(texts, indices, column, key)
    # One batched call: a fast tokenizer encodes the batch in parallel in Rust.
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return {"input_ids": [row + [eos] for row in ids]}


def _encode_chat(batch: dict[str, list], indices: list[int], *, tokenizer: Any, all_tokens: bool,
                 key: str) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "labels": []}
    for messages, index in zip(batch["messages"], indices):
        text, spans = render_chat(tokenizer, messages, key, index)
        ids, labels = _labelled(tokenizer, text, spans, all_tokens, None)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def _encode_completion(batch: dict[str, list], indices: list[int], *, tokenizer: Any, all_tokens: bool,
                       eos: int, key: str) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "labels": []}
    for column in ("prompt", "completion"):
        _check_strings(batch[column], indices, column, key)
    for prompt, completion in zip(batch["prompt"], batch["completion"]):
        ids, labels = _labelled(tokenizer, prompt + completion, [(len(prompt), len(prompt) + len(completion))],
                                all_tokens, eos)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def _flat_values(column: Any) -> Any:
    """The values of a list column (a pyarrow array in arrow format), concatenated, as numpy."""
    import numpy as np
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if isinstance(column, (pa.ListArray, pa.LargeListArray)):
        return column.flatten().to_numpy(zero_copy_only=False)
    return np.fromiter(itertools.chain.from_iterable(column), dtype=np.int32)


def _cut_rows(flats: dict[str, Any], length: int) -> dict[str, Any]:
    """Token arrays cut into ``[rows, length]`` arrays (the tail is dropped)."""
    count = len(flats["input_ids"]) // length
    return {name: flat[: count * length].reshape(count, length) for name, flat in flats.items()}


def _pack_concatenated(batch: Any, *, length: int) -> Any:
    """The batch's examples concatenated and cut into rows of ``length`` (the tail is dropped);
    vectorised over the Arrow buffers, no Python list of tokens."""
    columns = [name for name in ("input_ids", "labels") if name in batch.column_names]
    return _cut_rows({name: _flat_values(batch[name]) for name in columns}, length)


def _encode_and_pack(batch: dict[str, list], indices: list[int], *, tokenizer: Any, column: str, eos: int,
                     length: int, key: str) -> Any:
    """Text tokenized and packed in one step: no tokenized copy of the corpus is written."""
    ids = _encode_text(batch, indices, tokenizer=tokenizer, column=column, eos=eos, key=key)["input_ids"]
    return _cut_rows({"input_ids": _flat_values(ids)}, length)


def _truncate(batch: dict[str, list], *, length: int) -> dict[str, list]:
    return {name: [row[:length] for row in rows] for name, rows in batch.items()}


def _pack_documents(batch: dict[str, list], *, length: int) -> dict[str, list]:
    """Whole examples (each at most ``length`` tokens) filled in order into rows of at most
    ``length``, with ``position_ids`` restarting at 0 for each."""
    names = list(batch)
    out: dict[str, list] = {name: [] for name in [*names, "position_ids"]}
    current: dict[str, list] = {name: [] for name in out}
    for i, ids in enumerate(batch["input_ids"]):
        if current["input_ids"] and len(current["input_ids"]) + len(ids) > length:
            for name in out:
                out[name].append(current[name])
            current = {name: [] for name in out}
        for name in names:
            current[name].extend(batch[name][i])
        current["position_ids"].extend(range(len(ids)))
    if current["input_ids"]:
        for name in out:
            out[name].append(current[name])
    return out
