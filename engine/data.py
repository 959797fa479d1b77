"""Data on 🤗 Datasets: sources, a tokenizer, tokenized and packed examples, the batch collators.

``data.train`` / ``data.eval`` name a source (see :func:`load_source`):

* ``"embedded"``: docstrings of Python's own standard library, so a run works with no data;
* a local ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` / ``.arrow`` / ``.txt`` file, a glob,
  a folder of such files or a dataset saved with ``save_to_disk``;
* a dataset name, loaded with ``datasets.load_dataset(name, data.config, split=data.split)``;
* ``"package.module:function"``: called with the tokenizer, returns a torch or datasets dataset.

Rows hold text (``data.text_column``), a chat (``messages``), ``prompt`` / ``completion``, or
ready ``input_ids``. They are tokenized and shaped with ``Dataset.map(batched=True)`` over
Arrow (:func:`prepare`): fingerprinted, cached beside the source's Arrow files, memory-mapped,
so a second start reads the cache. ``data.packing = true`` concatenates examples and cuts rows
of ``max_length``; ``false`` keeps one (padded) example per row; ``"document"`` fills rows with
whole examples whose ``position_ids`` restart, batched padding-free by
:class:`FlatteningCollator`. Examples carry unshifted ``labels`` (or none: every token is
learnt): Hugging Face causal LMs shift them inside.

transformers and datasets are imported inside the functions that need them, so importing this
module stays cheap.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import itertools
import json
import logging
import os
import random
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

import torch
import xxhash
from torch.utils.data import Dataset as TorchDataset

from .config import DataConfig
from .errors import ConfigError
from .loss import IGNORE_INDEX
from .util import call_user, is_callable_spec, is_peft_model, load_callable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger("engine")

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Byte-level BPE starts from all 256 bytes plus the special tokens; merges come on top.
MIN_VOCAB_SIZE = 256 + 2
# Documents are cut by the datasets, not the tokenizer: no "sequence too long" warnings.
MODEL_MAX_LENGTH = 1 << 40
# file suffix -> the datasets builder that reads it
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow",
                 ".txt": "text"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EXAMPLE_COLUMNS = ("input_ids", "labels", "position_ids")  # what the tokenizing steps write
STREAMING_TOKENIZER_ROWS = 100_000  # data.streaming: documents a trained tokenizer learns from
MAP_BATCH_SIZE = 1000  # Dataset.map's default batch: concatenate-packing cuts within one
# Below these sizes reading and tokenizing take a second or so: one process, no progress bars,
# and reading the cache is not worth a line in the console.
LARGE_ROWS = 50_000
LARGE_FILE_BYTES = 50 * 10**6
PIPELINE_VERSION = 1  # part of every cache fingerprint: bump when a map step's output changes

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


def is_datasets_object(obj: Any) -> bool:
    """A 🤗 ``datasets.Dataset`` or ``IterableDataset`` (checked without importing datasets)."""
    return type(obj).__module__.startswith("datasets.") and hasattr(obj, "column_names")


_progress_wanted = True


def show_progress(enabled: bool) -> None:
    """datasets' progress bars (reading, tokenizing large data) on or off, as the console's
    (``train.disable_tqdm``)."""
    global _progress_wanted
    _progress_wanted = enabled


@contextlib.contextmanager
def _progress(large: bool) -> Iterator[None]:
    from datasets.utils import logging as datasets_logging

    if _progress_wanted and large:
        datasets_logging.enable_progress_bar()
    else:
        datasets_logging.disable_progress_bar()
    yield


def load_source(source: str, data: DataConfig, key: str, split: str | None = None) -> Any:
    """The rows of ``source`` as a ``datasets.Dataset`` (an ``IterableDataset`` with
    ``data.streaming``): ``"embedded"``, a local file, glob or folder, a dataset saved with
    ``save_to_disk``, or a dataset name for ``load_dataset`` (with ``data.config``).

    ``key`` is the config key naming the source ("data.train"), used in error messages;
    ``split`` the split of a dataset name or saved ``DatasetDict`` (default ``data.split``).
    """
    import datasets

    split = split or data.split
    if source == "embedded":
        rows = datasets.Dataset.from_dict({"text": embedded_corpus()})
        return rows.to_iterable_dataset() if data.streaming else rows
    path = Path(source).expanduser()
    if glob.has_magic(source):
        files = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise ConfigError(f"{key}: {source} matches no file")
        return _load_files(files, data, key, source)
    if path.is_file():
        return _load_files([str(path)], data, key, source)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _load_saved(path, data, key, split)
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_BUILDERS)
        if not files:
            raise ConfigError(f"{key}: folder {source} holds no {'/'.join(FILE_BUILDERS)} file and no "
                              "dataset saved with save_to_disk")
        return _load_files(files, data, key, source)
    if path.suffix.lower() in FILE_BUILDERS or source.startswith((".", "/", "~")) or path.parent.exists() \
            and path.parent != Path("."):
        raise ConfigError(f"{key}: file not found: {source} (expected 'embedded', a "
                          f"{'/'.join(FILE_BUILDERS)} file, a glob, a folder, a dataset name or "
                          "'package.module:function')")
    try:  # a dataset name: the Hub (or its cache)
        return datasets.load_dataset(source, data.config, split=split, cache_dir=data.cache_dir,
                                     streaming=data.streaming)
    except Exception as exc:  # datasets raises many kinds; all mean "this name does not load"
        raise ConfigError(f"{key}: {source!r} is no local file or folder, and load_dataset({source!r}"
                          f"{', ' + repr(data.config) if data.config else ''}, split={split!r}) failed: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _load_files(files: list[str], data: DataConfig, key: str, source: str) -> Any:
    import datasets

    suffixes = sorted({Path(f).suffix.lower() for f in files})
    unsupported = [s for s in suffixes if s not in FILE_BUILDERS]
    if unsupported:
        raise ConfigError(f"{key}: unsupported file type {unsupported[0] or '(none)'!r} in {source}; "
                          f"supported: {', '.join(FILE_BUILDERS)}")
    builders = {FILE_BUILDERS[s] for s in suffixes}
    if len(builders) > 1:
        raise ConfigError(f"{key}: {source} mixes file types ({', '.join(suffixes)}); name files of one type")
    (builder,) = builders
    try:
        with _progress(sum(os.path.getsize(f) for f in files) >= LARGE_FILE_BYTES):
            rows = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=data.cache_dir,
                                         streaming=data.streaming)
    except Exception as exc:  # parse errors arrive as DatasetGenerationError with the cause chained
        cause = exc.__cause__ or exc.__context__ or exc
        raise ConfigError(f"{key}: cannot read {source} as {builder}: {type(cause).__name__}: "
                          f"{_first_line(cause)}") from None
    if builder == "text":  # one row per line; blank lines are no documents
        with _progress(not data.streaming and len(rows) >= LARGE_ROWS):
            rows = rows.filter(_non_blank, batched=True, input_columns="text")
    return rows


def _non_blank(texts: list[str]) -> list[bool]:
    return [bool(t.strip()) for t in texts]


def _load_saved(path: Path, data: DataConfig, key: str, split: str) -> Any:
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise ConfigError(f"{key}: cannot load the saved dataset in {path}: {_first_line(exc)}") from None
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ConfigError(f"{key}: the saved dataset in {path} has no split {split!r} "
                              f"(splits: {', '.join(saved)}); set data.split / data.eval_dataset_split")
        saved = saved[split]
    return saved.to_iterable_dataset() if data.streaming else saved


def column_names(rows: Any) -> list[str]:
    """The columns of a datasets object; a streaming one without known features is peeked at."""
    names = rows.column_names
    if names is None:  # streaming JSON: the columns are known once a row is read
        first = next(iter(rows.take(1)), None)
        names = list(first) if first is not None else []
    return list(names)


def data_kind(rows: Any, data: DataConfig, key: str) -> str:
    """What the rows hold: "tokens" (input_ids), "chat" (messages), "completion" (prompt and
    completion) or "text" (``data.text_column``); a ConfigError listing the columns otherwise."""
    names = column_names(rows)
    if "input_ids" in names:
        return "tokens"
    if "messages" in names:
        return "chat"
    if "prompt" in names and "completion" in names:
        return "completion"
    if data.text_column in names:
        return "text"
    raise ConfigError(f"data.text_column: {key} has no column {data.text_column!r} (nor input_ids, messages, "
                      f"or prompt and completion); its columns: {', '.join(names) or 'none'}")


def text_batches(rows: Any, column: str, batch_size: int = 1000) -> Iterator[list[str]]:
    """The strings of ``column`` in batches (for training a tokenizer without holding them all)."""
    for batch in rows.iter(batch_size=batch_size):
        texts = batch[column]
        if not all(isinstance(t, str) for t in texts):
            bad = next(t for t in texts if not isinstance(t, str))
            raise ConfigError(f"data.text_column: column {column!r} holds a {type(bad).__name__}, expected strings")
        yield texts

# ---------------------------------------------------------------------------- tokenizers


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


def build_tokenizer(data: DataConfig, model_source: str, rows: Any = None,
                    task: str = "causal-lm") -> PreTrainedTokenizerBase:
    """The run's tokenizer per ``data.tokenizer``; ``model_source`` is ``train.model``. A trained
    one learns from ``rows`` (a datasets object given to Run), else from ``data.train``: the text
    column, or the columns of ``task`` (engine/tasks.py)."""
    if data.tokenizer == "auto":
        model_dir = Path(model_source)
        if any((model_dir / name).is_file() for name in TOKENIZER_FILES):
            return load_tokenizer(model_source, "train.model")
    elif data.tokenizer != "train":
        return load_tokenizer(data.tokenizer, "data.tokenizer")
    if rows is None:
        if is_callable_spec(data.train):
            raise ConfigError(f"data.tokenizer = {data.tokenizer!r} trains a tokenizer, which needs text "
                              f"data, but data.train is the callable {data.train!r}; "
                              "set data.tokenizer to a tokenizer folder")
        rows = load_source(data.train, data, "data.train")
    if task != "causal-lm":
        check_columns(rows, task, data, "data.train")
        if data.streaming:
            rows = rows.take(STREAMING_TOKENIZER_ROWS)
        return train_tokenizer(tokenizer_texts(rows, task, data), data.tokenizer_vocab_size)
    if data_kind(rows, data, "data.train") != "text":
        raise ConfigError(f"data.tokenizer = {data.tokenizer!r} trains a tokenizer on the text column "
                          f"{data.text_column!r}, which data.train lacks; set data.tokenizer to a tokenizer folder")
    if data.streaming:  # a corpus larger than memory: its start is sample enough
        rows = rows.take(STREAMING_TOKENIZER_ROWS)
        logger.info("data.tokenizer: training on the first %d documents of the stream", STREAMING_TOKENIZER_ROWS)
    return train_tokenizer(text_batches(rows, data.text_column), data.tokenizer_vocab_size)




# ---------------------------------------------------------------------------- tokenizing


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                where: str) -> tuple[str, list[tuple[int, int]]]:
    """A conversation rendered with the tokenizer's chat template, and the character spans of
    its assistant turns (each from after the generation prompt to the end of the turn).

    A turn's span is found by rendering the conversation up to it with the generation prompt
    and through it: templates render a conversation's prefix as a prefix of its text.
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ConfigError(f"{where}: 'messages' must be a list of {{'role': ..., 'content': ...}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: no assistant message, so nothing to learn; roles: "
                          f"{', '.join(m['role'] for m in messages) or 'none'}")

    def render(turns: list[dict[str, Any]], prompt: bool) -> str:
        if not turns:
            return ""
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt)

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (text.startswith(through) and through.startswith(start)):
            raise ConfigError(f"{where}: the chat template does not render a conversation's start as the start "
                              "of its text, so the assistant tokens cannot be found; set data.train_on_all_tokens")
        spans.append((len(start), len(through)))
    return text, spans


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


def _encode_text(batch: dict[str, list], *, tokenizer: Any, column: str, eos: int) -> dict[str, list]:
    texts = batch[column]
    if not texts:
        return {"input_ids": []}  # transformers fails on an empty batch
    # One batched call: a fast tokenizer encodes the batch in parallel in Rust.
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return {"input_ids": [row + [eos] for row in ids]}


def _encode_chat(batch: dict[str, list], indices: list[int], *, tokenizer: Any, all_tokens: bool,
                 key: str) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "labels": []}
    for messages, index in zip(batch["messages"], indices):
        text, spans = render_chat(tokenizer, messages, f"{key} row {index}")
        ids, labels = _labelled(tokenizer, text, spans, all_tokens, None)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def _encode_completion(batch: dict[str, list], indices: list[int], *, tokenizer: Any, all_tokens: bool,
                       eos: int, key: str) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "labels": []}
    for prompt, completion, index in zip(batch["prompt"], batch["completion"], indices):
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise ConfigError(f"{key} row {index}: 'prompt' and 'completion' must be strings, got "
                              f"{type(prompt).__name__} and {type(completion).__name__}")
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


def _encode_and_pack(batch: dict[str, list], *, tokenizer: Any, column: str, eos: int, length: int) -> Any:
    """Text tokenized and packed in one step: no tokenized copy of the corpus is written."""
    ids = _encode_text(batch, tokenizer=tokenizer, column=column, eos=eos)["input_ids"]
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


# ---------------------------------------------------------------------------- other tasks' rows

DEFAULT_LABEL_COLUMNS = {"sequence-classification": ("label", "labels"),
                         "token-classification": ("tags", "ner_tags", "labels")}


def _strings(values: list[Any], column: str, key: str) -> list[str]:
    bad = next((v for v in values if not isinstance(v, str)), None)
    if bad is not None:
        raise ConfigError(f"{key}: column {column!r} holds a {type(bad).__name__}, expected strings")
    return values


def _label_ids(values: list[Any], label2id: dict[str, int] | None, column: str, key: str) -> list[Any]:
    """Labels as class ids: strings through ``label2id`` (``train.label2id``)."""
    if not any(isinstance(v, str) for v in values):
        return values
    if label2id is None:
        raise ConfigError(f"{key}: column {column!r} holds strings; set train.label2id = {{name = id, ...}}")
    unknown = next((v for v in values if v not in label2id), None)
    if unknown is not None:
        raise ConfigError(f"{key}: label {unknown!r} is not in train.label2id ({', '.join(label2id)})")
    return [label2id[v] for v in values]


def _encode_sequences(batch: dict[str, list], *, tokenizer: Any, text: str, pair: str | None, label: str,
                      label2id: dict[str, int] | None, max_length: int, key: str) -> dict[str, list]:
    if not batch[text]:
        return {"input_ids": [], "labels": []}
    texts = [_strings(batch[text], text, key)] + ([_strings(batch[pair], pair, key)] if pair else [])
    encoded = dict(tokenizer(*texts, truncation=True, max_length=max_length))
    encoded["labels"] = _label_ids(batch[label], label2id, label, key)
    return encoded


def _begin_to_inside(label2id: dict[str, int] | None) -> dict[int, int]:
    """run_ner's b_to_i_label: the id of each B-X tag -> the id of I-X (others unchanged)."""
    if not label2id:
        return {}
    return {i: label2id.get("I-" + name[2:], i) for name, i in label2id.items() if name.startswith("B-")}


def _encode_words(batch: dict[str, list], *, tokenizer: Any, tokens: str, tags: str, label2id: dict[str, int] | None,
                  label_all_tokens: bool, max_length: int, key: str) -> dict[str, list]:
    if not batch[tokens]:
        return {"input_ids": [], "labels": []}
    for words, word_tags in zip(batch[tokens], batch[tags]):
        if not isinstance(words, list) or not isinstance(word_tags, list) or len(words) != len(word_tags):
            raise ConfigError(f"{key}: columns {tokens!r} and {tags!r} must hold lists of equal length "
                              "(one tag per word)")
    encoding = tokenizer(batch[tokens], truncation=True, max_length=max_length, is_split_into_words=True)
    inside = _begin_to_inside(label2id)
    labels = []
    for row, word_tags in enumerate(batch[tags]):
        ids = _label_ids(word_tags, label2id, tags, key)
        previous, aligned = None, []
        for word in encoding.word_ids(batch_index=row):
            if word is None:
                aligned.append(IGNORE_INDEX)
            elif word != previous:
                aligned.append(ids[word])
            else:
                aligned.append(inside.get(ids[word], ids[word]) if label_all_tokens else IGNORE_INDEX)
            previous = word
        labels.append(aligned)
    return {**encoding, "labels": labels}


def _encode_pairs(batch: dict[str, list], *, tokenizer: Any, source: str, target: str, max_length: int,
                  max_target_length: int, append_eos: bool, key: str) -> dict[str, list]:
    if not batch[source]:
        return {"input_ids": [], "labels": []}
    encoded = dict(tokenizer(_strings(batch[source], source, key), truncation=True, max_length=max_length))
    targets = _strings(batch[target], target, key)
    if append_eos:  # a tokenizer that adds no eos itself: the model must still learn where targets end
        ids = tokenizer(text_target=targets, truncation=True, max_length=max_target_length - 1)["input_ids"]
        encoded["labels"] = [row + [tokenizer.eos_token_id] for row in ids]
    else:
        encoded["labels"] = tokenizer(text_target=targets, truncation=True, max_length=max_target_length)["input_ids"]
    return encoded


def check_columns(rows: Any, task: str, data: DataConfig, key: str) -> None:
    """Refuse rows without the columns ``task`` reads, naming the option and the columns there are."""
    if task != "seq2seq":
        label_column(rows, task, data, key)
    options = {"sequence-classification": ["text_column", *(["text_pair_column"] if data.text_pair_column else [])],
               "token-classification": ["tokens_column"], "seq2seq": ["source_column", "target_column"]}[task]
    names = column_names(rows)
    for option in options:
        column = getattr(data, option)
        if column not in names:
            raise ConfigError(f"data.{option}: {key} has no column {column!r} for {task}; "
                              f"its columns: {', '.join(names) or 'none'}")


def prepare_task_rows(rows: Any, task: str, data: DataConfig, tokenizer: Any, key: str, pipeline: _Pipeline,
            label2id: dict[str, int] | None) -> Any:
    """Rows of a classification or seq2seq task (``train.task``, engine/tasks.py) tokenized as
    transformers' example scripts do (run_glue, run_ner, run_summarization): classification text
    with the tokenizer's special tokens, truncated to ``data.max_length``; each word's tag on its
    first sub-word (every sub-word with ``data.label_all_tokens``), -100 on the others; seq2seq
    targets as ``labels``, ending with eos. The class names of a ClassLabel label column stay with
    the ``labels``."""
    check_columns(rows, task, data, key)
    if task == "seq2seq":
        eos = tokenizer.eos_token_id
        append_eos = eos is not None and tokenizer(text_target="x")["input_ids"][-1:] != [eos]
        return pipeline.map(rows, _encode_pairs, "tokenize source and target", tokenizer=tokenizer,
                            source=data.source_column, target=data.target_column, max_length=data.max_length,
                            max_target_length=data.max_target_length or data.max_length, append_eos=append_eos,
                            key=key)
    label = label_column(rows, task, data, key)
    if task == "sequence-classification":
        encoded = pipeline.map(rows, _encode_sequences, "tokenize for sequence classification", tokenizer=tokenizer,
                               text=data.text_column, pair=data.text_pair_column, label=label, label2id=label2id,
                               max_length=data.max_length, key=key)
    else:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{key}: token classification needs a fast tokenizer (word_ids align the tags)")
        encoded = pipeline.map(rows, _encode_words, "tokenize and align tags", tokenizer=tokenizer,
                               tokens=data.tokens_column, tags=label, label2id=label2id,
                               label_all_tokens=data.label_all_tokens, max_length=data.max_length, key=key)
    feature = rows.features[label] if rows.features else None
    return encoded.cast_column("labels", feature) if class_names(feature, task) else encoded


def tokenizer_texts(rows: Any, task: str, data: DataConfig) -> Iterator[list[str]]:
    """Batches of the task's text, for training a tokenizer on it."""
    if task == "sequence-classification":
        yield from text_batches(rows, data.text_column)
        if data.text_pair_column:
            yield from text_batches(rows, data.text_pair_column)
    elif task == "token-classification":
        for batch in rows.iter(batch_size=1000):
            yield [" ".join(map(str, words)) for words in batch[data.tokens_column]]
    else:
        yield from text_batches(rows, data.source_column)
        yield from text_batches(rows, data.target_column)


def label_column(rows: Any, task: str, data: DataConfig, key: str) -> str:
    """The label column of ``rows`` (``data.label_column`` or the task's usual names)."""
    names = column_names(rows)
    wanted = (data.label_column,) if data.label_column else DEFAULT_LABEL_COLUMNS[task]
    found = next((name for name in wanted if name in names), None)
    if found is None:
        what = f"{data.label_column!r} (data.label_column)" if data.label_column else " or ".join(map(repr, wanted))
        raise ConfigError(f"data.label_column: {key} has no label column {what} for {task}; "
                          f"its columns: {', '.join(names) or 'none'}")
    return found


def class_names(feature: Any, task: str) -> list[str] | None:
    """The names of a ``ClassLabel`` feature (a list of them for tags), else None."""
    if task == "token-classification":
        feature = getattr(feature, "feature", None)
    return list(feature.names) if hasattr(feature, "names") else None


def _tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    if getattr(tokenizer, "is_fast", False):
        return tokenizer.backend_tokenizer.to_str() + str(getattr(tokenizer, "chat_template", None))
    from datasets.fingerprint import Hasher

    return Hasher.hash(tokenizer)


class _Pipeline:
    """Dataset.map steps of one source, each fingerprinted from its input and its settings, so a
    second start with the same data and settings reads the cached Arrow files; says which it did."""

    def __init__(self, data: DataConfig, tokenizer: PreTrainedTokenizerBase, key: str):
        self.data, self.tokenizer, self.key = data, tokenizer, key
        self.identity = xxhash.xxh64(_tokenizer_identity(tokenizer).encode()).hexdigest() if tokenizer else ""
        self.cached: list[str] = []  # steps read from the cache
        self.folder: Path | None = None
        self.rows = 0

    def num_proc(self, rows: Any) -> int | None:
        if self.data.num_proc is not None:
            procs = self.data.num_proc
        else:  # worker start-up costs more than it saves on small data
            procs = min(os.cpu_count() or 1, 8) if len(rows) >= LARGE_ROWS else 1
        if procs > 1:  # tokenizers in forked workers: one thread each, and no fork warning
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return procs if procs > 1 else None

    def map(self, rows: Any, function: Callable, step: str, *, with_indices: bool = False,
            arrow: bool = False, **fn_kwargs: Any) -> Any:
        import datasets

        remove = column_names(rows)
        if isinstance(rows, datasets.IterableDataset):
            source = rows.with_format("arrow") if arrow else rows
            # here remove_columns also drops the function's output columns of those names
            return source.map(function, batched=True, with_indices=with_indices, fn_kwargs=fn_kwargs,
                              remove_columns=[c for c in remove if c not in EXAMPLE_COLUMNS]).with_format(None)
        settings = {k: v for k, v in fn_kwargs.items() if k != "tokenizer"}
        fingerprint = xxhash.xxh64(json.dumps([PIPELINE_VERSION, rows._fingerprint, step, self.identity, settings],
                                              sort_keys=True).encode()).hexdigest()
        folder = Path(rows.cache_files[0]["filename"]).parent if rows.cache_files else None
        cached = folder is not None and any(folder.glob(f"cache-{fingerprint}*.arrow"))
        source = rows.with_format("arrow") if arrow else rows
        with _progress(len(rows) >= LARGE_ROWS):
            mapped = source.map(function, batched=True, with_indices=with_indices, fn_kwargs=fn_kwargs,
                                remove_columns=remove, num_proc=self.num_proc(rows), new_fingerprint=fingerprint,
                                desc=f"{self.key}: {step}").with_format(None)
        self.rows = len(rows)
        if cached:
            self.cached.append(step)
            self.folder = folder
        return mapped

    def report(self) -> None:
        if self.cached:
            logger.log(logging.INFO if self.rows >= LARGE_ROWS else logging.DEBUG, "%s: %s from the cache in %s",
                       self.key, " + ".join(self.cached), self.folder)


def prepare(rows: Any, data: DataConfig, tokenizer: PreTrainedTokenizerBase | None, key: str,
            task: str = "causal-lm", label2id: dict[str, int] | None = None) -> Any:
    """Examples for training from a datasets object: tokenized (text, chat or prompt/completion
    rows) and shaped per ``data.packing``; rows that already hold ``input_ids`` are used as is.
    Other tasks' rows by :func:`prepare_task_rows` (string labels mapped with ``label2id``).
    Steps read from the cache are logged in one line (at debug level for small data)."""
    if task != "causal-lm":
        if "input_ids" in column_names(rows):
            return rows
        if tokenizer is None:
            raise ConfigError(f"{key}: {task} rows need a tokenizer; pass tokenizer= or set data.tokenizer")
        pipeline = _Pipeline(data, tokenizer, key)
        examples = prepare_task_rows(rows, task, data, tokenizer, key, pipeline, label2id)
        pipeline.report()
        return examples
    kind = data_kind(rows, data, key)
    if kind == "tokens":
        return rows
    if tokenizer is None:
        raise ConfigError(f"{key}: {kind} rows need a tokenizer; pass tokenizer= or set data.tokenizer")
    pipeline = _Pipeline(data, tokenizer, key)
    examples = _tokenize_and_shape(rows, kind, data, tokenizer, key, pipeline)
    pipeline.report()
    return examples


def _tokenize_and_shape(rows: Any, kind: str, data: DataConfig, tokenizer: PreTrainedTokenizerBase, key: str,
                        pipeline: _Pipeline) -> Any:
    import datasets

    streaming = isinstance(rows, datasets.IterableDataset)
    if kind == "text":
        feature = rows.features[data.text_column] if rows.features else None
        if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ConfigError(f"data.text_column: {key} column {data.text_column!r} holds {feature}, expected strings")
        if data.packing is True:
            return _nonempty(pipeline.map(rows, _encode_and_pack, "tokenize + pack", tokenizer=tokenizer,
                                          column=data.text_column, eos=_eos_id(tokenizer), length=data.max_length),
                             data, key)
        encoded = pipeline.map(rows, _encode_text, "tokenize", tokenizer=tokenizer, column=data.text_column,
                               eos=_eos_id(tokenizer))
    else:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{key}: {kind} data needs a fast tokenizer (character offsets find the "
                              "tokens to learn); this one is slow")
        if kind == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{key}: chat data (a 'messages' column) needs a tokenizer with a chat template, "
                              "and this tokenizer has none; set data.tokenizer to a folder whose "
                              "tokenizer_config.json has one")
        if kind == "chat":
            encoded = pipeline.map(rows, _encode_chat, "render chat and tokenize", with_indices=True,
                                   tokenizer=tokenizer, all_tokens=data.train_on_all_tokens, key=key)
        else:
            encoded = pipeline.map(rows, _encode_completion, "tokenize prompt/completion", with_indices=True,
                                   tokenizer=tokenizer, all_tokens=data.train_on_all_tokens,
                                   eos=_eos_id(tokenizer), key=key)
    length = data.max_length
    if data.packing is True:
        return _nonempty(pipeline.map(encoded, _pack_concatenated, "pack", arrow=True, length=length), data, key)
    if not streaming:
        encoded = _fit(encoded, data, key, pipeline)
    elif data.truncation == "drop":
        encoded = encoded.filter(lambda ids: len(ids) <= length, input_columns="input_ids")
    else:
        encoded = pipeline.map(encoded, _truncate, "truncate", length=length)
    if data.packing == "document":
        return pipeline.map(encoded, _pack_documents, "pack documents", length=length)
    return encoded


def _nonempty(packed: Any, data: DataConfig, key: str) -> Any:
    import datasets

    if not isinstance(packed, datasets.IterableDataset) and len(packed) == 0:
        raise ConfigError(f"{key}: fewer tokens than data.max_length = {data.max_length} in any batch of "
                          f"{MAP_BATCH_SIZE} examples, so packing yields no example; lower data.max_length "
                          "or set data.packing = false")
    return packed


def _fit(encoded: Any, data: DataConfig, key: str, pipeline: _Pipeline) -> Any:
    """Examples longer than ``data.max_length`` truncated or dropped (``data.truncation``), counted."""
    import numpy as np
    import pyarrow.compute as pc

    lengths = pc.list_value_length(encoded.data.column("input_ids")).to_numpy()
    if len(lengths) == 0:
        raise ConfigError(f"{key}: no examples")
    too_long = int((lengths > data.max_length).sum())
    if too_long == 0:
        return encoded
    if data.truncation == "drop":
        if too_long == len(lengths):
            raise ConfigError(f"{key}: all {too_long} examples are longer than data.max_length = "
                              f"{data.max_length}; raise it or set data.truncation = \"truncate\"")
        logger.info("%s: dropped %d of %d examples longer than data.max_length = %d", key, too_long,
                    len(lengths), data.max_length)
        return encoded.select(np.flatnonzero(lengths <= data.max_length))
    logger.info("%s: truncated %d of %d examples longer than data.max_length = %d", key, too_long,
                len(lengths), data.max_length)
    return pipeline.map(encoded, _truncate, "truncate", length=data.max_length)


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ConfigError("data.tokenizer: the tokenizer has no eos token; "
                          "documents need one to mark where they end")
    return tokenizer.eos_token_id


# ---------------------------------------------------------------------------- collators


class DataCollator:
    """Batches examples: stacks equal-length rows, else right-pads and adds ``attention_mask``.

    Padded ``input_ids`` get ``pad_token_id``, padded ``labels`` get -100 (ignored by the loss).
    Examples without ``labels`` learn every real token. A scalar label per example (a class id,
    or a float for regression; ``label`` or ``label_ids`` as transformers' collators also take
    it) is stacked into ``labels [batch]``; label rows of another length than their
    ``input_ids`` (seq2seq targets) are padded to the longest of them. Other keys are kept when
    they stack.
    """

    _CORE_KEYS = ("input_ids", "labels", "attention_mask")
    _LABEL_KEYS = ("labels", "label", "label_ids")

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        key = next((k for k in self._LABEL_KEYS if k in features[0]), None)
        if key is not None and key != "labels":
            features = [{("labels" if k == key else k): v for k, v in f.items()} for f in features]
        if key is not None and torch.as_tensor(features[0]["labels"]).dim() == 0:
            values = [f["labels"] for f in features]
            scalar = torch.as_tensor(values, dtype=torch.float32 if any(isinstance(v, float) or (
                isinstance(v, torch.Tensor) and v.is_floating_point()) for v in values) else torch.long)
            batch = self([{k: v for k, v in f.items() if k != "labels"} for f in features])
            batch["labels"] = scalar
            return batch
        ids = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        labels = [torch.as_tensor(f["labels"], dtype=torch.long) if "labels" in f else None
                  for f in features]
        masks = [torch.as_tensor(f["attention_mask"], dtype=torch.long) if "attention_mask" in f
                 else None for f in features]
        targets = any(lab is not None and len(lab) != len(row) for row, lab in zip(ids, labels))
        if len({len(row) for row in ids}) == 1 and all(m is None for m in masks) and not targets:
            # Packed data: nothing to pad, and no mask means the model attends to everything.
            batch = {"input_ids": torch.stack(ids),
                     "labels": torch.stack([row if lab is None else lab for row, lab in zip(ids, labels)])}
        else:
            batch = self._pad(ids, labels, masks)
            if targets:  # seq2seq: the model makes its decoder inputs from the labels
                batch["labels"] = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True,
                                                                  padding_value=IGNORE_INDEX)
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


class FlatteningCollator:
    """Padding-free batches of document-packed rows (as transformers' DataCollatorWithFlattening):
    the rows concatenated into one ``[1, tokens]`` row with ``position_ids`` restarting per
    document; the label of each document's first token is -100, so no document learns from the
    one before it. The model's attention separates documents by their position_ids."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = torch.cat([torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features])
        positions = torch.cat([torch.as_tensor(f["position_ids"], dtype=torch.long) for f in features])
        labels = torch.cat([torch.as_tensor(f.get("labels", f["input_ids"]), dtype=torch.long) for f in features])
        labels = labels.masked_fill(positions == 0, IGNORE_INDEX)
        return {"input_ids": ids[None], "labels": labels[None], "position_ids": positions[None]}


# Attention implementations that keep the documents of a position_ids-packed row apart: flash
# attention takes them as sequence boundaries, transformers' masking_utils builds a block-diagonal
# causal mask from them for the others.
DOCUMENT_PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def enable_document_packing(model: torch.nn.Module) -> None:
    """Refuse ``data.packing = "document"`` for a model whose attention would mix the documents;
    else turn its KV cache off (transformers reads packed documents from position_ids only
    without a cache)."""
    import inspect

    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    if not takes_positions or implementation not in DOCUMENT_PACKING_ATTENTION:
        raise ConfigError(
            f"data.packing = \"document\": the model ({type(model).__name__}, attention "
            f"{implementation or 'unknown'}) cannot keep packed documents apart: that needs a transformers model "
            f"taking position_ids with attention {' / '.join(DOCUMENT_PACKING_ATTENTION)}; "
            "set data.packing = true or false")
    config.use_cache = False


def collator_for(data: DataConfig, tokenizer: PreTrainedTokenizerBase | None) -> Callable[[list[Any]], Any]:
    if data.packing == "document":
        return FlatteningCollator()
    pad_id = getattr(tokenizer, "pad_token_id", None)
    return DataCollator(pad_id if pad_id is not None else 0)


def forward_columns(model: torch.nn.Module, label_names: list[str]) -> list[str]:
    """The example keys ``train.remove_unused_columns`` keeps, as Trainer's: the model's forward
    arguments (a peft model's base model's), ``label``, ``label_ids`` and the label names."""
    import inspect

    if is_peft_model(model) and hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return [*inspect.signature(model.forward).parameters, *dict.fromkeys(["label", "label_ids", *label_names])]


def without_unused_columns(dataset: Any, collator: Callable[[list[Any]], Any], columns: list[str],
                           model: torch.nn.Module, key: str) -> tuple[Any, Callable[[list[Any]], Any]]:
    """``dataset`` and ``collator`` with the examples' keys outside ``columns`` dropped, as Trainer drops
    them: a ``datasets.Dataset`` loses those columns (said once, for the train dataset: evaluation
    loaders are made anew each time), other datasets' examples lose them in a wrapper around the
    collator (transformers' RemoveColumnsCollator, which tells transformers' logger as under Trainer)."""
    import datasets
    from transformers.trainer_utils import RemoveColumnsCollator

    name = type(model).__name__
    if not isinstance(dataset, datasets.Dataset):
        return dataset, RemoveColumnsCollator(collator, columns, logging.getLogger("transformers.trainer"), name, key)
    unused = [column for column in dataset.column_names if column not in columns]
    if not unused:
        return dataset, collator
    if len(unused) == len(dataset.column_names):
        raise ConfigError(f"train.remove_unused_columns: no column of the {key} ({', '.join(unused)}) is an "
                          f"argument of {name}.forward; rename them, or set train.remove_unused_columns = false")
    logger.log(logging.INFO if key == "train dataset" else logging.DEBUG,
               "%s: columns %s are no argument of %s.forward: left out (train.remove_unused_columns)",
               key, ", ".join(unused), name)
    return dataset.remove_columns(unused), collator


def example_lengths(dataset: Any, column: str, input_name: str) -> list[int]:
    """Each example's length for ``train_sampling_strategy = "group_by_length"``: the dataset's
    ``column`` (``train.length_column_name``) when it has one, else the length of its ``input_name``."""
    if is_datasets_object(dataset):
        names = column_names(dataset)
        if column in names:
            return [int(length) for length in dataset[column]]
        if input_name in names:
            import pyarrow.compute as pc

            return pc.list_value_length(dataset.with_format("arrow")[input_name]).to_pylist()
    else:
        from collections.abc import Mapping

        first = dataset[0]
        if isinstance(first, Mapping) and input_name in first:
            return [len(dataset[index][input_name]) for index in range(len(dataset))]
    raise ConfigError(f"train.train_sampling_strategy = \"group_by_length\": the train examples have no "
                      f"{input_name!r} to measure, and the dataset no {column!r} column (train.length_column_name)")


# ---------------------------------------------------------------------------- build_datasets


class Datasets(NamedTuple):
    """What :func:`engine.hookspecs.create_datasets` returns: train data, eval data (None, a
    dataset or a dict of them) and the collator (None: the engine's default for ``[data]``)."""

    train: Any
    eval: Any = None
    collator: Callable[[list[Any]], Any] | None = None


def _call_source(spec: str, key: str, tokenizer: PreTrainedTokenizerBase) -> Any:
    dataset = call_user(key, spec, load_callable(spec, key), tokenizer)
    if not isinstance(dataset, TorchDataset) and not is_datasets_object(dataset):  # IterableDataset is one too
        raise ConfigError(f"{key}: {spec!r} returned a {type(dataset).__name__}, "
                          "expected a torch.utils.data.Dataset or IterableDataset, or a datasets.Dataset")
    return dataset


def check_config(data: DataConfig) -> None:
    if data.max_length < 2:
        raise ConfigError(f"data.max_length: must be at least 2, got {data.max_length}")
    if not 0 <= data.eval_split < 1:
        raise ConfigError(f"data.eval_split: must be in [0, 1), got {data.eval_split}")


def build_datasets(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, *, shuffle: bool = True,
                   rank: int = 0, world_size: int = 1, task: str = "causal-lm",
                   label2id: dict[str, int] | None = None) -> Datasets:
    """The train dataset, the eval dataset (or None) and the collator for ``data``, tokenized for
    ``task`` (string labels mapped with ``label2id``).

    With ``data.streaming`` the train data is a :class:`ResumableStream` over this process's
    shard (``rank`` of ``world_size``), shuffled through a buffer of
    ``data.shuffle_buffer_size`` examples seeded by ``seed`` (``shuffle``).
    """
    check_config(data)

    def from_source(source: str, key: str, split: str | None = None) -> Any:
        if is_callable_spec(source):
            return prepare_given(_call_source(source, key, tokenizer), data, tokenizer, key, task, label2id)
        rows = load_source(source, data, key, split)
        if data.streaming and world_size > 1:
            from datasets.distributed import split_dataset_by_node

            rows = split_dataset_by_node(rows, rank=rank, world_size=world_size)
        return prepare(rows, data, tokenizer, key, task, label2id)

    if data.eval is not None or data.eval_split == 0:
        train = from_source(data.train, "data.train")
        if data.streaming and is_datasets_object(train):
            train = ResumableStream(train.shuffle(seed=seed, buffer_size=data.shuffle_buffer_size) if shuffle
                                    else train)
        evaluation = None if data.eval is None else from_source(data.eval, "data.eval", data.eval_dataset_split)
    else:
        if is_callable_spec(data.train):
            raise ConfigError(f"data.eval_split: holds out documents of text data, but data.train is "
                              f"the callable {data.train!r}; set data.eval instead")
        if data.streaming:
            raise ConfigError("data.eval_split: holds out documents of a dataset with a length, but data.streaming "
                              "is true; set data.eval instead")
        train_rows, eval_rows = _split(load_source(data.train, data, "data.train"), data.eval_split, seed)
        train = prepare(train_rows, data, tokenizer, "data.train", task, label2id)
        evaluation = prepare(eval_rows, data, tokenizer, "data.eval_split", task, label2id)
    collator = collator_for(data, tokenizer) if task == "causal-lm" else None  # the run's task collator
    return Datasets(train, evaluation, collator)


class ResumableStream(torch.utils.data.IterableDataset):
    """A streaming datasets ``IterableDataset`` that counts the examples it has handed out in
    the current pass, so a checkpoint records the position and a resumed run starts exactly
    there: it reads the stream again (same seed, same shuffle buffer) and skips what was used.
    datasets' own ``state_dict()`` would lose the shuffle buffer's contents on resume.

    The count is exact because the DataLoader reads it in this process
    (``train.dataloader_num_workers = 0``) and takes examples only as batches are needed.
    """

    def __init__(self, rows: Any):
        self.rows = rows
        self.epoch = 0
        self.position = 0  # examples handed out in this pass
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        self.rows.set_epoch(self.epoch)  # a new shuffle each pass
        examples = iter(self.rows)
        skip, self._skip = self._skip, 0
        for _ in itertools.islice(examples, skip):
            pass
        self.position = skip
        for example in examples:
            self.position += 1
            yield example
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._skip = int(state["epoch"]), int(state["position"])


def prepare_given(dataset: Any, data: DataConfig, tokenizer: PreTrainedTokenizerBase | None, key: str,
                  task: str = "causal-lm", label2id: dict[str, int] | None = None) -> Any:
    """A dataset given to Run or returned by a data hook: a datasets object is checked and
    tokenized like data.train (one with input_ids is used as is); anything else is used as is."""
    if isinstance(dataset, dict):
        return {name: prepare_given(d, data, tokenizer, f"{key}[{name!r}]", task, label2id)
                for name, d in dataset.items()}
    return prepare(dataset, data, tokenizer, key, task, label2id) if is_datasets_object(dataset) else dataset


def needs_tokenizer(dataset: Any, data: DataConfig, task: str = "causal-lm") -> bool:
    """Whether ``dataset`` (given to Run) holds rows that the engine tokenizes."""
    if isinstance(dataset, dict):
        return any(needs_tokenizer(d, data, task) for d in dataset.values())
    if not is_datasets_object(dataset):
        return False
    if task != "causal-lm":
        return "input_ids" not in column_names(dataset)
    return data_kind(dataset, data, "train_dataset") != "tokens"


def _split(rows: Any, fraction: float, seed: int) -> tuple[Any, Any]:
    """(train, eval) rows: a seeded random ``fraction`` held out, at least one each side."""
    import numpy as np

    total = len(rows)
    if total < 2:
        raise ConfigError(f"data.eval_split: data.train has {total} document(s); holding out "
                          "eval documents needs at least 2; set data.eval instead")
    count = min(max(1, round(total * fraction)), total - 1)
    order = list(range(total))
    random.Random(seed).shuffle(order)
    held_out = np.zeros(total, dtype=bool)
    held_out[order[:count]] = True
    # Both sides keep the file's document order; the sampler shuffles training examples.
    return rows.select(np.flatnonzero(~held_out)), rows.select(np.flatnonzero(held_out))
