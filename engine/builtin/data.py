"""The builtin data: ``[data]`` read, tokenized and packed with 🤗 Datasets (engine/data.py)."""

from __future__ import annotations

from pathlib import Path

from engine import hookimpl
from engine.errors import ConfigError


@hookimpl
def configure(run):
    train, data = run.config.train, run.config.data
    if run.tokenizer is None and run.model is None and run.model_init is None and Path(train.model).is_dir():
        from engine.checkpoint import check_model_folder
        from engine.data import check_tokenizer_source

        check_model_folder(Path(train.model), "train.model")  # a damaged folder says so first
        check_tokenizer_source(data, train.model)  # before anything loads: engine plan says it too
    from engine.data import no_evaluation_data, schedules_evaluation

    if run.eval_dataset is None and schedules_evaluation(train):
        others_supply_data = any(not impl.plugin_name.startswith("builtin.")
                                 for impl in run.hook.create_datasets.get_hookimpls())
        from_config = run.train_dataset is None
        if not (from_config and (others_supply_data or data.eval is not None or data.eval_split > 0)):
            raise no_evaluation_data(train)
    if data.streaming and train.dataloader_num_workers:
        raise ConfigError("data.streaming: needs train.dataloader_num_workers = 0 (the stream position is "
                          "counted in this process, so that a resumed run starts exactly where it stopped)")


@hookimpl(trylast=True)
def create_datasets(run):
    from engine.data import build_datasets
    from engine.tasks import label_ids_by_name

    train = run.config.train
    return build_datasets(run.config.data, run.tokenizer, train.seed,
                          shuffle=train.train_sampling_strategy != "sequential",  # a stream: shuffled, never grouped
                          rank=run.strategy.rank, world_size=run.strategy.world_size,
                          task=run.task, label2id=label_ids_by_name(train), limits=_model_limits(run))


def _model_limits(run):
    """What rows of token ids must fit (their ids, their lengths), from the model given or the config of the
    one the run builds after the data (None for a model factory: its rows are checked once it is built)."""
    from engine.models import input_limits, model_config

    if run.model is not None:
        return input_limits(run.model)
    config = model_config(run.config.train, run.tokenizer)  # a folder's config.json, or the one built from values
    return None if config is None else input_limits(config)


@hookimpl
def checkpoint_state(run):
    from engine.data import ResumableStream

    if isinstance(run.train_dataset, ResumableStream):
        return {"stream": run.train_dataset.state_dict()}
    return None


@hookimpl
def load_checkpoint_state(run, state):
    from engine.data import ResumableStream

    if "stream" in state and isinstance(run.train_dataset, ResumableStream):
        stream = dict(state["stream"])
        if run.config.train.ignore_data_skip:  # the resumed pass from its start, none of it skipped
            stream["position"] = 0
        run.train_dataset.load_state_dict(stream)
