"""Where rows come from: ``data.train`` / ``data.eval`` read through 🤗 Datasets.

A source (see :func:`load_source`) is ``"embedded"`` (docstrings of Python's own standard library, so a
run works with no data), a local ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` / ``.arrow`` /
``.txt`` file, a glob, a folder of such files, a dataset saved with ``save_to_disk``, or a dataset
name for ``datasets.load_dataset``. Files that do not read are named by file and line, as their
user counts them (:func:`read_error`, :func:`row_place`).
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
import re
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from engine.errors import ConfigError
from engine.util import is_callable_spec

if TYPE_CHECKING:
    from engine.config import DataConfig  # assembled from the builtins' options: not at import


logger = logging.getLogger("engine")
# file suffix -> the datasets builder that reads it
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow",
                 ".txt": "text"}
# Below these sizes reading and tokenizing take a second or so: one process, no progress bars,
# and reading the cache is not worth a line in the console.
LARGE_ROWS = 50_000
LARGE_FILE_BYTES = 50 * 10**6
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


@contextlib.contextmanager
def named_rows(source: str | None, key: str, data: DataConfig, source_rows: Any = None) -> Iterator[None]:
    """A :class:`BadRow` raised inside, whose index counts the rows of ``source`` (or ``source_rows``:
    the row of ``source`` each row read is), as one line naming the row as in its file. A ``source``
    of None names no file (rows given in Python are named by their index)."""
    try:
        yield
    except BadRow as bad:
        index = bad.index if source_rows is None else int(source_rows[bad.index])
        if source is None:
            raise BadRow(bad.key, index, bad.reason) from None
        raise ConfigError(f"{key}: {_name_row(source, key, index, data)}: {bad.reason}") from None


def _name_row(source: str, key: str, index: int, data: DataConfig) -> str:
    """Row ``index`` (counted from 0) of ``source`` as its user finds it: "FILE line N" / "FILE row N"."""
    files = source_files(source, key)
    return row_place(files, index, data.cache_dir) if files else f"row {index} of {source} (counted from 0)"


def column_names(rows: Any) -> list[str]:
    """The columns of a datasets object; a streaming one without known features is peeked at."""
    names = rows.column_names
    if names is None:  # streaming JSON: the columns are known once a row is read
        first = next(iter(rows.take(1)), None)
        names = list(first) if first is not None else []
    return list(names)


# data.format -> the kind of rows it reads (prepare.py encodes each kind; formats.py renders the prompt formats)
FORMAT_KINDS = {"text": "text", "chat": "chat", "sharegpt": "chat", "prompt_completion": "completion",
                "alpaca": "alpaca", "input_output": "input_output"}


def messages_column(data: DataConfig) -> str:
    """The column of conversations: ``data.messages_column``, else 'conversations' for sharegpt, 'messages'."""
    return data.messages_column or ("conversations" if data.format == "sharegpt" else "messages")


def format_columns(data: DataConfig) -> list[str]:
    """The columns the rows of ``data.format`` (not 'auto') must have."""
    return {"text": [data.text_column], "chat": [messages_column(data)], "sharegpt": [messages_column(data)],
            "prompt_completion": ["prompt", "completion"], "alpaca": ["instruction", "output"],
            "input_output": ["segments"]}[data.format]


PREFERENCE, UNPAIRED = "preference", "unpaired"  # the rows of preference plugins (.preference)


def preference_kind(names: list[str]) -> str | None:
    """The preference kind of rows with columns ``names``, None for other rows."""
    if "chosen" in names and "rejected" in names:
        return PREFERENCE
    if "completion" in names and "label" in names and "prompt" in names:
        return UNPAIRED
    return None


def no_preference_plugin(key: str, kind: str) -> ConfigError:
    """The refusal of preference rows in a run without a plugin that learns from them."""
    which = "dpo, orpo, cpo (SimPO) or reward" if kind == PREFERENCE else "kto"
    columns = "chosen and rejected" if kind == PREFERENCE else "prompt, completion and label"
    return ConfigError(f"{key} holds {kind} rows ({columns}), which a preference "
                       f"plugin learns from; enable one: plugins = [\"{which.split(',')[0]}\"] ({which})")


def missing_pair(names: list[str], key: str) -> str | None:
    """Why rows with one side of a pair cannot be read (None when they are not such rows)."""
    for present, absent in (("chosen", "rejected"), ("rejected", "chosen")):
        if present in names and absent not in names:
            return (f"{key} has a {present!r} column but no {absent!r} one (its columns: {', '.join(names)}); "
                    f"preference pairs need both, or give rows of prompt, completion and a boolean label "
                    f"(unpaired, for kto)")
    return None


def data_kind(rows: Any, data: DataConfig, key: str) -> str:
    """What the rows hold: "tokens" (input_ids), "preference" (chosen and rejected), "unpaired" (prompt,
    completion and label), "chat" (messages), "completion" (prompt and completion) or "text"
    (``data.text_column``); a ConfigError listing the columns otherwise.
    A ``data.format`` other than 'auto' says it (:data:`FORMAT_KINDS`), once its columns are found; rows of
    token ids are examples already, whatever the format."""
    names = column_names(rows)
    if "input_ids" in names:
        return "tokens"
    if data.format != "auto":
        missing = [name for name in format_columns(data) if name not in names]
        if missing:
            fix = {"text": "data.text_column", "chat": "data.messages_column", "sharegpt": "data.messages_column"}
            raise ConfigError(f"data.format = {data.format!r} needs the column(s) {', '.join(missing)}, which {key} "
                              f"lacks (its columns: {', '.join(names) or 'none'}); set data.format to the rows' "
                              f"format (or 'auto'){' or ' + fix[data.format] if data.format in fix else ''}")
        return FORMAT_KINDS[data.format]
    if preference_kind(names) is not None:
        return preference_kind(names)
    if missing_pair(names, key):
        raise ConfigError(missing_pair(names, key))
    if messages_column(data) in names:
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
