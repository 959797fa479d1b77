"""engine.data: text sources, tokenizers, datasets, collator and build_datasets (real files, no mocks)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.config import DataConfig
from engine.data import (
    DataCollator,
    DocumentDataset,
    PackedDataset,
    build_datasets,
    build_tokenizer,
    embedded_corpus,
    load_tokenizer,
    read_texts,
    train_tokenizer,
)
from engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [f"Document {i}: the {w} jumps over {i % 7} lazy dogs and writes {w * (i % 3 + 1)}."
        for i, w in enumerate(["fox", "cat", "owl", "eel", "yak", "emu", "gnu", "ant"] * 5)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(DOCS, 300)


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def stream_of(docs, tok):
    """The reference token stream: each document's ids followed by eos."""
    out = []
    for doc in docs:
        out += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


# ---------------------------------------------------------------------------- text sources


def test_import_does_not_load_transformers():
    code = "import sys, engine.data; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_embedded_corpus_is_substantial_and_deterministic():
    docs = embedded_corpus()
    assert len(docs) > 1000
    assert 400_000 < sum(map(len, docs)) < 1_500_000
    assert all(len(d) >= 40 and d == d.strip() for d in docs)
    assert any("ArgumentParser" in d for d in docs)
    assert embedded_corpus() == docs
    docs.clear()  # callers get a copy, the cache is untouched
    assert embedded_corpus()


def test_read_texts_formats(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"text": "first doc", "id": 1}, {"text": "second doc", "id": 2}]
    txt = write(tmp_path / "a.txt", "first doc\n\n  \nsecond doc\n")
    jsonl = write(tmp_path / "a.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    js = write(tmp_path / "a.json", json.dumps(rows))
    pq.write_table(pa.table({"body": ["first doc", "second doc"]}), tmp_path / "a.parquet")
    assert read_texts(txt, "text", "data.train") == ["first doc", "second doc"]
    assert read_texts(jsonl, "text", "data.train") == ["first doc", "second doc"]
    assert read_texts(js, "text", "data.train") == ["first doc", "second doc"]
    assert read_texts(str(tmp_path / "a.parquet"), "body", "data.eval") == ["first doc", "second doc"]
    assert read_texts("embedded", "text", "data.train") == embedded_corpus()


@pytest.mark.parametrize("name, content, expected", [
    ("missing.jsonl", None, ["data.train", "file not found", "missing.jsonl"]),
    ("a.csv", "text\nx\n", ["data.train", "unsupported file type '.csv'", ".jsonl"]),
    ("a.jsonl", '{"txt": "x", "b": 1}\n', ["data.text_column", "'text' not in data.train file", "txt, b"]),
    ("a.json", '[{"txt": "x"}]', ["data.text_column", "'text' not in data.train file", "txt"]),
    ("a.jsonl", '{"text": "x"}\n{"text": "y",}\n', ["data.train", "JSON syntax error", "line 2"]),
    ("a.json", '[\n{"text": "x"},\n{"text" "y"}\n]', ["data.train", "JSON syntax error", "line 3"]),
    ("a.jsonl", '{"text": "x"}\n{"text": 7}\n', ["data.train", "line 2", "holds a int, expected a string"]),
    ("a.json", '{"text": "x"}', ["data.train", "JSON list of objects"]),
    ("a.jsonl", '["x"]\n', ["data.train", "expected a JSON object, got list"]),
    ("a.txt", "\n  \n", ["data.train", "holds no documents"]),
])
def test_read_texts_errors(tmp_path, name, content, expected):
    if content is not None:
        write(tmp_path / name, content)
    with pytest.raises(ConfigError) as info:
        read_texts(str(tmp_path / name), "text", "data.train")
    for part in expected:
        assert part in str(info.value)


def test_read_parquet_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": ["x"], "b": [1]}), tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match=r"data.text_column: column 'txt' not in data.eval file .*x.parquet "
                                          r"\(columns: a, b\)"):
        read_texts(str(tmp_path / "x.parquet"), "txt", "data.eval")
    with pytest.raises(ConfigError, match="data.eval: .*column 'b' has type int64, expected string"):
        read_texts(str(tmp_path / "x.parquet"), "b", "data.eval")


# ---------------------------------------------------------------------------- tokenizers


def test_trained_tokenizer_round_trips_and_has_specials(tokenizer):
    text = "The owl writes  owlowl .\n\tünïcode ☃ never seen in training!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) == 300
    assert train_tokenizer(DOCS, 300).get_vocab() == tokenizer.get_vocab()


def test_train_tokenizer_on_embedded_corpus_is_fast():
    docs = embedded_corpus()
    start = time.perf_counter()
    tok = train_tokenizer(docs, 1024)
    seconds = time.perf_counter() - start
    print(f"\ntrained a 1024-token BPE on {sum(map(len, docs))} chars in {seconds:.2f} s")
    assert seconds < 10  # about 1 s on 2 cores; generous for slow CI machines
    assert len(tok) == 1024
    assert tok.decode(tok(docs[0], add_special_tokens=False)["input_ids"]) == docs[0]


def test_vocab_size_too_small():
    with pytest.raises(ConfigError, match="data.tokenizer_vocab_size: must be at least 258"):
        train_tokenizer(DOCS, 100)


def test_load_tokenizer(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"), "data.tokenizer")
    assert loaded(DOCS[3])["input_ids"] == tokenizer(DOCS[3], add_special_tokens=False)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)

    with pytest.raises(ConfigError, match="data.tokenizer: tokenizer folder not found: .*nope"):
        load_tokenizer(str(tmp_path / "nope"), "data.tokenizer")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="train.model: no usable tokenizer in .*empty"):
        load_tokenizer(str(tmp_path / "empty"), "train.model")


def test_load_tokenizer_without_pad_uses_eos(tmp_path, tokenizer):
    from transformers import PreTrainedTokenizerFast

    no_pad = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    no_pad.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path), "data.tokenizer")
    assert loaded.pad_token == "<|endoftext|>"
    assert loaded.pad_token_id == loaded.eos_token_id


def test_build_tokenizer(tmp_path, tokenizer):
    train = write(tmp_path / "train.txt", "\n".join(DOCS))
    data = DataConfig(train=train, tokenizer="train", tokenizer_vocab_size=280)
    assert len(build_tokenizer(data, "tiny-llama")) == 280

    # auto: the model folder's tokenizer when it has one, else a trained one
    tokenizer.save_pretrained(tmp_path / "model")
    auto = DataConfig(train=train, tokenizer="auto", tokenizer_vocab_size=280)
    assert len(build_tokenizer(auto, str(tmp_path / "model"))) == 300
    assert len(build_tokenizer(auto, "tiny-llama")) == 280

    folder = DataConfig(train=train, tokenizer=str(tmp_path / "model"))
    assert len(build_tokenizer(folder, "tiny-llama")) == 300

    from_callable = DataConfig(train="some.module:make", tokenizer="train")
    with pytest.raises(ConfigError, match="data.tokenizer = 'train' .*needs text data.*set data.tokenizer "
                                          "to a tokenizer folder"):
        build_tokenizer(from_callable, "tiny-llama")


# ---------------------------------------------------------------------------- datasets and collator


def test_packed_blocks_are_full_and_contiguous(tokenizer):
    dataset = PackedDataset(DOCS, tokenizer, 16)
    stream = stream_of(DOCS, tokenizer)
    assert len(dataset) == len(stream) // 16
    assert dataset.blocks.dtype == torch.int64 and dataset.blocks.shape == (len(dataset), 16)
    example = dataset[1]
    assert torch.equal(example["input_ids"], example["labels"])
    joined = torch.cat([dataset[i]["input_ids"] for i in range(len(dataset))]).tolist()
    assert joined == stream[: len(joined)]


def test_packing_too_little_text(tokenizer):
    with pytest.raises(ConfigError, match=r"data.eval: \d+ tokens, fewer than data.max_length = 4096.*"
                                          "lower data.max_length or set data.packing = false"):
        PackedDataset(DOCS[:2], tokenizer, 4096, "data.eval")


def test_document_dataset_truncates_and_appends_eos(tokenizer):
    dataset = DocumentDataset(["short", DOCS[0]], tokenizer, 8)
    short = tokenizer("short", add_special_tokens=False)["input_ids"]
    assert dataset[0]["input_ids"].tolist() == short + [tokenizer.eos_token_id]
    assert dataset[1]["input_ids"].tolist() == stream_of(DOCS[:1], tokenizer)[:8]
    assert len(dataset) == 2
    with pytest.raises(ConfigError, match="data.train: no documents"):
        DocumentDataset([], tokenizer, 8)


def test_collator_pads_and_masks():
    collate = DataCollator(pad_token_id=9)
    batch = collate([
        {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "weight": 0.5, "name": "a"},
        {"input_ids": torch.tensor([4]), "weight": 2.0, "name": "b"},
    ])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["weight"].tolist() == [0.5, 2.0]
    assert "name" not in batch  # strings are no model input

    # a given attention_mask also masks the labels derived from input_ids
    masked = collate([{"input_ids": [5, 6], "attention_mask": [0, 1]}, {"input_ids": [7, 8]}])
    assert masked["labels"].tolist() == [[-100, 6], [7, 8]]
    assert masked["attention_mask"].tolist() == [[0, 1], [1, 1]]


def test_collator_fast_path_stacks_without_mask(tokenizer):
    dataset = PackedDataset(DOCS, tokenizer, 16)
    batch = DataCollator(tokenizer.pad_token_id)([dataset[0], dataset[1]])
    assert set(batch) == {"input_ids", "labels"}
    assert torch.equal(batch["input_ids"], dataset.blocks[:2])
    assert torch.equal(batch["labels"], dataset.blocks[:2])
    unlabeled = DataCollator(0)([{"input_ids": [1, 2]}, {"input_ids": [3, 4]}])
    assert unlabeled["labels"].tolist() == [[1, 2], [3, 4]]


# ---------------------------------------------------------------------------- build_datasets


def decoded_docs(dataset, tok):
    """Documents back from a DocumentDataset whose rows are not truncated (last token is eos)."""
    return {tok.decode(dataset[i]["input_ids"][:-1]) for i in range(len(dataset))}


def test_eval_split_is_deterministic_and_disjoint(tmp_path, tokenizer):
    data = DataConfig(train=write(tmp_path / "t.txt", "\n".join(DOCS)), eval_split=0.25,
                      packing=False, max_length=64)
    train, evaluation, collator = build_datasets(data, tokenizer, seed=1)
    train_docs, eval_docs = decoded_docs(train, tokenizer), decoded_docs(evaluation, tokenizer)
    assert len(evaluation) == 10 and len(train) == 30
    assert not train_docs & eval_docs and train_docs | eval_docs == set(DOCS)
    assert collator.pad_token_id == tokenizer.pad_token_id

    again = build_datasets(data, tokenizer, seed=1)[1]
    assert decoded_docs(again, tokenizer) == eval_docs
    other_seed = build_datasets(data, tokenizer, seed=2)[1]
    assert decoded_docs(other_seed, tokenizer) != eval_docs


def test_eval_split_keeps_one_document_each_side(tmp_path, tokenizer):
    data = DataConfig(train=write(tmp_path / "t.txt", "one doc\nanother doc\n"), eval_split=0.9,
                      packing=False)
    train, evaluation, _ = build_datasets(data, tokenizer, seed=0)
    assert (len(train), len(evaluation)) == (1, 1)
    data.train = write(tmp_path / "one.txt", "only doc\n")
    with pytest.raises(ConfigError, match="data.eval_split: data.train has 1 document"):
        build_datasets(data, tokenizer, seed=0)


def test_build_datasets_packed_with_eval_file(tmp_path, tokenizer):
    data = DataConfig(train=write(tmp_path / "t.txt", "\n".join(DOCS)),
                      eval=write(tmp_path / "e.jsonl", "\n".join(json.dumps({"text": d}) for d in DOCS[:8])),
                      max_length=16)
    train, evaluation, collator = build_datasets(data, tokenizer, seed=0)
    assert isinstance(train, PackedDataset) and isinstance(evaluation, PackedDataset)
    assert evaluation.blocks.tolist()[0] == stream_of(DOCS[:8], tokenizer)[:16]
    no_eval = build_datasets(DataConfig(train=data.train, max_length=16), tokenizer, seed=0)[1]
    assert no_eval is None


@pytest.mark.parametrize("changes, message", [
    ({"max_length": 1}, "data.max_length: must be at least 2, got 1"),
    ({"eval_split": 1.0}, r"data.eval_split: must be in \[0, 1\), got 1.0"),
    ({"eval_split": -0.1}, r"data.eval_split: must be in \[0, 1\)"),
    ({"train": "embedded", "max_length": 10**7}, "data.train: .*fewer than data.max_length"),
])
def test_build_datasets_config_errors(tokenizer, changes, message):
    with pytest.raises(ConfigError, match=message):
        build_datasets(DataConfig(**changes), tokenizer, seed=0)


def test_callable_sources(tmp_path, monkeypatch, tokenizer):
    (tmp_path / "my_data.py").write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset, IterableDataset\n"
        "def make(tokenizer):\n"
        "    return TensorDataset(torch.full((3, 4), tokenizer.eos_token_id))\n"
        "class Stream(IterableDataset):\n"
        "    def __iter__(self):\n"
        "        yield {'input_ids': [1, 2]}\n"
        "def stream(tokenizer):\n"
        "    return Stream()\n"
        "def wrong(tokenizer):\n"
        "    return [1, 2, 3]\n",
        encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    train, evaluation, _ = build_datasets(DataConfig(train="my_data:make", eval="my_data:stream"),
                                          tokenizer, seed=0)
    assert len(train) == 3 and train[0][0].tolist() == [tokenizer.eos_token_id] * 4
    assert list(evaluation) == [{"input_ids": [1, 2]}]

    with pytest.raises(ConfigError, match="data.eval: 'my_data:wrong' returned a list, expected a torch"):
        build_datasets(DataConfig(train="my_data:make", eval="my_data:wrong"), tokenizer, seed=0)
    with pytest.raises(ConfigError, match="data.train: module 'my_data' has no attribute 'nope'"):
        build_datasets(DataConfig(train="my_data:nope"), tokenizer, seed=0)
    with pytest.raises(ConfigError, match="data.eval_split: .*callable 'my_data:make'; set data.eval"):
        build_datasets(DataConfig(train="my_data:make", eval_split=0.1), tokenizer, seed=0)
