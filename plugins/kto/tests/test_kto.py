"""engine-kto against TRL 1.16's KTOTrainer: the same rows, the same tiny Llama (same initial weights), the
same schedule give the same per-step losses and metrics (kl, rewards, logps, logits, entropy), for both loss
types, with a full model and a frozen copy as the reference, with paired rows unpaired, with a LoRA adapter
(the reference: the adapter off) and with precomputed reference log-probs. Then what TRL has no counterpart
for: bit-exact resume, and bad input refused.

Both sides read the rows in order (``train_sampling_strategy = "sequential"``, which the KL term needs), float32
on CPU. Tolerance: the engine logs values rounded to 6 decimals, TRL's fused LM head sums log-probabilities in
another order; the largest measured difference is 6.2e-6 (logps/chosen, about -30), kl's 2.5e-6.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from datasets import Dataset

import engine
from engine import ConfigError
from engine.testing import (
    PARITY_SCHEDULE, REVERSALS, assert_resume_is_exact, llama_for, logged_rows, preference_rows, preference_tokenizer,
    refusal, reversed_words, write_jsonl,
)

trl = pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 5e-5
SCHEDULE = PARITY_SCHEDULE
COMPARED = ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "logits/chosen", "logits/rejected", "entropy")


def unpaired_rows(count: int = 16, chat: bool = False) -> list[dict]:
    """Word reversals with feedback: the reversal desirable, the word itself not; two desirable rows in three."""
    rows = []
    for i, source in enumerate(REVERSALS[:count]):
        desirable = i % 3 != 0
        completion = f"is {reversed_words(source) if desirable else source}"
        if chat:
            rows.append({"prompt": [{"role": "user", "content": f"reverse {source}"}],
                         "completion": [{"role": "assistant", "content": completion}], "label": desirable})
        else:
            rows.append({"prompt": f"{source} reversed ", "completion": completion, "label": desirable})
    return rows


def pair_rows(count: int = 16) -> list[dict]:
    return preference_rows(count)


@pytest.fixture(scope="module")
def tokenizer():
    return preference_tokenizer()


def trl_rows(tmp_path, tokenizer, train, model, ref_model=None, peft_config=None, **kto):
    args = trl.KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                         gradient_checkpointing=False, max_length=128, **{**SCHEDULE, **kto})
    trainer = trl.KTOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=train,
                             processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    return logged_rows(trainer.state.log_history, COMPARED)


def engine_rows(tmp_path, tokenizer, train, model, plugins=("kto",), sections=None, **kto):
    mapping = {"plugins": list(plugins), "data": {"packing": False, "max_length": 128}, "kto": kto,
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "engine"), "save_final_model": False},
               **(sections or {})}
    run = engine.Run(mapping, model=model, tokenizer=tokenizer, train_dataset=train)
    run.train()
    return logged_rows(run.state.log_history, COMPARED)


def assert_same_rows(ours, theirs):
    assert len(ours) == len(theirs) == SCHEDULE["max_steps"]
    assert ours[0]["loss"] != ours[-1]["loss"]
    for mine, other in zip(ours, theirs):
        assert set(mine) == set(other), (sorted(mine), sorted(other))
        keys = sorted(other)
        np.testing.assert_allclose([mine[k] for k in keys], [other[k] for k in keys], rtol=0, atol=TOLERANCE,
                                   err_msg=str([(k, mine[k], other[k]) for k in keys]))


@pytest.mark.parametrize("kto", [
    {},
    {"loss_type": "apo_zero_unpaired", "beta": 0.3},
    {"desirable_weight": 0.6, "undesirable_weight": 1.3, "beta": 0.5},
], ids=["kto", "apo_zero_unpaired", "weights"])
def test_losses_match_kto_trainer(tmp_path, tokenizer, kto):
    train = Dataset.from_list(unpaired_rows())
    model = llama_for(tokenizer)
    theirs = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), copy.deepcopy(model), **kto)
    ours = engine_rows(tmp_path, tokenizer, train, model, **kto)
    assert_same_rows(ours, theirs)
    assert set(COMPARED) <= set(ours[0])
    if kto.get("loss_type") == "apo_zero_unpaired":
        assert all(row["kl"] == 0.0 for row in ours)  # no KL term
    elif not kto:
        assert ours[-1]["kl"] > 0.01  # the policy moved: the KL term is compared, not only its clamp at 0


def test_conversations_and_paired_rows_match_kto_trainer(tmp_path, tokenizer):
    """Conversations through the chat template; then pairs, which both unpair (chosen rows, then rejected): 4 pairs
    make one batch of 4 desirable and 4 undesirable rows."""
    model = llama_for(tokenizer)
    train = Dataset.from_list(unpaired_rows(chat=True))
    theirs = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), copy.deepcopy(model))
    assert_same_rows(engine_rows(tmp_path, tokenizer, train, copy.deepcopy(model)), theirs)
    pairs = Dataset.from_list(pair_rows(4))
    theirs = trl_rows(tmp_path / "pairs", tokenizer, pairs, copy.deepcopy(model), copy.deepcopy(model))
    assert_same_rows(engine_rows(tmp_path / "pairs", tokenizer, pairs, model), theirs)


def test_a_batch_of_one_kind_logs_no_margin_as_kto_trainer(tmp_path, tokenizer):
    """16 pairs unpaired: the first 16 rows are desirable, so neither step has a rejected row."""
    model = llama_for(tokenizer)
    pairs = Dataset.from_list(pair_rows(16))
    theirs = trl_rows(tmp_path, tokenizer, pairs, copy.deepcopy(model), copy.deepcopy(model))
    ours = engine_rows(tmp_path, tokenizer, pairs, model)
    assert_same_rows(ours, theirs)
    assert "rewards/margins" not in ours[0] and "rewards/rejected" not in ours[0]


def test_metrics_averaged_over_accumulated_batches_as_kto_trainer(tmp_path, tokenizer):
    """Batches of 2, 2 accumulated, a log row every 2 steps: 4 pairs unpaired give batches of desirable rows only,
    then undesirable only, so a row has rewards/chosen and rewards/rejected but no batch with both (no margin)."""
    model = llama_for(tokenizer)
    pairs = Dataset.from_list(pair_rows(4))
    schedule = {"max_steps": 4, "logging_steps": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    theirs = trl_rows(tmp_path, tokenizer, pairs, copy.deepcopy(model), copy.deepcopy(model), **schedule)
    ours = engine_rows(tmp_path, tokenizer, pairs, model,
                       sections={"train": {**SCHEDULE, **schedule, "output_dir": str(tmp_path / "engine"),
                                           "save_final_model": False}})
    assert_same_rows(ours, theirs)
    assert "rewards/margins" not in ours[0] and {"rewards/chosen", "rewards/rejected"} <= set(ours[0])


def test_lora_with_the_adapter_off_as_the_reference_matches_kto_trainer(tmp_path, tokenizer):
    """One LoRA adapter (the same initial weights) on both sides, the reference the adapter off on both."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(1)
    model = peft.get_peft_model(llama_for(tokenizer), config)
    train = Dataset.from_list(unpaired_rows())
    theirs = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), learning_rate=1e-2)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}
    ours = engine_rows(tmp_path, tokenizer, train, model, plugins=["kto", "peft"],
                       sections={"train": {**SCHEDULE, "learning_rate": 1e-2, "output_dir": str(tmp_path / "engine"),
                                           "save_final_model": False}})
    assert_same_rows(ours, theirs)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters() if name in before)


def test_precomputed_reference_log_probs_match_kto_trainer_and_are_read_back_on_a_second_start(tmp_path, tokenizer):
    rows = write_jsonl(tmp_path / "feedback.jsonl", unpaired_rows())
    import datasets

    train = datasets.load_dataset("json", data_files=str(rows), split="train")
    model = llama_for(tokenizer)
    theirs = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), precompute_ref_log_probs=True,
                      precompute_ref_batch_size=5)
    sections = {"data": {"packing": False, "max_length": 128, "train": str(rows)}}
    ours = engine_rows(tmp_path, tokenizer, None, copy.deepcopy(model), sections=sections,
                       precompute_ref_log_probs=True, precompute_ref_batch_size=5)
    assert_same_rows(ours, theirs)
    calls = []
    forward = transformers.LlamaForCausalLM.forward
    try:
        transformers.LlamaForCausalLM.forward = lambda self, *a, **k: calls.append(self.training) or forward(self, *a, **k)
        again = engine_rows(tmp_path / "again", tokenizer, None, copy.deepcopy(model), sections=sections,
                            precompute_ref_log_probs=True, precompute_ref_batch_size=5)
    finally:
        transformers.LlamaForCausalLM.forward = forward
    assert again == ours
    assert False not in calls  # no forward in eval mode: the reference log-probs came from the cache


def test_a_resume_is_bit_exact_and_the_reference_recorded(tmp_path, tokenizer):
    check = assert_resume_is_exact(
        4, 2, tmp_path, plugins=["kto"], make_model=lambda seed: llama_for(tokenizer, seed), resumed_model_seed=0,
        tokenizer=tokenizer, dataset=Dataset.from_list(unpaired_rows()), data_collator=None,
        sections={"data": {"packing": False, "max_length": 128}},
        train={"per_device_train_batch_size": 4, "learning_rate": 1e-2, "train_sampling_strategy": "sequential"})
    state = torch.load(check.checkpoint / "engine_state.pt", weights_only=True)["plugins"]["kto"]
    assert len(state["reference"]) == 16
    assert any("kl" in entry for entry in check.resumed.state.log_history)


def test_a_resume_against_another_reference_is_refused(tmp_path, tokenizer):
    train = Dataset.from_list(unpaired_rows())
    settings = {"data": {"packing": False, "max_length": 128}, "plugins": ["kto"],
                "train": {**SCHEDULE, "output_dir": str(tmp_path), "save_strategy": "steps", "save_steps": 2}}
    engine.Run(settings, model=llama_for(tokenizer), tokenizer=tokenizer, train_dataset=train).train()
    resumed = {**settings, "train": {**settings["train"], "max_steps": 4, "resume_from_checkpoint": True}}
    run = engine.Run(resumed, model=llama_for(tokenizer, seed=5), tokenizer=tokenizer, train_dataset=train)
    with pytest.raises(ConfigError, match="trained against another reference"):
        run.train()


def test_evaluation_logs_the_metrics(tmp_path, tokenizer):
    mapping = {"plugins": ["kto"], "data": {"packing": False, "max_length": 128},
               "train": {**SCHEDULE, "output_dir": str(tmp_path), "eval_strategy": "steps", "eval_steps": 2}}
    run = engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer,
                     train_dataset=Dataset.from_list(unpaired_rows()),
                     eval_dataset=Dataset.from_list(unpaired_rows(8)))
    run.train()
    evaluated = next(entry for entry in run.state.log_history if "eval_loss" in entry)
    assert {"eval_kl", "eval_rewards/margins", "eval_logps/chosen", "eval_entropy"} <= set(evaluated)


# ---------------------------------------------------------------------------- bad input, refused before training


def refused(tmp_path, tokenizer, rows, kto=None, data=None, train=None):
    mapping = {"plugins": ["kto"], "kto": kto or {}, "data": {"packing": False, "max_length": 128, **(data or {})},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "out"), **(train or {})}}
    return refusal(mapping, model=llama_for(tokenizer), tokenizer=tokenizer, train_dataset=Dataset.from_list(rows))


def test_bad_input_is_refused_in_one_line(tmp_path, tokenizer):
    rows = unpaired_rows(4)
    assert "'label' holds" in refused(tmp_path, tokenizer, [{**row, "label": "yes"} for row in rows])
    long_prompt = [{**rows[0], "prompt": "word " * 200}] + rows[1:]
    assert "leaves no completion token" in refused(tmp_path, tokenizer, long_prompt)
    completions = [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows]
    assert "kto learns from unpaired rows: prompt, completion, label" in refused(tmp_path, tokenizer, completions)
    assert 'train_sampling_strategy = "sequential"' in refused(tmp_path, tokenizer, rows,
                                                              train={"train_sampling_strategy": "random"})
    assert "at least 2 rows per batch" in refused(tmp_path, tokenizer, rows, train={"per_device_train_batch_size": 1})
    assert "set data.packing = false" in refused(tmp_path, tokenizer, rows, data={"packing": True})
    assert "kto.sync_ref_model" in refused(tmp_path, tokenizer, rows, kto={"sync_ref_model": True})
    assert "kto.loss_type" in refused(tmp_path, tokenizer, rows, kto={"loss_type": "sigmoid"})


def test_a_collator_without_the_kl_rows_is_refused(tmp_path, tokenizer):
    from engine.kit.preference import CompletionCollator

    mapping = {"plugins": ["kto"], "data": {"packing": False, "max_length": 128},
               "train": {**SCHEDULE, "output_dir": str(tmp_path)}}
    run = engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer,
                     train_dataset=Dataset.from_list(unpaired_rows(8)),
                     data_collator=CompletionCollator(tokenizer.pad_token_id, 128))
    with pytest.raises(ConfigError, match="the batches lack KL_input_ids"):
        run.train()


def test_a_ref_model_folder_of_the_starting_weights_is_the_frozen_copy(tmp_path, tokenizer):
    folder = tmp_path / "reference"
    llama_for(tokenizer).save_pretrained(folder)
    train = Dataset.from_list(unpaired_rows())
    copied = engine_rows(tmp_path / "copy", tokenizer, train, llama_for(tokenizer))
    assert engine_rows(tmp_path / "folder", tokenizer, train, llama_for(tokenizer), ref_model=str(folder)) == copied
