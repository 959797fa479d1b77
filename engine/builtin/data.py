"""The builtin data: ``[data]`` read, tokenized and packed with 🤗 Datasets (engine/data.py)."""

from __future__ import annotations

from engine import hookimpl


@hookimpl(trylast=True)
def create_datasets(run):
    from engine.data import build_datasets

    return build_datasets(run.config.data, run.tokenizer, run.config.train.seed)
