"""The run's tokenizer: ``data.tokenizer`` loaded, the model folder's, or one trained on the data."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from engine.errors import ConfigError
from engine.util import is_callable_spec

from .sources import data_kind, load_source, logger, text_batches
from .task_rows import check_columns, tokenizer_texts

if TYPE_CHECKING:
    from engine.config import DataConfig  # assembled from the builtins' options: not at import
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Byte-level BPE starts from all 256 bytes plus the special tokens; merges come on top.
MIN_VOCAB_SIZE = 256 + 2
# Documents are cut by the datasets, not the tokenizer: no "sequence too long" warnings.
MODEL_MAX_LENGTH = 1 << 40
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
STREAMING_TOKENIZER_ROWS = 100_000  # data.streaming: documents a trained tokenizer learns from


def train_tokenizer(texts: Iterable[str] | Iterable[list[str]], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` (strings, or batches of them: nothing
    needs to be held at once); deterministic for the same input.

    ``<|endoftext|>`` is bos and eos, ``<|pad|>`` is pad; no special tokens are added on encode.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"data.tokenizer_vocab_size: must be at least {MIN_VOCAB_SIZE} "
                          f"(256 bytes + 2 special tokens), got {vocab_size}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # Every byte is in the vocabulary, so any text encodes, seen in training or not.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        # The default clean-up rewrites " ." to "." and breaks decode(encode(text)) == text.
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str, key: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in local folder ``path`` (named by config ``key``); pad falls back to eos."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{key}: tokenizer folder not found: {path}")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: no usable tokenizer in {path} "
                          f"(expected {' or '.join(TOKENIZER_FILES)}): {exc}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{key}: the tokenizer in {path} has no eos token; "
                          "documents need one to mark where they end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def has_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds a saved tokenizer (a model folder, a checkpoint)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer_source(data: DataConfig, model_source: str) -> None:
    """Pretrained weights (a ``train.model`` folder) keep the tokenizer their embeddings belong to:
    training a new one for them is refused, as is a folder without one (unless data.tokenizer names one)."""
    if data.tokenizer not in ("auto", "train") or not Path(model_source).is_dir():
        return
    if data.tokenizer == "train":
        raise ConfigError(f"data.tokenizer = 'train' would pair a newly trained tokenizer with the pretrained "
                          f"weights of train.model {model_source!r}, whose embeddings belong to its own "
                          "tokenizer; set data.tokenizer = 'auto' (the model folder's tokenizer) or to the "
                          "folder of the tokenizer the weights were trained with")
    if not has_tokenizer(model_source):
        raise ConfigError(f"data.tokenizer: train.model {model_source!r} holds pretrained weights but no "
                          f"tokenizer ({' or '.join(TOKENIZER_FILES)}); set data.tokenizer to the folder of "
                          "the tokenizer the weights were trained with")


def build_tokenizer(data: DataConfig, model_source: str, rows: Any = None,
                    task: str = "causal-lm") -> PreTrainedTokenizerBase:
    """The run's tokenizer per ``data.tokenizer``; ``model_source`` is ``train.model``. A trained
    one learns from ``rows`` (a datasets object given to Run), else from ``data.train``: the text
    column, or the columns of ``task`` (engine/builtin/tasks.py)."""
    if data.tokenizer not in ("auto", "train"):
        return load_tokenizer(data.tokenizer, "data.tokenizer")
    if Path(model_source).is_dir():
        check_tokenizer_source(data, model_source)
        return load_tokenizer(model_source, "train.model")
    key = "data.train" if rows is None else "train_dataset"
    if rows is None:
        if is_callable_spec(data.train):
            raise ConfigError(f"data.tokenizer = {data.tokenizer!r} trains a tokenizer, which needs text "
                              f"data, but data.train is the callable {data.train!r}; "
                              "set data.tokenizer to a tokenizer folder")
        rows = load_source(data.train, data, "data.train")
    if task != "causal-lm":
        check_columns(rows, task, data, key)
        if data.streaming:
            rows = rows.take(STREAMING_TOKENIZER_ROWS)
        return train_tokenizer(tokenizer_texts(rows, task, data), data.tokenizer_vocab_size)
    if data_kind(rows, data, key) != "text":
        raise ConfigError(f"data.tokenizer = {data.tokenizer!r} trains a tokenizer on the text column "
                          f"{data.text_column!r}, which {key} lacks; set data.tokenizer to a tokenizer folder")
    if data.streaming:  # a corpus larger than memory: its start is sample enough
        rows = rows.take(STREAMING_TOKENIZER_ROWS)
        logger.info("data.tokenizer: training on the first %d documents of the stream", STREAMING_TOKENIZER_ROWS)
    return train_tokenizer(text_batches(rows, data.text_column, key=key), data.tokenizer_vocab_size)
