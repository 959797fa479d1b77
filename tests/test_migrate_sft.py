"""``engine migrate`` of what SFT users have: the alignment handbook's zephyr and smollm recipes, TRL's
sft.py command line and Axolotl's llama-3 LoRA/QLoRA examples (vendored in tests/data/recipes/, each
naming its source), an SFTConfig object, a ModelConfig; then a few steps of the migrated runs on a tiny
model once the placeholders (model, data) are filled in."""

import json
import tomllib
from pathlib import Path

import pytest

import engine
from engine.cli import main
from engine.testing import CHATML_TEMPLATE, chatml_tokenizer, tiny_model, write_jsonl
from engine.tooling.migration import migrate, read_arguments

RECIPES = Path(__file__).resolve().parent / "data" / "recipes"
ZEPHYR_FULL = RECIPES / "zephyr-7b-beta-sft-config_full.yaml"
ZEPHYR_QLORA = RECIPES / "zephyr-7b-beta-sft-config_qlora.yaml"
SMOLLM = RECIPES / "smollm-sft-config.yaml"
TRL_FULL, TRL_LORA = RECIPES / "trl-sft-full.txt", RECIPES / "trl-sft-lora.txt"
AXOLOTL_LORA, AXOLOTL_QLORA = RECIPES / "axolotl-llama-3-lora-1b.yml", RECIPES / "axolotl-llama-3-qlora-1b.yml"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORDS = "the fox cat owl jumps over lazy dogs and writes answers questions hello world".split()
TEMPLATE = CHATML_TEMPLATE


def converted(path, **kwargs):
    return migrate(read_arguments(path), source=str(path), **kwargs)


def phrase(i, n=6):
    return " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(n))


@pytest.fixture(scope="module")
def tokenizer():
    return chatml_tokenizer([phrase(i, 9) for i in range(60)], 300)


def chat_rows(n=24):
    return [{"messages": [{"role": "user", "content": phrase(i)}, {"role": "assistant", "content": phrase(i + 1)}]}
            for i in range(n)]


def alpaca_rows(n=24):
    return [{"instruction": phrase(i), "input": "", "output": phrase(i + 2)} for i in range(n)]


def trained(mapping, tmp_path, data, model=None, tokenizer=None, steps=2, max_length=64):
    """The migrated run with its placeholders filled: local rows, a tiny model, no Hub or tracker plugin,
    a few steps; the losses it logged."""
    mapping = json.loads(json.dumps(mapping))
    mapping["plugins"] = [p for p in mapping["plugins"] if p not in ("hub", "tensorboard", "wandb")]
    for section in ("hub", "tensorboard", "wandb"):
        mapping.pop(section, None)
    train, data_section = mapping["train"], mapping["data"]
    train.update(max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=1, logging_steps=1,
                 output_dir=str(tmp_path / "out"), save_strategy="no", eval_strategy="no", disable_tqdm=True,
                 save_final_model=False, log_level="warning")
    train.pop("model", None) if model is not None else None
    for key in ("mixture", "eval", "eval_dataset_split", "split", "num_proc", "tokenizer"):
        data_section.pop(key, None)
    data_section.update(train=data, max_length=max_length, eval_split=0.0, cache_dir=str(tmp_path / "cache"))
    run = engine.Run(mapping, model=model, tokenizer=tokenizer)
    run.train()
    losses = [record["loss"] for record in run.state.log_history if "loss" in record]
    assert len(losses) == steps and all(0 < loss < 20 for loss in losses)
    return run


# ---------------------------------------------------------------------------- the handbook's recipes


def test_the_zephyr_full_recipe_keeps_sft_trainers_objective():
    migration = converted(ZEPHYR_FULL)
    train, data = migration.sections["train"], migration.sections["data"]
    assert data["max_length"] == 2048  # max_seq_length, not the engine's 128
    assert data["packing"] is False  # SFTConfig's default: no packing (the engine packs by default)
    assert data["train_on_all_tokens"] == "chat"  # chat rows, no assistant_only_loss: the whole conversation
    assert (data["train"], data["split"], data["eval"], data["eval_dataset_split"]) == (
        "HuggingFaceH4/ultrachat_200k", "train_sft", "HuggingFaceH4/ultrachat_200k", "test_sft")
    assert data["num_proc"] == 12
    assert train["model"] == "mistralai/Mistral-7B-v0.1"
    assert (train["learning_rate"], train["bf16"], train["tf32"], train["activation_checkpointing"]) == (
        2e-5, True, True, True)
    assert train["eval_strategy"] == "epoch" and train["lr_scheduler_type"] == "cosine"
    assert migration.sections["hub"] == {"repo": "zephyr-7b-sft-full"}  # a bare name: the hub plugin resolves it
    lost = dict(migration.lost)
    assert "torch_dtype = \"bfloat16\"" in lost and "use_flash_attention_2 = true" in lost
    assert migration.unknown == []
    text = migration.toml()
    assert tomllib.loads(text)["data"]["max_length"] == 2048
    assert "TRL SFTConfig, ModelConfig and ScriptArguments" in text.splitlines()[0]


def test_the_zephyr_qlora_recipe_writes_peft_and_the_4bit_base():
    migration = converted(ZEPHYR_QLORA)
    assert "peft" in migration.plugins
    assert migration.sections["peft"] == {
        "r": 16, "lora_alpha": 16.0, "lora_dropout": 0.05, "target_modules": TARGETS, "use_dora": False,
        "quantize": "4bit", "bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": "bfloat16"}
    assert migration.sections["data"]["chat_template"].startswith("{% for message in messages %}\n")
    assert migration.sections["train"]["activation_checkpointing_kwargs"] == {"use_reentrant": False}


def test_the_smollm_recipe_becomes_a_mixture_with_its_weights():
    data = converted(SMOLLM).sections["data"]
    assert [(s["source"], s.get("weight", 1.0), s["split"]) for s in data["mixture"]] == [
        ("HuggingFaceTB/Magpie-Pro-300K-Filtered-H4", 1.0, "train_sft"),
        ("HuggingFaceTB/self-oss-instruct-sc2-H4", 1.0, "train_sft"),
        ("HuggingFaceTB/OpenHermes-2.5-H4", 0.001, "train_sft"),
        ("HuggingFaceTB/everyday-conversations-llama3.1-2k", 1.0, "train_sft"),
        ("HuggingFaceTB/instruct-data-basics-smollm-H4", 1.0, "train_sft")]
    assert "train" not in data  # one of data.train and data.mixture
    assert data["add_special_tokens"] is False and data["tokenizer"] == "HuggingFaceTB/SmolLM-360M-Instruct"


def test_the_new_handbook_dataset_mixture_and_the_loss_switches():
    recipe = {"model_name_or_path": "m", "dataset_mixture": {
        "datasets": [{"id": "a/chat", "split": "train", "columns": ["messages"], "weight": 0.5},
                     {"id": "b/chat", "config": "default", "columns": ["messages"], "weight": 1.0}],
        "seed": 0, "test_split_size": 0.05}, "assistant_only_loss": True, "packing": True,
        "packing_strategy": "wrapped", "max_length": 512, "eos_token": "<|im_end|>", "pad_token": "<pad>",
        "dataset_text_field": "content", "chat_template_path": "template.jinja",
        "dataset_kwargs": {"add_special_tokens": True}}
    data = migrate(recipe).sections["data"]
    assert data["mixture"] == [
        {"source": "a/chat", "split": "train", "columns": ["messages"], "weight": 0.5},
        {"source": "b/chat", "config": "default", "columns": ["messages"], "weight": 1.0}]
    assert data["eval_split"] == 0.05
    assert data["train_on_all_tokens"] is False and data["packing"] == "wrapped" and data["max_length"] == 512
    assert (data["eos_token"], data["pad_token"], data["text_column"]) == ("<|im_end|>", "<pad>", "content")
    assert data["chat_template"] == "template.jinja" and data["add_special_tokens"] is True


@pytest.mark.parametrize("fields, packing, padding_free", [
    ({}, False, None), ({"packing": True}, "bfd", None), ({"packing": True, "packing_strategy": "bfd_split"}, "bfd_split", None),
    ({"packing": True, "packing_strategy": "wrapped"}, "wrapped", None),
    ({"packing": True, "packing_strategy": "wrapped", "padding_free": True}, "wrapped", True),
    ({"padding_free": True}, False, True), ({"packing": True, "padding_free": True}, "bfd", None)])
def test_trl_packing_settings_give_the_packings_tested_against_trl(fields, packing, padding_free):
    """tests/test_trl_parity.py shows each of these values trains SFTTrainer's rows."""
    data = migrate({"dataset_text_field": "text", **fields}).sections["data"]
    assert (data["packing"], data.get("padding_free")) == (packing, padding_free)
    assert data["add_special_tokens"] is True  # SFTTrainer encodes text with the tokenizer's special tokens


@pytest.mark.parametrize("fields, coverage", [
    ({}, "chat"), ({"completion_only_loss": False}, True), ({"assistant_only_loss": True}, False),
    ({"assistant_only_loss": True, "completion_only_loss": True}, False)])
def test_trl_loss_coverage_whatever_the_rows(fields, coverage):
    """SFTTrainer's default learns chat rows whole and prompt/completion rows' completions: data.train_on_all_tokens
    = "chat" says both, so the run file needs no knowledge of the data (tests/test_trl_parity.py trains both)."""
    migration = migrate(["--dataset_name", "some/data", *(arg for k, v in fields.items() for arg in (f"--{k}", str(v)))])
    assert migration.sections["data"].get("train_on_all_tokens", False) == coverage


def test_assistant_only_loss_with_every_completion_token_is_lost_with_the_fix():
    migration = migrate({"dataset_text_field": "text", "assistant_only_loss": True, "completion_only_loss": False})
    assert "train_on_all_tokens" not in migration.sections["data"]
    assert any("has no one value: set data.train_on_all_tokens" in why for _, why in migration.lost)


# ---------------------------------------------------------------------------- TRL's command line and objects


def test_trl_sft_command_lines():
    full, lora = converted(TRL_FULL), converted(TRL_LORA)
    data = full.sections["data"]
    assert (data["train"], data["max_length"], data["packing"], data["eos_token"]) == (
        "trl-lib/Capybara", 1024, "bfd", "<|im_end|>")
    train = full.sections["train"]
    assert (train["learning_rate"], train["per_device_train_batch_size"], train["gradient_accumulation_steps"],
            train["eval_steps"], train["activation_checkpointing"]) == (2e-5, 2, 8, 100, True)
    assert "peft" not in full.plugins and "hub" in full.plugins
    # no 4-bit base: TRL's bnb defaults are not written (the peft plugin refuses them without quantize)
    assert lora.sections["peft"] == {"r": 32, "lora_alpha": 16.0, "lora_dropout": 0.05, "use_dora": False}


def test_an_sftconfig_and_a_modelconfig_object():
    from trl import ModelConfig, SFTConfig

    config = SFTConfig(output_dir="out", max_length=333, packing=True, packing_strategy="wrapped",
                       assistant_only_loss=True, bf16=False, use_cpu=True, learning_rate=1e-4)
    migration = engine.migrate(config)
    data = migration.sections["data"]
    assert (data["max_length"], data["packing"], data["train_on_all_tokens"]) == (333, "wrapped", False)
    assert migration.sections["train"]["learning_rate"] == 1e-4 and migration.source == "SFTConfig"
    peft = engine.migrate(ModelConfig(model_name_or_path="m", use_peft=True, lora_r=4, load_in_8bit=True))
    assert peft.sections["peft"]["r"] == 4 and peft.sections["peft"]["quantize"] == "8bit"
    assert peft.sections["train"]["model"] == "m"


def test_no_credential_from_a_recipe_is_written_or_shown(tmp_path):
    recipe = ZEPHYR_FULL.read_text() + "hub_token: hf_SECRETVALUE1\nwandb_api_key: SECRETVALUE2\n" \
                                       "dataset_kwargs:\n  add_special_tokens: false\n  api_key: SECRETVALUE3\n"
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    migration = converted(path)
    everything = migration.toml() + migration.report()
    assert "SECRETVALUE" not in everything
    assert migration.sections["data"]["add_special_tokens"] is False


# ---------------------------------------------------------------------------- Axolotl


def test_axolotl_qlora_example():
    migration = converted(AXOLOTL_QLORA)
    train, data, peft = (migration.sections[s] for s in ("train", "data", "peft"))
    assert migration.plugins == ["bnb", "peft"]  # adamw_bnb_8bit, adapter: qlora
    assert (train["model"], train["per_device_train_batch_size"], train["gradient_accumulation_steps"],
            train["optim"], train["lr_scheduler_type"], train["warmup_steps"], train["bf16"]) == (
        "NousResearch/Llama-3.2-1B", 2, 4, "adamw_bnb_8bit", "cosine", 10, True)
    assert (data["train"], data["format"], data["max_length"], data["packing"], data["eval_split"],
            data["pad_token"]) == ("teknium/GPT4-LLM-Cleaned", "alpaca", 2048, "bfd", 0.1, "<|end_of_text|>")
    assert peft == {"r": 32, "lora_alpha": 16.0, "lora_dropout": 0.05, "quantize": "4bit",
                    "target_modules": ["gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj"]}
    assert any(what.startswith("evals_per_epoch = 4") for what, _ in migration.lost)
    assert migration.kind == "Axolotl config" and migration.unknown == []


def test_axolotl_defaults_and_dataset_types():
    config = {"base_model": "m", "datasets": [
        {"path": "a.jsonl", "type": "chat_template", "field_messages": "conversation",
         "message_property_mappings": {"role": "from", "content": "value"}, "roles": {"user": ["human"]}},
        {"path": "b.jsonl", "type": "completion", "field": "body"}], "micro_batch_size": 2, "num_epochs": 2,
        "train_on_inputs": True, "lora_target_linear": True, "adapter": "lora", "tokens": ["<x>"],
        "special_tokens": {"eos_token": "</s>"}, "chat_template": "chatml", "max_steps": 40, "evals_per_epoch": 2}
    migration = migrate(config)
    data, train = migration.sections["data"], migration.sections["train"]
    assert data["mixture"] == [
        {"source": "a.jsonl", "format": "chat", "messages_column": "conversation", "role_key": "from",
         "content_key": "value", "roles": {"user": ["human"]}},
        {"source": "b.jsonl", "format": "text", "text_column": "body"}]
    assert data["max_length"] == 512 and data["packing"] is False  # Axolotl's defaults, written
    assert data["train_on_all_tokens"] is True and data["added_tokens"] == ["<x>"] and data["eos_token"] == "</s>"
    assert data["chat_template"] == "chatml" and migration.sections["peft"]["target_modules"] == "all-linear"
    assert (train["eval_strategy"], train["eval_steps"]) == ("steps", 10)  # 40 steps / (2 x 2 epochs)


def test_migrate_command_reads_yaml_and_from_axolotl(tmp_path, capsys):
    copy = tmp_path / "config.yaml"
    copy.write_text(AXOLOTL_LORA.read_text())
    assert main(["migrate", str(copy), "--from", "axolotl", "-o", str(tmp_path / "run.toml")]) == 0
    run = tomllib.loads((tmp_path / "run.toml").read_text())
    assert run["peft"]["r"] == 16 and run["data"]["format"] == "alpaca"
    assert "Axolotl config" in capsys.readouterr().err


# ---------------------------------------------------------------------------- a few steps of each


def test_the_zephyr_full_run_trains(tmp_path, tokenizer):
    run = trained(converted(ZEPHYR_FULL).mapping, tmp_path, write_jsonl(tmp_path / "chat.jsonl", chat_rows()),
                  model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer)
    assert run.config.data.packing is False and run.config.data.train_on_all_tokens == "chat"
    example = run.train_dataset[0]
    assert example["labels"] == example["input_ids"]  # the whole conversation, as SFTTrainer's default


def test_the_zephyr_qlora_run_trains_a_4bit_base(tmp_path, tokenizer):
    saved = tmp_path / "base"
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(saved)
    mapping = converted(ZEPHYR_QLORA).mapping
    mapping["train"]["model"] = str(saved)
    mapping["data"]["chat_template"] = TEMPLATE.replace("<|im_end|>", "{{ eos_token }}")
    run = trained(mapping, tmp_path, write_jsonl(tmp_path / "chat.jsonl", chat_rows()), tokenizer=tokenizer)
    assert "Linear4bit" in {type(m).__name__ for m in run.model.modules()}


def test_the_axolotl_lora_run_trains_alpaca_rows(tmp_path, tokenizer):
    mapping = converted(AXOLOTL_LORA).mapping
    mapping["data"].pop("pad_token")  # Llama 3's token, which the tiny tokenizer has not
    run = trained(mapping, tmp_path, write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows()),
                  model=tiny_model(vocab_size=len(tokenizer)), tokenizer=tokenizer, max_length=200)
    assert run.config.data.format == "alpaca" and run.config.data.packing == "bfd"
    assert type(run.optimizer).__module__.startswith("bitsandbytes")  # adamw_8bit, through the bnb plugin


@pytest.mark.parametrize("recipe", [SMOLLM, TRL_FULL, TRL_LORA, AXOLOTL_QLORA], ids=lambda path: path.stem)
def test_every_other_vendored_file_trains_a_few_steps(recipe, tmp_path, tokenizer):
    """The SmolLM mixture recipe, TRL's two sft.py command lines (bfd packing, LoRA) and Axolotl's QLoRA example,
    each migrated, with local rows of its format and a tiny model in place of the Hub's."""
    mapping = converted(recipe).mapping
    model = tiny_model(vocab_size=len(tokenizer))
    if mapping.get("peft", {}).get("quantize"):  # a 4-bit base loads from a saved folder
        model.save_pretrained(tmp_path / "base")
        mapping["train"]["model"], model = str(tmp_path / "base"), None
    mapping["data"].pop("pad_token", None)  # Llama 3's, which the tiny tokenizer has not
    alpaca = mapping["data"].get("format") == "alpaca"
    rows = write_jsonl(tmp_path / "rows.jsonl", alpaca_rows() if alpaca else chat_rows())
    run = trained(mapping, tmp_path, rows, model=model, tokenizer=tokenizer, max_length=200 if alpaca else 64)
    assert run.config.data.max_length == (200 if alpaca else 64)


# ---------------------------------------------------------------------------- the tables, bad input


def test_every_trl_field_has_an_answer_whose_keys_exist():
    import dataclasses

    from engine_peft import PeftOptions
    from transformers import TrainingArguments
    from trl import ModelConfig, ScriptArguments, SFTConfig

    from engine.config import DataConfig
    from engine.tooling.axolotl import AXOLOTL_FIELDS
    from engine.tooling.sft_args import SFT_ANSWERS

    trainer = {f.name for f in dataclasses.fields(TrainingArguments)}
    missing = [f.name for cls in (SFTConfig, ModelConfig, ScriptArguments) for f in dataclasses.fields(cls)
               if f.name not in trainer and f.name not in SFT_ANSWERS]
    assert missing == []
    keys = {"data": {f.name for f in dataclasses.fields(DataConfig)},
            "peft": {f.name for f in dataclasses.fields(PeftOptions)}}
    for answer in [*SFT_ANSWERS.values(), *AXOLOTL_FIELDS.values()]:
        for dotted in answer.keys:
            section, key = dotted.split(".", 1)
            assert key in keys.get(section, {key}), dotted


@pytest.mark.parametrize("name, content, message", [
    ("recipe.yaml", "model_name_or_path: [unclosed\n", "recipe.yaml is not YAML"),
    ("recipe.yaml", "- a\n- b\n", "recipe.yaml holds a YAML list, expected a mapping of settings"),
    ("args.txt", "--model_name_or_path m stray\nnot-an-argument\n", None),
])
def test_bad_recipe_files(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    if message is None:  # the values after a key are its list: TRL's nargs
        assert read_arguments(path) == {"model_name_or_path": ["m", "stray", "not-an-argument"]}
        return
    with pytest.raises(engine.ConfigError, match=message.replace(".", r"\.")):
        read_arguments(path)


def test_a_bad_axolotl_dataset_type_is_lost_with_the_formats_named():
    migration = migrate({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca_chat.load_qa"}]})
    assert ("datasets = [{\"path\": \"d.jsonl\", \"type\": \"alpaca_chat.load_qa\"}]",
            "dataset type 'alpaca_chat.load_qa': the engine's formats are Axolotl's alpaca, sharegpt, "
            "chat_template, input_output, completion") in migration.lost


def test_the_docs_table_answers_every_key_as_the_code_does():
    from engine.tooling.axolotl import AXOLOTL_FIELDS
    from engine.tooling.sft_args import SFT_ANSWERS

    page = (Path(__file__).resolve().parents[1] / "docs" / "migrate-sft.md").read_text()
    rows = [f"| `{name}` | {answer.describe(name).replace('|', chr(92) + '|')} |"
            for table in (SFT_ANSWERS, AXOLOTL_FIELDS) for name, answer in table.items()]
    assert [row for row in rows if row not in page] == []  # stale: re-render the tables into docs/migrate-sft.md


def test_the_axolotl_alpaca_example_runs_unchanged_after_engine_migrate(tmp_path, monkeypatch):
    """examples/axolotl-alpaca: `engine migrate config.yml -o run.toml` then `engine train run.toml`, from the
    repository root as the README says (only the output folder moved here); the loss goes down."""
    root = RECIPES.parents[2]
    monkeypatch.chdir(root)
    run_file = tmp_path / "run.toml"
    assert main(["migrate", "examples/axolotl-alpaca/config.yml", "-o", str(run_file)]) == 0
    run = engine.Run(run_file, overrides=[f"train.output_dir={tmp_path / 'out'}"])
    run.train()
    assert (run.config.data.format, run.config.data.packing, run.config.plugins) == ("alpaca", "bfd", ["peft"])
    evaluations = [row["eval_loss"] for row in run.state.log_history if "eval_loss" in row]
    assert len(evaluations) == 8 and evaluations[-1] < evaluations[0]
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_an_axolotl_template_name_the_engine_has_not_is_lost_with_the_fix():
    migration = migrate({"base_model": "m", "chat_template": "qwen_25", "datasets": [{"path": "d", "type": "chat_template"}]},
                        kind="axolotl")
    assert "chat_template" not in migration.sections["data"]
    (why,) = [why for what, why in migration.lost if what.startswith("chat_template = ")]
    assert "known: chatml, zephyr, llama3, tokenizer_default" in why and "chat_template_jinja" in why
    assert migrate({"base_model": "m", "chat_template": "llama3"}, kind="axolotl").sections["data"]["chat_template"] == \
        "llama3"
