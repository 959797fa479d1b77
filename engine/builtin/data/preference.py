"""Preference rows, tokenized as TRL's preference trainers tokenize them (DPO, KTO, reward models).

- ``preference``: ``prompt`` (optional), ``chosen`` and ``rejected``; text or conversations (lists of
  ``{role, content}``). Without a prompt column, the prompt is what chosen and rejected share at
  their start (TRL's ``extract_prompt``).
- ``unpaired``: ``prompt``, ``completion`` and a boolean ``label`` (desirable or not): KTO's rows.

Each row becomes ``prompt_ids`` and ``chosen_ids`` / ``rejected_ids`` (or ``completion_ids`` and
``label``), as TRL 1.16's trainers make them: text completions get the tokenizer's eos appended
(unless they end with it), a conversation is rendered by the chat template (the prompt with the
generation prompt), and the completion starts where the tokenized prompt and prompt + completion
diverge. Nothing is packed or cut here: the preference plugin's collator cuts prompt + completion
to ``data.max_length`` (TRL's ``keep_start``), so a row whose prompt alone fills it, leaving no
completion token, is refused (TRL drops such rows without a word).
"""

from __future__ import annotations

import math
from typing import Any

from engine.kit.preference import PAIR_COLUMNS, UNPAIRED_COLUMNS

from .sources import PREFERENCE, UNPAIRED, BadRow, _a

PREFERENCE_KINDS = (PREFERENCE, UNPAIRED)
# what the examples of each kind hold: the columns the preference plugins read (engine.kit.preference)
PREFERENCE_COLUMNS = {PREFERENCE: PAIR_COLUMNS, UNPAIRED: UNPAIRED_COLUMNS}


def tokenized_kind(names: list[str]) -> str | None:
    """The preference kind of examples tokenized already (columns ``names``), None for others."""
    return next((kind for kind, columns in PREFERENCE_COLUMNS.items() if set(columns) <= set(names)), None)


def row_texts(batch: dict[str, list], kind: str) -> list[str]:
    """The text of a batch of preference rows, for training a tokenizer."""
    columns = ("prompt", "chosen", "rejected") if kind == PREFERENCE else ("prompt", "completion")
    texts = []
    for values in zip(*(batch.get(column, [None] * len(batch["label" if kind == UNPAIRED else "chosen"]))
                        for column in columns)):
        parts = []
        for value in values:
            if isinstance(value, str):
                parts.append(value)
            elif isinstance(value, list):
                parts += [turn.get("content") for turn in value
                          if isinstance(turn, dict) and isinstance(turn.get("content"), str)]
        texts.append("\n".join(parts))
    return texts


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(turn, dict) for turn in value)


def _extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected): the start chosen and rejected share taken out as the prompt (TRL's
    ``extract_prompt``: whole turns of a conversation; of text, up to the last space before they differ)."""
    shared = 0
    for shared, (a, b) in enumerate(zip(chosen, rejected)):
        if a != b:
            if isinstance(chosen, str) and chosen[shared - 1] == " ":
                shared -= 1
            break
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _tokenize(tokenizer: Any, value: Any, special_tokens: bool, generation_prompt: bool = False) -> list[int]:
    if isinstance(value, list):
        encoded = tokenizer.apply_chat_template(value, tokenize=True, add_generation_prompt=generation_prompt,
                                                return_dict=True)
        return list(encoded["input_ids"])
    return tokenizer(value, add_special_tokens=special_tokens)["input_ids"]


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


def _check_value(value: Any, column: str, key: str, index: int, chat: bool) -> None:
    if chat and not _is_chat(value):
        raise BadRow(key, index, f"{column!r} holds {_a(value)}, but the row's other columns are conversations; "
                                 "give every column as a list of {'role': ..., 'content': ...}")
    if not chat and not isinstance(value, str):
        what = "is missing or null" if value is None else f"holds {_a(value)}"
        raise BadRow(key, index, f"{column!r} {what}, expected a string (or a conversation)")


def _encode_row(tokenizer: Any, prompt: Any, completions: list[Any], columns: list[str], special_tokens: bool,
                max_length: int, key: str, index: int) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, each completion's ids) of one row, as TRL's ``tokenize_fn``."""
    chat = _is_chat(prompt) if prompt is not None else _is_chat(completions[0])
    for value, column in zip(completions, columns):
        _check_value(value, column, key, index, chat)
    if prompt is None:  # implicit: the start chosen and rejected share
        prompt, *completions = _extract_prompt(*completions)
    _check_value(prompt, "prompt", key, index, chat)
    if chat:
        prompt_ids = _tokenize(tokenizer, prompt, special_tokens, generation_prompt=True)
        full = [_tokenize(tokenizer, prompt + completion, special_tokens) for completion in completions]
    else:
        eos = tokenizer.eos_token or ""
        full = [_tokenize(tokenizer, prompt + (c if c.endswith(eos) else c + eos), special_tokens)
                for c in completions]
        prompt_ids = _tokenize(tokenizer, prompt, special_tokens)
    start = min(_common_prefix(prompt_ids, ids) for ids in full)
    if start >= max_length:
        raise BadRow(key, index, f"its prompt is {start} tokens, so data.max_length = {max_length} leaves no "
                                 "completion token to learn from; raise data.max_length, or shorten the prompt")
    for ids, column in zip(full, columns):
        if len(ids) == start:
            raise BadRow(key, index, f"{column!r} is empty once tokenized: nothing to compare")
    return prompt_ids[:start], [ids[start:] for ids in full]


def encode_pairs(batch: dict[str, list], indices: list[int], *, tokenizer: Any, special_tokens: bool,
                 max_length: int, key: str) -> dict[str, list]:
    """A batch of preference rows as ``prompt_ids``, ``chosen_ids``, ``rejected_ids``, and ``margin`` where the rows
    have one (TRL's reward models: how far the chosen reward must exceed the rejected) (Dataset.map, batched)."""
    out: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    prompts = batch.get("prompt", [None] * len(indices))
    for prompt, chosen, rejected, index in zip(prompts, batch["chosen"], batch["rejected"], indices):
        prompt_ids, (chosen_ids, rejected_ids) = _encode_row(
            tokenizer, prompt, [chosen, rejected], ["chosen", "rejected"], special_tokens, max_length, key, index)
        out["prompt_ids"].append(prompt_ids)
        out["chosen_ids"].append(chosen_ids)
        out["rejected_ids"].append(rejected_ids)
    if "margin" in batch:
        out["margin"] = [_margin(value, key, index) for value, index in zip(batch["margin"], indices)]
    return out


def _margin(value: Any, key: str, index: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRow(key, index, f"'margin' holds {value!r}, expected a finite number (how far the chosen reward "
                                 "must exceed the rejected one)")
    return float(value)


def encode_unpaired(batch: dict[str, list], indices: list[int], *, tokenizer: Any, special_tokens: bool,
                    max_length: int, key: str) -> dict[str, list]:
    """A batch of unpaired rows as ``prompt_ids``, ``completion_ids`` and ``label`` (Dataset.map, batched)."""
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "label": []}
    for prompt, completion, label, index in zip(batch["prompt"], batch["completion"], batch["label"], indices):
        if not isinstance(label, bool):
            raise BadRow(key, index, f"'label' holds {_a(label)} ({label!r}), expected true (desirable) or false")
        prompt_ids, (completion_ids,) = _encode_row(
            tokenizer, prompt, [completion], ["completion"], special_tokens, max_length, key, index)
        out["prompt_ids"].append(prompt_ids)
        out["completion_ids"].append(completion_ids)
        out["label"].append(label)
    return out
