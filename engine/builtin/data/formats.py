"""Prompt formats (``data.format``): Axolotl's and LLaMA-Factory's common row layouts made into the
examples the engine already learns from, with the loss mask their users expect
(``data.train_on_all_tokens = false``: the response only).

- ``alpaca``: rows of ``instruction``, ``input`` (optional), ``output`` and ``system`` (optional),
  rendered with the Stanford Alpaca prompt as Axolotl writes it (``axolotl/prompters.py``,
  ``AlpacaPrompter``, instruct style: the preamble with or without input, then ``### Instruction:``,
  ``### Input:``, ``### Response:``; a row's ``system`` replaces the preamble as
  ``### System:\\n{system}\\n\\n``, as ``prompt_strategies/alpaca_w_system.py`` does). The prompt and the
  output then go through the prompt/completion encoder: loss on the output and the eos appended to it.
- ``sharegpt`` and ``chat``: a column of turns whose role and text sit under any keys
  (``data.messages_column``, ``data.role_key``, ``data.content_key``), the roles mapped by
  ``data.roles`` (Axolotl's ``chat_template`` type with ``field_messages``,
  ``message_property_mappings`` and ``roles``), then the chat encoder (the tokenizer's chat
  template; loss on the assistant turns). sharegpt reads ``conversations`` of ``{from, value}``
  with roles human / gpt / system, and a ``system`` column as the first turn (LLaMA-Factory's
  layout). LLaMA-Factory's ``observation`` and ``function_call`` turns are not mapped by default: their
  rendering is the template's business, so such a row is refused until ``data.roles`` says what they are
  (e.g. ``{observation = "tool", function_call = "assistant"}``).
- ``input_output``: Axolotl's template-free rows, ``{"segments": [{"label": true, "text": ...}]}``:
  each segment tokenized on its own, concatenated as is, learnt where its label is true. As in Axolotl
  (``prompt_strategies/input_output.py``, docs/dataset-formats/template_free.qmd) nothing is added:
  no BOS, no EOS; the segments' text carries them where the user wants them.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

from engine.errors import ConfigError
from engine.loss import IGNORE_INDEX

from .chat import _chat_turns
from .packing import _encode_chat, _encode_completion
from .preference import PREFERENCE_KINDS, row_texts as preference_texts
from .sources import (
    BadRow, _a, _check_strings, _is_saved_dataset, data_kind, load_source, messages_column, source_files,
    text_batches,
)

if TYPE_CHECKING:
    from engine.config import DataConfig  # assembled from the builtins' options: not at import


# The Stanford Alpaca prompt, as Axolotl's AlpacaPrompter (instruct style) writes it.
ALPACA_PREAMBLE = ("Below is an instruction that describes a task, paired with an input that provides further "
                   "context. Write a response that appropriately completes the request.\n\n")
ALPACA_PREAMBLE_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                            "completes the request.\n\n")
ALPACA_SYSTEM = "### System:\n{system}\n\n"  # alpaca_w_system's SystemDataPrompter: replaces the preamble
ALPACA_TURN = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_TURN_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"

CHAT_FORMATS = ("auto", "chat", "sharegpt")  # the formats that read data.messages_column and the role keys
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
PLAN_ROWS = 100  # rows checked at configure time (engine plan): the first of each local source


class ChatFields(NamedTuple):
    """Where a conversation's turns are: the ``column``, each turn's ``role_key`` and ``content_key``,
    and ``roles`` (source role -> chat role; None: the roles as they are)."""

    column: str
    role_key: str
    content_key: str
    roles: dict[str, str] | None

    def as_they_are(self) -> bool:
        """Whether the rows are chats as the chat encoder reads them (nothing to map)."""
        return self == ("messages", "role", "content", None)


def chat_fields(data: DataConfig) -> ChatFields:
    """The chat keys of ``data``, sharegpt's defaults filled in; ``data.roles`` as source -> chat role."""
    sharegpt = data.format == "sharegpt"
    roles = data.roles if data.roles is not None else SHAREGPT_ROLES if sharegpt else None
    return ChatFields(messages_column(data), data.role_key or ("from" if sharegpt else "role"),
                      data.content_key or ("value" if sharegpt else "content"), _source_roles(roles))


def _source_roles(roles: dict[str, Any] | None) -> dict[str, str] | None:
    """``data.roles`` as source role -> chat role: Axolotl's form (chat role -> [source roles]) inverted."""
    if roles is None:
        return None
    mapped: dict[str, str] = {}
    for name, value in roles.items():
        if isinstance(value, str):
            mapped[name] = value
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            mapped.update((source, name) for source in value)
        else:
            raise ConfigError(f"data.roles: {name!r} maps to {value!r}; give a chat role (source = \"user\") or "
                              f"a list of source roles (user = [\"human\"])")
    return mapped


def check_options(data: DataConfig) -> None:
    """The format keys agree with each other: the chat keys are read by a chat format only."""
    given = [name for name in ("messages_column", "role_key", "content_key", "roles") if getattr(data, name) is not None]
    if given and data.format not in CHAT_FORMATS:
        raise ConfigError(f"data.{given[0]}: read by data.format = 'chat' or 'sharegpt' only, but data.format is "
                          f"{data.format!r}; remove it, or set data.format = 'chat'")
    chat_fields(data)  # data.roles checked


# ---------------------------------------------------------------------------- rows into what the encoders read


def alpaca_prompt(instruction: str, context: str | None, system: str | None) -> str:
    """The Alpaca prompt of a row (its ``input`` is the ``context``), up to and including ``### Response:\\n``;
    an empty input or system is none, as in Axolotl."""
    preamble = ALPACA_SYSTEM.format(system=system) if system else ALPACA_PREAMBLE if context else \
        ALPACA_PREAMBLE_NO_INPUT
    turn = ALPACA_TURN.format(instruction=instruction, input=context) if context else \
        ALPACA_TURN_NO_INPUT.format(instruction=instruction)
    return preamble + turn


def alpaca_pairs(batch: dict[str, list], indices: list[int], key: str) -> dict[str, list[str]]:
    """The batch's alpaca rows as prompt/completion columns; a row without a string instruction or output,
    or with an input or system that is no string, refused."""
    count = len(batch["instruction"])
    for column in ("instruction", "output"):
        _check_strings(batch[column], indices, column, key)
    optional = {column: batch.get(column, [None] * count) for column in ("input", "system")}
    for column, values in optional.items():
        for value, index in zip(values, indices):
            if value is not None and not isinstance(value, str):
                raise BadRow(key, index, f"{column!r} holds {_a(value)}, expected a string (or nothing)")
    prompts = [alpaca_prompt(*row) for row in zip(batch["instruction"], optional["input"], optional["system"])]
    return {"prompt": prompts, "completion": batch["output"]}


def mapped_chats(batch: dict[str, list], indices: list[int], fields: ChatFields, key: str,
                 system: bool = False) -> list[list[dict[str, Any]]]:
    """The batch's conversations as chat turns ``{role, content, ...}``: ``fields`` says where the role and
    the text are and maps the roles; with ``system``, a non-empty ``system`` column becomes the first turn."""
    systems = batch.get("system") if system else None
    chats = []
    for position, (turns, index) in enumerate(zip(batch[fields.column], indices)):
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            got = "nothing (null)" if turns is None else _a(turns) if not isinstance(turns, list) else \
                f"{_a(next(t for t in turns if not isinstance(t, dict)))} in it"
            raise BadRow(key, index, f"{fields.column!r} must be a list of {{{fields.role_key!r}: ..., "
                                     f"{fields.content_key!r}: ...}}, got {got}")
        chat = [_mapped_turn(turn, number, fields, key, index) for number, turn in enumerate(turns)]
        if systems is not None and systems[position]:
            chat.insert(0, {"role": "system", "content": systems[position]})
        chats.append(chat)
    return chats


def _mapped_turn(turn: dict[str, Any], number: int, fields: ChatFields, key: str, index: int) -> dict[str, Any]:
    for name, option, what in ((fields.role_key, "role_key", "role"), (fields.content_key, "content_key", "text")):
        if name not in turn:  # most likely the key is named otherwise in these rows
            raise BadRow(key, index, f"message {number} has no key {name!r} (its keys: {', '.join(turn)}); set "
                                     f"data.{option} to the key of each turn's {what}")
    role = turn[fields.role_key]
    if role is None:
        raise BadRow(key, index, f"message {number} has no role (its {fields.role_key!r} is null or missing)")
    if fields.roles is not None:
        if role not in fields.roles:
            raise BadRow(key, index, f"message {number} has the role {role!r}, which data.roles does not map "
                                     f"({', '.join(fields.roles)}); add it, e.g. data.roles = {{{role} = \"user\"}}")
        role = fields.roles[role]
    others = {name: value for name, value in turn.items() if name not in (fields.role_key, fields.content_key)}
    return {**others, "role": role, "content": turn[fields.content_key]}


def segment_parts(segments: Any, key: str, index: int) -> list[tuple[bool, str]]:
    """An input_output row's segments as (learnt, text) pairs, checked."""
    if not isinstance(segments, list) or not segments:
        got = "an empty list" if isinstance(segments, list) else f"{_a(segments)} ({segments!r})"[:80]
        raise BadRow(key, index, f"'segments' holds {got}, expected a list of {{\"label\": true|false, \"text\": ...}}")
    parts = []
    for number, segment in enumerate(segments):
        label = segment.get("label") if isinstance(segment, dict) else None
        text = segment.get("text") if isinstance(segment, dict) else None
        if not isinstance(label, bool) or not isinstance(text, str):
            raise BadRow(key, index, f"segment {number} is {segment!r}"[:120] + ", expected {\"label\": true|false, "
                                     "\"text\": a string}")
        parts.append((label, text))
    return parts


def row_texts(rows: Any, kind: str, data: DataConfig, key: str, batch_size: int = 1000) -> Iterator[list[str]]:
    """The text of rows of any causal-LM ``kind``, in batches, for training a tokenizer: a text row's column, a
    prompt and its completion, an alpaca row as rendered, an input_output row's segments, a chat's turns."""
    if kind == "text":
        yield from text_batches(rows, data.text_column, batch_size, key)
        return
    if kind == "tokens":
        raise ConfigError(f"{key} holds token ids (input_ids), from which no tokenizer can be trained; set "
                          "data.tokenizer to the folder of the tokenizer that made them")
    fields = chat_fields(data)
    for start, batch in zip(itertools.count(0, batch_size), rows.iter(batch_size=batch_size)):
        if kind in PREFERENCE_KINDS:
            yield preference_texts(batch, kind)
            continue
        indices = list(range(start, start + len(next(iter(batch.values())))))
        if kind == "alpaca":
            batch = alpaca_pairs(batch, indices, key)
        if kind in ("alpaca", "completion"):
            yield [prompt + completion for prompt, completion in zip(batch["prompt"], batch["completion"])]
        elif kind == "input_output":
            yield ["".join(text for _, text in segment_parts(row, key, index))
                   for row, index in zip(batch["segments"], indices)]
        else:  # chat: the turns' text (the template's own tokens come with data.chat_template's added tokens)
            chats = mapped_chats(batch, indices, fields, key, data.format == "sharegpt")
            yield ["\n".join(turn["content"] for turn in chat if isinstance(turn.get("content"), str))
                   for chat in chats]


# ---------------------------------------------------------------------------- encoders (Dataset.map, batched)


def _encode_alpaca(batch: dict[str, list], indices: list[int], *, tokenizer: Any, all_tokens: bool, eos: int,
                   special_tokens: bool, key: str) -> dict[str, list]:
    return _encode_completion(alpaca_pairs(batch, indices, key), indices, tokenizer=tokenizer,
                              all_tokens=all_tokens, eos=eos, key=key, special_tokens=special_tokens)


def _encode_mapped_chat(batch: dict[str, list], indices: list[int], *, tokenizer: Any, all_tokens: bool,
                        fields: list[Any], system: bool, key: str) -> dict[str, list]:
    chats = mapped_chats(batch, indices, ChatFields(*fields), key, system)
    return _encode_chat({"messages": chats}, indices, tokenizer=tokenizer, all_tokens=all_tokens, key=key)


def _encode_segments(batch: dict[str, list], indices: list[int], *, tokenizer: Any, all_tokens: bool,
                     key: str) -> dict[str, list]:
    rows = [segment_parts(segments, key, index) for segments, index in zip(batch["segments"], indices)]
    texts = [text for parts in rows for _, text in parts]
    # one batched call, each segment on its own: its tokens are exactly the ones it labels (as Axolotl)
    encoded = iter(tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
                   if texts else [])
    out: dict[str, list] = {"input_ids": [], "labels": []}
    for parts in rows:
        ids: list[int] = []
        labels: list[int] = []
        for learnt, _ in parts:
            tokens = next(encoded)
            ids += tokens
            labels += tokens if learnt or all_tokens else [IGNORE_INDEX] * len(tokens)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def format_encoder(kind: str, data: DataConfig, eos: Callable[[], int]) -> tuple[Any, str, dict[str, Any]] | None:
    """The map step (function, its name, its settings) that encodes rows of ``kind`` in ``data.format``,
    or None where the kind's own encoder reads them as they are (text, chats as the template reads
    them, prompt/completion). ``eos()``: the id that ends an alpaca output (the tokenizer's eos); alpaca rows
    get the tokenizer's special tokens with ``data.add_special_tokens`` as prompt/completion rows do
    (Axolotl's alpaca prompt starts with the tokenizer's bos); input_output rows never (as Axolotl)."""
    if kind == "alpaca":
        return _encode_alpaca, "render alpaca and tokenize", {"eos": eos(), "special_tokens": data.add_special_tokens}
    if kind == "input_output":
        return _encode_segments, "tokenize segments", {}
    if kind == "chat":
        fields = chat_fields(data)
        if not fields.as_they_are():
            return _encode_mapped_chat, "map chat turns, render and tokenize", {
                "fields": list(fields), "system": data.format == "sharegpt"}
    return None


# ---------------------------------------------------------------------------- configure time (engine plan)


def _check_batch(batch: dict[str, list], indices: list[int], kind: str, data: DataConfig, key: str) -> None:
    if kind == "alpaca":
        alpaca_pairs(batch, indices, key)
    elif kind == "input_output":
        for segments, index in zip(batch["segments"], indices):
            segment_parts(segments, key, index)
    elif kind == "chat":
        fields = chat_fields(data)
        for chat, index in zip(mapped_chats(batch, indices, fields, key, data.format == "sharegpt"), indices):
            _chat_turns(chat, key, index)


def peekable_sources(data: DataConfig) -> Iterable[tuple[str, str, str]]:
    """(key, source, split) of data.train and data.eval where they are local files or saved datasets:
    their first rows are cheap to read at configure time."""
    for key, source, split in (("data.train", data.train, data.split),
                               ("data.eval", data.eval, data.eval_dataset_split)):
        if source is None:
            continue
        try:
            local = source_files(source, key) is not None or _is_saved_dataset(Path(source).expanduser())
        except ConfigError:  # a path to nothing: refused, with its reason, where it loads
            continue
        if local:
            yield key, source, split


def check_rows(data: DataConfig, key: str, source: str, split: str) -> str | None:
    """The kind of ``source``'s rows (:func:`data_kind`), read from its first rows without loading it all. Unless
    ``data.format`` is 'auto', the first :data:`PLAN_ROWS` rows are read as it says: its columns there, each
    row's values of the format's shape (refused as a :class:`BadRow` counted from 0). With 'auto', rows that
    cannot be read give None: they are refused where the data loads, after the checks that come first."""
    try:
        peek = load_source(source, dataclasses.replace(data, streaming=True), key, split)
        kind = data_kind(peek, data, key)
    except ConfigError:
        if data.format != "auto":
            raise
        return None
    batch = None if data.format == "auto" else next(iter(peek.take(PLAN_ROWS).iter(batch_size=PLAN_ROWS)), None)
    if batch is not None:
        _check_batch(batch, list(range(len(next(iter(batch.values()))))), kind, data, key)
    return kind


def no_chat_template(key: str, data: DataConfig) -> ConfigError:
    return ConfigError(f"{key}: chat data (a {messages_column(data)!r} column) needs a tokenizer with a chat "
                       "template, and this tokenizer has none; set data.chat_template (e.g. 'chatml', "
                       "inline Jinja or a file), or data.tokenizer to a folder whose tokenizer has one")
