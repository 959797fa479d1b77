"""The builtin data: ``[data]`` read, tokenized and packed with 🤗 Datasets; the tokenizer; the collator.

Its modules, one concern each: :mod:`.sources` (files, globs, folders, saved datasets, dataset
names), :mod:`.tokenizer`, :mod:`.chat` (chat templates), :mod:`.packing` (tokenizing and
packing), :mod:`.task_rows` (other tasks' rows), :mod:`.checks` (rows of token ids against the
model), :mod:`.prepare` (the cached map pipeline), :mod:`.collators`, :mod:`.build`
(:func:`build_datasets`), :mod:`.mixture` (several sources, ``[[data.mixture]]``), :mod:`.formats`
(prompt formats: alpaca, sharegpt, input_output), :mod:`.templates` (named chat templates) and
:mod:`.streaming`. transformers and datasets are imported inside the functions that need them, so
importing this package stays cheap.

This module is the plugin: it answers the setup hooks for the tokenizer, the data and the collator,
checks what the data needs at configure time, and keeps a stream's position in checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine import hookimpl
from engine.errors import ConfigError
from engine.kit.loaders import loader_data
from engine.kit.models import model_config
from engine.util import is_datasets_object

from .build import (
    build_datasets, check_config, check_examples, named_rows, needs_tokenizer, no_evaluation_data, prepare_given,
    schedules_evaluation,
)
from .checks import input_limits
from .collators import collator_for, enable_document_packing, flattens
from .formats import check_options as check_format_options, check_rows, no_chat_template, peekable_sources
from .mixture import peekable_sources as peekable_mixture
from .options import DataOptions
from .preference import PREFERENCE_KINDS, tokenized_kind
from .sources import no_preference_plugin, show_progress
from .streaming import ResumableStream
from .task_rows import label_ids_by_name
from .tokenizer import (
    apply_token_options, build_tokenizer, check_token_options, check_tokenizer_source, fit_model_to_tokens,
    has_chat_template, has_tokenizer, load_tokenizer,
)

DATA_OPTIONS = DataOptions  # the [data] keys it reads: engine.config.DataConfig has them


@hookimpl
def configure(run):
    train, data = run.config.train, run.config.data
    if run.tokenizer is None and run.model is None and run.model_init is None and Path(train.model).is_dir():
        from engine.kit.checkpoint import check_model_folder

        check_model_folder(Path(train.model), "train.model")  # a damaged folder says so first
        check_tokenizer_source(data, train.model)  # before anything loads: engine plan says it too
    check_token_options(data)  # the chat template read and parsed: engine plan refuses a bad one
    if run.eval_dataset is None and schedules_evaluation(train):
        others_supply_data = any(not run.plugin_manager.is_builtin(impl.plugin_name)
                                 for impl in run.hook.create_datasets.get_hookimpls())
        from_config = run.train_dataset is None
        if not (from_config and (others_supply_data or data.eval is not None or data.eval_split > 0)):
            raise no_evaluation_data(train)
    if data.streaming and train.dataloader_num_workers:
        raise ConfigError("data.streaming: needs train.dataloader_num_workers = 0 (the stream position is "
                          "counted in this process, so that a resumed run starts exactly where it stopped)")
    check_config(data)  # data.mixture's entries, before anything loads
    check_format_options(data)
    if run.train_dataset is None and run.task == "causal-lm":  # other tasks' rows: engine/builtin/tasks.py
        _check_first_rows(run, data)


def _check_first_rows(run, data):
    """The first rows of the local sources (each mixed source by its own format keys), for engine plan: rows of
    another format than data.format, or chats that no chat template will render, are refused."""
    others_tokenize = any(not run.plugin_manager.is_builtin(impl.plugin_name)
                          for impl in run.hook.create_tokenizer.get_hookimpls())
    templated = others_tokenize or data.chat_template is not None or \
        has_chat_template(run.tokenizer, data, run.config.train.model)
    sources = [(key, source, split, data) for key, source, split in peekable_sources(data)]
    if data.mixture is not None:
        sources += [(mixed.key, mixed.entry.source, mixed.entry.split or data.split, mixed.data)
                    for mixed in peekable_mixture(data)]
    for key, source, split, read_as in sources:
        if read_as.format == "auto" and templated:
            continue  # nothing to check without reading rows
        with named_rows(source, key, read_as):
            kind = check_rows(read_as, key, source, split)
            if kind == "chat" and not templated:
                raise no_chat_template(key, read_as)
            if kind in PREFERENCE_KINDS and not _others_collate(run):
                raise no_preference_plugin(key, kind)


@hookimpl
def on_build_start(run):
    given = run.train_dataset
    if given is None:
        check_config(run.config.data)  # whoever supplies the data (create_datasets), [data] shapes it
    if given is None or is_datasets_object(given):
        show_progress(not run.config.train.disable_tqdm)
    if run.tokenizer is not None:  # given to Run: the [data] tokenizer keys apply to it as to one built
        apply_token_options(run.tokenizer, run.config.data)


@hookimpl(trylast=True)
def create_tokenizer(run, checkpoint):
    data, given = run.config.data, run.train_dataset
    if checkpoint is not None:  # the tokenizer those weights were trained with, not one trained again on today's data
        return apply_token_options(load_tokenizer(str(checkpoint), "--checkpoint"), data) \
            if data.tokenizer in ("auto", "train") and has_tokenizer(checkpoint) else None
    if given is not None and run.model is not None and not needs_tokenizer(given, data, run.task):
        return None  # rows of token ids and a model: nothing to tokenize
    rows = given if is_datasets_object(given) else None
    with named_rows(data.train if given is None else None, "data.train", data):  # rows learnt from
        return apply_token_options(build_tokenizer(data, run.config.train.model, rows, run.task), data)


@hookimpl
def on_model_built(run):
    if run.tokenizer is not None and run.model is not None:
        fit_model_to_tokens(run.model, run.tokenizer, run.config.data)  # the tokens the [data] keys added


@hookimpl(trylast=True)
def create_datasets(run):
    train = run.config.train
    built = build_datasets(run.config.data, run.tokenizer, train.seed,
                           shuffle=train.train_sampling_strategy != "sequential",  # a stream: shuffled, never grouped
                           rank=run.strategy.rank, world_size=run.strategy.world_size,
                           task=run.task, label2id=label_ids_by_name(train), limits=_model_limits(run))
    return built._replace(collator=None)  # the run's comes from create_collator, once the model is built


def _model_limits(run):
    """What rows of token ids must fit (their ids, their lengths), from the model given or the config of the
    one the run builds after the data (None for a model factory: its rows are checked once it is built)."""
    if run.model is not None:
        return input_limits(run.model)
    config = model_config(run.config.train, run.tokenizer)  # a folder's config.json, or the one built from values
    return None if config is None else input_limits(config)


@hookimpl(trylast=True)
def prepare_dataset(run, dataset, key):
    return prepare_given(dataset, run.config.data, run.tokenizer, key, run.task, label_ids_by_name(run.config.train))


@hookimpl(trylast=True)
def create_collator(run):
    kind = tokenized_kind(getattr(run.train_dataset, "column_names", None) or [])
    if kind is not None:  # no plugin that learns from them answered first
        raise no_preference_plugin("data.train", kind)
    return collator_for(run.config.data, run.tokenizer)


def _others_collate(run) -> bool:
    return any(not run.plugin_manager.is_builtin(impl.plugin_name) for impl in run.hook.create_collator.get_hookimpls())


@hookimpl
def on_build_end(run):
    if flattens(run.config.data):
        enable_document_packing(run.model, flattens(run.config.data))
    if run.config.train.label_names is not None:
        _check_label_names(run)
    vocab_size = getattr(getattr(run.model, "config", None), "vocab_size", None)
    if vocab_size is not None and run.tokenizer is not None and len(run.tokenizer) > vocab_size:
        raise ConfigError(f"the tokenizer has {len(run.tokenizer)} tokens but the model's vocab_size is "
                          f"{vocab_size}; set data.tokenizer to the model's tokenizer or pass tokenizer=")
    limits = input_limits(run.model)  # rows of token ids given, or made by a data plugin, fit the model
    check_examples(run.train_dataset, run.task, "train_dataset", limits)
    check_examples(run.eval_dataset, run.task, "eval_dataset", limits)
    if run.eval_dataset is None and schedules_evaluation(run.config.train):  # a data plugin gave none
        raise no_evaluation_data(run.config.train)  # now, not at the first evaluation an epoch later


def _check_label_names(run) -> None:
    """``train.label_names`` are keys of the batches evaluation sees (one example collated to find out)."""
    evaluation = run.eval_dataset if isinstance(run.eval_dataset, dict) else {"eval": run.eval_dataset}
    dataset = next((d for d in evaluation.values() if d is not None), run.train_dataset)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return  # a stream: its first batch is not read ahead
    dataset, collator = loader_data(run, dataset, "eval dataset")
    if len(dataset) == 0:
        return
    example = dataset[0]
    keys = collator([example]) if collator is not None else example
    if not hasattr(keys, "keys"):
        return  # not a mapping: the model takes no keyword batch
    missing = [name for name in run.label_names if name not in keys]
    if missing:
        raise ConfigError(f"train.label_names: {', '.join(map(repr, missing))} is not a key of the batches, "
                          f"which hold {', '.join(map(repr, keys))}; name the label keys, or leave "
                          "train.label_names unset (the model's label arguments)")


@hookimpl
def checkpoint_state(run):
    if isinstance(run.train_dataset, ResumableStream):
        return {"stream": run.train_dataset.state_dict()}
    return None


@hookimpl
def load_checkpoint_state(run, state):
    if "stream" in state and isinstance(run.train_dataset, ResumableStream):
        stream = dict(state["stream"])
        if run.config.train.ignore_data_skip:  # the resumed pass from its start, none of it skipped
            stream["position"] = 0
        run.train_dataset.load_state_dict(stream)
