"""Chat and prompt/completion data (loss masks checked against the rendered text), document
packing (a packed row's loss against its documents' separate losses), datasets objects given to
Run, the create_datasets hook and train_sampling_strategy."""

import json

import pytest
import torch

import engine
from engine.config import DataConfig
from engine.builtin.data.build import build_datasets
from engine.builtin.data.chat import render_chat
from engine.builtin.data.collators import FlatteningCollator, enable_document_packing
from engine.builtin.data.prepare import prepare
from engine.builtin.data.tokenizer import train_tokenizer
from engine.loss import IGNORE_INDEX
from engine.state import Datasets
from engine.errors import ConfigError
from engine.testing import CHATML_TEMPLATE, chatml_tokenizer, tiny_model, write_jsonl

WORDS = "the fox cat owl jumps over lazy dogs and writes answers questions hello world".split()
TEMPLATE = CHATML_TEMPLATE
CHATS = [
    [{"role": "user", "content": "hello fox"}, {"role": "assistant", "content": "hello world, the cat"}],
    [{"role": "system", "content": "be lazy"}, {"role": "user", "content": "owl?"},
     {"role": "assistant", "content": "jumps over dogs"}, {"role": "user", "content": "and?"},
     {"role": "assistant", "content": "writes answers"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(9)) for i in range(60)]
    return chatml_tokenizer(texts, 300)


def config(tmp_path, **changes):
    return DataConfig(cache_dir=str(tmp_path / "cache"), **changes)


def learnt_runs(tok, ids, labels):
    """The decoded text of each maximal run of tokens whose label is not ignored."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    if current:
        runs.append(current)
    return [tok.decode(run) for run in runs]


# ---------------------------------------------------------------------------- chat, prompt/completion


def test_chat_loss_mask_is_exactly_the_assistant_turns(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    train = build_datasets(config(tmp_path, train=source, packing=False, max_length=128), tokenizer, 0).train
    for messages, ids, labels in zip(CHATS, train["input_ids"], train["labels"]):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        assert tokenizer.decode(ids) == text  # the whole rendered conversation, nothing added
        # the reference: each assistant turn as the template writes it, after its header
        expected = [f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        assert all(f"<|im_start|>assistant\n{turn}" in text for turn in expected)
        assert learnt_runs(tokenizer, ids, labels) == expected

    everything = build_datasets(config(tmp_path, train=source, packing=False, max_length=128,
                                       train_on_all_tokens=True), tokenizer, 0).train
    assert everything["labels"] == everything["input_ids"]


def test_prompt_completion_loss_mask(tmp_path, tokenizer):
    rows = [{"prompt": "questions: the fox", "completion": " jumps over dogs"},
            {"prompt": "hello", "completion": " world and cat"}]
    source = write_jsonl(tmp_path / "pc.jsonl", rows)
    train = build_datasets(config(tmp_path, train=source, packing=False), tokenizer, 0).train
    eos = tokenizer.eos_token
    for row, ids, labels in zip(rows, train["input_ids"], train["labels"]):
        assert tokenizer.decode(ids) == row["prompt"] + row["completion"] + eos
        assert learnt_runs(tokenizer, ids, labels) == [row["completion"] + eos]


def test_chat_rows_pack_with_their_labels(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS * 4])
    unpacked = build_datasets(config(tmp_path, train=source, packing=False, max_length=128), tokenizer, 0).train
    packed = build_datasets(config(tmp_path, train=source, max_length=16), tokenizer, 0).train
    flat_ids = [t for row in unpacked["input_ids"] for t in row]
    flat_labels = [t for row in unpacked["labels"] for t in row]
    cuts = [(flat_ids[i:i + 16], flat_labels[i:i + 16]) for i in range(0, len(flat_ids) - 15, 16)]
    # a row cut from the middle of a prompt has nothing to learn (its first label predicts nothing): left out
    kept = [cut for cut in cuts if any(label != IGNORE_INDEX for label in cut[1][1:])]
    assert 0 < len(kept) < len(cuts)
    assert list(zip(packed["input_ids"], packed["labels"])) == kept


USER, ANSWER = {"role": "user", "content": "hello fox"}, {"role": "assistant", "content": "the cat"}
BAD_CHATS = [  # (messages of the bad row, the message naming it)
    ([USER], "no assistant message, so nothing to learn; roles: user"),
    ([USER, {"role": "assistant", "content": None}],
     "message 1 (assistant) has no content (null or missing); give it a string, or leave the turn out"),
    # Arrow cannot read a column of strings with a number in it: the line is found for it
    ([{"role": 3, "content": "hi"}, ANSWER],
     "'messages/[]/role' holds a number where the rows before hold a string; give it a string (or the rows before "
     "a number)"),
    ([USER, {"role": "assistant", "content": "boom"}],
     "the chat template raised TemplateError: no boom; fix the row, or the template (data.chat_template, or the "
     "tokenizer's own)"),
]


@pytest.mark.parametrize("messages, message", BAD_CHATS, ids=[m for _, m in BAD_CHATS])
def test_a_bad_chat_row_is_refused_naming_its_line(tmp_path, tokenizer, messages, message):
    tok = tokenizer.__class__.from_pretrained(save_tokenizer(tokenizer, tmp_path / "tok"))
    tok.chat_template = "{% if messages[-1]['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}" + TEMPLATE
    # the bad row is line 7 of the file, the 5th row: blank lines are no rows, and the held-out
    # eval rows are not counted out of the train rows' numbers
    lines = [json.dumps({"messages": CHATS[i % 2]}) for i in range(4)] + ["", ""] + \
        [json.dumps({"messages": messages})] + [json.dumps({"messages": CHATS[0]})] * 5
    source = tmp_path / "chat.jsonl"
    source.write_text("\n".join(lines) + "\n")
    for eval_split in (0.0, 0.4):
        with pytest.raises(ConfigError) as refused:
            build_datasets(config(tmp_path, train=str(source), eval_split=eval_split), tok, 0)
        assert str(refused.value) == f"data.train: {source} line 7: {message}"


def save_tokenizer(tok, folder):
    tok.save_pretrained(folder)
    return folder


def test_chat_turns_as_trl_renders_them(tmp_path, tokenizer):
    """Arrow gives every turn every key some turn has (null where it lacks it): the template sees
    only the keys a turn has, as TRL's SFTTrainer drops the nulls, so no "None" is rendered; an
    assistant turn with tool_calls needs no content."""
    import datasets

    tok = tokenizer.__class__.from_pretrained(save_tokenizer(tokenizer, tmp_path / "tok"))
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}{% if m.name is defined %} ({{ m.name }}){% endif %}: "
                         "{% if m.tool_calls is defined %}calls {{ m.tool_calls[0].name }}{% endif %}"
                         "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    chat = [{"role": "user", "content": "owl?", "name": "fox"},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "search"}]},
            {"role": "assistant", "content": "jumps"}]
    rows = datasets.Dataset.from_list([{"messages": chat}])
    assert rows[0]["messages"][2] == {"role": "assistant", "content": "jumps", "name": None, "tool_calls": None}
    train = prepare(rows, config(tmp_path, packing=False), tok, "train_dataset")
    assert tok.decode(train[0]["input_ids"]) == "user (fox): owl?\nassistant: calls search\nassistant: jumps\n"


def test_chat_errors(tmp_path, tokenizer):
    plain = train_tokenizer(WORDS * 3, 280)
    good = write_jsonl(tmp_path / "b.jsonl", [{"messages": CHATS[0]}])
    with pytest.raises(ConfigError, match="data.train: chat data .* needs a tokenizer with a chat template"):
        build_datasets(config(tmp_path, train=good), plain, 0)
    with pytest.raises(ConfigError, match=r"eval_dataset: row 4 \(counted from 0\): no assistant message"):
        render_chat(tokenizer, [], "eval_dataset", 4)
    with pytest.raises(ConfigError, match=r"message 0 has an int \(3\) as its role, expected a string such as 'user'"):
        render_chat(tokenizer, [{"role": 3, "content": "hi"}, ANSWER])
    with pytest.raises(ConfigError, match=r"message 1 \(assistant\) has an int as its content, expected a string"):
        render_chat(tokenizer, [USER, {"role": "assistant", "content": 5}])
    with pytest.raises(ConfigError, match="'messages' must be a list of"):
        render_chat(tokenizer, "hello")


def test_examples_left_with_nothing_to_learn_are_dropped_and_counted(tmp_path, tokenizer, caplog):
    """Truncation that cuts an example's whole answer away leaves it no label: it is dropped and counted
    (a batch of such examples had a nan loss, stopping the run as "diverged")."""
    rows = [{"prompt": "hello fox", "completion": " the cat"}] * 3 + [{"prompt": "hello " * 20, "completion": " owl"}] * 2
    source = write_jsonl(tmp_path / "pc.jsonl", rows)
    with caplog.at_level("INFO", logger="engine"):
        train = build_datasets(config(tmp_path, train=source, packing=False, max_length=8), tokenizer, 0).train
    assert len(train) == 3 and all(any(label != IGNORE_INDEX for label in labels[1:]) for labels in train["labels"])
    assert "data.train: dropped 2 of 5 examples with no token to learn (a label other than -100 after the first): " \
           "data.max_length = 8 cuts the answers away in 2 of 5 examples (their first answer token is at position 80; " \
           "data.max_length = 81 keeps one in every example); raise it, or set data.truncation = \"drop\"" in caplog.text


def test_rows_of_token_ids_are_checked_against_the_model_not_data_max_length(tmp_path, tokenizer):
    """data.max_length (128 by default) shapes the rows the engine tokenizes; rows given as token ids
    are checked by their own lengths and ids against the model."""
    import datasets

    def run(rows, **model):
        return engine.Run({"train": {"max_steps": 2, "per_device_train_batch_size": 2, "save_strategy": "no",
                                     "disable_tqdm": True, "output_dir": str(tmp_path / "out"),
                                     "save_final_model": False},
                           "data": {"cache_dir": str(tmp_path / "cache")}},
                          model=tiny_model(vocab_size=len(tokenizer), **model), tokenizer=tokenizer,
                          train_dataset=datasets.Dataset.from_dict({"input_ids": rows}))

    fits = [list(range(1, 41))] * 8
    run(fits, max_position_embeddings=64).train()  # refused before: 128 tokens per example, 64 positions
    bad = [(fits[:5] + [list(range(1, 70))] + fits, r"train_dataset: row 5 \(counted from 0\): 69 tokens, but the model "
                                                   r"has 64 positions \(max_position_embeddings\); shorten the row"),
           (fits[:2] + [[1, 2, len(tokenizer)]] + fits, r"train_dataset: row 2 \(counted from 0\): 'input_ids' holds the "
                                                        rf"id {len(tokenizer)}, but the model's embedding has "
                                                        rf"{len(tokenizer)} rows")]
    for rows, message in bad:
        with pytest.raises(ConfigError, match=message):
            run(rows, max_position_embeddings=64).setup()


# ---------------------------------------------------------------------------- document packing


def test_document_rows_keep_whole_documents_with_restarting_positions(tmp_path, tokenizer):
    docs = [" ".join(WORDS[i: i + n]) for i, n in zip(range(12), [3, 9, 2, 6, 4, 8, 1, 5, 7, 3, 2, 6])]
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    train = build_datasets(config(tmp_path, train=source, packing="document", max_length=24), tokenizer, 0).train
    eos = tokenizer.eos_token_id
    documents = []
    for ids, positions in zip(train["input_ids"], train["position_ids"]):
        assert len(ids) == len(positions) <= 24
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        assert starts[0] == 0
        for lo, hi in zip(starts, starts[1:]):
            assert positions[lo:hi] == list(range(hi - lo)) and ids[hi - 1] == eos
            documents.append(tokenizer.decode(ids[lo:hi - 1]))
    assert documents == docs  # every document once, whole, in order

    batch = FlatteningCollator()([{"input_ids": [5, 6, 7], "position_ids": [0, 1, 0]},
                                  {"input_ids": [8, 9], "labels": [-100, 4], "position_ids": [0, 1]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, -100, -100, 4]]


def test_packed_row_loss_is_the_sum_of_the_documents_losses():
    """sdpa on a tiny Llama: one flattened row of three documents against each alone (float32,
    so the token-summed losses agree to 1e-5 relative)."""
    model = tiny_model(vocab_size=64, attn_implementation="sdpa").eval()
    enable_document_packing(model)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (7, 12, 5)]
    batch = FlatteningCollator()([{"input_ids": d, "position_ids": list(range(len(d)))} for d in documents])
    with torch.no_grad():
        packed = model(**batch).loss * (sum(map(len, documents)) - len(documents))
        separate = sum(model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss * (len(d) - 1)
                       for d in documents)
        packed_logits = model(**batch).logits[0]
        mixed_logits = model(input_ids=batch["input_ids"]).logits[0]  # positions not restarted: documents mix
        last = documents[-1]
        alone = model(input_ids=torch.tensor([last])).logits[0]
    assert torch.allclose(packed, separate, rtol=1e-5), (packed, separate)
    assert torch.allclose(packed_logits[-len(last):], alone, atol=1e-5)
    assert (mixed_logits[-len(last):] - alone).abs().max() > 1e-3  # the test can tell mixing apart


def test_document_packing_refused_where_attention_would_mix_documents():
    class NoPositions(torch.nn.Module):
        def forward(self, input_ids, labels=None):
            return input_ids

    with pytest.raises(ConfigError, match=r'data.packing = "document": the model \(NoPositions, attention unknown\) '
                                          "cannot keep packed documents apart"):
        enable_document_packing(NoPositions())


def test_document_packing_trains_end_to_end(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": " ".join(WORDS[i % 7: i % 7 + 6])} for i in range(40)])
    run = engine.Run({"train": {"max_steps": 3, "per_device_train_batch_size": 2, "save_strategy": "no",
                                "disable_tqdm": True, "output_dir": str(tmp_path / "out"), "save_final_model": False},
                      "data": {"train": source, "packing": "document", "max_length": 32,
                               "cache_dir": str(tmp_path / "cache")}},
                     model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer)
    run.train()
    batch = next(iter(run.train_loader))
    assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch and "attention_mask" not in batch
    assert len(run.state.log_history) > 0


# ---------------------------------------------------------------------------- datasets given to Run, the hook


def _run(tmp_path, data=None, train=None, **kwargs):
    return engine.Run({"train": {"max_steps": 2, "per_device_train_batch_size": 2, "save_strategy": "no",
                                 "disable_tqdm": True, "output_dir": str(tmp_path / "out"), "save_final_model": False,
                                 **(train or {})},
                       "data": {"max_length": 16, "cache_dir": str(tmp_path / "cache"), **(data or {})}}, **kwargs)


def test_datasets_objects_given_to_run(tmp_path, tokenizer):
    import datasets

    text = datasets.Dataset.from_dict({"text": [" ".join(WORDS[i % 5:]) for i in range(30)]})
    run = _run(tmp_path, model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer, train_dataset=text)
    run.train()
    assert run.train_dataset.column_names == ["input_ids"]  # tokenized and packed like data.train
    assert all(len(row) == 16 for row in run.train_dataset["input_ids"])

    tokens = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 8})
    run = _run(tmp_path, model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer, train_dataset=tokens)
    run.setup()
    assert run.train_dataset is tokens  # used as is

    wrong = datasets.Dataset.from_dict({"body": ["x"] * 4, "n": [1] * 4})
    with pytest.raises(ConfigError, match=r"data.text_column: train_dataset has no column 'text' .*; its columns: "
                                          "body, n"):
        _run(tmp_path, model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer, train_dataset=wrong).setup()


def test_create_datasets_hook_supplies_the_data(tmp_path, tokenizer):
    import datasets

    def rows():
        for i in range(24):
            yield {"text": " ".join(WORDS[i % 6: i % 6 + 7])}

    class FromGenerator:
        name = "from_generator"

        @engine.hookimpl
        def create_datasets(self, run):
            return Datasets(train=datasets.Dataset.from_generator(rows, cache_dir=str(tmp_path / "gen")))

    run = _run(tmp_path, model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer, plugins=[FromGenerator()])
    run.train()
    expected = tokenizer(" ".join(WORDS[0:7]), add_special_tokens=False)["input_ids"]
    assert run.train_dataset["input_ids"][0] == expected + [tokenizer.eos_token_id] + \
        tokenizer(" ".join(WORDS[1:8]), add_special_tokens=False)["input_ids"][: 16 - len(expected) - 1]

    class Wrong:
        name = "wrong"

        @engine.hookimpl
        def create_datasets(self, run):
            return [1, 2]

    with pytest.raises(ConfigError, match="create_datasets returned a list, expected engine.Datasets"):
        _run(tmp_path, model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer, plugins=[Wrong()]).setup()


@pytest.mark.parametrize("strategy", ["random", "sequential"])
def test_train_sampling_strategy(tmp_path, strategy):
    from engine.testing import tiny_dataset

    run = _run(tmp_path, train={"train_sampling_strategy": strategy}, model=tiny_model(), train_dataset=tiny_dataset(size=8))
    run.setup()
    order = list(run.train_loader.sampler)
    assert sorted(order) == list(range(8))
    assert (order == list(range(8))) == (strategy == "sequential")
