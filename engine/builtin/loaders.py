"""``builtin.loaders``: the train DataLoader (the ``create_train_loader`` answer).

Batches of ``train.per_device_train_batch_size`` examples in the order of an
:class:`engine.kit.loaders.EpochSampler` (``train_sampling_strategy``: random, sequential or grouped by
length; ``data_seed``), this process's share of them, with the ``[train] dataloader_*`` arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from engine import hookimpl
from engine.config import option
from engine.errors import ConfigError
from engine.kit.loaders import EpochSampler, example_lengths, loader_data, loader_options
from engine.state import RunView

logger = logging.getLogger("engine")


@dataclass
class LoaderOptions:
    """``[train]`` keys of builtin.loaders (the DataLoader arguments; engine.kit.loaders reads them for
    any plugin building loaders, so a block does not refuse them, except dataloader_drop_last: only this
    builtin's train loader reads it)."""

    dataloader_num_workers: int = option(0, shared=True, min=0, help="DataLoader worker processes")
    dataloader_pin_memory: bool = option(True, shared=True, help="page-locked batches when training on a GPU")
    dataloader_persistent_workers: bool = option(False, shared=True, help=(
        "keep the DataLoader's workers between epochs (needs dataloader_num_workers > 0)"))
    dataloader_prefetch_factor: int | None = option(None, shared=True, min=1, help=(
        "batches each worker loads ahead (needs dataloader_num_workers > 0; default: torch's 2)"))
    dataloader_multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = option(None, shared=True, help=(
        "start method of the DataLoader's workers (default: the platform's)"))
    dataloader_in_order: bool = option(True, shared=True, help=(
        "workers' batches in sampler order (false: as they are ready)"))
    train_sampling_strategy: Literal["random", "sequential", "group_by_length"] = option("random", shared=True, help=(
        "order of the training examples: a seeded shuffle each epoch, the dataset's order, or 'group_by_length': "
        "that shuffle grouped into batches of similar length, longest first (less padding; Trainer's "
        "LengthGroupedSampler algorithm)"))
    length_column_name: str = option("length", shared=True, nonempty=True, help=(
        "group_by_length: the dataset column holding each example's length (default: the length of its "
        "input_ids, or of the tokenizer's first model input)"))
    remove_unused_columns: bool = option(True, shared=True, help=(
        "drop the columns (keys) of the examples that the model's forward does not take (label_names, label and "
        "label_ids kept) before the collator sees them, as Trainer"))
    dataloader_drop_last: bool = option(False, help="drop the last incomplete batch")


TRAIN_OPTIONS = LoaderOptions  # the [train] keys it reads: engine.config.TrainConfig has them


@hookimpl(tryfirst=True)  # its keys checked before the enabled plugins' configure, as the kernel's are
def configure(run: RunView) -> None:
    train = run.config.train
    for key in ("dataloader_persistent_workers", "dataloader_prefetch_factor"):
        if getattr(train, key) not in (None, False) and train.dataloader_num_workers == 0:
            raise ConfigError(f"train.{key} needs worker processes: set train.dataloader_num_workers > 0")


@hookimpl(trylast=True)
def create_train_loader(run: RunView) -> torch.utils.data.DataLoader:
    train = run.config.train
    dataset = run.train_dataset
    sampler = None
    lengths = None
    if train.train_sampling_strategy == "group_by_length":
        if isinstance(dataset, torch.utils.data.IterableDataset):
            logger.warning("train.train_sampling_strategy = 'group_by_length': the train dataset is an "
                           "IterableDataset, so its examples are not grouped by length (as Trainer)")
        else:  # the lengths are read before remove_unused_columns drops a length column
            input_name = (getattr(run.tokenizer, "model_input_names", None) or ["input_ids"])[0]
            lengths = example_lengths(dataset, train.length_column_name, input_name)
    dataset, collator = loader_data(run, dataset, "train dataset")
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        try:
            length = len(dataset)
        except TypeError:
            raise ConfigError("train dataset has no len(); use an IterableDataset with train.max_steps") from None
        if length == 0:
            raise ConfigError("the train dataset is empty")
        batch = train.per_device_train_batch_size * run.strategy.world_size
        if batch > length:  # every step would silently be the whole dataset
            raise ConfigError(f"train.per_device_train_batch_size: {train.per_device_train_batch_size} per device "
                              f"x {run.strategy.world_size} process(es) is more than the {length} train examples; "
                              "lower it, or give more data")
        data_seed = train.data_seed if train.data_seed is not None else train.seed
        sampler = EpochSampler(length, data_seed, train.train_sampling_strategy == "random",
                               run.strategy.rank, run.strategy.world_size, lengths,
                               train.per_device_train_batch_size * train.gradient_accumulation_steps)
    elif train.max_steps <= 0:
        raise ConfigError("train.max_steps: an IterableDataset has no length; set train.max_steps > 0")
    return torch.utils.data.DataLoader(
        dataset, batch_size=train.per_device_train_batch_size, sampler=sampler,
        collate_fn=collator, drop_last=train.dataloader_drop_last, **loader_options(run),
        # its own generator: starting an iterator must not draw from the global RNG, or a
        # resumed run (which starts one mid-epoch) would see different dropout masks
        generator=torch.Generator().manual_seed(train.seed),
    )
