"""data.streaming: rows tokenized and packed on the fly, shuffled through a buffer, per-rank
shards, and a resumed run that sees exactly the batches an uninterrupted one sees."""

import json

import pytest

import engine
from engine.config import DataConfig
from engine.builtin.data.build import build_datasets
from engine.builtin.data.streaming import ResumableStream
from engine.builtin.data.tokenizer import train_tokenizer
from engine.errors import ConfigError
from engine.testing import tiny_model

WORDS = "the fox cat owl jumps over lazy dogs and writes answers questions hello world".split()
DOCS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(4 + i % 9)) + f" {i}" for i in range(300)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(DOCS, 300)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    return str(path)


def rows_of(dataset):
    return [list(example["input_ids"]) for example in dataset]


def test_streaming_rows_are_the_map_style_rows(tmp_path, corpus, tokenizer):
    cache = str(tmp_path / "cache")
    mapped = build_datasets(DataConfig(train=corpus, max_length=16, cache_dir=cache), tokenizer, 0).train
    stream = build_datasets(DataConfig(train=corpus, max_length=16, cache_dir=cache, streaming=True), tokenizer, 0,
                            shuffle=False).train
    assert isinstance(stream, ResumableStream)
    assert rows_of(stream) == mapped["input_ids"]

    shuffled = build_datasets(DataConfig(train=corpus, max_length=16, cache_dir=cache, streaming=True,
                                         shuffle_buffer_size=50), tokenizer, 0).train
    rows = rows_of(shuffled)
    assert rows != mapped["input_ids"] and sorted(rows) == sorted(mapped["input_ids"])
    assert rows_of(shuffled) != rows  # the next pass is shuffled anew

    # two ranks read disjoint shares that together are the whole stream
    shares = [rows_of(build_datasets(DataConfig(train=corpus, max_length=16, cache_dir=cache, streaming=True),
                                     tokenizer, 0, shuffle=False, rank=r, world_size=2).train) for r in (0, 1)]
    assert shares[0] and shares[1] and shares[0] != shares[1]


class Batches:
    """Records the input_ids of every micro-batch the loop trains on, by step."""

    name = "batches"

    def __init__(self):
        self.seen = {}

    @engine.hookimpl(wrapper=True)
    def training_step(self, run, batches, num_items_in_batch):
        self.seen[run.state.global_step + 1] = [b["input_ids"].tolist() for b in batches]
        return (yield)


def _train(tmp_path, output, corpus, tokenizer, max_steps, **train):
    recorder = Batches()
    run = engine.Run({"train": {"max_steps": max_steps, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2,
                                "disable_tqdm": True, "output_dir": str(tmp_path / output), "save_strategy": "steps",
                                "save_steps": 3, "logging_steps": 1, "save_final_model": False, **train},
                      "data": {"train": corpus, "max_length": 16, "streaming": True, "shuffle_buffer_size": 40,
                               "cache_dir": str(tmp_path / "cache")}},
                     model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer, plugins=[recorder])
    run.train()
    return recorder.seen


def test_resumed_stream_sees_the_same_next_batches(tmp_path, corpus, tokenizer):
    # 300 documents make 100-odd rows: 6 steps of 2 x 3 rows pass the end of the stream once
    whole = _train(tmp_path, "whole", corpus, tokenizer, 30)
    _train(tmp_path, "resumed", corpus, tokenizer, 3)
    resumed = _train(tmp_path, "resumed", corpus, tokenizer, 30, resume_from_checkpoint=True)
    assert min(resumed) == 4 and max(resumed) == 30
    for step in range(4, 31):
        assert resumed[step] == whole[step], step


def test_tokenizer_trained_on_the_stream_start(tmp_path, corpus, monkeypatch):
    import engine.builtin.data.tokenizer

    monkeypatch.setattr(engine.builtin.data.tokenizer, "STREAMING_TOKENIZER_ROWS", 10)
    config = DataConfig(train=corpus, streaming=True, tokenizer="train", tokenizer_vocab_size=280,
                        cache_dir=str(tmp_path / "cache"))
    trained = engine.builtin.data.tokenizer.build_tokenizer(config, "tiny-llama")
    assert trained.get_vocab() == train_tokenizer(DOCS[:10], 280).get_vocab()
    assert trained.get_vocab() != train_tokenizer(DOCS, 280).get_vocab()  # the cap is what made it so


def test_streaming_needs_workers_in_process(tmp_path, corpus):
    with pytest.raises(ConfigError, match="data.streaming: needs train.dataloader_num_workers = 0"):
        engine.Run({"train": {"dataloader_num_workers": 1}, "data": {"train": corpus, "streaming": True}})


def test_a_bad_row_in_a_shuffled_shard_is_named_by_its_line(tmp_path, tokenizer):
    """The stream of one process of two, shuffled: the bad row is found again in the file's order."""
    lines = [json.dumps({"text": d}) for d in DOCS * 8]
    lines[1500] = json.dumps({"body": "no text"})
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines[:700] + [""] + lines[700:]) + "\n")  # a blank line: no row
    stream = build_datasets(DataConfig(train=str(path), max_length=16, streaming=True, shuffle_buffer_size=50,
                                       cache_dir=str(tmp_path / "cache")), tokenizer, 0, rank=1, world_size=2).train
    with pytest.raises(ConfigError) as refused:
        rows_of(stream)
    assert str(refused.value) == f"data.train: {path} line 1502: 'text' is missing or null, expected a string"


def test_a_stream_that_gives_no_example_is_refused_not_waited_on(tmp_path, tokenizer):
    """Every document longer than data.max_length and left out: the loop would wait for a batch forever."""
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(WORDS * 3)}) + "\n" for _ in range(20)))
    stream = build_datasets(DataConfig(train=str(path), max_length=16, streaming=True, packing=False,
                                       truncation="drop", cache_dir=str(tmp_path / "cache")), tokenizer, 0).train
    with pytest.raises(ConfigError, match="data.train: a whole pass over the stream gave no example: every row was "
                                          "left out"):
        rows_of(stream)
