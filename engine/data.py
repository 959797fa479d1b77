"""Data: documents from text sources, a tokenizer, datasets of token ids and the batch collator.

``data.train`` / ``data.eval`` name one of three kinds of source:

* ``"embedded"``: docstrings of Python's own standard library, so a run works with no data;
* a local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` file of documents;
* ``"package.module:function"``: called with the tokenizer, returns a ready torch ``Dataset``.

Text sources are tokenized into a :class:`PackedDataset` (``data.packing = true``: documents
joined by eos and cut into ``max_length`` blocks) or a :class:`DocumentDataset` (one padded row
per document). Examples carry unshifted ``labels``: Hugging Face causal LMs shift them inside.

transformers is imported inside the functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from .config import DataConfig
from .errors import ConfigError
from .loss import IGNORE_INDEX
from .util import call_user, is_callable_spec, load_callable, require

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Byte-level BPE starts from all 256 bytes plus the special tokens; merges come on top.
MIN_VOCAB_SIZE = 256 + 2
# Documents are cut by the datasets, not the tokenizer: no "sequence too long" warnings.
MODEL_MAX_LENGTH = 1 << 40
TEXT_EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Pure-Python stdlib modules with plenty of prose in their docstrings; each is present on
# CPython 3.11+ (one that a distribution leaves out is skipped). Roughly 0.6 MB of text.
EMBEDDED_MODULES = (
    "abc", "argparse", "ast", "asyncio.events", "bdb", "calendar", "cmd", "codecs",
    "collections", "concurrent.futures._base", "configparser", "contextlib", "dataclasses",
    "datetime", "difflib", "doctest", "email.message", "enum", "fractions", "functools",
    "http.client", "http.server", "inspect", "ipaddress", "json", "json.decoder", "json.encoder",
    "locale", "logging", "mailbox", "optparse", "os", "pathlib", "pdb", "pickle", "queue",
    "random", "re", "shutil", "smtplib", "socket", "statistics", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "traceback", "turtle", "typing",
    "unittest.case", "urllib.parse", "urllib.request", "uuid", "xml.etree.ElementTree", "zipfile",
)
MIN_DOCSTRING_CHARS = 40  # shorter ones are mostly "Return self." boilerplate


# ---------------------------------------------------------------------------- text sources


def embedded_corpus() -> list[str]:
    """Docstrings of :data:`EMBEDDED_MODULES`, in module then source order (read, not imported)."""
    return list(_embedded_docstrings())


@functools.lru_cache(maxsize=1)
def _embedded_docstrings() -> tuple[str, ...]:
    stdlib = Path(sysconfig.get_path("stdlib"))
    docs: list[str] = []
    for name in EMBEDDED_MODULES:
        base = stdlib.joinpath(*name.split("."))
        # A module may be a file or (after a refactor in a later Python) a package.
        path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
        if path is None:
            continue
        tree = ast.parse(path.read_bytes(), filename=str(path))
        defs = [n for n in ast.walk(tree)
                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in [tree, *sorted(defs, key=lambda n: n.lineno)]:
            doc = ast.get_docstring(node, clean=True) or ""  # clean: inspect.cleandoc's dedent
            # cleandoc keeps whitespace-only lines when no line sets the indentation to remove.
            doc = "\n".join(line.rstrip() for line in doc.splitlines()).strip()
            if len(doc) >= MIN_DOCSTRING_CHARS:
                docs.append(doc)
    return tuple(docs)


def read_texts(source: str, text_column: str, key: str) -> list[str]:
    """The documents of ``source``: ``"embedded"`` or a local text file (see module docs).

    ``key`` is the config key naming the source ("data.train"), used in error messages.
    """
    if source == "embedded":
        return embedded_corpus()
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"{key}: file not found: {source} (expected 'embedded', a "
                          f"{'/'.join(TEXT_EXTENSIONS)} file or 'package.module:function')")
    if not path.is_file():
        raise ConfigError(f"{key}: {source} is not a file")
    suffix = path.suffix.lower()
    if suffix not in TEXT_EXTENSIONS:
        raise ConfigError(f"{key}: unsupported file type {suffix or '(none)'!r} for {source}; "
                          f"supported: {', '.join(TEXT_EXTENSIONS)}")
    if suffix == ".parquet":
        texts = _read_parquet(path, text_column, key)
    else:
        try:
            content = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{key}: {source} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if suffix == ".txt":
            texts = [line for line in content.splitlines() if line.strip()]
        elif suffix == ".jsonl":
            texts = _read_jsonl(content, path, text_column, key)
        else:
            texts = _read_json(content, path, text_column, key)
    if not texts:
        raise ConfigError(f"{key}: {source} holds no documents")
    return texts


def _read_jsonl(content: str, path: Path, column: str, key: str) -> list[str]:
    texts = []
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}: JSON syntax error in {path} line {lineno}: {exc.msg}") from None
        texts.append(_text_of(record, column, key, f"{path} line {lineno}"))
    return texts


def _read_json(content: str, path: Path, column: str, key: str) -> list[str]:
    try:
        records = json.loads(content)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{key}: JSON syntax error in {path} line {exc.lineno}: {exc.msg}") from None
    if not isinstance(records, list):
        raise ConfigError(f"{key}: {path} must hold a JSON list of objects, "
                          f"got a {type(records).__name__}")
    return [_text_of(r, column, key, f"{path} item {i}") for i, r in enumerate(records)]


def _text_of(record: Any, column: str, key: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ConfigError(f"{key}: {where}: expected a JSON object, got {type(record).__name__}")
    if column not in record:
        raise ConfigError(f"data.text_column: column {column!r} not in {key} file {where} "
                          f"(columns: {', '.join(record) or 'none'})")
    value = record[column]
    if not isinstance(value, str):
        raise ConfigError(f"{key}: {where}: column {column!r} holds a {type(value).__name__}, "
                          "expected a string")
    return value


def _read_parquet(path: Path, column: str, key: str) -> list[str]:
    require("pyarrow", "pyarrow", "Parquet data")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except pa.ArrowException as exc:
        raise ConfigError(f"{key}: cannot read Parquet file {path}: {exc}") from None
    if column not in schema.names:
        raise ConfigError(f"data.text_column: column {column!r} not in {key} file {path} "
                          f"(columns: {', '.join(schema.names)})")
    field_type = schema.field(column).type
    if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
        raise ConfigError(f"{key}: {path}: column {column!r} has type {field_type}, expected string")
    values = pq.read_table(path, columns=[column]).column(column)
    if values.null_count:
        raise ConfigError(f"{key}: {path}: column {column!r} has {values.null_count} null value(s)")
    return values.to_pylist()


# ---------------------------------------------------------------------------- tokenizers


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` (deterministic for the same input).

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


def build_tokenizer(data: DataConfig, model_source: str) -> PreTrainedTokenizerBase:
    """The run's tokenizer per ``data.tokenizer``; ``model_source`` is ``train.model``."""
    if data.tokenizer == "auto":
        model_dir = Path(model_source)
        if any((model_dir / name).is_file() for name in TOKENIZER_FILES):
            return load_tokenizer(model_source, "train.model")
    elif data.tokenizer != "train":
        return load_tokenizer(data.tokenizer, "data.tokenizer")
    if is_callable_spec(data.train):
        raise ConfigError(f"data.tokenizer = {data.tokenizer!r} trains a tokenizer, which needs text "
                          f"data, but data.train is the callable {data.train!r}; "
                          "set data.tokenizer to a tokenizer folder")
    texts = read_texts(data.train, data.text_column, "data.train")
    return train_tokenizer(texts, data.tokenizer_vocab_size)


# ---------------------------------------------------------------------------- datasets


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ConfigError("data.tokenizer: the tokenizer has no eos token; "
                          "documents need one to mark where they end")
    return tokenizer.eos_token_id


def _encode(documents: list[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    if not documents:
        return []  # transformers fails on an empty batch
    # One batched call: a fast tokenizer encodes the batch in parallel in Rust.
    return tokenizer(documents, add_special_tokens=False, return_attention_mask=False)["input_ids"]


class PackedDataset(Dataset):
    """Documents, each followed by eos, concatenated and cut into blocks of ``max_length``.

    The tail shorter than a block is dropped. All blocks live in one int64 tensor
    ``[len(self), max_length]``, so no example needs padding.
    """

    def __init__(self, documents: list[str], tokenizer: PreTrainedTokenizerBase, max_length: int,
                 key: str = "data.train"):
        eos = _eos_id(tokenizer)
        stream: list[int] = []
        for ids in _encode(documents, tokenizer):
            stream.extend(ids)
            stream.append(eos)
        count = len(stream) // max_length
        if count == 0:
            raise ConfigError(f"{key}: {len(stream)} tokens, fewer than data.max_length = {max_length}, "
                              "so packing yields no example; lower data.max_length or set "
                              "data.packing = false")
        self.blocks = torch.tensor(stream[: count * max_length], dtype=torch.long).view(count, max_length)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.blocks[index]
        return {"input_ids": row, "labels": row}


class DocumentDataset(Dataset):
    """One example per document: its tokens plus eos, truncated to ``max_length``."""

    def __init__(self, documents: list[str], tokenizer: PreTrainedTokenizerBase, max_length: int,
                 key: str = "data.train"):
        eos = _eos_id(tokenizer)
        if not documents:
            raise ConfigError(f"{key}: no documents")
        self.rows = [torch.tensor((ids + [eos])[:max_length], dtype=torch.long)
                     for ids in _encode(documents, tokenizer)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        return {"input_ids": row, "labels": row}


class DataCollator:
    """Batches examples: stacks equal-length rows, else right-pads and adds ``attention_mask``.

    Padded ``input_ids`` get ``pad_token_id``, padded ``labels`` get -100 (ignored by the loss).
    Examples without ``labels`` learn every real token. Other keys are kept when they stack.
    """

    _CORE_KEYS = ("input_ids", "labels", "attention_mask")

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        labels = [torch.as_tensor(f["labels"], dtype=torch.long) if "labels" in f else None
                  for f in features]
        masks = [torch.as_tensor(f["attention_mask"], dtype=torch.long) if "attention_mask" in f
                 else None for f in features]
        if len({len(row) for row in ids}) == 1 and all(m is None for m in masks):
            # Packed data: nothing to pad, and no mask means the model attends to everything.
            batch = {"input_ids": torch.stack(ids),
                     "labels": torch.stack([row if lab is None else lab for row, lab in zip(ids, labels)])}
        else:
            batch = self._pad(ids, labels, masks)
        for key in features[0]:
            if key in self._CORE_KEYS:
                continue
            try:
                batch[key] = torch.stack([torch.as_tensor(f[key]) for f in features])
            except (KeyError, TypeError, ValueError, RuntimeError):
                pass  # metadata such as string ids or ragged lists is no model input
        return batch

    def _pad(self, ids: list[torch.Tensor], labels: list[torch.Tensor | None],
             masks: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        size = (len(ids), max(len(row) for row in ids))
        input_ids = torch.full(size, self.pad_token_id, dtype=torch.long)
        label_ids = torch.full(size, IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros(size, dtype=torch.long)
        for i, (row, lab, mask) in enumerate(zip(ids, labels, masks)):
            n = len(row)
            input_ids[i, :n] = row
            attention[i, :n] = 1 if mask is None else mask
            if lab is None:
                label_ids[i, :n] = row.masked_fill(attention[i, :n] == 0, IGNORE_INDEX)
            else:
                label_ids[i, : len(lab)] = lab
        return {"input_ids": input_ids, "labels": label_ids, "attention_mask": attention}


def _call_source(spec: str, key: str, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    dataset = call_user(key, spec, load_callable(spec, key), tokenizer)
    if not isinstance(dataset, Dataset):  # IterableDataset is a Dataset too
        raise ConfigError(f"{key}: {spec!r} returned a {type(dataset).__name__}, "
                          "expected a torch.utils.data.Dataset or IterableDataset")
    return dataset


def build_datasets(data: DataConfig, tokenizer: PreTrainedTokenizerBase,
                   seed: int) -> tuple[Dataset, Dataset | None, DataCollator]:
    """The train dataset, the eval dataset (or None) and the collator for ``data``."""
    if data.max_length < 2:
        raise ConfigError(f"data.max_length: must be at least 2, got {data.max_length}")
    if not 0 <= data.eval_split < 1:
        raise ConfigError(f"data.eval_split: must be in [0, 1), got {data.eval_split}")
    dataset_class = PackedDataset if data.packing else DocumentDataset

    def from_source(source: str, key: str) -> Dataset:
        if is_callable_spec(source):
            return _call_source(source, key, tokenizer)
        texts = read_texts(source, data.text_column, key)
        return dataset_class(texts, tokenizer, data.max_length, key)

    if data.eval is not None or data.eval_split == 0:
        train = from_source(data.train, "data.train")
        evaluation = None if data.eval is None else from_source(data.eval, "data.eval")
    else:
        if is_callable_spec(data.train):
            raise ConfigError(f"data.eval_split: holds out documents of text data, but data.train is "
                              f"the callable {data.train!r}; set data.eval instead")
        texts = read_texts(data.train, data.text_column, "data.train")
        train_texts, eval_texts = _split(texts, data.eval_split, seed)
        train = dataset_class(train_texts, tokenizer, data.max_length, "data.train")
        evaluation = dataset_class(eval_texts, tokenizer, data.max_length, "data.eval_split")
    return train, evaluation, DataCollator(tokenizer.pad_token_id)


def _split(texts: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, eval) documents: a seeded random ``fraction`` held out, at least one each side."""
    if len(texts) < 2:
        raise ConfigError(f"data.eval_split: data.train has {len(texts)} document(s); holding out "
                          "eval documents needs at least 2; set data.eval instead")
    count = min(max(1, round(len(texts) * fraction)), len(texts) - 1)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    held_out = set(order[:count])
    # Both sides keep the file's document order; the DataLoader shuffles training examples.
    train = [t for i, t in enumerate(texts) if i not in held_out]
    evaluation = [t for i, t in enumerate(texts) if i in held_out]
    return train, evaluation
