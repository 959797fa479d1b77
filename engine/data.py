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
import dataclasses
import functools
import glob
import itertools
import json
import logging
import os
import random
import re
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, NoReturn

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
LABEL_KEYS = ("labels", "label", "label_ids")  # where the collators find an example's labels, in this order
STREAMING_TOKENIZER_ROWS = 100_000  # data.streaming: documents a trained tokenizer learns from
MAP_BATCH_SIZE = 1000  # Dataset.map's default batch: concatenate-packing cuts within one
# Below these sizes reading and tokenizing take a second or so: one process, no progress bars,
# and reading the cache is not worth a line in the console.
LARGE_ROWS = 50_000
LARGE_FILE_BYTES = 50 * 10**6
PIPELINE_VERSION = 2  # part of every cache fingerprint: bump when a map step's output changes

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


class BadRow(ConfigError):
    """Row ``index`` (counted from 0 in the rows a map step read) of the data ``key`` names cannot be
    used, for ``reason``. :func:`build_datasets` names the row as it is in the source file instead."""

    def __init__(self, key: str, index: int, reason: str):
        super().__init__(key, index, reason)  # the arguments, so that it pickles (map's worker processes)
        self.key, self.index, self.reason = key, index, reason

    def __str__(self) -> str:
        return f"{self.key}: row {self.index} (counted from 0): {self.reason}"


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
    if _is_saved_dataset(path):
        return _load_saved(path, data, key, split)
    files = source_files(source, key)
    if files is not None:
        return _load_files(files, data, key, source)
    try:  # a dataset name: the Hub (or its cache)
        return datasets.load_dataset(source, data.config, split=split, cache_dir=data.cache_dir,
                                     streaming=data.streaming)
    except Exception as exc:  # datasets raises many kinds; all mean "this name does not load"
        raise ConfigError(f"{key}: {source!r} is no local file or folder, and load_dataset({source!r}"
                          f"{', ' + repr(data.config) if data.config else ''}, split={split!r}) failed: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def source_files(source: str, key: str) -> list[str] | None:
    """The local data files ``source`` names (a file, a glob, a folder of data files), in the order
    their rows are read; None for the other forms ("embedded", a saved dataset, a dataset name).
    A source that looks like a path to nothing is refused."""
    path = Path(source).expanduser()
    if source == "embedded" or is_callable_spec(source) or _is_saved_dataset(path):
        return None
    if glob.has_magic(source):
        files = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise ConfigError(f"{key}: {source} matches no file")
        return files
    if path.is_file():
        return [str(path)]
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_BUILDERS)
        if not files:
            raise ConfigError(f"{key}: folder {source} holds no {'/'.join(FILE_BUILDERS)} file and no "
                              "dataset saved with save_to_disk")
        return files
    if path.suffix.lower() in FILE_BUILDERS or source.startswith((".", "/", "~")) or path.parent.exists() \
            and path.parent != Path("."):
        raise ConfigError(f"{key}: file not found: {source} (expected 'embedded', a "
                          f"{'/'.join(FILE_BUILDERS)} file, a glob, a folder, a dataset name or "
                          "'package.module:function')")
    return None


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
    for file in files:  # datasets would say StopIteration or SchemaInferenceError
        emptiness = _emptiness(file, builder)
        if emptiness:
            raise ConfigError(f"{key}: {file} is {emptiness}; give it rows, or name another file")
    try:
        with _progress(sum(os.path.getsize(f) for f in files) >= LARGE_FILE_BYTES):
            rows = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=data.cache_dir,
                                         streaming=data.streaming)
    except Exception as exc:  # parse errors arrive as DatasetGenerationError with the cause chained
        raise read_error(exc, files, key, source) from None
    if builder == "text":  # one row per line; blank lines are no documents
        with _progress(not data.streaming and len(rows) >= LARGE_ROWS):
            rows = rows.filter(_non_blank, batched=True, input_columns="text")
    if not data.streaming and len(rows) == 0:  # a CSV header alone, a JSON "[]"
        raise ConfigError(f"{key}: {source} holds no rows; give it rows, or name another file")
    return rows


# formats written as text, where a file of blank lines holds no rows
TEXT_BUILDERS = ("json", "text", "csv")


def _emptiness(file: str, builder: str) -> str | None:
    """"empty" (0 bytes), "empty (only blank lines)" for a text format, or None: the file has content."""
    if os.path.getsize(file) == 0:
        return "empty (0 bytes)"
    if builder not in TEXT_BUILDERS:
        return None
    with open(file, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return None
    return "empty (only blank lines)"


# how pyarrow says that a JSON value has another type than the same column's in rows before it
JSON_TYPE_CHANGE = re.compile(r"Column\((/[^)]*)\) changed from (\w+) to (\w+)")


def read_error(exc: BaseException, files: list[str], key: str, source: str) -> ConfigError:
    """A ConfigError for ``exc``, raised while datasets read ``files``: in JSON lines files, the first
    line that is not JSON, or whose value changes a column's type; else datasets' reason."""
    cause = exc.__cause__ or exc.__context__ or exc
    change = JSON_TYPE_CHANGE.search(str(cause))
    bad = next(filter(None, (_bad_json_line(file, change) for file in files)), None)
    if bad is not None:
        return ConfigError(f"{key}: {bad}")
    builder = FILE_BUILDERS.get(Path(files[0]).suffix.lower())
    if "corresponds to no data" in str(cause):  # datasets' words for a split of 0 rows
        return ConfigError(f"{key}: {source} holds no rows; give it rows, or name another file")
    return ConfigError(f"{key}: cannot read {source} as {builder}: {type(cause).__name__}: {_first_line(cause)}")


def _json_lines(file: str) -> bool:
    """Whether a .json/.jsonl file holds JSON lines (its first non-blank line is an object), as
    datasets reads it first; else it holds one JSON document."""
    if FILE_BUILDERS.get(Path(file).suffix.lower()) != "json":
        return False
    with open(file, encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


def _bad_json_line(file: str, change: re.Match[str] | None = None) -> str | None:
    """"FILE line N ...", for the first line of a JSON lines file that is no JSON object, or (``change``:
    pyarrow's words for it) whose value at a column has another type than the rows before it."""
    if not _json_lines(file):
        return None
    with open(file, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"{file} line {number} is not valid JSON ({exc.msg} at column {exc.colno})"
            if not isinstance(value, dict):
                return f"{file} line {number} is a JSON {type(value).__name__}, expected an object (one row per line)"
            if change and change[3] in map(_json_type, _values_at(value, change[1].strip("/").split("/"))):
                return (f"{file} line {number}: {change[1].strip('/')!r} holds a {change[3]} where the rows before "
                        f"hold a {change[2]}; give it a {change[2]} (or the rows before a {change[3]})")
    return None


def _values_at(value: Any, path: list[str]) -> Iterator[Any]:
    """The values at a pyarrow column path in a JSON value ("[]": every item of a list)."""
    if not path:
        yield value
    elif path[0] == "[]" and isinstance(value, list):
        for item in value:
            yield from _values_at(item, path[1:])
    elif isinstance(value, dict) and path[0] in value:
        yield from _values_at(value[path[0]], path[1:])


def _json_type(value: Any) -> str:
    """A JSON value's type, as pyarrow names it."""
    for kind, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array"),
                       (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null"


def row_place(files: list[str], index: int, cache_dir: str | None = None) -> str:
    """Where row ``index`` (counted from 0 over the rows of ``files`` in order) is, as its user
    counts: "FILE line N" in a text or JSON lines file (rows are its non-blank lines), else "FILE row N"."""
    for position, file in enumerate(files):
        if FILE_BUILDERS[Path(file).suffix.lower()] == "text" or _json_lines(file):
            with open(file, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        if index == 0:
                            return f"{file} line {number}"
                        index -= 1
            continue
        count = None if position == len(files) - 1 else _count_rows(file, cache_dir)
        if count is None or index < count:
            return f"{file} row {index + 1}"
        index -= count
    return f"{files[-1]} row {index + 1} past its end"  # unreachable while the files are unchanged


def _count_rows(file: str, cache_dir: str | None) -> int:
    import datasets

    return len(datasets.load_dataset(FILE_BUILDERS[Path(file).suffix.lower()], data_files=[file], split="train",
                                     cache_dir=cache_dir))


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


def text_batches(rows: Any, column: str, batch_size: int = 1000, key: str = "data.train") -> Iterator[list[str]]:
    """The strings of ``column`` in batches (for training a tokenizer without holding them all)."""
    for start, batch in zip(itertools.count(0, batch_size), rows.iter(batch_size=batch_size)):
        texts = batch[column]
        _check_strings(texts, range(start, start + len(texts)), column, key)
        yield texts


def _a(value: Any) -> str:
    """"a str", "an int": the type of ``value`` for a message."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _check_strings(values: list[Any], indices: Iterable[int], column: str, key: str) -> list[str]:
    """``values``; the first row (of ``indices``) whose ``column`` holds no string (null: the row lacks it) refused."""
    for value, index in zip(values, indices):
        if not isinstance(value, str):
            what = "is missing or null" if value is None else f"holds {_a(value)}"
            raise BadRow(key, index, f"{column!r} {what}, expected a string")
    return values

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
    column, or the columns of ``task`` (engine/tasks.py)."""
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


# ---------------------------------------------------------------------------- tokenizing


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], key: str = "data.train",
                index: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """A conversation rendered with the tokenizer's chat template, and the character spans of
    its assistant turns (each from after the generation prompt to the end of the turn). A row that
    cannot be rendered is refused as row ``index`` of ``key``.

    A turn's span is found by rendering the conversation up to it with the generation prompt
    and through it: templates render a conversation's prefix as a prefix of its text.
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
                                     "(data.tokenizer's tokenizer_config.json)") from None

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (text.startswith(through) and through.startswith(start)):
            raise BadRow(key, index, "the chat template does not render a conversation's start as the start of its "
                                     "text, so the assistant tokens cannot be found; set data.train_on_all_tokens")
        spans.append((len(start), len(through)))
    return text, spans


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


# ---------------------------------------------------------------------------- other tasks' rows

DEFAULT_LABEL_COLUMNS = {"sequence-classification": ("label", "labels"),
                         "token-classification": ("tags", "ner_tags", "labels")}


def _label_ids(values: list[Any], indices: list[int], label2id: dict[str, int] | None, column: str,
               key: str) -> list[Any]:
    """Labels (of the rows ``indices``) as class ids: strings through ``label2id`` (``train.label2id``)."""
    for value, index in zip(values, indices):
        if value is None or isinstance(value, bool) or not isinstance(value, (str, int, float)):
            what = "is missing or null" if value is None else f"holds {_a(value)} ({value!r})"
            raise BadRow(key, index, f"label column {column!r} {what}, expected a class id or name")
    if not any(isinstance(v, str) for v in values):
        return values
    if label2id is None:
        raise ConfigError(f"{key}: column {column!r} holds strings; set train.label2id = {{name = id, ...}}")
    for value, index in zip(values, indices):
        if value not in label2id:
            raise BadRow(key, index, f"label {value!r} is not in train.label2id ({', '.join(label2id)})")
    return [label2id[v] for v in values]


def _encode_sequences(batch: dict[str, list], indices: list[int], *, tokenizer: Any, text: str, pair: str | None,
                      label: str, label2id: dict[str, int] | None, max_length: int, key: str) -> dict[str, list]:
    if not batch[text]:
        return {"input_ids": [], "labels": []}
    texts = [_check_strings(batch[column], indices, column, key) for column in (text, pair) if column]
    encoded = dict(tokenizer(*texts, truncation=True, max_length=max_length))
    encoded["labels"] = _label_ids(batch[label], indices, label2id, label, key)
    return encoded


def _begin_to_inside(label2id: dict[str, int] | None) -> dict[int, int]:
    """run_ner's b_to_i_label: the id of each B-X tag -> the id of I-X (others unchanged)."""
    if not label2id:
        return {}
    return {i: label2id.get("I-" + name[2:], i) for name, i in label2id.items() if name.startswith("B-")}


def _encode_words(batch: dict[str, list], indices: list[int], *, tokenizer: Any, tokens: str, tags: str,
                  label2id: dict[str, int] | None, label_all_tokens: bool, max_length: int,
                  key: str) -> dict[str, list]:
    if not batch[tokens]:
        return {"input_ids": [], "labels": []}
    for words, word_tags, index in zip(batch[tokens], batch[tags], indices):
        if not isinstance(words, list) or not isinstance(word_tags, list) or len(words) != len(word_tags):
            raise BadRow(key, index, f"columns {tokens!r} and {tags!r} must hold lists of equal length "
                                     "(one tag per word)")
        word = next((w for w in words if not isinstance(w, str)), "")
        if not isinstance(word, str):
            raise BadRow(key, index, f"column {tokens!r} holds {_a(word)} among its words, expected strings")
    encoding = tokenizer(batch[tokens], truncation=True, max_length=max_length, is_split_into_words=True)
    inside = _begin_to_inside(label2id)
    labels = []
    for row, word_tags in enumerate(batch[tags]):
        ids = _label_ids(word_tags, [indices[row]] * len(word_tags), label2id, tags, key)
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


def _encode_pairs(batch: dict[str, list], indices: list[int], *, tokenizer: Any, source: str, target: str,
                  max_length: int, max_target_length: int, append_eos: bool, key: str) -> dict[str, list]:
    if not batch[source]:
        return {"input_ids": [], "labels": []}
    encoded = dict(tokenizer(_check_strings(batch[source], indices, source, key), truncation=True,
                             max_length=max_length))
    targets = _check_strings(batch[target], indices, target, key)
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
        return pipeline.map(rows, _encode_pairs, "tokenize source and target", with_indices=True, tokenizer=tokenizer,
                            source=data.source_column, target=data.target_column, max_length=data.max_length,
                            max_target_length=data.max_target_length or data.max_length, append_eos=append_eos,
                            key=key)
    label = label_column(rows, task, data, key)
    if task == "sequence-classification":
        encoded = pipeline.map(rows, _encode_sequences, "tokenize for sequence classification", with_indices=True,
                               tokenizer=tokenizer,
                               text=data.text_column, pair=data.text_pair_column, label=label, label2id=label2id,
                               max_length=data.max_length, key=key)
    else:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{key}: token classification needs a fast tokenizer (word_ids align the tags)")
        encoded = pipeline.map(rows, _encode_words, "tokenize and align tags", with_indices=True, tokenizer=tokenizer,
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


# ---------------------------------------------------------------------------- rows of token ids


class ModelLimits(NamedTuple):
    """What token rows must fit: ids below ``vocab_size`` (the model's embedding rows) and at most
    ``positions`` tokens (with the config attribute that says so); None: not known."""

    vocab_size: int | None
    positions: tuple[int, str] | None


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _described(value: Any) -> str:
    if value is None:
        return "nothing (null, or the row lacks it)"
    if isinstance(value, list):
        odd = next((v for v in value if not isinstance(v, int) or isinstance(v, bool)), None)
        return f"{_a(odd)} ({odd!r}) among its values"
    return _a(value)


def token_row_problem(row: dict[str, Any], task: str, limits: ModelLimits | None = None) -> str | None:
    """Why a row of token ids cannot be trained on (None: it can). The labels (under the first of
    :data:`LABEL_KEYS` the row has, as the collators read them) of a causal LM or token classifier are
    one per token (-100: no loss); seq2seq labels are target ids of any length; a sequence
    classifier's are one class id (or float) per row."""
    ids = row.get("input_ids")
    if not _int_list(ids):
        return f"'input_ids' holds {_described(ids)}, expected a list of token ids (ints)"
    if not ids:
        return "'input_ids' is empty"
    if min(ids) < 0:
        return f"'input_ids' holds the negative id {min(ids)}; token ids start at 0"
    for name in ("attention_mask", "position_ids"):
        if row.get(name) is not None and (not isinstance(row[name], list) or len(row[name]) != len(ids)):
            return f"{name!r} does not hold one value per token of 'input_ids' ({len(ids)})"
    label_key = next((key for key in LABEL_KEYS if key in row), None)
    labels = row.get(label_key)
    if task == "sequence-classification":
        if label_key and (labels is None or isinstance(labels, (str, bool))):
            return f"{label_key!r} holds {_described(labels)}, expected a class id (or a float for regression)"
    elif label_key:
        problem = _token_labels_problem(labels, label_key, len(ids), task)
        if problem:
            return problem
    if limits is None:
        return None
    if limits.positions and len(ids) > limits.positions[0]:
        positions, name = limits.positions
        return (f"{len(ids)} tokens, but the model has {positions} positions ({name}); shorten the row, or "
                f"raise train.model_config.{name}")
    vocab_size = limits.vocab_size
    for name in ("input_ids", label_key) if task in ("causal-lm", "seq2seq") and label_key else ("input_ids",):
        if vocab_size and max(row[name], default=0) >= vocab_size:
            return (f"{name!r} holds the id {max(row[name])}, but the model's embedding has {vocab_size} rows "
                    f"(ids 0 to {vocab_size - 1}); give ids of the model's tokenizer, or a model with that vocabulary")
    return None


def _token_labels_problem(labels: Any, key: str, length: int, task: str) -> str | None:
    if isinstance(labels, (int, float)) and task == "causal-lm":
        return (f"{key!r} holds one value per row, but a causal LM learns a label per token; give a list of them, "
                "or set train.task = \"sequence-classification\" to learn one per row")
    if not _int_list(labels):
        return f"{key!r} holds {_described(labels)}, expected a list of token ids (ints, -100 for no loss)"
    if task != "seq2seq" and len(labels) != length:
        return f"{key!r} holds {len(labels)} values, 'input_ids' {length}: give one label per token (-100 for no loss)"
    negative = next((label for label in labels if label < 0 and label != IGNORE_INDEX), None)
    if negative is not None:
        return f"{key!r} holds {negative}; a label is a token id, or -100 for no loss"
    return None


def check_token_rows(rows: Any, task: str, key: str, limits: ModelLimits | None = None) -> Any:
    """``rows`` of token ids, each checked with :func:`token_row_problem`; the first bad one is refused
    as a :class:`BadRow`. A stream's rows are checked as they are read."""
    import datasets

    if isinstance(rows, datasets.IterableDataset):
        return rows.map(_check_token_batch, batched=True, with_indices=True,
                        fn_kwargs={"task": task, "key": key, "limits": limits})
    if not isinstance(rows, datasets.Dataset) or _token_columns_fit(rows, task, limits):
        return rows
    for start, batch in zip(itertools.count(0, MAP_BATCH_SIZE), rows.iter(batch_size=MAP_BATCH_SIZE)):
        _check_token_batch(batch, range(start, start + len(batch["input_ids"])), task=task, key=key, limits=limits)
    return rows


def _check_token_batch(batch: dict[str, list], indices: Iterable[int], *, task: str, key: str,
                       limits: ModelLimits | None) -> dict[str, list]:
    for position, index in enumerate(indices):
        problem = token_row_problem({name: values[position] for name, values in batch.items()}, task, limits)
        if problem:
            raise BadRow(key, index, problem)
    return batch


def _token_columns_fit(rows: Any, task: str, limits: ModelLimits | None) -> bool:
    """Whether every row of a ``datasets.Dataset`` passes :func:`token_row_problem`, found over its
    Arrow columns at once (False: a row may not; the rows are then checked one by one)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def int_lists(name: str) -> Any:
        column = rows.data.column(name).combine_chunks()  # a select()ed dataset: all its table's rows, a superset
        fits = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
        return column if fits and pa.types.is_integer(column.type.value_type) and column.null_count == 0 \
            and column.flatten().null_count == 0 else None

    ids = int_lists("input_ids")
    if ids is None or len(ids) == 0:
        return ids is not None
    lengths, flat = pc.list_value_length(ids), ids.flatten()
    if pc.min(lengths).as_py() == 0 or pc.min(flat).as_py() < 0:
        return False
    for name in ("attention_mask", "position_ids"):
        if name in rows.column_names:
            other = rows.data.column(name).combine_chunks()
            if other.null_count or not pa.types.is_list(other.type) or \
                    not pc.all(pc.equal(pc.list_value_length(other), lengths)).as_py():
                return False
    label_key = next((key for key in LABEL_KEYS if key in rows.column_names), None)
    if task == "sequence-classification" and label_key:  # a class id or float per row (floats per row: multi-label)
        column = rows.data.column(label_key)
        value_type = column.type.value_type if pa.types.is_list(column.type) else column.type
        if column.null_count or not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
            return False
    labels = int_lists(label_key) if label_key and task != "sequence-classification" else ids
    if labels is None:
        return False
    label_values = labels.flatten()
    if labels is not ids and (
            task != "seq2seq" and not pc.all(pc.equal(pc.list_value_length(labels), lengths)).as_py()
            or pc.any(pc.and_(pc.less(label_values, 0), pc.not_equal(label_values, IGNORE_INDEX))).as_py()):
        return False
    if limits is None:
        return True
    if limits.positions and pc.max(lengths).as_py() > limits.positions[0]:
        return False
    largest = max(pc.max(flat).as_py(), (pc.max(label_values).as_py() or 0) if task in ("causal-lm", "seq2seq") else 0)
    return not limits.vocab_size or largest < limits.vocab_size


def _learnable(examples: Any, key: str, why: str) -> Any:
    """Causal-LM examples that keep a token to learn: a label other than -100 after the first (the
    model shifts labels by one). Truncation can cut every answer of an example away: such examples
    are dropped and counted (``why`` says how it came to be and what to change), and none left is
    refused, so that no step's loss is nan from an empty set of labels."""
    import datasets
    import numpy as np
    import pyarrow.compute as pc

    if "labels" not in column_names(examples):
        return examples
    if isinstance(examples, datasets.IterableDataset):
        return examples.filter(_has_label_token, input_columns="labels")
    labels = examples.with_format("arrow")["labels"].combine_chunks()
    values = labels.flatten().to_numpy(zero_copy_only=False)
    learnt = values != IGNORE_INDEX
    starts = labels.offsets.to_numpy()[:-1]
    learnt[starts[starts < len(values)]] = False  # each example's first label: nothing predicts it
    counts = np.bincount(pc.list_parent_indices(labels).to_numpy(zero_copy_only=False)[learnt],
                         minlength=len(labels))
    empty = int((counts == 0).sum())
    if empty == 0:
        return examples
    if empty == len(labels):
        raise ConfigError(f"{key}: no example has a token to learn (a label other than -100 after the first): {why}")
    logger.info("%s: dropped %d of %d examples with no token to learn (a label other than -100 after the first): %s",
                key, empty, len(labels), why)
    return examples.select(np.flatnonzero(counts > 0))


def _has_label_token(labels: list[int]) -> bool:
    return any(label != IGNORE_INDEX for label in labels[1:])


def prepare(rows: Any, data: DataConfig, tokenizer: PreTrainedTokenizerBase | None, key: str,
            task: str = "causal-lm", label2id: dict[str, int] | None = None, limits: ModelLimits | None = None) -> Any:
    """Examples for training from a datasets object: tokenized (text, chat or prompt/completion
    rows) and shaped per ``data.packing``; rows that already hold ``input_ids`` are used as they
    are, once checked (:func:`check_token_rows`, against the model's ``limits`` when known).
    Other tasks' rows by :func:`prepare_task_rows` (string labels mapped with ``label2id``).
    Steps read from the cache are logged in one line (at debug level for small data). A row that
    cannot be used is refused as a :class:`BadRow`."""
    if task != "causal-lm":
        if "input_ids" in column_names(rows):
            return check_token_rows(rows, task, key, limits)
        if tokenizer is None:
            raise ConfigError(f"{key}: {task} rows need a tokenizer; pass tokenizer= or set data.tokenizer")
        pipeline = _Pipeline(data, tokenizer, key)
        examples = prepare_task_rows(rows, task, data, tokenizer, key, pipeline, label2id)
        pipeline.report()
        return examples
    kind = data_kind(rows, data, key)
    if kind == "tokens":
        return _learnable(check_token_rows(rows, task, key, limits), key,
                          "give each row one, or leave the row out")
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
            return _nonempty(pipeline.map(rows, _encode_and_pack, "tokenize + pack", with_indices=True,
                                          tokenizer=tokenizer, column=data.text_column, eos=_eos_id(tokenizer),
                                          length=data.max_length, key=key),
                             data, key)
        encoded = pipeline.map(rows, _encode_text, "tokenize", with_indices=True, tokenizer=tokenizer,
                               column=data.text_column, eos=_eos_id(tokenizer), key=key)
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
    # text rows learn every token; the answers of chat and prompt/completion rows may be cut away
    why = (f"data.max_length = {length} cuts the answers away; raise it" +
           ("" if data.packing is True or data.truncation == "drop" else
            ", or set data.truncation = \"drop\" to leave out examples longer than it"))
    if data.packing is True:
        return _learnable(_nonempty(pipeline.map(encoded, _pack_concatenated, "pack", arrow=True, length=length),
                                    data, key), key, why)
    if not streaming:
        encoded = _fit(encoded, data, key, pipeline, why)
    elif data.truncation == "drop":
        encoded = _learnable(encoded.filter(lambda ids: len(ids) <= length, input_columns="input_ids"), key, why)
    else:
        encoded = _learnable(pipeline.map(encoded, _truncate, "truncate", length=length), key, why)
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


def _fit(encoded: Any, data: DataConfig, key: str, pipeline: _Pipeline, why: str) -> Any:
    """Examples longer than ``data.max_length`` truncated or dropped (``data.truncation``), then
    those left with no token to learn dropped (:func:`_learnable`, ``why``); counted."""
    import numpy as np
    import pyarrow.compute as pc

    lengths = pc.list_value_length(encoded.data.column("input_ids")).to_numpy()
    if len(lengths) == 0:
        raise ConfigError(f"{key}: no examples")
    too_long = int((lengths > data.max_length).sum())
    if too_long == 0:
        return _learnable(encoded, key, why)
    if data.truncation == "drop":
        if too_long == len(lengths):
            raise ConfigError(f"{key}: all {too_long} examples are longer than data.max_length = "
                              f"{data.max_length}; raise it or set data.truncation = \"truncate\"")
        fitted, done = _learnable(encoded.select(np.flatnonzero(lengths <= data.max_length)), key, why), "dropped"
    else:
        fitted, done = _learnable(pipeline.map(encoded, _truncate, "truncate", length=data.max_length), key, why), \
            "truncated"
    logger.info("%s: %s %d of %d examples longer than data.max_length = %d", key, done, too_long, len(lengths),
                data.max_length)
    return fitted


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
    _LABEL_KEYS = LABEL_KEYS

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
            lengths = list(dataset[column])
            for index, length in enumerate(lengths):
                if not isinstance(length, int) or isinstance(length, bool) or length < 0:
                    got = "null" if length is None else f"{type(length).__name__} {length!r}"
                    raise ConfigError(f"train.length_column_name: column {column!r} of the train dataset holds "
                                      f"{got} in row {index} (counted from 0), expected each example's length "
                                      "(an int >= 0); fix the column, or name another")
            return lengths
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


def schedules_evaluation(train: Any) -> bool:
    """Whether the run evaluates while it trains (``train.eval_strategy``, ``train.eval_on_start``)."""
    return train.eval_strategy != "no" or train.eval_on_start


def no_evaluation_data(train: Any) -> ConfigError:
    """The refusal of a run whose schedule evaluates but that has no evaluation data."""
    key = f"train.eval_strategy = {train.eval_strategy!r}" if train.eval_strategy != "no" else "train.eval_on_start"
    return ConfigError(f"{key} evaluates, but the run has no evaluation data: set data.eval or data.eval_split "
                       "(or pass eval_dataset), or set train.eval_strategy = 'no'")


def check_config(data: DataConfig) -> None:
    if data.max_length < 2:
        raise ConfigError(f"data.max_length: must be at least 2, got {data.max_length}")
    if not 0 <= data.eval_split < 1:
        raise ConfigError(f"data.eval_split: must be in [0, 1), got {data.eval_split}")


def build_datasets(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, *, shuffle: bool = True,
                   rank: int = 0, world_size: int = 1, task: str = "causal-lm",
                   label2id: dict[str, int] | None = None, limits: ModelLimits | None = None) -> Datasets:
    """The train dataset, the eval dataset (or None) and the collator for ``data``, tokenized for
    ``task`` (string labels mapped with ``label2id``; rows of token ids checked against the
    model's ``limits``). A row that cannot be used is refused naming it as in its source file.

    With ``data.streaming`` the train data is a :class:`ResumableStream` over this process's
    shard (``rank`` of ``world_size``), shuffled through a buffer of
    ``data.shuffle_buffer_size`` examples seeded by ``seed`` (``shuffle``).
    """
    check_config(data)

    def prepared(rows: Any, key: str, source: str, source_key: str, source_rows: Any = None) -> Any:
        with named_rows(source, source_key, data, source_rows):
            return prepare(rows, data, tokenizer, key, task, label2id, limits)

    def from_source(source: str, key: str, split: str | None = None) -> Any:
        if is_callable_spec(source):
            return prepare_given(_call_source(source, key, tokenizer), data, tokenizer, key, task, label2id, limits)
        rows = load_source(source, data, key, split)
        if not data.streaming:
            return prepared(rows, key, source, key)
        if world_size > 1:
            from datasets.distributed import split_dataset_by_node

            rows = split_dataset_by_node(rows, rank=rank, world_size=world_size)
        try:  # its first rows are read here; the others as it trains (ResumableStream)
            return prepare(rows, data, tokenizer, key, task, label2id, limits)
        except Exception as exc:
            raise_explained(exc, stream_errors(source, key, split))

    def stream_errors(source: str, key: str, split: str | None) -> Callable[[Exception], Exception]:
        """What a stream of ``source`` raised as one line naming the row in its file: a row refused is
        looked up again from the start of the files, in their order (not shuffled, not this process's share)."""
        def explain(error: Exception) -> Exception:
            if isinstance(error, BadRow):
                try:
                    for _ in prepare(load_source(source, data, key, split), data, tokenizer, key, task, label2id,
                                     limits):
                        pass
                    return error
                except BadRow as first:
                    return ConfigError(f"{key}: {_name_row(source, key, first.index, data)}: {first.reason}")
                except Exception as unreadable:  # a file that cannot be read before the row
                    error = unreadable
            files = source_files(source, key)
            return read_error(error, files, key, source) if files and _reading_error(error) else error
        return explain

    if data.eval is not None or data.eval_split == 0:
        train = from_source(data.train, "data.train")
        if data.streaming and is_datasets_object(train):
            train = ResumableStream(train.shuffle(seed=seed, buffer_size=data.shuffle_buffer_size) if shuffle
                                    else train, "data.train", stream_errors(data.train, "data.train", None))
        evaluation = None if data.eval is None else from_source(data.eval, "data.eval", data.eval_dataset_split)
    else:
        if is_callable_spec(data.train):
            raise ConfigError(f"data.eval_split: holds out documents of text data, but data.train is "
                              f"the callable {data.train!r}; set data.eval instead")
        if data.streaming:
            raise ConfigError("data.eval_split: holds out documents of a dataset with a length, but data.streaming "
                              "is true; set data.eval instead")
        rows = load_source(data.train, data, "data.train")
        train_rows, eval_rows = _split(len(rows), data.eval_split, seed)
        train = prepared(rows.select(train_rows), "data.train", data.train, "data.train", train_rows)
        evaluation = prepared(rows.select(eval_rows), "data.eval_split", data.train, "data.train", eval_rows)
    collator = collator_for(data, tokenizer) if task == "causal-lm" else None  # the run's task collator
    return Datasets(train, evaluation, collator)


@contextlib.contextmanager
def named_rows(source: str | None, key: str, data: DataConfig, source_rows: Any = None) -> Iterator[None]:
    """A :class:`BadRow` raised inside, whose index counts the rows of ``source`` (or ``source_rows``:
    the row of ``source`` each row read is), as one line naming the row as in its file. A ``source``
    of None names nothing (rows given in Python are named by their index)."""
    try:
        yield
    except BadRow as bad:
        if source is None:
            raise
        index = bad.index if source_rows is None else int(source_rows[bad.index])
        raise ConfigError(f"{key}: {_name_row(source, key, index, data)}: {bad.reason}") from None


def _name_row(source: str, key: str, index: int, data: DataConfig) -> str:
    """Row ``index`` (counted from 0) of ``source`` as its user finds it: "FILE line N" / "FILE row N"."""
    files = source_files(source, key)
    return row_place(files, index, data.cache_dir) if files else f"row {index} of {source} (counted from 0)"


def raise_explained(error: Exception, explain: Callable[[Exception], Exception] | None) -> NoReturn:
    """Raise what ``explain`` makes of ``error`` (one line for the user), or ``error`` itself with its traceback."""
    explained = explain(error) if explain else error
    if explained is error:
        raise error
    raise explained from None


def _reading_error(error: Exception) -> bool:
    """Whether datasets raised ``error`` reading a file (not parseable, not of the columns' types)."""
    import pyarrow as pa
    from datasets.exceptions import DatasetGenerationError

    return isinstance(error, (pa.ArrowException, DatasetGenerationError, UnicodeDecodeError, json.JSONDecodeError))


class ResumableStream(torch.utils.data.IterableDataset):
    """A streaming datasets ``IterableDataset`` that counts the examples it has handed out in
    the current pass, so a checkpoint records the position and a resumed run starts exactly
    there: it reads the stream again (same seed, same shuffle buffer) and skips what was used.
    datasets' own ``state_dict()`` would lose the shuffle buffer's contents on resume.

    The count is exact because the DataLoader reads it in this process
    (``train.dataloader_num_workers = 0``) and takes examples only as batches are needed.

    What reading raises goes through ``explain`` (a bad row found mid-training becomes one line naming
    it); a pass that gives no example at all is refused (the loop would wait for one forever).
    """

    def __init__(self, rows: Any, key: str = "data.train",
                 explain: Callable[[Exception], Exception] | None = None):
        self.rows, self.key, self.explain = rows, key, explain
        self.epoch = 0
        self.position = 0  # examples handed out in this pass
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        self.rows.set_epoch(self.epoch)  # a new shuffle each pass
        examples = iter(self.rows)
        skip, self._skip = self._skip, 0
        try:
            for _ in itertools.islice(examples, skip):
                pass
            self.position = skip
            for example in examples:
                self.position += 1
                yield example
        except Exception as exc:
            raise_explained(exc, self.explain)
        if self.position == 0:
            raise ConfigError(f"{self.key}: a whole pass over the stream gave no example: every row was left out "
                              "(longer than data.max_length with data.truncation = \"drop\", or with no token to "
                              "learn), or there are none")
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._skip = int(state["epoch"]), int(state["position"])


def prepare_given(dataset: Any, data: DataConfig, tokenizer: PreTrainedTokenizerBase | None, key: str,
                  task: str = "causal-lm", label2id: dict[str, int] | None = None,
                  limits: ModelLimits | None = None) -> Any:
    """A dataset given to Run or returned by a data hook: a datasets object is checked and
    tokenized like data.train (one with input_ids is used as is, once checked); anything else is used as is."""
    if isinstance(dataset, dict):
        return {name: prepare_given(d, data, tokenizer, f"{key}[{name!r}]", task, label2id, limits)
                for name, d in dataset.items()}
    return prepare(dataset, data, tokenizer, key, task, label2id, limits) if is_datasets_object(dataset) else dataset


def tokenized_max_length(data: DataConfig, given: Any, task: str = "causal-lm") -> int | None:
    """``data.max_length`` where the engine tokenizes the train rows (it bounds their lengths), None
    where they come as token ids (``given`` to Run, or a local data.train whose first row is read):
    their own lengths are checked against the model then (:func:`check_token_rows`)."""
    if given is not None:
        return data.max_length if needs_tokenizer(given, data, task) else None
    try:
        if source_files(data.train, "data.train") is None and not _is_saved_dataset(Path(data.train).expanduser()):
            return data.max_length  # embedded, a callable, a dataset name: not read before they load
        peek = load_source(data.train, dataclasses.replace(data, streaming=True), "data.train")
        return None if "input_ids" in column_names(peek) else data.max_length
    except Exception:  # an unreadable source is refused, with its reason, where it loads
        return data.max_length


def check_examples(dataset: Any, task: str, key: str, limits: ModelLimits) -> None:
    """Refuse rows of token ids (a ``datasets.Dataset``, or a dict of them) that do not fit the model
    (``limits``): the last check of rows given to Run or made by a data plugin, named by their index."""
    import datasets

    if isinstance(dataset, dict):
        for name, each in dataset.items():
            check_examples(each, task, f"{key}[{name!r}]", limits)
    elif isinstance(dataset, datasets.Dataset) and "input_ids" in dataset.column_names:
        check_token_rows(dataset, task, key, limits)


def needs_tokenizer(dataset: Any, data: DataConfig, task: str = "causal-lm") -> bool:
    """Whether ``dataset`` (given to Run) holds rows that the engine tokenizes."""
    if isinstance(dataset, dict):
        return any(needs_tokenizer(d, data, task) for d in dataset.values())
    if not is_datasets_object(dataset):
        return False
    if task != "causal-lm":
        return "input_ids" not in column_names(dataset)
    return data_kind(dataset, data, "train_dataset") != "tokens"


def _split(total: int, fraction: float, seed: int) -> tuple[Any, Any]:
    """The indices of (train, eval) rows of ``total``: a seeded random ``fraction`` held out, at
    least one each side, each side in the file's order (the sampler shuffles training examples)."""
    import numpy as np

    if total < 2:
        raise ConfigError(f"data.eval_split: data.train has {total} document(s); holding out "
                          "eval documents needs at least 2; set data.eval instead")
    count = min(max(1, round(total * fraction)), total - 1)
    order = list(range(total))
    random.Random(seed).shuffle(order)
    held_out = np.zeros(total, dtype=bool)
    held_out[order[:count]] = True
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)
