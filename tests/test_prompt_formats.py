"""Prompt formats (data.format): alpaca, sharegpt, chat with mapped keys, input_output. Each row's tokens and
loss mask are checked against the text its format writes (the Alpaca prompt as Axolotl's AlpacaPrompter has
it, spelled out here), both ways of data.train_on_all_tokens; with packing, truncation, streaming, eval
data and the cache; each bad input refused in one line before the model loads."""

import subprocess
import sys
from pathlib import Path

import pytest

import engine
from engine.builtin.data.build import build_datasets
from engine.builtin.data.tokenizer import train_tokenizer
from engine.config import DataConfig
from engine.errors import ConfigError
from engine.loss import IGNORE_INDEX
from engine.testing import CHATML_TEMPLATE, assert_one_line_error, chatml_tokenizer, tiny_model, write_jsonl

EXAMPLE = Path(__file__).parent.parent / "examples" / "axolotl-alpaca" / "data.jsonl"
TEMPLATE = CHATML_TEMPLATE
# Axolotl's prompters.py AlpacaPrompter, instruct style; alpaca_w_system's "### System:" for a row's system
WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
              "Write a response that appropriately completes the request.\n\n"
              "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
WITH_SYSTEM = "### System:\n{system}\n\n### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA = [
    ({"instruction": "Add the two numbers.", "input": "36 and 53", "output": "89"},
     WITH_INPUT.format(instruction="Add the two numbers.", input="36 and 53")),
    ({"instruction": "What is 57 minus 1?", "input": "", "output": "56"},
     NO_INPUT.format(instruction="What is 57 minus 1?")),
    ({"instruction": "Reverse {the} word.", "output": "olleh"},  # no input column value at all; braces kept
     NO_INPUT.format(instruction="Reverse {the} word.")),
    ({"instruction": "Say hi.", "input": "", "output": "hi", "system": "Be brief."},
     WITH_SYSTEM.format(system="Be brief.", instruction="Say hi.")),
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [line for line in EXAMPLE.read_text().splitlines()] + [WITH_INPUT, NO_INPUT, WITH_SYSTEM] * 3
    return chatml_tokenizer(texts, 400)


def config(tmp_path, **changes):
    return DataConfig(cache_dir=str(tmp_path / "cache"), **{"packing": False, "max_length": 256, **changes})


def learnt_runs(tok, ids, labels):
    """The decoded text of each maximal run of tokens whose label is not ignored (each label its token)."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE_INDEX:
            runs, current = runs + [current] if current else runs, []
        else:
            assert label == token
            current.append(token)
    return [tok.decode(run) for run in runs + ([current] if current else [])]


def built(tmp_path, tok, rows, name="rows.jsonl", **changes):
    return build_datasets(config(tmp_path, train=write_jsonl(tmp_path / name, rows), **changes), tok, 0).train


# ---------------------------------------------------------------------------- alpaca


def test_alpaca_rows_render_the_alpaca_prompt_and_learn_the_output(tmp_path, tokenizer):
    train = built(tmp_path, tokenizer, [row for row, _ in ALPACA], format="alpaca")
    eos = tokenizer.eos_token
    for (row, prompt), ids, labels in zip(ALPACA, train["input_ids"], train["labels"]):
        assert tokenizer.decode(ids) == prompt + row["output"] + eos
        # the prompt/completion encoder on the same text: the same tokens
        assert ids == tokenizer(prompt + row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert learnt_runs(tokenizer, ids, labels) == [row["output"] + eos]
    everything = built(tmp_path, tokenizer, [row for row, _ in ALPACA], format="alpaca", train_on_all_tokens=True)
    assert everything["labels"] == everything["input_ids"] == train["input_ids"]


def test_alpaca_with_packing_truncation_streaming_and_eval(tmp_path, tokenizer):
    rows = [row for row, _ in ALPACA] * 6
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    unpacked = build_datasets(config(tmp_path, train=source, format="alpaca"), tokenizer, 0).train
    flat = [(t, label) for ids, labels in zip(unpacked["input_ids"], unpacked["labels"]) for t, label in zip(ids, labels)]

    packed = build_datasets(config(tmp_path, train=source, format="alpaca", packing=True, max_length=32), tokenizer, 0)
    cuts = [flat[i:i + 32] for i in range(0, len(flat) - 31, 32)]
    kept = [cut for cut in cuts if any(label != IGNORE_INDEX for _, label in cut[1:])]
    assert [list(zip(i, lab)) for i, lab in zip(packed.train["input_ids"], packed.train["labels"])] == kept

    documents = build_datasets(config(tmp_path, train=source, format="alpaca", packing="document", max_length=128),
                               tokenizer, 0).train
    assert sum(len(ids) for ids in documents["input_ids"]) == len(flat) and len(documents) < len(rows)

    longest = max(map(len, unpacked["input_ids"]))
    cut = build_datasets(config(tmp_path, train=source, format="alpaca", max_length=longest - 1), tokenizer, 0).train
    assert max(map(len, cut["input_ids"])) == longest - 1

    streamed = build_datasets(config(tmp_path, train=source, format="alpaca", streaming=True), tokenizer, 0, shuffle=False)
    assert [(e["input_ids"], e["labels"]) for e in streamed.train] == list(zip(unpacked["input_ids"], unpacked["labels"]))

    held_out = build_datasets(config(tmp_path, train=source, format="alpaca", eval=source), tokenizer, 0)
    assert held_out.eval["labels"] == unpacked["labels"]


def test_the_format_is_part_of_the_cache_fingerprint(tmp_path, tokenizer):
    """One file read as text, then as alpaca, then with all tokens learnt, from one cache folder: each its own."""
    rows = [{**row, "text": f"plain {i}"} for i, (row, _) in enumerate(ALPACA)]
    text = built(tmp_path, tokenizer, rows, format="text")
    alpaca = built(tmp_path, tokenizer, rows, format="alpaca")
    everything = built(tmp_path, tokenizer, rows, format="alpaca", train_on_all_tokens=True)
    assert tokenizer.decode(text[0]["input_ids"]) == "plain 0" + tokenizer.eos_token
    assert tokenizer.decode(alpaca[0]["input_ids"]).startswith(WITH_INPUT[:40])
    assert everything["labels"] != alpaca["labels"]


# ---------------------------------------------------------------------------- sharegpt and mapped chats


SHAREGPT = [
    {"conversations": [{"from": "human", "value": "hello fox"}, {"from": "gpt", "value": "the cat"},
                       {"from": "human", "value": "and?"}, {"from": "gpt", "value": "jumps over dogs"}]},
    {"conversations": [{"from": "system", "value": "be lazy"}, {"from": "human", "value": "owl?"},
                       {"from": "gpt", "value": "writes answers"}]},
]


def as_messages(turns, roles):
    return [{"role": roles[t["from"]], "content": t["value"]} for t in turns]


def test_sharegpt_rows_are_chats_with_their_roles_mapped(tmp_path, tokenizer):
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    train = built(tmp_path, tokenizer, SHAREGPT, format="sharegpt")
    for row, ids, labels in zip(SHAREGPT, train["input_ids"], train["labels"]):
        messages = as_messages(row["conversations"], roles)
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
        assert learnt_runs(tokenizer, ids, labels) == [f"{m['content']}<|im_end|>\n" for m in messages
                                                       if m["role"] == "assistant"]
    everything = built(tmp_path, tokenizer, SHAREGPT, format="sharegpt", train_on_all_tokens=True)
    assert everything["labels"] == everything["input_ids"] == train["input_ids"]
    streamed = build_datasets(config(tmp_path, train=str(tmp_path / "rows.jsonl"), format="sharegpt", streaming=True),
                              tokenizer, 0, shuffle=False).train
    assert [(e["input_ids"], e["labels"]) for e in streamed] == list(zip(train["input_ids"], train["labels"]))

    # LLaMA-Factory's layout: the system prompt in a column of its own, the first turn
    with_system = built(tmp_path, tokenizer, [{**SHAREGPT[0], "system": "be brief"}], name="s.jsonl", format="sharegpt")
    assert tokenizer.decode(with_system[0]["input_ids"]) == tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, *as_messages(SHAREGPT[0]["conversations"], roles)], tokenize=False)


def test_chat_with_any_column_keys_and_roles(tmp_path, tokenizer):
    """Axolotl's chat_template type: field_messages, message_property_mappings and roles (its form:
    chat role -> the source roles, as here, or source role -> chat role)."""
    rows = [{"dialog": [{"speaker": "Q", "says": "hello fox", "name": "fox"}, {"speaker": "A", "says": "the cat"}]}]
    reference = built(tmp_path, tokenizer, [{"messages": [{"role": "user", "content": "hello fox", "name": "fox"},
                                                          {"role": "assistant", "content": "the cat"}]}],
                      name="reference.jsonl")
    for fmt, roles in (("chat", {"user": ["Q"], "assistant": ["A"]}), ("auto", {"Q": "user", "A": "assistant"})):
        mapped = built(tmp_path, tokenizer, rows, format=fmt, messages_column="dialog", role_key="speaker",
                       content_key="says", roles=roles)
        assert mapped["input_ids"] == reference["input_ids"] and mapped["labels"] == reference["labels"]


# ---------------------------------------------------------------------------- input_output


def test_input_output_segments_are_concatenated_as_they_are(tmp_path, tokenizer):
    segments = [{"label": True, "text": "hello fox\n"}, {"label": False, "text": "the cat "},
                {"label": True, "text": "jumps<|endoftext|>"}]
    train = built(tmp_path, tokenizer, [{"segments": segments}], format="input_output")
    pieces = [tokenizer(s["text"], add_special_tokens=False)["input_ids"] for s in segments]
    assert train[0]["input_ids"] == pieces[0] + pieces[1] + pieces[2]  # nothing added: no bos, no eos (as Axolotl)
    assert train[0]["labels"] == pieces[0] + [IGNORE_INDEX] * len(pieces[1]) + pieces[2]
    assert learnt_runs(tokenizer, train[0]["input_ids"], train[0]["labels"]) == ["hello fox\n", "jumps<|endoftext|>"]
    everything = built(tmp_path, tokenizer, [{"segments": segments}], format="input_output", train_on_all_tokens=True)
    assert everything[0]["labels"] == everything[0]["input_ids"]


# ---------------------------------------------------------------------------- end to end, errors


def run_config(tmp_path, **data):
    return {"train": {"max_steps": 4, "per_device_train_batch_size": 4, "save_strategy": "no", "disable_tqdm": True,
                      "output_dir": str(tmp_path / "out"), "save_final_model": False, "learning_rate": 1e-3},
            "data": {"cache_dir": str(tmp_path / "cache"), **data}}


def test_an_alpaca_file_trains_end_to_end(tmp_path, tokenizer):
    run = engine.Run(run_config(tmp_path, train=str(EXAMPLE), format="alpaca", packing=False, max_length=160),
                     model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer)
    run.train()
    losses = [record["loss"] for record in run.state.log_history if "loss" in record]
    assert len(run.train_dataset) == 40 and losses and all(0 < loss < 20 for loss in losses)
    example = run.train_dataset[0]
    assert learnt_runs(tokenizer, example["input_ids"], example["labels"]) == ["89" + tokenizer.eos_token]


BAD_ROWS = [  # (format, keys, the bad row, its message)
    ("sharegpt", {}, {"conversations": [{"from": "human", "value": "hi"}, {"from": "observation", "value": "42"}]},
     "message 1 has the role 'observation', which data.roles does not map (human, gpt, system); add it, e.g. "
     "data.roles = {observation = \"user\"}"),
    ("input_output", {}, {"segments": "hello fox"},
     "'segments' holds a str ('hello fox'), expected a list of {\"label\": true|false, \"text\": ...}"),
    ("input_output", {}, {"segments": [{"label": "yes", "text": "hi"}]},
     "segment 0 is {'label': 'yes', 'text': 'hi'}, expected {\"label\": true|false, \"text\": a string}"),
    ("alpaca", {}, {"instruction": "Add.", "output": None}, "'output' is missing or null, expected a string"),
    ("chat", {"role_key": "speaker"}, {"messages": [{"role": "user", "content": "hi"}]},
     "message 0 has no key 'speaker' (its keys: role, content); set data.role_key to the key of each turn's role"),
    ("chat", {}, {"messages": [{"role": None, "content": "hi"}]}, "message 0 has no role (its 'role' is null or missing)"),
]


@pytest.mark.parametrize("fmt, keys, row, message", BAD_ROWS, ids=[m[:40] for *_, m in BAD_ROWS])
def test_a_bad_row_is_refused_at_configure_time_naming_its_line(tmp_path, fmt, keys, row, message):
    good = {"alpaca": ALPACA[0][0], "sharegpt": SHAREGPT[0], "input_output": {"segments": [{"label": True, "text": "x"}]},
            "chat": {"messages": [{"role": "user", "speaker": "user", "content": "hi"},
                                  {"role": "assistant", "speaker": "assistant", "content": "yes"}]}}[fmt]
    if fmt == "input_output" and not isinstance(row["segments"], list):  # Arrow reads a column of one type
        rows = [row, good]
        line = 1
    else:
        rows, line = [good, good, row], 3
    source = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError) as refused:
        engine.Run(run_config(tmp_path, train=source, format=fmt, **keys))  # configure: no model, no tokenizer yet
    assert str(refused.value) == f"data.train: {source} line {line}: {message}"


def test_format_keys_that_do_not_fit_are_refused(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello", "instruction": "x"}])
    with pytest.raises(ConfigError) as refused:
        engine.Run(run_config(tmp_path, train=source, format="alpaca"))
    assert str(refused.value) == ("data.format = 'alpaca' needs the column(s) output, which data.train lacks (its "
                                  "columns: text, instruction); set data.format to the rows' format (or 'auto')")
    with pytest.raises(ConfigError, match=r"^data.format = 'sharegpt' needs the column\(s\) conversations, which "
                                          r"data.train lacks .*; set data.format to the rows' format \(or 'auto'\) or "
                                          r"data.messages_column$"):
        engine.Run(run_config(tmp_path, train=source, format="sharegpt"))
    with pytest.raises(ConfigError, match=r"^data.roles: read by data.format = 'chat' or 'sharegpt' only, but "
                                          r"data.format is 'alpaca'; remove it, or set data.format = 'chat'$"):
        engine.Run(run_config(tmp_path, train=source, format="alpaca", roles={"human": "user"}))
    with pytest.raises(ConfigError, match=r"^data.roles: 'user' maps to 3; give a chat role"):
        engine.Run(run_config(tmp_path, train=source, format="chat", roles={"user": 3}))
    chats = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError) as refused:
        engine.Run(run_config(tmp_path, train=chats, format="chat", content_key="text"))
    assert str(refused.value) == (f"data.train: {chats} line 1: message 0 has no key 'text' (its keys: role, content); "
                                  "set data.content_key to the key of each turn's text")

    plain = train_tokenizer(["hello fox"] * 3, 280)
    sharegpt = write_jsonl(tmp_path / "s.jsonl", SHAREGPT)
    with pytest.raises(ConfigError, match=r"^data.train: chat data \(a 'conversations' column\) needs a tokenizer "
                                          "with a chat template"):
        build_datasets(config(tmp_path, train=sharegpt, format="sharegpt"), plain, 0)


def test_engine_plan_refuses_rows_of_another_format(tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", [{"text": "hello"}])
    result = subprocess.run([sys.executable, "-m", "engine", "plan", "--set", f"data.train={source}",
                             "--set", "data.format=alpaca", "--set", f"train.output_dir={tmp_path / 'out'}"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert_one_line_error(result, "data.format = 'alpaca' needs the column(s) instruction, output, which data.train "
                                  "lacks (its columns: text)")
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_trains_on_the_rows_of_every_format(tmp_path):
    """data.tokenizer = "auto" with no model folder learns from what the format renders (no folder to build by hand)."""
    from engine.builtin.data.formats import alpaca_prompt
    from engine.builtin.data.tokenizer import build_tokenizer

    rows = [{"instruction": f"add {i} and {i}", "input": "", "output": f"{2 * i}"} for i in range(30)]
    data = DataConfig(train=write_jsonl(tmp_path / "alpaca.jsonl", rows), format="alpaca", tokenizer_vocab_size=300)
    learnt = build_tokenizer(data, "tiny-llama").get_vocab()
    rendered = [alpaca_prompt(row["instruction"], "", None) + row["output"] for row in rows]
    assert learnt == train_tokenizer(rendered, 300).get_vocab()


def test_engine_plan_refuses_chats_no_template_will_render(tmp_path, monkeypatch, capfd):
    """A trained tokenizer (or a folder's) without a chat template, for chat rows: engine plan says so, not the
    build after the model loaded; data.chat_template, or a folder whose tokenizer has one, is accepted."""
    from engine.cli import main

    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": "hello"}]}])
    monkeypatch.chdir(tmp_path)
    with_template = tmp_path / "with-template"
    chatml_tokenizer(["hi hello"] * 3).save_pretrained(with_template)
    without = tmp_path / "without"
    train_tokenizer(["hi hello"] * 3, 280).save_pretrained(without)
    for sets, refused in (([], True), ([f"data.tokenizer={without}"], True), (["data.chat_template=chatml"], False),
                          ([f"data.tokenizer={with_template}"], False)):
        capfd.readouterr()
        status = main(["plan", "--set", f"data.train={chats}", *(arg for item in sets for arg in ("--set", item))])
        out, err = capfd.readouterr()
        if refused:
            assert_one_line_error(subprocess.CompletedProcess(["engine"], status, out, err),
                                  "data.train: chat data (a 'messages' column) needs a tokenizer with a chat template")
        else:
            assert status == 0, err
    assert not (tmp_path / "output").exists()
