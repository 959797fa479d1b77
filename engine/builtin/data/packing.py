"""Rows tokenized and shaped with ``Dataset.map(batched=True)``: text, chats, prompt/completion;
concatenate-packing, truncation and document packing (in order, or best-fit decreasing as TRL's ``bfd``).

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
              all_tokens: bool, eos: int | None, special_tokens: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` (plus ``eos``; with the tokenizer's own special tokens if ``special_tokens``)
    and labels: the ids of tokens overlapping ``spans`` (every token with ``all_tokens``), -100
    elsewhere; an appended eos counts as inside, the tokenizer's special tokens (no characters) do not.
    A token that straddles a span's start is learnt, as TRL learns it (its completion starts where the
    tokens of prompt and prompt + completion part; transformers' assistant mask starts at the token
    holding the span's first character)."""
    encoded = tokenizer(text, add_special_tokens=special_tokens, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [token if all_tokens or any(start < hi and end > lo for lo, hi in spans) else IGNORE_INDEX
              for token, (start, end) in zip(ids, encoded["offset_mapping"])]
    if eos is not None:
        ids, labels = ids + [eos], labels + [eos]
    return ids, labels


def _encode_text(batch: dict[str, list], indices: list[int], *, tokenizer: Any, column: str, eos: int,
                 key: str, special_tokens: bool = False) -> dict[str, list]:
    """Each text's token ids (with the tokenizer's own special tokens if ``special_tokens``: its bos,
    as TRL encodes text) and ``eos``."""
    texts = batch[column]
    if not texts:
        return {"input_ids": []}  # transformers fails on an empty batch
    _check_strings(texts, indices, column, key)
    # One batched call: a fast tokenizer encodes the batch in parallel in Rust.
    ids = tokenizer(texts, add_special_tokens=special_tokens, return_attention_mask=False)["input_ids"]
    return {"input_ids": [row + [eos] for row in ids]}


def _encode_chat(batch: dict[str, list], indices: list[int], *, tokenizer: Any, all_tokens: bool,
                 key: str) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "labels": []}
    for messages, index in zip(batch["messages"], indices):
        text, spans = render_chat(tokenizer, messages, key, index, spans=not all_tokens)
        ids, labels = _labelled(tokenizer, text, spans, all_tokens, None)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def _encode_completion(batch: dict[str, list], indices: list[int], *, tokenizer: Any, all_tokens: bool,
                       eos: int, key: str, special_tokens: bool = False) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "labels": []}
    for column in ("prompt", "completion"):
        _check_strings(batch[column], indices, column, key)
    for prompt, completion in zip(batch["prompt"], batch["completion"]):
        ids, labels = _labelled(tokenizer, prompt + completion, [(len(prompt), len(prompt) + len(completion))],
                                all_tokens, eos, special_tokens)
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


def _cut_rows(flats: dict[str, Any], length: int, keep_tail: bool = False) -> dict[str, Any]:
    """Token arrays cut into ``[rows, length]`` arrays; the shorter tail dropped, or kept as a last,
    shorter row (``keep_tail``: TRL's ``wrapped`` packing; then lists of rows)."""
    if keep_tail:
        import numpy as np

        cuts = np.arange(length, len(flats["input_ids"]), length)
        return {name: np.split(flat, cuts) for name, flat in flats.items()}
    count = len(flats["input_ids"]) // length
    return {name: flat[: count * length].reshape(count, length) for name, flat in flats.items()}


def _pack_concatenated(batch: Any, *, length: int, keep_tail: bool = False) -> Any:
    """The batch's examples concatenated and cut into rows of ``length`` (the tail dropped unless
    ``keep_tail``); vectorised over the Arrow buffers, no Python list of tokens."""
    columns = [name for name in ("input_ids", "labels") if name in batch.column_names]
    return _cut_rows({name: _flat_values(batch[name]) for name in columns}, length, keep_tail)


def _encode_and_pack(batch: dict[str, list], indices: list[int], *, tokenizer: Any, column: str, eos: int,
                     length: int, key: str, keep_tail: bool = False, special_tokens: bool = False) -> Any:
    """Text tokenized and packed in one step: no tokenized copy of the corpus is written."""
    ids = _encode_text(batch, indices, tokenizer=tokenizer, column=column, eos=eos, key=key,
                       special_tokens=special_tokens)["input_ids"]
    return _cut_rows({"input_ids": _flat_values(ids)}, length, keep_tail)


def _truncate(batch: dict[str, list], *, length: int) -> dict[str, list]:
    return {name: [row[:length] for row in rows] for name, rows in batch.items()}


def _pack_documents(batch: dict[str, list], *, length: int) -> dict[str, list]:
    """Whole examples (each at most ``length`` tokens) filled in order into rows of at most
    ``length``, with ``position_ids`` restarting at 0 for each."""
    groups: list[list[int]] = []
    filled = 0
    for i, ids in enumerate(batch["input_ids"]):
        if not groups or filled + len(ids) > length:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += len(ids)
    return _joined(batch, groups)


def _pack_best_fit(batch: dict[str, list], *, length: int, split: bool = False) -> dict[str, list]:
    """Whole examples (each at most ``length`` tokens) packed best-fit decreasing into rows of at most
    ``length``, with ``position_ids`` restarting at 0 for each: TRL's ``bfd`` packing, row for row. The
    longest example first (ties in the batch's order) goes into the open row it leaves the least room
    in (of rows with the same room, the first opened), else into a new row; rows in the order opened.
    With ``split`` (TRL's ``bfd_split``), a longer example is first cut into pieces of ``length``
    tokens (the last shorter), each packed as an example."""
    import bisect
    from collections import defaultdict, deque

    if split:
        starts = [(i, at) for i, ids in enumerate(batch["input_ids"]) for at in range(0, len(ids), length)]
        batch = {name: [values[i][at:at + length] for i, at in starts] for name, values in batch.items()}

    sizes = [len(ids) for ids in batch["input_ids"]]
    groups: list[list[int]] = []
    rows_with_room: dict[int, deque[list[int]]] = defaultdict(deque)  # room left -> rows, first opened first
    rooms: list[int] = []  # the room left in open rows, ascending, each value once
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # a stable sort, as TRL's
        at = bisect.bisect_left(rooms, sizes[i])
        if at < len(rooms):
            room = rooms[at]
            group = rows_with_room[room].popleft()
            if not rows_with_room[room]:
                del rooms[at]
        else:
            room, group = length, []
            groups.append(group)
        group.append(i)
        left = room - sizes[i]
        if left > 0:
            if not rows_with_room[left]:
                bisect.insort(rooms, left)
            rows_with_room[left].append(group)
    return _joined(batch, groups)


def _joined(batch: dict[str, list], groups: list[list[int]]) -> dict[str, list]:
    """One row per group of examples, their columns concatenated in the group's order, with
    ``position_ids`` restarting at 0 for each example."""
    out = {name: [[value for i in group for value in batch[name][i]] for group in groups] for name in batch}
    out["position_ids"] = [[p for i in group for p in range(len(batch["input_ids"][i]))] for group in groups]
    return out
