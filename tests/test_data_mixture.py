"""[[data.mixture]]: several sources, each a seeded fraction of its rows and its own format keys, mixed and
shaped together; data.eval_split over the mixture and over a function's rows; an exact resume; the refusals."""

import copy
import logging
import subprocess

import pytest

import engine
from engine.builtin.data.build import build_datasets
from engine.builtin.data.tokenizer import train_tokenizer
from engine.config import DataConfig
from engine.errors import ConfigError
from engine.loss import IGNORE_INDEX
from engine.testing import assert_one_line_error, tiny_model, write_jsonl

MARKERS = ("alpha", "beta", "gamma")
ROWS = 2000


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([" ".join(MARKERS) + " row words question answer ?"] * 20, 300)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One file of ROWS text rows per marker: "<marker> <row number>"."""
    folder = tmp_path_factory.mktemp("sources")
    return [write_jsonl(folder / f"{marker}.jsonl", ({"text": f"{marker} {i}"} for i in range(ROWS)))
            for marker in MARKERS]


def mixture(sources, weights, **data):
    return DataConfig(mixture=[{"source": s, "weight": w} for s, w in zip(sources, weights)],
                      **{"packing": False, **data})


def texts(dataset, tokenizer):
    return [tokenizer.decode(ids).removesuffix(tokenizer.eos_token) for ids in dataset["input_ids"]]


def test_each_source_keeps_its_weight_of_rows_drawn_across_the_source(sources, tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        train = build_datasets(mixture(sources, (1.0, 0.5, 0.25), cache_dir=str(tmp_path)), tokenizer, 0).train
    rows = [text.split() for text in texts(train, tokenizer)]
    counts = {marker: sum(row[0] == marker for row in rows) for marker in MARKERS}
    assert counts == {"alpha": 2000, "beta": 1000, "gamma": 500}
    for marker, kept in (("beta", 1000), ("gamma", 500)):
        numbers = [int(row[1]) for row in rows if row[0] == marker]
        assert len(set(numbers)) == kept  # each row once
        # drawn across the file, not its first rows: the share from its first half within 4 sigma of 1/2
        first_half = sum(n < ROWS // 2 for n in numbers) / kept
        assert abs(first_half - 0.5) < 4 * (0.25 / kept) ** 0.5, first_half
    # shuffled together: the first hundred examples are not one source's
    assert len({row[0] for row in rows[:100]}) == 3
    lines = [r.getMessage() for r in caplog.records if "rows read" in r.getMessage()]
    tokens = sum(len(ids) for ids, row in zip(train["input_ids"], rows) if row[0] == "beta")
    assert lines[1] == f"data.mixture[1]: {sources[1]}: 2000 rows read, 1000 kept (weight 0.5), {tokens} tokens"
    assert len(lines) == 3


def test_the_same_seed_gives_the_same_examples_in_the_same_order(sources, tokenizer, tmp_path):
    def examples(seed, weights=(0.5, 0.1, 0.2)):
        data = mixture(sources, weights, cache_dir=str(tmp_path / "cache"), packing=True, max_length=16)
        return build_datasets(data, tokenizer, seed).train["input_ids"]

    first = examples(0)
    assert examples(0) == first  # the second start reads the cache: the same rows
    assert examples(1) != first and len(examples(1)) == pytest.approx(len(first), rel=0.05)
    assert len(examples(0, (0.5, 0.1, 0.4))) > len(first)  # a weight changed: not the cached rows


def test_sources_of_other_formats_each_read_with_their_own_keys(tmp_path, tokenizer):
    body = write_jsonl(tmp_path / "body.jsonl", ({"body": f"alpha {i}", "text": 1} for i in range(40)))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", ({"prompt": f"question {i} ?", "completion": f" beta {i}",
                                                    "note": "x"} for i in range(40)))
    data = DataConfig(packing=False, cache_dir=str(tmp_path / "cache"), mixture=[
        {"source": body, "text_column": "body", "columns": ["body"]},
        {"source": pairs, "weight": 0.5},
        {"source": pairs, "weight": 0.25, "train_on_all_tokens": True, "columns": ["prompt", "completion"]}])
    train = build_datasets(data, tokenizer, 0).train
    examples = list(zip(texts(train, tokenizer), train["input_ids"], train["labels"]))
    assert len(examples) == 40 + 20 + 10
    text = [labels == ids for t, ids, labels in examples if t.startswith("alpha")]
    assert len(text) == 40 and all(text)  # text rows learn every token
    masked = [labels[0] == IGNORE_INDEX for t, _, labels in examples if t.startswith("question")]
    assert sorted(masked) == [False] * 10 + [True] * 20  # the completion only, but where train_on_all_tokens


def test_a_prompt_format_per_source(tmp_path, tokenizer, capfd):
    from engine.cli import main

    from engine.builtin.data.templates import resolve_chat_template

    body = write_jsonl(tmp_path / "body.jsonl", ({"text": f"alpha {i}"} for i in range(10)))
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", ({"instruction": f"question {i}", "input": "", "output": "beta"}
                                                     for i in range(10)))
    chats = write_jsonl(tmp_path / "chats.jsonl", ({"turns": [{"from": "human", "value": f"words {i}"},
                                                              {"from": "gpt", "value": "gamma"}]} for i in range(10)))
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = resolve_chat_template("chatml")
    data = DataConfig(packing=False, max_length=512, cache_dir=str(tmp_path / "cache"), mixture=[
        {"source": body}, {"source": alpaca, "format": "alpaca"},
        {"source": chats, "format": "sharegpt", "messages_column": "turns"}])
    train = build_datasets(data, tokenizer, 0).train
    learnt = {text: tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
              for text, labels in zip(texts(train, tokenizer), train["labels"])}
    assert len(learnt) == 30
    answers = [answer for text, answer in learnt.items() if "question" in text]
    assert len(answers) == 10 and set(answers) == {"beta" + tokenizer.eos_token}  # the response only
    assert all(text.startswith("Below is an instruction") for text in learnt if "question" in text)
    replies = [answer for text, answer in learnt.items() if "words" in text]
    assert len(replies) == 10 and set(replies) == {"gamma<|im_end|>\n"}  # the assistant turn only
    assert all(answer == text + tokenizer.eos_token for text, answer in learnt.items() if "alpha" in text)

    # engine plan reads a few rows of each source as its own format says
    (tmp_path / "run.toml").write_text(f'[[data.mixture]]\nsource = "{alpaca}"\nformat = "alpaca"\n'
                                       f'[[data.mixture]]\nsource = "{body}"\nformat = "alpaca"\n')
    capfd.readouterr()  # what building the datasets above logged, once an earlier test turned the console on
    status = main(["plan", str(tmp_path / "run.toml")])
    captured = capfd.readouterr()
    assert_one_line_error(subprocess.CompletedProcess(["engine"], status, captured.out, captured.err),
                          "data.format = 'alpaca' needs the column(s) instruction, output, which data.mixture[1] lacks")


def test_eval_split_holds_out_a_seeded_fraction_of_the_mixture(sources, tokenizer, tmp_path):
    data = mixture(sources, (0.1, 0.1, 0.1), eval_split=0.2, cache_dir=str(tmp_path))
    train, evaluation, _ = build_datasets(data, tokenizer, 0)
    assert (len(train), len(evaluation)) == (480, 120)
    assert not set(texts(train, tokenizer)) & set(texts(evaluation, tokenizer))
    assert texts(build_datasets(data, tokenizer, 0).eval, tokenizer) == texts(evaluation, tokenizer)


def test_a_function_source_held_out_by_eval_split_and_mixed(tmp_path, monkeypatch, tokenizer):
    (tmp_path / "mixture_rows.py").write_text(
        "import datasets, torch\n"
        "def texts(tokenizer):\n"
        "    return datasets.Dataset.from_dict({'text': [f'alpha {i}' for i in range(50)]})\n"
        "def tensors(tokenizer):\n"
        "    return torch.utils.data.TensorDataset(torch.arange(20))\n"
        "class Stream(torch.utils.data.IterableDataset):\n"
        "    def __iter__(self):\n"
        "        yield {'input_ids': [1, 2]}\n"
        "def stream(tokenizer):\n"
        "    return Stream()\n"
        "def gaps(tokenizer):\n"
        "    return datasets.Dataset.from_dict({'text': [None if i == 14 else f'alpha {i}' for i in range(20)]})\n",
        encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = DataConfig(train="mixture_rows:texts", eval_split=0.2, packing=False, cache_dir=str(tmp_path / "cache"))
    train, evaluation, _ = build_datasets(data, tokenizer, 0)
    held_out = texts(evaluation, tokenizer)
    assert len(held_out) == 10 and sorted(texts(train, tokenizer) + held_out) == sorted(f"alpha {i}" for i in range(50))
    assert texts(build_datasets(data, tokenizer, 1).eval, tokenizer) != held_out  # another seed, other rows

    train, evaluation, _ = build_datasets(DataConfig(train="mixture_rows:tensors", eval_split=0.25), tokenizer, 0)
    values = sorted(int(row[0]) for row in [*train, *evaluation])
    assert (len(train), len(evaluation)) == (15, 5) and values == list(range(20))
    with pytest.raises(ConfigError, match=r"^data.eval_split: holds out rows of a dataset with a length, but "
                                          r"data.train's function 'mixture_rows:stream' returned a Stream, which has "
                                          r"none; set data.eval instead$"):
        build_datasets(DataConfig(train="mixture_rows:stream", eval_split=0.25), tokenizer, 0)
    # in a mixture, a function's row is named by its index among the function's rows, not the rows kept
    data = DataConfig(mixture=[{"source": "mixture_rows:gaps", "weight": 0.9}], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"^data.mixture\[0\]: row 14 \(counted from 0\): 'text' is missing"):
        build_datasets(data, tokenizer, 0)
    data = DataConfig(mixture=[{"source": "mixture_rows:texts"}, {"source": "mixture_rows:tensors"}])
    with pytest.raises(ConfigError, match=r"^data.mixture\[1\].source: 'mixture_rows:tensors' returned a TensorDataset; "
                                          r"a mixture samples and tokenizes rows: return a datasets.Dataset$"):
        build_datasets(data, tokenizer, 0)
    with pytest.raises(ConfigError, match=r"^data.mixture: mixes causal-LM rows .*, but train.task is "
                                          r"'sequence-classification'; read its rows with data.train$"):
        build_datasets(DataConfig(mixture=[{"source": "mixture_rows:texts"}]), tokenizer, 0,
                       task="sequence-classification")


class StopAt:
    def __init__(self, step):
        self.step = step

    @engine.hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.step:
            run.control.request_stop("simulated interruption")


def _mixture_run(tmp_path, sources, tokenizer, output, stop_at=None, **train):
    run = engine.Run({"train": {"max_steps": 8, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
                                "logging_steps": 1, "save_strategy": "steps", "save_steps": 3, "disable_tqdm": True,
                                "save_final_model": False, "output_dir": str(tmp_path / output), **train},
                      "data": {"mixture": [{"source": sources[0], "weight": 0.05},
                                           {"source": sources[1], "weight": 0.02}],
                               "max_length": 16, "cache_dir": str(tmp_path / "cache")}},
                     model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer)
    if stop_at is not None:  # registered directly: not an enabled plugin, not in the checkpoint's plugin set
        run.plugin_manager.pm.register(StopAt(stop_at), name="stop_at")
    run.train()
    return [(h["step"], h["loss"]) for h in run.state.log_history if "loss" in h]


def test_a_resumed_mixture_run_trains_exactly_as_an_uninterrupted_one(tmp_path, sources, tokenizer):
    straight = _mixture_run(tmp_path, sources, tokenizer, "straight")
    assert len(straight) == 8
    assert _mixture_run(tmp_path, sources, tokenizer, "resumed", stop_at=4)[-1][0] == 4
    resumed = _mixture_run(tmp_path, sources, tokenizer, "resumed", resume_from_checkpoint=True)
    assert resumed == straight  # steps 1-3 from the checkpoint's history, 4-8 trained again


@pytest.mark.parametrize("changes, message", [
    ({"train": "a.jsonl", "mixture": [{"source": "b.jsonl"}]}, "data.mixture and data.train = 'a.jsonl' are both set; list that source in data.mixture"),
    ({"mixture": []}, "data.mixture: empty; give it [[data.mixture]] tables"),
    ({"mixture": [{"source": "a.jsonl", "wieght": 0.5}]}, "data.mixture[0].wieght: unknown key; did you mean 'weight'?"),
    ({"mixture": [{"weight": 0.5}]}, "data.mixture[0]: no source; set data.mixture[0].source"),
    ({"mixture": [{"source": "a.jsonl"}, {"source": "b.jsonl", "weight": 0}]},
     "data.mixture[1].weight: the fraction of the source's rows kept, in (0, 1], got 0"),
    ({"mixture": [{"source": "a.jsonl", "weight": 2}]},
     "data.mixture[0].weight: the fraction of the source's rows kept, in (0, 1], got 2; to repeat a source, list it again"),
    ({"mixture": [{"source": "a.jsonl", "train_on_all_tokens": "yes"}]},
     "data.mixture[0].train_on_all_tokens: expected bool | 'chat', got str 'yes'"),
    ({"mixture": [{"source": "a.jsonl", "columns": "text"}]}, "data.mixture[0].columns: expected list of str"),
    ({"mixture": ["a.jsonl"]}, "data.mixture: expected list of table | none, got list ['a.jsonl']"),
    ({"mixture": [{"source": "a.jsonl"}], "streaming": True}, "data.mixture: reads whole sources to sample"),
    ({"mixture": [{"source": "a.jsonl", "format": "text", "role_key": "from"}]},
     "data.mixture[0]: data.role_key: read by data.format = 'chat' or 'sharegpt' only"),
])
def test_bad_mixtures_are_refused_before_anything_loads(changes, message):
    with pytest.raises(ConfigError) as refused:
        engine.Run({"data": changes})
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_a_source_that_is_a_path_to_nothing_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match=rf"^data.mixture\[0\].source: file not found: {tmp_path}/a.jsonl \(expected"):
        engine.Run({"data": {"mixture": [{"source": str(tmp_path / "a.jsonl")}]}})
    with pytest.raises(ConfigError, match=rf"^data.mixture\[0\].source: {tmp_path}/\*.jsonl matches no file$"):
        engine.Run({"data": {"mixture": [{"source": str(tmp_path / "*.jsonl")}]}})


def test_rows_that_a_source_cannot_give_are_named(tmp_path, sources, tokenizer):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "alpha"}, {"text": None}, {"text": "beta"}])
    data = DataConfig(mixture=[{"source": sources[0], "weight": 0.01}, {"source": bad}], cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^data.mixture\[1\]: {bad} line 2: 'text' is missing or null"):
        build_datasets(data, tokenizer, 0)
    rows = [{"text": f"alpha {i}"} for i in range(20)]
    rows[14] = {"text": None}
    sampled = write_jsonl(tmp_path / "sampled.jsonl", rows)  # the row is named in the file, not among the kept rows
    data = DataConfig(mixture=[{"source": sampled, "weight": 0.9}], cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^data.mixture\[0\]: {sampled} line 15: 'text' is missing or null"):
        build_datasets(data, tokenizer, 0)
    few = DataConfig(mixture=[{"source": bad, "weight": 0.1}], cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^data.mixture\[0\].weight: 0.1 of 3 row\(s\) of .* keeps none; raise it$"):
        build_datasets(few, tokenizer, 0)
    columns = DataConfig(mixture=[{"source": bad, "columns": ["body"]}], cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^data.mixture\[0\].columns: {bad} has no column 'body'; its columns: text$"):
        build_datasets(columns, tokenizer, 0)


def test_engine_plan_refuses_a_bad_mixture_in_one_line(tmp_path, capfd):
    from engine.cli import main

    (tmp_path / "run.toml").write_text('[data]\ntrain = "a.jsonl"\n[[data.mixture]]\nsource = "b.jsonl"\n')
    status = main(["plan", str(tmp_path / "run.toml")])
    captured = capfd.readouterr()
    assert_one_line_error(subprocess.CompletedProcess(["engine"], status, captured.out, captured.err),
                          "data.mixture and data.train = 'a.jsonl' are both set")


def test_a_trained_tokenizer_learns_every_sources_text(sources, tmp_path):
    from engine.builtin.data.tokenizer import build_tokenizer

    data = mixture(sources[:2], (0.1, 1.0), tokenizer_vocab_size=270, cache_dir=str(tmp_path))
    learnt = build_tokenizer(data, "tiny-llama").get_vocab()
    texts = [f"{marker} {i}" for marker in MARKERS[:2] for i in range(ROWS)]  # all rows: weights sample examples
    assert learnt == train_tokenizer(texts, 270).get_vocab()
    assert learnt != train_tokenizer(texts[:ROWS], 270).get_vocab()
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"ask {i} ", "completion": f"reply {i}"}
                                                   for i in range(ROWS)])
    with_pairs = build_tokenizer(mixture([sources[0], pairs], (1, 1), tokenizer_vocab_size=270), "tiny-llama").get_vocab()
    assert with_pairs == train_tokenizer([*texts[:ROWS], *(f"ask {i} reply {i}" for i in range(ROWS))], 270).get_vocab()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "alpha"}, {"text": None}])
    with pytest.raises(ConfigError, match=rf"^data.mixture\[1\]: {bad} line 2: 'text' is missing or null"):
        build_tokenizer(mixture([sources[0], bad], (1, 1)), "tiny-llama")


def test_a_mixtures_tokenizer_is_cached_and_sampled_as_one_corpus(sources, tmp_path, caplog):
    """As data.train's: kept beside the sources' cached rows, and every n-th row of each source when the
    sources together hold more text than data.tokenizer_train_bytes."""
    from engine.builtin.data.sources import load_source
    from engine.builtin.data.tokenizer import build_tokenizer

    data = mixture(sources[:2], (0.1, 1.0), tokenizer_vocab_size=270, cache_dir=str(tmp_path / "cache"))
    learnt = build_tokenizer(data, "tiny-llama").get_vocab()
    assert len(list((tmp_path / "cache").rglob("engine-tokenizer-*/tokenizer.json"))) == 1
    with caplog.at_level(logging.DEBUG, logger="engine"):
        assert build_tokenizer(data, "tiny-llama").get_vocab() == learnt
    assert "data.tokenizer: the tokenizer trained on these rows before, from the cache" in caplog.text

    size = sum(load_source(source, data, "data.mixture").data.nbytes for source in sources[:2])
    sampled = mixture(sources[:2], (0.1, 1.0), tokenizer_vocab_size=270, cache_dir=str(tmp_path / "cache"),
                      tokenizer_train_bytes=-(-size // 5))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine"):
        learnt = build_tokenizer(sampled, "tiny-llama").get_vocab()
    assert f"data.tokenizer: trained on one row in 5 ({2 * ROWS // 5} of {2 * ROWS} rows" in caplog.text
    every_fifth = [f"{marker} {i}" for marker in MARKERS[:2] for i in range(0, ROWS, 5)]
    assert learnt == train_tokenizer(every_fifth, 270).get_vocab()


def test_engine_plan_shows_the_mixture(tmp_path, sources, capfd):
    from engine.cli import main

    (tmp_path / "run.toml").write_text(f'[[data.mixture]]\nsource = "{sources[0]}"\nweight = 0.5\n'
                                       f'[[data.mixture]]\nsource = "{sources[1]}"\ntext_column = "text"\n')
    assert main(["plan", str(tmp_path / "run.toml")]) == 0
    assert (f'mixture = [{{source = "{sources[0]}", weight = 0.5}}, {{source = "{sources[1]}", text_column = "text"}}]'
            in capfd.readouterr().out)
