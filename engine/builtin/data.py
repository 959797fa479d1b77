"""The builtin data: ``[data]`` read, tokenized and packed with 🤗 Datasets (engine/data.py)."""

from __future__ import annotations

from engine import hookimpl
from engine.errors import ConfigError


@hookimpl
def configure(run):
    train, data = run.config.train, run.config.data
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
                          task=run.task, label2id=label_ids_by_name(train))


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
