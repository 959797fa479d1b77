"""The run's tokenizer: ``data.tokenizer`` loaded, the model folder's, or one trained on the data."""

from __future__ import annotations

import functools
import itertools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from engine.errors import ConfigError
from engine.util import is_callable_spec

from .formats import row_texts
from .mixture import mixture_sources_rows, source_texts
from .sources import LARGE_ROWS, data_kind, load_source, logger
from .task_rows import check_columns, tokenizer_texts
from .templates import TOKENIZER_DEFAULT, TURN_ENDS, resolve_chat_template

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
TOKENIZER_RECIPE = 1  # train_tokenizer's version: a change to it makes new cache entries
STREAMING_TOKENIZER_ROWS = 100_000  # data.streaming: documents a trained tokenizer learns from
SPECIAL_TOKEN_KEYS = ("eos_token", "pad_token", "bos_token")  # [data] keys naming the tokenizer's special tokens


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


def has_chat_template(given: Any, data: DataConfig, model_source: str) -> bool:
    """Whether the tokenizer a run will use has a chat template, told before it loads: the one given to Run,
    else the folder of data.tokenizer or of the model (a trained tokenizer has none). A folder whose files
    cannot be read here counts as having one: loading it says what is wrong."""
    if given is not None:
        return bool(getattr(given, "chat_template", None))
    folder = data.tokenizer if data.tokenizer not in ("auto", "train") else \
        model_source if data.tokenizer == "auto" and Path(model_source).is_dir() else None
    if folder is None:
        return False
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return True


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
    if rows is None and data.mixture is not None:  # learnt from every source's text
        return _mixture_tokenizer(data)
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
    kind = data_kind(rows, data, key)
    if data.streaming:  # a corpus larger than memory: its start is sample enough
        rows = rows.take(STREAMING_TOKENIZER_ROWS)
        logger.info("data.tokenizer: training on the first %d documents of the stream", STREAMING_TOKENIZER_ROWS)
        return train_tokenizer(row_texts(rows, kind, data, key), data.tokenizer_vocab_size)
    return _trained_or_cached(data, [(rows, kind, lambda rows: row_texts(rows, kind, data, key))])


def _mixture_tokenizer(data: DataConfig) -> PreTrainedTokenizerBase:
    """The tokenizer learnt from every source of ``data.mixture``, cached and sampled as one corpus."""
    return _trained_or_cached(data, [(rows, kind, functools.partial(source_texts, kind=kind, source=source))
                                     for rows, kind, source in mixture_sources_rows(data)])


def _trained_or_cached(data: DataConfig, sources: list[tuple[Any, str, Callable[[Any], Iterable[list[str]]]]]
                       ) -> PreTrainedTokenizerBase:
    """The tokenizer trained on ``sources`` (one, or a mixture's: ``(rows, kind, texts)``, where ``texts(rows)``
    reads the rows' text in batches), from the cache when these rows trained one before; plain-text rows sampled
    to ``data.tokenizer_train_bytes``."""
    folder = _cached_tokenizer_folder([rows for rows, _, _ in sources], data)
    if folder is not None and (folder / "tokenizer.json").is_file():
        logger.log(logging.INFO if sum(len(rows) for rows, _, _ in sources) >= LARGE_ROWS else logging.DEBUG,
                   "data.tokenizer: the tokenizer trained on these rows before, from the cache in %s", folder)
        return _load_trained(folder)
    # a large corpus: a sample of its documents learns the same merges, in a fraction of the time
    every = _sample_every([rows for rows, kind, _ in sources if kind == "text"], data)
    batches = (texts(rows.select(range(0, len(rows), every)) if kind == "text" and every > 1 else rows)
               for rows, kind, texts in sources)
    tokenizer = train_tokenizer(itertools.chain.from_iterable(batches), data.tokenizer_vocab_size)
    if folder is not None:
        _keep(tokenizer, folder)
    return tokenizer


def _cached_tokenizer_folder(row_sets: list[Any], data: DataConfig) -> Path | None:
    """Where the tokenizer trained on ``row_sets`` is kept: beside the first one's Arrow files (as the tokenized
    data is), named by all their files (path, size, modification time: the sources' content, since datasets
    writes them anew when a source file changes), the [data] keys and the recipe below. None if any rows are
    held in memory, or have files outside datasets' cache (a ``save_to_disk`` folder is the user's, not a place
    to write in)."""
    import hashlib

    import datasets

    from engine.config import to_mapping

    cache = Path(data.cache_dir or datasets.config.HF_DATASETS_CACHE).expanduser().resolve()
    files = []
    for rows in row_sets:
        own = [Path(entry["filename"]).resolve() for entry in getattr(rows, "cache_files", None) or []]
        if not own or not all(file.is_relative_to(cache) for file in own):
            return None
        files += own
    try:
        stats = [(str(file), file.stat().st_size, file.stat().st_mtime_ns) for file in files]
    except OSError:
        return None
    sizes = [len(rows) for rows in row_sets]
    key = json.dumps([TOKENIZER_RECIPE, stats, sizes[0] if len(sizes) == 1 else sizes, to_mapping(data)],
                     sort_keys=True, default=str)
    return files[0].parent / f"engine-tokenizer-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _sample_every(row_sets: list[Any], data: DataConfig) -> int:
    """n such that every n-th row of ``row_sets`` holds about ``data.tokenizer_train_bytes`` of text (1: all)."""
    size = sum(rows.data.nbytes for rows in row_sets)  # the Arrow tables': about the text's bytes
    limit = data.tokenizer_train_bytes
    if not limit or size <= limit:
        return 1
    every = -(-size // limit)
    total = sum(len(rows) for rows in row_sets)
    logger.info("data.tokenizer: trained on one row in %d (%d of %d rows, about %.1f of %.1f MB: "
                "data.tokenizer_train_bytes)", every, sum(-(-len(rows) // every) for rows in row_sets), total,
                size / every / 1e6, size / 1e6)
    return every


def _keep(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """``tokenizer`` saved into ``folder`` whole or not at all; a cache that cannot be written is skipped."""
    import shutil
    import tempfile

    try:
        partial = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    except OSError:  # a read-only cache
        return
    try:
        tokenizer.save_pretrained(partial)
        partial.rename(folder)
    except OSError:  # another process kept it first
        shutil.rmtree(partial, ignore_errors=True)


def _load_trained(folder: Path) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)


def check_token_options(data: DataConfig) -> None:
    """The tokenizer's [data] keys, checked at configure time (the template read and parsed)."""
    if data.chat_template is not None:
        resolve_chat_template(data.chat_template)
    for index, token in enumerate(data.added_tokens):
        if not token:
            raise ConfigError(f"data.added_tokens[{index}]: an empty string is not a token; remove it")


def apply_token_options(tokenizer: PreTrainedTokenizerBase, data: DataConfig) -> PreTrainedTokenizerBase:
    """``tokenizer`` with the [data] keys set on it (so saved with it into checkpoints and the output):
    ``added_tokens`` and new eos/pad/bos tokens added to its vocabulary as special tokens, and the chat template."""
    before = len(tokenizer)
    if data.added_tokens:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in data.added_tokens],
                             special_tokens=True)
    for name in SPECIAL_TOKEN_KEYS:
        token = getattr(data, name)
        if token is not None and getattr(tokenizer, name) != token:
            tokenizer.add_special_tokens({name: token})  # added to the vocabulary when new
    if len(tokenizer) > before:
        logger.info("data: %d new tokens added to the tokenizer (now %d)", len(tokenizer) - before, len(tokenizer))
    if data.chat_template is None:
        return tokenizer
    template = resolve_chat_template(data.chat_template)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.chat_template = {TOKENIZER_DEFAULT!r}: the tokenizer has no chat template; name one "
                          f"(e.g. 'chatml'), give it inline or as a file")
    if template is not None:
        tokenizer.chat_template = template
    turn_end = TURN_ENDS.get(data.chat_template)
    if turn_end is not None and data.eos_token is None and tokenizer.eos_token != turn_end:
        logger.warning("data.chat_template = %r ends each turn with %s but the tokenizer's eos is %s, at which "
                       "generation stops; set data.eos_token = %r (as Axolotl's and TRL's %s recipes do)",
                       data.chat_template, turn_end, tokenizer.eos_token, turn_end, data.chat_template)
    return tokenizer


def named_token_ids(tokenizer: PreTrainedTokenizerBase, data: DataConfig) -> list[int]:
    """The ids of the tokens the [data] keys name (added_tokens, eos/pad/bos), in the order named, once each."""
    names = [*data.added_tokens, *(getattr(data, name) for name in SPECIAL_TOKEN_KEYS)]
    ids = tokenizer.convert_tokens_to_ids([name for name in names if name is not None])
    return list(dict.fromkeys(ids))


def fit_model_to_tokens(model: Any, tokenizer: PreTrainedTokenizerBase, data: DataConfig) -> None:
    """The model after the [data] keys changed its tokenizer: embeddings grown to hold the tokens they added
    (new rows mean-initialised, transformers' default), and the model's eos/pad/bos ids those of the keys
    (the generation config stops at the new eos too, as TRL's SFTTrainer does)."""
    config = getattr(model, "config", None)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        named = set(named_token_ids(tokenizer, data))
        if all(index in named for index in range(rows, len(tokenizer))):  # else on_build_end refuses the mismatch
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # its notice of the mean initialisation: the line below says it
            try:
                model.resize_token_embeddings(len(tokenizer))
            finally:
                hf_logging.set_verbosity(verbosity)
            logger.info("data: the model's embeddings grew from %d to %d rows for the new tokens (mean-initialised)",
                        rows, len(tokenizer))
    if config is None:
        return
    for name in SPECIAL_TOKEN_KEYS:
        if getattr(data, name) is not None:
            setattr(config, f"{name}_id", getattr(tokenizer, f"{name}_id"))
    generation = getattr(model, "generation_config", None)
    if data.eos_token is not None and generation is not None:
        stops = generation.eos_token_id
        stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
        if tokenizer.eos_token_id not in stops:
            generation.eos_token_id = [tokenizer.eos_token_id, *stops]
    if data.pad_token is not None and generation is not None:
        generation.pad_token_id = tokenizer.pad_token_id
