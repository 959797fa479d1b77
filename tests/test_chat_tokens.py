"""The tokenizer's chat side as [data] keys: chat_template (inline, a file, a name), eos/pad/bos tokens,
added_tokens (the model's embeddings grown; with peft the new rows trained and saved in the adapter),
what is saved with the output, the tokenized-data cache, and each bad value's one-line error."""

import json
import types
from pathlib import Path

import pytest
import torch
import yaml

import engine
from engine.builtin.data.chat import render_chat
from engine.builtin.data.templates import CHAT_TEMPLATES
from engine.builtin.data.tokenizer import train_tokenizer
from engine.cli import main
from engine.errors import ConfigError
from engine.testing import assert_one_line_error, tiny_model

WORDS = "the fox cat owl jumps over lazy dogs and writes answers questions hello world".split()
CHATS = [
    [{"role": "user", "content": "hello fox"}, {"role": "assistant", "content": "hello world, the cat"}],
    [{"role": "system", "content": "be lazy"}, {"role": "user", "content": "owl?"},
     {"role": "assistant", "content": "jumps over dogs"}, {"role": "user", "content": "and?"},
     {"role": "assistant", "content": "writes answers"}],
]
# ChatML as the tokenizer of Qwen2 ships it (the reference the named template must render as)
QWEN_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A trained tokenizer (no chat template) in ``tok``, a chat file, and a pretrained model folder ``base``
    holding weights of exactly that tokenizer's vocabulary, and the tokenizer."""
    root = tmp_path_factory.mktemp("chat_tokens")
    tok = train_tokenizer([" ".join(WORDS[(i + j) % len(WORDS)] for j in range(9)) for i in range(60)], 300)
    tok.save_pretrained(root / "tok")
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS * 4))
    tiny_model(vocab_size=len(tok)).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    return types.SimpleNamespace(root=root, tok=tok, size=len(tok))


def run_config(folders, tmp_path, data=None, train=None, **sections):
    return {"train": {"model": str(folders.root / "base"), "max_steps": 2, "per_device_train_batch_size": 2,
                      "save_strategy": "no", "output_dir": str(tmp_path / "out"), "disable_tqdm": True,
                      "learning_rate": 0.1, **(train or {})},
            "data": {"train": str(folders.root / "chat.jsonl"), "packing": False, "max_length": 64,
                     "cache_dir": str(tmp_path / "cache"), **(data or {})},
            **sections}


def test_named_templates_render_conversations_with_their_assistant_turns(folders):
    tok = folders.tok
    for name, template in CHAT_TEMPLATES.items():
        tok.chat_template = template
        for messages in CHATS:
            text, spans = render_chat(tok, messages)
            turns = [m["content"] for m in messages if m["role"] == "assistant"]
            for (lo, hi), turn in zip(spans, turns, strict=True):
                assert text[lo:hi].startswith(turn), (name, text[lo:hi])
    tok.chat_template = CHAT_TEMPLATES["chatml"]
    reference = tok.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True, chat_template=QWEN_CHATML)
    assert tok.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True) == reference
    tok.chat_template = None
    recipe = Path(__file__).parent / "data" / "recipes" / "zephyr-7b-beta-sft-config_qlora.yaml"
    assert yaml.safe_load(recipe.read_text())["chat_template"] == CHAT_TEMPLATES["zephyr"]  # the handbook's, verbatim


@pytest.mark.parametrize("form", ["name", "inline", "file"])
def test_chat_template_and_tokens_are_set_trained_on_and_saved_with_the_output(folders, tmp_path, form):
    value = {"name": "chatml", "inline": QWEN_CHATML, "file": str(tmp_path / "chatml.jinja")}[form]
    (tmp_path / "chatml.jinja").write_text(QWEN_CHATML)
    data = {"tokenizer": str(folders.root / "tok"), "chat_template": value, "eos_token": "<|im_end|>",
            "pad_token": "<|pad|>", "added_tokens": ["<|im_start|>"]}
    run = engine.Run(run_config(folders, tmp_path, data, {"model": "tiny-llama", "save_strategy": "steps",
                                                           "save_steps": 2}))
    run.train() if form == "name" else run.setup()  # one form trains and saves: the others set the same tokenizer
    tok = run.tokenizer
    expected = CHAT_TEMPLATES["chatml"] if form == "name" else QWEN_CHATML
    assert tok.chat_template == expected
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert (im_start, im_end) == (folders.size, folders.size + 1)  # one token each, new
    assert tok.eos_token_id == im_end and tok.pad_token == "<|pad|>"
    example = run.train_dataset[0]  # the rendered chat, with the new tokens as single tokens
    assert example["input_ids"][0] == im_start and im_end in example["labels"]
    assert run.model.config.vocab_size == folders.size + 2 and run.model.config.eos_token_id == im_end
    if form != "name":
        return
    from transformers import AutoConfig, AutoTokenizer

    for folder in (tmp_path / "out", tmp_path / "out" / "checkpoint-2"):  # a later run and generation see them
        saved = AutoTokenizer.from_pretrained(folder)
        assert saved.chat_template == expected and saved.eos_token == "<|im_end|>" and len(saved) == len(tok)
        assert saved("<|im_start|>user")["input_ids"][0] == im_start
        assert AutoConfig.from_pretrained(folder).eos_token_id == im_end


def test_tokenizer_default_uses_the_tokenizer_template_and_refuses_none(folders, tmp_path):
    folder = tmp_path / "templated"
    folders.tok.chat_template = QWEN_CHATML
    folders.tok.save_pretrained(folder)
    folders.tok.chat_template = None
    run = engine.Run(run_config(folders, tmp_path, {"tokenizer": str(folder), "chat_template": "tokenizer_default"},
                                {"model": "tiny-llama"}))
    run.setup()
    assert run.tokenizer.chat_template == QWEN_CHATML
    run = engine.Run(run_config(folders, tmp_path, {"chat_template": "tokenizer_default"}))
    with pytest.raises(ConfigError, match="data.chat_template = 'tokenizer_default': the tokenizer has no chat "
                                          "template; name one"):
        run.setup()


def test_new_tokens_grow_a_pretrained_model_mean_initialised(folders, tmp_path, caplog):
    caplog.set_level("INFO", logger="engine")
    run = engine.Run(run_config(folders, tmp_path, {"chat_template": "chatml", "eos_token": "<|im_end|>",
                                                    "added_tokens": ["<|im_start|>", "<|tool|>"]}))
    run.setup()
    weights = run.model.get_input_embeddings().weight.detach()
    assert weights.shape[0] == folders.size + 3 == len(run.tokenizer) == run.model.config.vocab_size
    old_mean = weights[:folders.size].mean(0)
    assert torch.allclose(weights[folders.size:], old_mean.expand(3, -1), atol=1e-3)  # transformers' mean init
    assert run.model.get_output_embeddings().weight.shape[0] == folders.size + 3  # untied: both grow
    assert f"the model's embeddings grew from {folders.size} to {folders.size + 3} rows" in caplog.text
    assert run.model.generation_config.eos_token_id[0] == run.tokenizer.eos_token_id  # generation stops there too


def test_a_tokenizer_larger_than_the_model_for_another_reason_is_still_refused(folders, tmp_path):
    other = tmp_path / "other"
    tok = train_tokenizer([" ".join(WORDS[(i + j) % len(WORDS)] for j in range(9)) for i in range(60)], 300)
    tok.add_tokens([f"<t{i}>" for i in range(5)])  # tokens no [data] key names: not the engine's to grow for
    tok.save_pretrained(other)
    run = engine.Run(run_config(folders, tmp_path, {"tokenizer": str(other), "chat_template": "chatml",
                                                    "added_tokens": ["<|im_start|>"]}))
    with pytest.raises(ConfigError, match="the tokenizer has .* tokens but the model's vocab_size is"):
        run.setup()


@pytest.mark.parametrize("method, tied", [("lora", False), ("lora", True), ("ia3", False)])
def test_with_peft_the_new_rows_train_and_the_adapter_reloads_on_a_grown_base(folders, tmp_path, method, tied):
    import peft
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = folders.root / "base"
    if tied:
        base = tmp_path / "tied"
        tiny_model(vocab_size=folders.size, tie_word_embeddings=True).save_pretrained(base)
        folders.tok.save_pretrained(base)
    data = {"chat_template": "chatml", "eos_token": "<|im_end|>", "added_tokens": ["<|im_start|>"]}
    options = {"r": 4, "target_modules": ["q_proj"]} if method == "lora" else \
        {"method": "ia3", "target_modules": ["q_proj", "down_proj"], "feedforward_modules": ["down_proj"]}
    run = engine.Run(run_config(folders, tmp_path, data, {"model": str(base), "max_steps": 3},
                                plugins=["peft"], peft=options))
    run.setup()
    new = [folders.size, folders.size + 1]
    embeddings = run.model.get_input_embeddings()

    def new_rows():  # the input embedding rows of the new tokens, as the adapted model uses them
        if method == "ia3":  # no trainable tokens: the embeddings train in full
            return embeddings.modules_to_save["default"].weight[new].detach().clone()
        return embeddings.token_adapter.get_merged_weights(["default"])[new].detach().clone()

    before = new_rows()
    config = run.model.peft_config["default"]
    if method == "ia3":
        assert set(config.modules_to_save) == {"embed_tokens", "lm_head"}
    else:  # untied: the lm_head's new rows too, or the new tokens could be read but never written
        rows = {"model.embed_tokens": new} if tied else {"model.embed_tokens": new, "lm_head": new}
        assert config.trainable_token_indices == rows
    run.train()
    out = tmp_path / "out"
    if method == "lora":
        assert json.loads((out / "adapter_config.json").read_text())["trainable_token_indices"] == rows
    saved = [name for name in load_file(str(out / "adapter_model.safetensors")) if "embed_tokens" in name]
    # the new rows (lora), or the embeddings trained in full (ia3), once: not also the base's resized matrix
    assert saved == (["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"] if method == "lora"
                     else ["base_model.model.model.embed_tokens.weight"]), saved
    x = torch.tensor([[new[0], 5, 6, new[1], 7]])
    with torch.no_grad():
        trained = run.model(input_ids=x).logits
    assert not torch.allclose(new_rows(), before)  # the new rows trained
    # a fresh base grown to the tokenizer, its new rows zeroed: the adapter brings them
    fresh = AutoModelForCausalLM.from_pretrained(base)
    fresh.resize_token_embeddings(len(run.tokenizer))
    with torch.no_grad():
        fresh.get_input_embeddings().weight[new] = 0
        fresh.get_output_embeddings().weight[new] = 0
    loaded = peft.PeftModel.from_pretrained(fresh, out)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, trained, atol=1e-5)
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(out)  # grows the base itself from the saved tokenizer
    with torch.no_grad():
        assert torch.allclose(auto(input_ids=x).logits, trained, atol=1e-5)


def test_the_tokenized_data_cache_follows_the_template_and_tokens(folders, tmp_path):
    def first_ids(**data):
        run = engine.Run(run_config(folders, tmp_path, {"tokenizer": str(folders.root / "tok"), **data},
                                    {"model": "tiny-llama"}))
        run.setup()
        return run.train_dataset[0]["input_ids"]

    chatml = first_ids(chat_template="chatml")
    assert first_ids(chat_template="chatml") == chatml  # same settings: the same (cached) rows
    assert first_ids(chat_template="zephyr") != chatml
    grown = first_ids(chat_template="chatml", added_tokens=["<|im_start|>"])
    assert grown != chatml and grown[0] == folders.size


def _cli(capfd, *argv):
    capfd.readouterr()
    status = main(list(argv))
    out, err = capfd.readouterr()
    return types.SimpleNamespace(returncode=status, stdout=out, stderr=err)


@pytest.mark.parametrize("data, fragment", [
    ({"chat_template": "chatlm"}, "data.chat_template: unknown template name 'chatlm'; known names: chatml, zephyr, "
                                  "llama3, tokenizer_default; it may also be inline Jinja"),
    ({"chat_template": "missing/template.jinja"},
     "data.chat_template: template file not found: missing/template.jinja"),
    ({"chat_template": "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"},
     "data.chat_template: the chat template does not parse: line 2: "),
    ({"chat_template": "FILE"}, "the chat template does not parse: line 1: "),
    ({"chat_template": "."}, "data.chat_template: . is a folder; name its template file (e.g. chat_template.jinja)"),
    ({"eos_token": ""}, "data.eos_token"),
    ({"pad_token": ""}, "data.pad_token"),
    ({"added_tokens": ["<a>", ""]}, "data.added_tokens[1]: an empty string is not a token; remove it"),
])
def test_bad_values_are_one_line_errors_at_plan(folders, tmp_path, capfd, data, fragment):
    if data.get("chat_template") == "FILE":
        (tmp_path / "bad.jinja").write_text("{% if %}")
        data = {"chat_template": str(tmp_path / "bad.jinja")}
        fragment = f"data.chat_template ({tmp_path / 'bad.jinja'}): {fragment}"
    from engine.config import to_toml

    run_file = tmp_path / "run.toml"
    run_file.write_text(to_toml(run_config(folders, tmp_path, data)))
    result = _cli(capfd, "plan", str(run_file))
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "out").exists()


def test_an_adapter_run_with_new_tokens_resumes_exactly(folders, tmp_path):
    from safetensors.torch import load_file

    data = {"chat_template": "chatml", "eos_token": "<|im_end|>", "added_tokens": ["<|im_start|>"]}
    peft_run = {"plugins": ["peft"], "peft": {"r": 4, "target_modules": ["q_proj"]}}
    train = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "logging_steps": 1}
    engine.Run(run_config(folders, tmp_path / "straight", data, train, **peft_run)).train()
    checkpoint = tmp_path / "straight" / "out" / "checkpoint-2"
    engine.Run(run_config(folders, tmp_path / "resumed", data, {**train, "resume_from_checkpoint": str(checkpoint)},
                          **peft_run)).train()
    straight, resumed = (load_file(str(tmp_path / name / "out" / "adapter_model.safetensors"))
                         for name in ("straight", "resumed"))
    assert straight.keys() == resumed.keys() and any("trainable_tokens_delta" in name for name in straight)
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    losses = [{row["step"]: row["loss"] for row in map(json.loads, open(tmp_path / name / "out" / "metrics.jsonl"))
               if "loss" in row} for name in ("straight", "resumed")]
    assert list(losses[1]) == [3, 4] and all(losses[1][step] == losses[0][step] for step in (3, 4))


def test_a_tokenizer_given_to_run_gets_the_keys_and_chatml_warns_of_its_eos(folders, tmp_path, caplog):
    import copy

    tok = copy.deepcopy(folders.tok)
    run = engine.Run(run_config(folders, tmp_path, {"chat_template": "chatml"}, {"model": "tiny-llama"}), tokenizer=tok)
    run.setup()
    assert tok.chat_template == CHAT_TEMPLATES["chatml"]
    assert ("data.chat_template = 'chatml' ends each turn with <|im_end|> but the tokenizer's eos is <|endoftext|>, "
            "at which generation stops; set data.eos_token = '<|im_end|>'") in caplog.text
