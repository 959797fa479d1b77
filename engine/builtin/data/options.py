"""The ``[data]`` keys, declared by the data builtin that reads them; ``engine.config.DataConfig`` has them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    text_column: str = option("text", nonempty=True, help=(
        "column holding the text (rows with 'messages', 'prompt'/'completion' or 'input_ids' use those)"))
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
    packing: bool | Literal["document"] = option(True, help=(
        "true: concatenate examples and cut max_length rows; false: one padded example per row; "
        "'document': whole examples packed per row, attention kept within each (padding-free)"))
    truncation: Literal["truncate", "drop"] = option("truncate", help=(
        "examples longer than max_length (packing false or 'document'): cut, or left out; counts are logged"))
    train_on_all_tokens: bool = option(False, help=(
        "chat and prompt/completion data: learn every token, not only the assistant / completion ones"))
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
