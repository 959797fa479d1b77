"""What a DataLoader takes of a run: the examples' columns the model's forward takes
(``train.remove_unused_columns``, as Trainer), each example's length (``group_by_length``), the
``[train] dataloader_*`` arguments, and the deterministic sampler (:class:`EpochSampler`).

For a plugin that makes a loader (``create_train_loader``, an evaluation pass)::

    dataset, collator = loader_data(run, dataset, "eval dataset")
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=collator, **loader_options(run))
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterator

import torch

from engine.errors import ConfigError
from engine.state import RunView
from engine.util import is_datasets_object, is_peft_model

logger = logging.getLogger("engine")


def loader_data(run: RunView, dataset: Any, key: str) -> tuple[Any, Callable[[list[Any]], Any]]:
    """The dataset and collator a loader of ``dataset`` uses: the examples' keys that the model's forward
    does not take left out (``train.remove_unused_columns``, as Trainer)."""
    if not run.config.train.remove_unused_columns:
        return dataset, run.data_collator
    kept = [column for columns in run.hook.keep_columns(run=run) for column in columns or ()]
    return without_unused_columns(dataset, run.data_collator, forward_columns(run.model, run.label_names) + kept,
                                  run.model, key)


def loader_options(run: RunView) -> dict[str, Any]:
    """The DataLoader arguments ``[train] dataloader_*`` set, for the train and evaluation loaders."""
    train = run.config.train
    options = {"num_workers": train.dataloader_num_workers,
               "pin_memory": train.dataloader_pin_memory and run.strategy.device.type == "cuda",
               "in_order": train.dataloader_in_order}
    if train.dataloader_num_workers:
        options.update(persistent_workers=train.dataloader_persistent_workers,
                       prefetch_factor=train.dataloader_prefetch_factor,
                       multiprocessing_context=train.dataloader_multiprocessing_context)
    return options


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

    name = type(model).__name__
    if not isinstance(dataset, datasets.Dataset):
        from transformers.trainer_utils import RemoveColumnsCollator  # here only: it imports peft (~2 s)

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
        names = list(dataset.column_names)
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


class EpochSampler(torch.utils.data.Sampler[int]):
    """Deterministic order per (seed, epoch), sharded over ``world_size`` ranks.

    The order of epoch e depends only on seed and e, so a resumed run can skip exactly the
    samples it already saw (``start``) instead of replaying the data loader.

    ``lengths`` (one per example) groups the shuffled order by length with Trainer's
    ``get_length_grouped_indices``: the same shuffled order cut into megabatches of
    ``min(50, length // (4 * group_size))`` (at least 1) x ``group_size`` examples, each sorted longest
    first, the longest example of all moved to the front.
    """

    def __init__(self, length: int, seed: int, shuffle: bool = True, rank: int = 0, world_size: int = 1,
                 lengths: list[int] | None = None, group_size: int = 1):
        self.length, self.seed, self.shuffle = length, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.lengths, self.group_size = lengths, group_size
        self.epoch = 0
        self.start = 0
        self.per_rank = math.ceil(length / world_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        if self.lengths is not None:
            from transformers.trainer_pt_utils import get_length_grouped_indices

            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = get_length_grouped_indices(self.lengths, self.group_size, generator=generator)
        elif self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        order += order[: self.per_rank * self.world_size - self.length]  # equal share per rank
        return iter(order[self.rank::self.world_size][self.start:])

    def __len__(self) -> int:
        return self.per_rank - self.start
