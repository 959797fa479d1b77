"""engine.builtin.data: sources through 🤗 Datasets, tokenizers, tokenized and packed examples, collators
and build_datasets (real files read back, no mocks)."""

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.config import DataConfig
from engine.builtin.data.build import build_datasets
from engine.builtin.data.checks import ModelLimits, check_token_rows, token_row_problem
from engine.builtin.data.collators import DataCollator
from engine.builtin.data.sources import embedded_corpus, load_source
from engine.builtin.data.tokenizer import build_tokenizer, load_tokenizer, train_tokenizer
from engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [f"Document {i}: the {w} jumps over {i % 7} lazy dogs and writes {w * (i % 3 + 1)}."
        for i, w in enumerate(["fox", "cat", "owl", "eel", "yak", "emu", "gnu", "ant"] * 5)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(DOCS, 300)


@pytest.fixture
def data(tmp_path):
    """``data(**changes)``: a DataConfig whose datasets cache lies in this test's folder."""
    return lambda **changes: DataConfig(cache_dir=str(tmp_path / "cache"), **changes)


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def stream_of(docs, tok):
    """The reference token stream: each document's ids followed by eos."""
    out = []
    for doc in docs:
        out += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def texts_of(rows):
    return list(rows["text"])


# ---------------------------------------------------------------------------- sources


def test_import_does_not_load_transformers_or_datasets():
    code = "import sys, engine.builtin.data; assert 'transformers' not in sys.modules and 'datasets' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_embedded_corpus_is_substantial_and_deterministic(data):
    docs = embedded_corpus()
    assert len(docs) > 1000
    assert 400_000 < sum(map(len, docs)) < 1_500_000
    assert all(len(d) >= 40 and d == d.strip() for d in docs)
    assert any("ArgumentParser" in d for d in docs)
    assert embedded_corpus() == docs
    docs.clear()  # callers get a copy, the cache is untouched
    assert embedded_corpus()
    assert texts_of(load_source("embedded", data(), "data.train")) == embedded_corpus()


def test_load_source_files_globs_folders_and_saved_datasets(tmp_path, data):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": "first doc", "id": 1}, {"text": "second doc", "id": 2}]
    expected = ["first doc", "second doc"]
    sources = {
        "txt": write(tmp_path / "a.txt", "first doc\n\n  \nsecond doc\n"),  # blank lines are no documents
        "jsonl": write_jsonl(tmp_path / "a.jsonl", rows),
        "json": write(tmp_path / "a.json", json.dumps(rows)),
        "csv": write(tmp_path / "a.csv", "text,id\nfirst doc,1\nsecond doc,2\n"),
    }
    pq.write_table(pa.table({"text": expected}), tmp_path / "a.parquet")
    sources["parquet"] = str(tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"text": expected}).save_to_disk(tmp_path / "saved")
    sources["saved"] = str(tmp_path / "saved")
    arrow_file = next((tmp_path / "saved").glob("*.arrow"))
    sources["arrow"] = str(arrow_file)
    for name, source in sources.items():
        assert texts_of(load_source(source, data(), "data.train")) == expected, name

    (tmp_path / "shards").mkdir()
    write_jsonl(tmp_path / "shards" / "b.jsonl", rows[1:])
    write_jsonl(tmp_path / "shards" / "a.jsonl", rows[:1])
    assert texts_of(load_source(str(tmp_path / "shards" / "*.jsonl"), data(), "data.train")) == expected
    assert texts_of(load_source(str(tmp_path / "shards"), data(), "data.train")) == expected

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t"]}),
                          "dev": datasets.Dataset.from_dict({"text": ["d"]})}).save_to_disk(tmp_path / "dict")
    assert texts_of(load_source(str(tmp_path / "dict"), data(), "data.train")) == ["t"]
    assert texts_of(load_source(str(tmp_path / "dict"), data(), "data.eval", "dev")) == ["d"]
    with pytest.raises(ConfigError, match=r"data.eval: the saved dataset in .*dict has no split 'validation' "
                                          r"\(splits: train, dev\)"):
        load_source(str(tmp_path / "dict"), data(), "data.eval", "validation")


@pytest.mark.parametrize("name, content, expected", [
    ("missing.jsonl", None, ["data.train: file not found: ", "missing.jsonl"]),
    ("nothing-*.jsonl", None, ["data.train: ", "nothing-*.jsonl matches no file"]),
    ("a.xml", "<x/>", ["data.train: unsupported file type '.xml'", ".jsonl"]),
    ("a.jsonl", '{"text": "x"}\n\n{"text": "y",}\n',
     ["data.train: ", "a.jsonl line 3 is not valid JSON (Expecting property name enclosed in double quotes at column 14)"]),
    ("a.jsonl", '{"text": "x"}\n[1, 2]\n', ["a.jsonl line 2 is a JSON list, expected an object (one row per line)"]),
    ("a.json", '[{"text": "x"}, {"text": ', ["data.train: cannot read ", "a.json as json: ValueError: "]),
    # empty files, in the engine's words (datasets says StopIteration or SchemaInferenceError)
    ("a.jsonl", "", ["data.train: ", "a.jsonl is empty (0 bytes); give it rows, or name another file"]),
    ("a.txt", "\n  \n\n", ["data.train: ", "a.txt is empty (only blank lines); give it rows, or name another file"]),
    ("a.parquet", "", ["data.train: ", "a.parquet is empty (0 bytes)"]),
    ("a.csv", "text,label\n", ["data.train: ", "a.csv holds no rows; give it rows, or name another file"]),
    ("a.json", "[]", ["data.train: ", "a.json holds no rows"]),
])
def test_load_source_errors(tmp_path, data, name, content, expected):
    if content is not None:
        write(tmp_path / name, content)
    with pytest.raises(ConfigError) as info:
        load_source(str(tmp_path / name), data(), "data.train")
    for part in expected:
        assert part in str(info.value)


def test_a_dataset_name_goes_to_load_dataset(tmp_path, monkeypatch, data):
    monkeypatch.chdir(tmp_path)  # "someone/" is no folder here: a name (the tests run with HF_HUB_OFFLINE)
    with pytest.raises(ConfigError) as info:
        load_source("someone/no-such-dataset", data(config="small", split="dev"), "data.train")
    message = str(info.value)
    assert message.startswith("data.train: 'someone/no-such-dataset' is no local file or folder, and "
                              "load_dataset('someone/no-such-dataset', 'small', split='dev') failed: ")
    assert "\n" not in message


def test_missing_column_lists_the_columns(tmp_path, data, tokenizer):
    source = write_jsonl(tmp_path / "a.jsonl", [{"txt": "x", "b": 1}])
    with pytest.raises(ConfigError, match=r"data.text_column: data.train has no column 'text' \(nor input_ids, "
                                          r"messages, or prompt and completion\); its columns: txt, b"):
        build_datasets(data(train=source), tokenizer, seed=0)
    numbers = write_jsonl(tmp_path / "n.jsonl", [{"text": 7}])
    with pytest.raises(ConfigError, match="data.text_column: data.train column 'text' holds .*int64.*expected strings"):
        build_datasets(data(train=numbers), tokenizer, seed=0)


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


def test_build_tokenizer(tmp_path, tokenizer, data):
    train = write(tmp_path / "train.txt", "\n".join(DOCS))
    assert len(build_tokenizer(data(train=train, tokenizer="train", tokenizer_vocab_size=280), "tiny-llama")) == 280

    # auto: the model folder's tokenizer when it has one, else a trained one
    tokenizer.save_pretrained(tmp_path / "model")
    auto = data(train=train, tokenizer="auto", tokenizer_vocab_size=280)
    assert len(build_tokenizer(auto, str(tmp_path / "model"))) == 300
    assert len(build_tokenizer(auto, "tiny-llama")) == 280

    folder = data(train=train, tokenizer=str(tmp_path / "model"))
    assert len(build_tokenizer(folder, "tiny-llama")) == 300

    from_callable = data(train="some.module:make", tokenizer="train")
    with pytest.raises(ConfigError, match="data.tokenizer = 'train' .*needs text data.*set data.tokenizer "
                                          "to a tokenizer folder"):
        build_tokenizer(from_callable, "tiny-llama")


def test_a_trained_tokenizer_is_kept_with_the_cached_rows_and_trained_again_when_they_change(tmp_path, data, caplog):
    path = tmp_path / "t.jsonl"
    config = data(train=write_jsonl(path, [{"text": d} for d in DOCS]), tokenizer="train", tokenizer_vocab_size=280)
    first = build_tokenizer(config, "tiny-llama")
    assert len(list((tmp_path / "cache").rglob("engine-tokenizer-*/tokenizer.json"))) == 1
    with caplog.at_level(logging.DEBUG, logger="engine"):  # said at debug level for small data
        again = build_tokenizer(config, "tiny-llama")
    assert "data.tokenizer: the tokenizer trained on these rows before, from the cache" in caplog.text
    assert again.get_vocab() == first.get_vocab() and len(again) == 280
    for attribute in ("bos_token", "eos_token", "pad_token", "model_max_length", "clean_up_tokenization_spaces"):
        assert getattr(again, attribute) == getattr(first, attribute)
    text = DOCS[3] + " unseen words ünïcode"
    assert again(text)["input_ids"] == first(text)["input_ids"] and again.decode(again(text)["input_ids"]) == text

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="engine"):
        assert len(build_tokenizer(data(train=config.train, tokenizer="train", tokenizer_vocab_size=290),
                                   "tiny-llama")) == 290  # another vocabulary size: trained afresh
        write_jsonl(path, [{"text": d.upper()} for d in DOCS])  # the file changed: its rows and tokenizer are new
        changed = build_tokenizer(config, "tiny-llama")
    assert "from the cache" not in caplog.text and changed.get_vocab() != first.get_vocab()

    saved = tmp_path / "saved"  # a save_to_disk folder is the user's: nothing is written into it
    load_source(config.train, config, "data.train").save_to_disk(str(saved))
    before = sorted(saved.rglob("*"))
    assert len(build_tokenizer(data(train=str(saved), tokenizer="train", tokenizer_vocab_size=280),
                               "tiny-llama")) == 280
    assert sorted(saved.rglob("*")) == before


def test_a_large_corpus_trains_its_tokenizer_on_evenly_spaced_documents(tmp_path, data, caplog):
    rows = [{"text": d} for d in DOCS]
    config = data(train=write_jsonl(tmp_path / "t.jsonl", rows), tokenizer="train", tokenizer_vocab_size=280)
    size = load_source(config.train, config, "data.train").data.nbytes
    sampled = data(train=config.train, tokenizer="train", tokenizer_vocab_size=280, tokenizer_train_bytes=-(-size // 4))
    with caplog.at_level(logging.INFO, logger="engine"):
        tokenizer = build_tokenizer(sampled, "tiny-llama")
    assert f"data.tokenizer: trained on one row in 4 (10 of {len(DOCS)} rows" in caplog.text
    assert tokenizer.get_vocab() == train_tokenizer([d for d in DOCS[::4]], 280).get_vocab()


# ---------------------------------------------------------------------------- tokenized examples


def test_packed_rows_are_full_and_contiguous(tmp_path, data, tokenizer):
    config = data(train=write(tmp_path / "t.txt", "\n".join(DOCS)), max_length=16)
    train = build_datasets(config, tokenizer, seed=0).train
    stream = stream_of(DOCS, tokenizer)
    assert len(train) == len(stream) // 16  # all documents in one map batch: only the tail is cut
    assert train.column_names == ["input_ids"]
    joined = [token for row in train["input_ids"] for token in row]
    assert joined == stream[: len(joined)]


def test_packing_too_little_text(tmp_path, data, tokenizer):
    config = data(train=write(tmp_path / "t.txt", "\n".join(DOCS[:2])), max_length=4096)
    with pytest.raises(ConfigError, match=r"data.train: fewer tokens than data.max_length = 4096.*"
                                          "lower data.max_length or set data.packing = false"):
        build_datasets(config, tokenizer, seed=0)


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_unpacked_examples_truncated_or_dropped_and_counted(tmp_path, data, tokenizer, caplog, truncation):
    docs = ["short", DOCS[0], "tiny"]
    config = data(train=write(tmp_path / "t.txt", "\n".join(docs)), packing=False, max_length=8,
                  truncation=truncation)
    with caplog.at_level(logging.INFO, logger="engine"):
        train = build_datasets(config, tokenizer, seed=0).train
    rows = train["input_ids"]
    short = tokenizer("short", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    tiny = tokenizer("tiny", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if truncation == "truncate":
        assert rows == [short, stream_of(DOCS[:1], tokenizer)[:8], tiny]
        assert "data.train: truncated 1 of 3 examples longer than data.max_length = 8" in caplog.text
    else:
        assert rows == [short, tiny]
        assert "data.train: dropped 1 of 3 examples longer than data.max_length = 8" in caplog.text


def test_second_start_reuses_the_cache(tmp_path, data, tokenizer, caplog):
    config = data(train=write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in DOCS]), max_length=16)
    first = build_datasets(config, tokenizer, seed=0).train
    assert list((tmp_path / "cache").rglob("cache-*.arrow"))  # the tokenized rows are on disk
    with caplog.at_level(logging.DEBUG, logger="engine"):
        second = build_datasets(config, tokenizer, seed=0).train
    assert "data.train: tokenize + pack from the cache in" in caplog.text
    assert second["input_ids"] == first["input_ids"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="engine"):  # other settings: tokenized afresh
        build_datasets(data(train=config.train, max_length=8), tokenizer, seed=0)
    assert "from the cache" not in caplog.text


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


def test_collator_fast_path_stacks_without_mask():
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6], "labels": [-100, 5, 6]}]
    batch = DataCollator(0)(rows)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert batch["labels"].tolist() == [[1, 2, 3], [-100, 5, 6]]


# ---------------------------------------------------------------------------- build_datasets


def decoded_docs(dataset, tok):
    """Documents back from unpacked rows that are not truncated (last token is eos)."""
    return {tok.decode(row[:-1]) for row in dataset["input_ids"]}


def test_eval_split_is_deterministic_and_disjoint(tmp_path, data, tokenizer):
    config = data(train=write(tmp_path / "t.txt", "\n".join(DOCS)), eval_split=0.25, packing=False, max_length=64)
    train, evaluation, collator = build_datasets(config, tokenizer, seed=1)
    train_docs, eval_docs = decoded_docs(train, tokenizer), decoded_docs(evaluation, tokenizer)
    assert len(evaluation) == 10 and len(train) == 30
    assert not train_docs & eval_docs and train_docs | eval_docs == set(DOCS)
    assert collator.pad_token_id == tokenizer.pad_token_id

    again = build_datasets(config, tokenizer, seed=1)[1]
    assert decoded_docs(again, tokenizer) == eval_docs
    other_seed = build_datasets(config, tokenizer, seed=2)[1]
    assert decoded_docs(other_seed, tokenizer) != eval_docs


def test_eval_split_keeps_one_document_each_side(tmp_path, data, tokenizer):
    config = data(train=write(tmp_path / "t.txt", "one doc\nanother doc\n"), eval_split=0.9, packing=False)
    train, evaluation, _ = build_datasets(config, tokenizer, seed=0)
    assert (len(train), len(evaluation)) == (1, 1)
    config.train = write(tmp_path / "one.txt", "only doc\n")
    with pytest.raises(ConfigError, match="data.eval_split: data.train has 1 document"):
        build_datasets(config, tokenizer, seed=0)


def test_build_datasets_packed_with_eval_file(tmp_path, data, tokenizer):
    config = data(train=write(tmp_path / "t.txt", "\n".join(DOCS)),
                  eval=write_jsonl(tmp_path / "e.jsonl", [{"text": d} for d in DOCS[:8]]), max_length=16)
    train, evaluation, collator = build_datasets(config, tokenizer, seed=0)
    assert evaluation["input_ids"][0] == stream_of(DOCS[:8], tokenizer)[:16]
    assert build_datasets(data(train=config.train, max_length=16), tokenizer, seed=0)[1] is None


@pytest.mark.parametrize("changes, message", [
    ({"max_length": 1}, "data.max_length: must be at least 2, got 1"),
    ({"eval_split": 1.0}, r"data.eval_split: must be in \[0, 1\), got 1.0"),
    ({"eval_split": -0.1}, r"data.eval_split: must be in \[0, 1\)"),
    ({"train": "embedded", "max_length": 10**7}, "data.train: fewer tokens than data.max_length"),
    ({"streaming": True, "eval_split": 0.1}, "data.eval_split: .*data.streaming is true; set data.eval"),
])
def test_build_datasets_config_errors(data, tokenizer, changes, message):
    with pytest.raises(ConfigError, match=message):
        build_datasets(data(**changes), tokenizer, seed=0)


def test_callable_sources(tmp_path, monkeypatch, data, tokenizer):
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
        "def texts(tokenizer):\n"
        "    import datasets\n"
        "    return datasets.Dataset.from_dict({'text': ['a b c d e f g h i j'] * 4})\n"
        "def wrong(tokenizer):\n"
        "    return [1, 2, 3]\n",
        encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    train, evaluation, _ = build_datasets(data(train="my_data:make", eval="my_data:stream"), tokenizer, seed=0)
    assert len(train) == 3 and train[0][0].tolist() == [tokenizer.eos_token_id] * 4
    assert list(evaluation) == [{"input_ids": [1, 2]}]
    packed = build_datasets(data(train="my_data:texts", max_length=4), tokenizer, seed=0).train  # tokenized
    assert packed.column_names == ["input_ids"] and all(len(row) == 4 for row in packed["input_ids"])

    with pytest.raises(ConfigError, match="data.eval: 'my_data:wrong' returned a list, expected a torch"):
        build_datasets(data(train="my_data:make", eval="my_data:wrong"), tokenizer, seed=0)
    with pytest.raises(ConfigError, match="data.train: module 'my_data' has no attribute 'nope'"):
        build_datasets(data(train="my_data:nope"), tokenizer, seed=0)
    with pytest.raises(ConfigError, match="data.eval_split: .*'my_data:stream' returned a Stream, which has none"):
        build_datasets(data(train="my_data:stream", eval_split=0.1), tokenizer, seed=0)


TOKEN_ROW_PROBLEMS = [  # (row, task, why it cannot be trained on)
    ({"input_ids": []}, "causal-lm", "'input_ids' is empty"),
    ({"input_ids": [1, 2], "attention_mask": [1]}, "causal-lm",
     "'attention_mask' does not hold one value per token of 'input_ids' (2)"),
    ({"input_ids": [1, 2], "labels": [1, -5]}, "causal-lm", "'labels' holds -5; a label is a token id, or -100 for no loss"),
    ({"input_ids": [1, 2], "labels": [1.5, 2.0]}, "causal-lm",
     "'labels' holds a float (1.5) among its values, expected a list of token ids (ints, -100 for no loss)"),
    ({"input_ids": [1, 2], "label": 1}, "causal-lm",
     "'label' holds one value per row, but a causal LM learns a label per token; give a list of them, or set "
     "train.task = \"sequence-classification\" to learn one per row"),
    ({"input_ids": [1, 2], "labels": [0, 1, 0]}, "token-classification",
     "'labels' holds 3 values, 'input_ids' 2: give one label per token (-100 for no loss)"),
    ({"input_ids": [1, 2], "labels": None}, "sequence-classification",
     "'labels' holds nothing (null, or the row lacks it), expected a class id (or a float for regression)"),
    ({"input_ids": [1, 2], "labels": [1, 9]}, "seq2seq",
     "'labels' holds the id 9, but the model's embedding has 8 rows (ids 0 to 7); give ids of the model's tokenizer"),
    ({"input_ids": [1] * 9}, "causal-lm", "9 tokens, but the model has 8 positions (n_positions); shorten the row"),
]


@pytest.mark.parametrize("row, task, problem", TOKEN_ROW_PROBLEMS, ids=[p for _, _, p in TOKEN_ROW_PROBLEMS])
def test_rows_of_token_ids_that_would_fail_inside_the_step_are_refused(row, task, problem):
    """Each found over the Arrow columns at once and then named by its row (siblings of issue 28's cases)."""
    import datasets

    limits = ModelLimits(vocab_size=8, positions=(8, "n_positions"))
    assert token_row_problem(row, task, limits).startswith(problem)
    with pytest.raises(ConfigError) as refused:
        check_token_rows(datasets.Dataset.from_list([row]), task, "train_dataset", limits)
    assert str(refused.value).startswith(f"train_dataset: row 0 (counted from 0): {problem}")
    fine = {"input_ids": [3, 4], "labels": 1 if task == "sequence-classification" else [-100, 2]}
    assert token_row_problem(fine, task, limits) is None
