"""engine-dpo against TRL 1.16's DPOTrainer: the same rows, the same tiny Llama (same initial weights), the
same DPOConfig (the engine's run converted from it by ``engine.migrate``) give the same per-step losses and reward
metrics, for every loss type, with a full model and a
frozen copy as the reference, with a LoRA adapter (the reference: the adapter off) and with precomputed
reference log-probs. Then what TRL has no counterpart for: bit-exact resume, and bad input refused.

Both sides read the rows in order (``train_sampling_strategy = "sequential"``), float32 on CPU. Tolerance: the
engine logs values rounded to 6 decimals, TRL's fused LM head sums log-probabilities in another order; the
largest measured difference is 1.9e-5 (sigmoid_norm's logps, about -40), relative ~5e-7.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from datasets import Dataset

import engine
from engine import ConfigError
from engine.testing import (
    PARITY_SCHEDULE, assert_resume_is_exact, llama_for, logged_rows, preference_rows, preference_tokenizer, refusal,
    write_jsonl,
)

trl = pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 5e-5
SCHEDULE = PARITY_SCHEDULE
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


def pair_rows(count: int = 16, chat: bool = False) -> list[dict]:
    return preference_rows(count, "chat" if chat else "text")


@pytest.fixture(scope="module")
def tokenizer():
    return preference_tokenizer()


def dpo_config(tmp_path, **dpo):
    return trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                         gradient_checkpointing=False, max_length=128, **{**SCHEDULE, **dpo})


def trl_rows(tmp_path, tokenizer, train, model, ref_model=None, peft_config=None, **dpo):
    trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=dpo_config(tmp_path, **dpo), train_dataset=train,
                             processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    return logged_rows(trainer.state.log_history, COMPARED)


def engine_rows(tmp_path, tokenizer, train, model, plugins=("dpo",), data=None, **dpo):
    """The engine's rows, its run converted by ``engine.migrate`` from the same DPOConfig as TRL's."""
    mapping = engine.migrate(dpo_config(tmp_path, **dpo)).mapping
    assert mapping["plugins"] == ["dpo"] and mapping["data"]["packing"] is False
    mapping["plugins"] = list(plugins)
    mapping["train"].update(output_dir=str(tmp_path / "engine"), save_final_model=False)
    mapping["data"].update(data or {})
    run = engine.Run(mapping, model=model, tokenizer=tokenizer, train_dataset=train)
    run.train()
    return logged_rows(run.state.log_history, COMPARED)


def assert_same_rows(ours, theirs):
    assert len(ours) == len(theirs) == SCHEDULE["max_steps"]
    assert ours[0]["loss"] != ours[-1]["loss"] or ours[0]["rewards/margins"] != ours[-1]["rewards/margins"]
    for mine, other in zip(ours, theirs):
        assert set(mine) == set(COMPARED), sorted(set(COMPARED) - set(mine))
        np.testing.assert_allclose([mine[k] for k in COMPARED], [other[k] for k in COMPARED], rtol=0,
                                   atol=TOLERANCE, err_msg=str(list(zip(COMPARED, mine.values(), other.values()))))


LOSSES = [("sigmoid", {}), ("hinge", {}), ("ipo", {}), ("exo_pair", {"label_smoothing": 1e-3}),
          ("nca_pair", {}), ("robust", {"label_smoothing": 0.1}), ("bco_pair", {}), ("sppo_hard", {}), ("aot", {}),
          ("aot_unpaired", {}), ("apo_zero", {}), ("apo_down", {}), ("discopop", {}), ("sft", {}),
          ("sigmoid_norm", {})]


@pytest.mark.parametrize("loss_type, extra", LOSSES, ids=[name for name, _ in LOSSES])
def test_each_loss_type_matches_dpo_trainer(tmp_path, tokenizer, loss_type, extra):
    train = Dataset.from_list(pair_rows())
    model = llama_for(tokenizer)
    theirs = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), copy.deepcopy(model), loss_type=[loss_type],
                      **extra)
    assert_same_rows(engine_rows(tmp_path, tokenizer, train, model, loss_type=[loss_type], **extra), theirs)


@pytest.mark.parametrize("dpo", [
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "beta": 0.2},  # RPO
    {"ld_alpha": 0.5},
    {"f_divergence_type": "js_divergence"},
    {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
], ids=["rpo", "ld_alpha", "js", "alpha"])
def test_weighted_losses_and_divergences_match_dpo_trainer_on_conversations(tmp_path, tokenizer, dpo):
    train = Dataset.from_list(pair_rows(chat=True))
    model = llama_for(tokenizer)
    theirs = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), copy.deepcopy(model), **dpo)
    assert_same_rows(engine_rows(tmp_path, tokenizer, train, model, **dpo), theirs)


def test_lora_with_the_adapter_off_as_the_reference_matches_dpo_trainer(tmp_path, tokenizer):
    """One LoRA adapter (the same initial weights) on both sides; TRL keeps a copy of the starting adapter as its
    reference, the engine the base with the adapter off: the same, since a new adapter's B is zero."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(1)
    model = peft.get_peft_model(llama_for(tokenizer), config)
    train = Dataset.from_list(pair_rows())
    theirs = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), learning_rate=1e-2)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}
    ours = engine_rows(tmp_path, tokenizer, train, model, plugins=["dpo", "peft"], learning_rate=1e-2)
    assert_same_rows(ours, theirs)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters() if name in before)


def test_precomputed_reference_log_probs_match_dpo_trainer_and_are_read_back_on_a_second_start(tmp_path, tokenizer):
    rows = tmp_path / "pairs.jsonl"
    write_jsonl(rows, pair_rows())
    import datasets

    train = datasets.load_dataset("json", data_files=str(rows), split="train")
    model = llama_for(tokenizer)
    theirs = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), copy.deepcopy(model),
                      precompute_ref_log_probs=True)
    ours = engine_rows(tmp_path, tokenizer, None, copy.deepcopy(model), data={"train": str(rows)},
                       precompute_ref_log_probs=True)
    assert_same_rows(ours, theirs)
    calls = []
    forward = transformers.LlamaForCausalLM.forward
    try:
        transformers.LlamaForCausalLM.forward = lambda self, *a, **k: calls.append(self.training) or forward(self, *a, **k)
        again = engine_rows(tmp_path / "again", tokenizer, None, copy.deepcopy(model), data={"train": str(rows)},
                            precompute_ref_log_probs=True)
    finally:
        transformers.LlamaForCausalLM.forward = forward
    assert again == ours
    assert False not in calls  # no forward in eval mode: the reference log-probs came from the cache


def test_a_resume_is_bit_exact_and_the_reference_untouched(tmp_path, tokenizer):
    check = assert_resume_is_exact(
        4, 2, tmp_path, plugins=["dpo"], make_model=lambda seed: llama_for(tokenizer, seed), resumed_model_seed=0,
        tokenizer=tokenizer,
        dataset=Dataset.from_list(pair_rows()), data_collator=None,
        sections={"data": {"packing": False, "max_length": 128}},
        train={"per_device_train_batch_size": 4, "learning_rate": 1e-2, "train_sampling_strategy": "sequential"})
    state = torch.load(check.checkpoint / "engine_state.pt", weights_only=True)["plugins"]["dpo"]
    assert len(state["reference"]) == 16
    assert any("rewards/margins" in entry for entry in check.resumed.state.log_history)


def test_a_resume_against_another_reference_is_refused(tmp_path, tokenizer):
    train = Dataset.from_list(pair_rows())
    settings = {"data": {"packing": False, "max_length": 128}, "plugins": ["dpo"],
                "train": {**SCHEDULE, "output_dir": str(tmp_path), "save_strategy": "steps", "save_steps": 2}}
    engine.Run(settings, model=llama_for(tokenizer), tokenizer=tokenizer, train_dataset=train).train()
    resumed = {**settings, "train": {**settings["train"], "max_steps": 4, "resume_from_checkpoint": True}}
    run = engine.Run(resumed, model=llama_for(tokenizer, seed=5), tokenizer=tokenizer, train_dataset=train)
    with pytest.raises(ConfigError, match="trained against another reference"):
        run.train()


def test_evaluation_logs_the_reward_metrics(tmp_path, tokenizer):
    mapping = {"plugins": ["dpo"], "data": {"packing": False, "max_length": 128},
               "train": {**SCHEDULE, "output_dir": str(tmp_path), "eval_strategy": "steps", "eval_steps": 2}}
    run = engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer,
                     train_dataset=Dataset.from_list(pair_rows()),
                     eval_dataset=Dataset.from_list(pair_rows(8)))
    run.train()
    evaluated = next(entry for entry in run.state.log_history if "eval_loss" in entry)
    assert {"eval_rewards/margins", "eval_rewards/accuracies", "eval_logps/chosen"} <= set(evaluated)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/margins" in row for row in rows)


# ---------------------------------------------------------------------------- bad input, refused before training


def refused(tmp_path, tokenizer, rows, dpo=None, data=None):
    mapping = {"plugins": ["dpo"], "dpo": dpo or {}, "data": {"packing": False, "max_length": 128, **(data or {})},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "out")}}
    return refusal(mapping, model=llama_for(tokenizer), tokenizer=tokenizer, train_dataset=Dataset.from_list(rows))


def test_bad_input_is_refused_in_one_line(tmp_path, tokenizer):
    pairs = pair_rows(4)
    no_rejected = [{"prompt": p["prompt"], "chosen": p["chosen"]} for p in pairs]
    assert "no 'rejected'" in refused(tmp_path, tokenizer, no_rejected)
    long_prompt = [{**pairs[0], "prompt": "word " * 200}] + pairs[1:]
    message = refused(tmp_path, tokenizer, long_prompt)
    assert "row 0" in message and "leaves no completion token" in message
    assert "is no DPO loss" in refused(tmp_path, tokenizer, pairs, dpo={"loss_type": ["sigmoidal"]})
    assert "exo_pair needs it above 0" in refused(tmp_path, tokenizer, pairs, dpo={"loss_type": ["exo_pair"]})
    assert "set data.packing = false" in refused(tmp_path, tokenizer, pairs, data={"packing": True})
    other = tmp_path / "other-vocabulary"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer) + 7, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    assert "vocabulary" in refused(tmp_path, tokenizer, pairs, dpo={"ref_model": str(other)})


def test_preference_rows_without_a_preference_plugin_are_refused(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(4))
    mapping = {"data": {"packing": False, "train": path}, "train": {**SCHEDULE, "output_dir": str(tmp_path / "out")}}
    with pytest.raises(ConfigError, match=r'enable one: plugins = \["dpo"\]'):
        engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer).train()


# ---------------------------------------------------------------------------- two processes


def test_two_ddp_processes_train_as_one_with_twice_the_batch(tmp_path, tokenizer):
    """``torchrun -m engine train`` with the ddp plugin, each process a frozen copy of the starting weights as
    its reference, against one process with the whole batch: the same weights (SGD, float32)."""
    from safetensors.torch import load_file

    from engine.testing import torchrun

    model_dir = tmp_path / "start"
    llama_for(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(16))
    train = {"model": str(model_dir), "max_steps": 3, "optim": "sgd", "learning_rate": 0.05, "logging_steps": 1,
             "save_strategy": "no", "disable_tqdm": True, "seed": 0}
    sections = {"data": {"train": data, "packing": False, "max_length": 128}}
    two = tmp_path / "two.toml"
    two.write_text(engine.to_toml({"plugins": ["dpo", "ddp"], **sections, "train": {
        **train, "per_device_train_batch_size": 4, "output_dir": str(tmp_path / "two")}}))
    result = torchrun(["-m", "engine", "train", str(two)], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    one = engine.Run({"plugins": ["dpo"], **sections,
                      "train": {**train, "per_device_train_batch_size": 8, "output_dir": str(tmp_path / "one")}})
    one.train()
    theirs = load_file(tmp_path / "two" / "model.safetensors")
    ours = load_file(tmp_path / "one" / "model.safetensors")
    difference = max(float((theirs[name] - ours[name]).abs().max()) for name in ours)
    print(f"max |weight difference|, two processes vs one: {difference:.2e}")
    assert difference < 1e-5
    logged = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([row["loss"] for row in logged if "rewards/margins" in row],
                               [row["loss"] for row in one.state.log_history if "rewards/margins" in row], atol=1e-5)


def test_the_sft_then_dpo_examples_train_the_second_from_the_first(tmp_path, monkeypatch):
    """examples/sft.toml, then examples/dpo.toml from its output (model and tokenizer), a few steps each; the
    DPO run's report draws the reward margins."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("ENGINE_REPORT", "full")  # the suite's conftest turns the end-of-run report off
    sft = engine.Run(str(ROOT / "examples" / "sft.toml"),
                     overrides=["train.max_steps=4", f"train.output_dir={tmp_path / 'sft'}"])
    sft.train()
    dpo = engine.Run(str(ROOT / "examples" / "dpo.toml"),
                     overrides=["train.max_steps=4", f"train.model={tmp_path / 'sft'}",
                                f"train.output_dir={tmp_path / 'dpo'}"])
    dpo.train()
    assert len(dpo.tokenizer) == len(sft.tokenizer) and dpo.tokenizer.get_vocab() == sft.tokenizer.get_vocab()
    assert any("rewards/margins" in row for row in dpo.state.log_history)
    assert "](report-rewards.png)" in (tmp_path / "dpo" / "report.md").read_text()
    assert (tmp_path / "dpo" / "report-rewards.png").stat().st_size > 1000


def implicit(rows):
    """Rows without a prompt column: chosen and rejected hold the whole conversation (UltraFeedback's layout)."""
    return [{"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]} for row in rows]


def test_implicit_prompts_match_dpo_trainer(tmp_path, tokenizer):
    train = Dataset.from_list(implicit(pair_rows(chat=True)))
    model = llama_for(tokenizer)
    theirs = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), copy.deepcopy(model))
    assert_same_rows(engine_rows(tmp_path, tokenizer, train, model), theirs)


def test_a_mixture_of_pairs_with_a_held_out_split_evaluates_the_reward_metrics(tmp_path, tokenizer):
    rows = implicit(pair_rows(16, chat=True))
    first, second = write_jsonl(tmp_path / "a.jsonl", rows[:8]), write_jsonl(tmp_path / "b.jsonl", rows[8:])
    mapping = {"plugins": ["dpo"], "data": {"packing": False, "max_length": 64, "eval_split": 0.25, "mixture": [
        {"source": first, "columns": ["chosen", "rejected"]}, {"source": second, "weight": 0.5}]},
        "train": {**SCHEDULE, "per_device_train_batch_size": 4, "output_dir": str(tmp_path / "out"),
                  "eval_strategy": "steps", "eval_steps": 2}}
    run = engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer)
    run.train()
    assert len(run.train_dataset) + len(run.eval_dataset) == 12  # 8 + half of 8
    evaluated = next(entry for entry in run.state.log_history if "eval_loss" in entry)
    assert 0 <= evaluated["eval_rewards/accuracies"] <= 1


def test_a_ref_model_folder_of_the_starting_weights_is_the_frozen_copy(tmp_path, tokenizer):
    folder = tmp_path / "reference"
    llama_for(tokenizer).save_pretrained(folder)
    train = Dataset.from_list(pair_rows())
    copied = engine_rows(tmp_path / "copy", tokenizer, train, llama_for(tokenizer))
    mapping = {"plugins": ["dpo"], "dpo": {"ref_model": str(folder)}, "data": {"packing": False, "max_length": 128},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "folder"), "save_final_model": False}}
    run = engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer, train_dataset=train)
    run.train()
    assert logged_rows(run.state.log_history, COMPARED) == copied
