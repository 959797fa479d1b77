"""The ``[data]`` keys, declared by the data builtin that reads them; ``engine.config.DataConfig`` has them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.config import option


@dataclass
class DataOptions:
    """``[data]``: the tokenizer and the datasets (builtin.data's ``DATA_OPTIONS``)."""

    train: str = option("embedded", nonempty=True, help=(
        "'embedded' (docstrings that ship with Python), a local .jsonl/.json/.csv/.parquet/.arrow/.txt "
        "file, a glob, a folder (of such files, or saved with save_to_disk), a dataset name for "
        "load_dataset, or 'package.module:function' taking the tokenizer and returning a dataset"))
    eval: str | None = option(None, help="evaluation data, same forms as train")
    eval_split: float = option(0.0, min=0, below=1, help="fraction of the train documents held out for eval when eval is unset")
    config: str | None = option(None, help="the configuration (subset) of a dataset name, as load_dataset's name")
    split: str = option("train", nonempty=True, help="split of a dataset name or saved DatasetDict used for train")
    eval_dataset_split: str = option("validation", nonempty=True, help=(
        "split of a dataset name or saved DatasetDict used for eval"))
    mixture: list[dict[str, Any]] | None = option(None, help=(
        "several train sources in one run instead of data.train ([[data.mixture]] tables): each a 'source' (the "
        "forms of data.train), 'weight' (the fraction of its rows kept, sampled with the seed; default 1), 'split', "
        "'config', 'columns' (keep only these) and its own format keys (format, text_column, messages_column, "
        "role_key, content_key, roles, train_on_all_tokens); data.eval_split holds out a fraction of the mixture"))
    text_column: str = option("text", nonempty=True, help=(
        "column holding the text (rows with 'messages', 'prompt'/'completion' or 'input_ids' use those)"))
    format: Literal["auto", "text", "chat", "prompt_completion", "alpaca", "sharegpt", "input_output"] = option(
        "auto", help=(
            "how rows are read: 'auto' (input_ids, else a messages column: chat, else prompt+completion, else "
            "data.text_column), or forced: 'text', 'chat', 'prompt_completion', 'alpaca' (instruction, input, "
            "output, system: the Stanford Alpaca prompt), 'sharegpt' (conversations of from/value turns), "
            "'input_output' (Axolotl's segments of {label, text}, concatenated as they are)"))
    messages_column: str | None = option(None, nonempty=True, help=(
        "chat and sharegpt: the column of conversations (default 'messages'; sharegpt 'conversations')"))
    role_key: str | None = option(None, nonempty=True, help=(
        "chat and sharegpt: the key of a turn's role (default 'role'; sharegpt 'from')"))
    content_key: str | None = option(None, nonempty=True, help=(
        "chat and sharegpt: the key of a turn's text (default 'content'; sharegpt 'value')"))
    roles: dict[str, Any] | None = option(None, help=(
        "chat and sharegpt: the rows' roles mapped to chat roles, {source = \"user\"} (or Axolotl's "
        "{user = [\"human\"]}); a role not in it is refused (default: as they are; sharegpt {human = \"user\", "
        "gpt = \"assistant\", system = \"system\"})"))
    text_pair_column: str | None = option(None, nonempty=True, help=(
        "sequence classification: the column holding each example's second text (pairs, as in GLUE)"))
    label_column: str | None = option(None, nonempty=True, help=(
        "classification: the column of labels (default: 'label' or 'labels'; token classification: 'tags', "
        "'ner_tags' or 'labels')"))
    tokens_column: str = option("tokens", nonempty=True, help="token classification: the column of words")
    label_all_tokens: bool = option(False, help=(
        "token classification: every sub-word of a word gets its label (B- becoming I-), not only the first"))
    source_column: str = option("source", nonempty=True, help="seq2seq: the column of input texts")
    target_column: str = option("target", nonempty=True, help="seq2seq: the column of target texts")
    max_target_length: int | None = option(None, min=1, help="seq2seq: tokens per target (default: max_length)")
    max_length: int = option(128, min=2, help="tokens per example")
    packing: bool | Literal["document", "bfd", "bfd_split", "wrapped"] = option(True, help=(
        "true: concatenate examples and cut max_length rows (the tail of each 1,000 examples dropped); "
        "'wrapped': the same with that tail kept as a shorter row (TRL's wrapped); false: one padded example "
        "per row; 'document': whole examples packed in order per row, attention kept within each "
        "(padding-free); 'bfd': the same packed best-fit decreasing (TRL's bfd); 'bfd_split': longer "
        "examples cut into max_length pieces first, packed as examples (TRL's bfd_split)"))
    padding_free: bool = option(False, help=(
        "each batch flattened into one row without padding, position_ids restarting per example, attention "
        "kept within each (TRL's padding_free; 'document', 'bfd' and 'bfd_split' packing always are)"))
    truncation: Literal["truncate", "drop"] = option("truncate", help=(
        "examples longer than max_length (packing false, 'document' or 'bfd'): cut, or left out; counts are logged"))
    train_on_all_tokens: bool | Literal["chat"] = option(False, help=(
        "chat and prompt/completion data (and the prompt formats): learn every token, not only the assistant / "
        "completion / response ones; 'chat': chat rows every token, the others their response only (TRL "
        "SFTTrainer's default: assistant_only_loss false, completion_only_loss true)"))
    num_proc: int | None = option(None, min=1, help=(
        "processes for tokenizing (default: one per core up to 8 from 50,000 rows, else 1)"))
    cache_dir: str | None = option(None, help="where datasets caches files and tokenized data (default: HF_DATASETS_CACHE)")
    streaming: bool = option(False, help=(
        "read data.train as it trains (tokenized and packed on the fly), for corpora larger than memory"))
    shuffle_buffer_size: int = option(10_000, min=1, help="streaming: examples in the shuffle buffer")
    tokenizer: str = option("auto", nonempty=True, help=(
        "'auto' (the model folder's tokenizer, else train one), 'train' (refused for a pretrained train.model folder, "
        "whose weights keep their own), or a local tokenizer folder"))
    tokenizer_vocab_size: int = option(1024, min=258, help="vocabulary size of a trained tokenizer")
    tokenizer_train_bytes: int = option(32_000_000, min=0, help=(
        "a trained tokenizer learns from text documents of at most this many bytes in all: evenly spaced ones "
        "when the data holds more (0: all of it)"))
    chat_template: str | None = option(None, nonempty=True, help=(
        "the tokenizer's chat template (saved with it): inline Jinja, the path of a template file, or a name: "
        "'chatml', 'zephyr' (the alignment handbook's), 'llama3', 'tokenizer_default' (the tokenizer's own)"))
    eos_token: str | None = option(None, nonempty=True, help=(
        "the tokenizer's eos token (added as a special token if new; the model's eos_token_id follows)"))
    pad_token: str | None = option(None, nonempty=True, help=(
        "the tokenizer's pad token (added as a special token if new)"))
    bos_token: str | None = option(None, nonempty=True, help=(
        "the tokenizer's bos token (added as a special token if new)"))
    added_tokens: list[str] = option(default_factory=list, help=(
        "new special tokens added to the tokenizer (Axolotl's tokens); the model's embeddings grow to hold them "
        "and, with peft, their rows train and are saved with the adapter"))
    add_special_tokens: bool = option(False, help=(
        "text and prompt/completion data: encode with the tokenizer's special tokens (its bos, as TRL's "
        "SFTTrainer does); the engine appends eos itself; chats get what their template writes"))
