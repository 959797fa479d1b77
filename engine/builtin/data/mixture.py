"""``[[data.mixture]]``: several train sources in one run, as the alignment handbook's ``dataset_mixture``.

Each entry names a ``source`` (the forms of ``data.train``), the ``weight`` (fraction) of its rows kept,
sampled with the run's seed, its ``split`` / ``config``, the ``columns`` kept, and its own format keys
(:data:`FORMAT_KEYS`): it is read and tokenized with ``[data]`` as that entry overrides it. The examples of
all sources are concatenated, shuffled with the seed, and shaped (packed) together, once
(:func:`engine.builtin.data.build.build_datasets`).
"""

from __future__ import annotations

import dataclasses
import difflib
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from engine.config import check_value, from_mapping, option
from engine.errors import ConfigError
from engine.util import is_callable_spec

from .formats import check_options as check_format_options
from .formats import row_texts
from .preference import PREFERENCE_COLUMNS, tokenized_kind
from .sources import (
    _is_saved_dataset, column_names, data_kind, load_source, logger, named_rows, source_files,
)

if TYPE_CHECKING:
    from engine.config import DataConfig  # assembled from the builtins' options: not at import

# [data] keys an entry may set for its own rows; those the installed [data] lacks are unknown keys
FORMAT_KEYS = ("format", "text_column", "messages_column", "role_key", "content_key", "roles", "train_on_all_tokens")
EXAMPLE_COLUMNS = ("input_ids", "labels")  # what a source's examples keep for the shaping they share


@dataclasses.dataclass
class MixtureEntry:
    """One ``[[data.mixture]]`` table, less its format keys."""

    source: str = option(nonempty=True, help="the forms of data.train")
    weight: float = option(1.0, help="the fraction of the source's rows kept, in (0, 1]")
    split: str | None = option(None, nonempty=True, help="split of a dataset name or saved DatasetDict (default data.split)")
    config: str | None = option(None, help="configuration of a dataset name (default data.config)")
    columns: list[str] | None = option(None, help="the columns kept (default all)")


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    """An entry checked: ``key`` names it ("data.mixture[0]"), ``data`` is ``[data]`` as it overrides it."""

    key: str
    entry: MixtureEntry
    data: DataConfig


def mixture_sources(data: DataConfig) -> list[MixtureSource]:
    """``data.mixture`` checked (at configure time: each refusal is one line naming the key)."""
    defaults = {f.name: f.default for f in dataclasses.fields(data)}
    if data.train != defaults["train"]:
        raise ConfigError(f"data.mixture and data.train = {data.train!r} are both set; list that source in "
                          "data.mixture (one [[data.mixture]] table each), or remove data.mixture")
    if not data.mixture:
        raise ConfigError("data.mixture: empty; give it [[data.mixture]] tables with a source each, or remove it "
                          "(data.train reads one source)")
    if data.streaming:
        raise ConfigError("data.mixture: reads whole sources to sample their rows, but data.streaming is true; "
                          "set data.streaming = false, or read one source with data.train")
    formats = [key for key in FORMAT_KEYS if key in defaults]
    known = [f.name for f in dataclasses.fields(MixtureEntry)] + formats
    sources = []
    for index, table in enumerate(data.mixture):
        key = f"data.mixture[{index}]"
        for name in table:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
                raise ConfigError(f"{key}.{name}: unknown key; {hint}")
        if "source" not in table:
            raise ConfigError(f"{key}: no source; set {key}.source (the forms of data.train)")
        entry = from_mapping(MixtureEntry, {k: v for k, v in table.items() if k not in formats}, key)
        if not 0 < entry.weight <= 1:
            raise ConfigError(f"{key}.weight: the fraction of the source's rows kept, in (0, 1], got {entry.weight:g}; "
                              "to repeat a source, list it again")
        overrides = {name: check_value(type(data), name, table[name], f"{key}.{name}") for name in formats
                     if name in table}
        if entry.config is not None:
            overrides["config"] = entry.config
        effective = dataclasses.replace(data, **overrides)
        try:
            check_format_options(effective)
        except ConfigError as refused:  # its keys are this table's
            raise ConfigError(f"{key}: {refused}") from None
        sources.append(MixtureSource(key, entry, effective))
    for source in sources:  # a path to nothing, once every table reads
        source_files(source.entry.source, f"{source.key}.source")
    return sources


def peekable_sources(data: DataConfig) -> Iterator[MixtureSource]:
    """The sources of ``data.mixture`` whose rows ``engine plan`` reads a few of: local ones of a format other
    than 'auto' (each checked against its format)."""
    for source in mixture_sources(data):
        spec = source.entry.source
        if source.data.format != "auto" and (source_files(spec, source.key) is not None
                                             or _is_saved_dataset(Path(spec).expanduser())):
            yield source


def mixture_rows(source: MixtureSource, rows: Any) -> Any:
    """The rows of ``source`` with its ``columns`` only (a column it lacks refused)."""
    columns = source.entry.columns
    if columns is None:
        return rows
    missing = [name for name in columns if name not in column_names(rows)]
    if missing:
        raise ConfigError(f"{source.key}.columns: {source.entry.source} has no column {missing[0]!r}; "
                          f"its columns: {', '.join(column_names(rows))}")
    return rows.select_columns(columns)


def kept_rows(total: int, source: MixtureSource, index: int, seed: int) -> list[int]:
    """The rows of ``source`` (the ``index``-th entry) its weight keeps: round(weight x total) of them, drawn with
    ``seed`` (each source its own draw), in their order in the source."""
    count = round(source.entry.weight * total)
    if count == 0:
        raise ConfigError(f"{source.key}.weight: {source.entry.weight:g} of {total} row(s) of {source.entry.source} "
                          "keeps none; raise it")
    if count == total:
        return list(range(total))
    return sorted(random.Random(f"{seed}/{index}").sample(range(total), count))


def mixed_examples(parts: list[Any], seed: int) -> Any:
    """The examples of every source, concatenated and shuffled with ``seed`` (so that packing mixes them), with
    :data:`EXAMPLE_COLUMNS` only: text examples (no labels: every token learnt) get their input_ids as labels
    when another source has labels."""
    import datasets

    kinds = {tokenized_kind(part.column_names) for part in parts}
    if len(kinds) > 1 and None in kinds:
        raise ConfigError("data.mixture: mixes preference pairs with other rows; a run learns from one or the other")
    kind = kinds.pop()
    columns = PREFERENCE_COLUMNS[kind] if kind is not None else EXAMPLE_COLUMNS
    labelled = any("labels" in part.column_names for part in parts)
    parts = [part.select_columns([c for c in columns if c in part.column_names]) for part in parts]
    if labelled:
        parts = [part if "labels" in part.column_names else part.map(_every_token_learnt, batched=True)
                 for part in parts]
    features = parts[0].features  # ids from a tokenizer or from a file may differ in width
    examples = datasets.concatenate_datasets([part if part.features == features else part.cast(features)
                                              for part in parts])
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return examples.select(order).flatten_indices()  # shaping reads the columns' buffers: no indices mapping


def _every_token_learnt(batch: dict[str, list]) -> dict[str, list]:
    return {"labels": batch["input_ids"]}


def log_source(source: MixtureSource, read: int, kept: int, examples: Any) -> None:
    """One line per source, so the user sees the mixture's proportions."""
    import pyarrow.compute as pc

    table = examples.with_format("arrow")
    tokens = sum(pc.sum(pc.list_value_length(table[column])).as_py() or 0 for column in table.column_names
                 if column == "input_ids" or column.endswith("_ids") and tokenized_kind(table.column_names))
    logger.info("%s: %s: %d rows read, %d kept (weight %g), %d tokens", source.key, source.entry.source, read, kept,
                source.entry.weight, tokens)


def mixture_sources_rows(data: DataConfig) -> list[tuple[Any, str, MixtureSource]]:
    """Every source's rows and kind (as its format says), for training a tokenizer: all sources, whatever
    their weights (a tokenizer learns from the sources)."""
    loaded = []
    for source in mixture_sources(data):
        if is_callable_spec(source.entry.source):
            raise ConfigError(f"data.tokenizer = {data.tokenizer!r} trains a tokenizer, which needs text data, but "
                              f"{source.key}.source is the callable {source.entry.source!r}; set data.tokenizer to a "
                              "tokenizer folder")
        rows = load_source(source.entry.source, source.data, source.key, source.entry.split)
        loaded.append((rows, data_kind(rows, source.data, source.key), source))
    return loaded


def source_texts(rows: Any, kind: str, source: MixtureSource) -> Iterator[list[str]]:
    """The text of a source's ``rows`` (all of them or a sample), in batches; a bad row names the source."""
    with named_rows(source.entry.source, source.key, source.data):
        yield from row_texts(rows, kind, source.data, source.key)
