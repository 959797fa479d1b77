"""Chats (``messages`` rows) rendered through the tokenizer's chat template, with the assistant's spans."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from .sources import BadRow, _a, _first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # how transformers and TRL find one in a template


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], key: str = "data.train",
                index: int = 0, spans: bool = True) -> tuple[str, list[tuple[int, int]]]:
    """A conversation rendered with the tokenizer's chat template, and the character spans of
    its assistant turns (none unless ``spans``). A row that cannot be rendered is refused as row
    ``index`` of ``key``.

    A template that marks what the assistant generates with ``{% generation %}`` blocks gives
    those blocks (what TRL's assistant_only_loss learns). Otherwise a turn's span runs from after
    the generation prompt to the end of the turn, found by rendering the conversation up to it
    with the generation prompt and through it: templates render a conversation's prefix as a
    prefix of its text.
    """
    messages = _chat_turns(messages, key, index)

    def render(turns: list[dict[str, Any]], prompt: bool) -> str:
        if not turns:
            return ""
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt)
        except Exception as exc:  # a jinja error, raise_exception() in the template, or its own TypeError
            reason = f"{type(exc).__name__}: {_first_line(exc).rstrip('.')}"
            raise BadRow(key, index, f"the chat template raised {reason}; fix the row, or the template "
                                     "(data.chat_template, or the tokenizer's own)") from None

    text = render(messages, False)
    if not spans:
        return text, []
    template = tokenizer.get_chat_template()
    if GENERATION_BLOCK.search(template):
        from transformers.utils.chat_template_utils import render_jinja_template

        # rendered as apply_chat_template renders it (the same text), with the blocks' character spans
        _, marked = render_jinja_template([messages], chat_template=template, return_assistant_tokens_mask=True,
                                          **tokenizer.special_tokens_map)
        return text, [tuple(span) for span in marked[0]]
    found = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (text.startswith(through) and through.startswith(start)):
            raise BadRow(key, index, "the chat template does not render a conversation's start as the start of its "
                                     "text, so the assistant tokens cannot be found; set data.train_on_all_tokens, "
                                     "or use a template that marks them with {% generation %}")
        found.append((len(start), len(through)))
    return text, found


def _chat_turns(messages: Any, key: str, index: int) -> list[dict[str, Any]]:
    """The turns of a chat row, checked, without the null values Arrow fills in for keys that other
    turns have (as TRL's SFTTrainer drops them): a template would render them as "None". A turn
    whose content is null (or missing) is refused, unless it holds tool_calls."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRow(key, index, "'messages' must be a list of {'role': ..., 'content': ...}")
    turns = [_without_nulls(m) for m in messages]
    for number, turn in enumerate(turns):
        role = turn.get("role")
        if not isinstance(role, str):
            got = "none" if role is None else f"{_a(role)} ({role!r})"
            raise BadRow(key, index, f"message {number} has {got} as its role, expected a string such as 'user'")
        content = turn.get("content")
        if content is None and "tool_calls" not in turn:
            raise BadRow(key, index, f"message {number} ({role}) has no content (null or missing); give it a "
                                     "string, or leave the turn out")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRow(key, index, f"message {number} ({role}) has {_a(content)} as its content, "
                                     "expected a string (or a list of parts)")
    if not any(turn["role"] == "assistant" for turn in turns):
        raise BadRow(key, index, f"no assistant message, so nothing to learn; roles: "
                                 f"{', '.join(turn['role'] for turn in turns) or 'none'}")
    return turns


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
