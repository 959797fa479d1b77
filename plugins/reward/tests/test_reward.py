"""engine-reward against TRL 1.16's RewardTrainer: the same rows, the same tiny LlamaForSequenceClassification (same
initial weights, num_labels=1), the same schedule give the same per-step losses and the metrics TRL logs, with and
without center_rewards_coefficient and a margin column, on text and on conversations. Then what TRL does otherwise:
pairs longer than data.max_length (TRL drops them silently; the engine cuts or, with data.truncation = "drop",
leaves them out, counted), and bad input refused.

Both sides read the rows in order (``train_sampling_strategy = "sequential"``), float32 on CPU. Tolerance: the
engine logs its metrics rounded to 6 decimals; the largest measured difference is stated in TOLERANCE's comment.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from datasets import Dataset

import engine
from engine.testing import (
    PARITY_SCHEDULE, llama_for, logged_rows, preference_rows, preference_tokenizer, refusal, write_jsonl,
)

trl = pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 2e-6  # measured: at most 4.8e-7, the engine's 6-decimal rounding
SCHEDULE = PARITY_SCHEDULE
COMPARED = ("loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def pair_rows(count: int = 16, chat: bool = False, implicit: bool = False) -> list[dict]:
    return preference_rows(count, "chat" if chat else "implicit" if implicit else "text")


@pytest.fixture(scope="module")
def tokenizer():
    return preference_tokenizer()


def scorer(tokenizer, seed: int = 0, num_labels: int = 1):
    return llama_for(tokenizer, seed, num_labels=num_labels)


def trl_rows(tmp_path, tokenizer, train, model, max_length=128, **reward):
    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                            gradient_checkpointing=False, max_length=max_length, **{**SCHEDULE, **reward})
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    return logged_rows(trainer.state.log_history, COMPARED), trainer


def engine_run(tmp_path, tokenizer, train, model, data=None, train_keys=None, **reward):
    mapping = {"plugins": ["reward"], "data": {"packing": False, "max_length": 128, **(data or {})}, "reward": reward,
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "engine"), "save_final_model": False,
                         **(train_keys or {})}}
    run = engine.Run(mapping, model=model, tokenizer=tokenizer, train_dataset=train)
    run.train()
    return run


def engine_rows(*args, **kwargs):
    return logged_rows(engine_run(*args, **kwargs).state.log_history, COMPARED)


def assert_same_rows(ours, theirs):
    assert len(ours) == len(theirs) == SCHEDULE["max_steps"]
    assert ours[0]["loss"] != ours[-1]["loss"]
    for mine, other in zip(ours, theirs):
        assert set(mine) == set(COMPARED), sorted(set(COMPARED) - set(mine))
        np.testing.assert_allclose([mine[k] for k in COMPARED], [other[k] for k in COMPARED], rtol=0,
                                   atol=TOLERANCE, err_msg=str(list(zip(COMPARED, mine.values(), other.values()))))


@pytest.mark.parametrize("rows, reward", [
    ("text", {}),
    ("text", {"center_rewards_coefficient": 0.5}),
    ("chat", {"center_rewards_coefficient": 0.01}),
    ("implicit", {}),
], ids=["text", "centered", "chat-centered", "implicit-prompt"])
def test_losses_and_metrics_match_reward_trainer(tmp_path, tokenizer, rows, reward):
    train = Dataset.from_list(pair_rows(chat=rows == "chat", implicit=rows == "implicit"))
    model = scorer(tokenizer)
    theirs, _ = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), **reward)
    assert_same_rows(engine_rows(tmp_path, tokenizer, train, model, **reward), theirs)


def test_without_a_pad_token_the_eos_pads_as_in_reward_trainer(tmp_path, tokenizer):
    """TRL pads with the eos where the tokenizer has no pad token, and sets the model's pad_token_id to it."""
    plain = copy.deepcopy(tokenizer)
    plain.pad_token = None
    model = scorer(plain)
    model.config.pad_token_id = None
    train = Dataset.from_list(pair_rows())
    theirs, _ = trl_rows(tmp_path, copy.deepcopy(plain), train, copy.deepcopy(model))
    assert_same_rows(engine_rows(tmp_path, plain, train, model), theirs)
    assert model.config.pad_token_id == plain.eos_token_id and plain.pad_token is None


def test_a_given_lora_model_of_sequence_classification_matches_reward_trainer(tmp_path, tokenizer):
    """A peft model of task type SEQ_CLS (its score head saved with the adapter) passed to both sides."""
    import peft

    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             task_type="SEQ_CLS")
    model = peft.get_peft_model(scorer(tokenizer), config)
    train = Dataset.from_list(pair_rows())
    theirs, _ = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), learning_rate=1e-2)
    assert_same_rows(engine_rows(tmp_path, tokenizer, train, model, train_keys={"learning_rate": 1e-2}), theirs)


def test_a_margin_column_matches_reward_trainer(tmp_path, tokenizer):
    rows = [{**row, "margin": 0.25 * (i % 4)} for i, row in enumerate(pair_rows())]
    train = Dataset.from_list(rows)
    model = scorer(tokenizer)
    theirs, _ = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model))
    plain, _ = trl_rows(tmp_path / "plain", tokenizer, Dataset.from_list(pair_rows()), copy.deepcopy(model))
    assert abs(theirs[0]["loss"] - plain[0]["loss"]) > 1e-3  # the margin counts
    assert_same_rows(engine_rows(tmp_path, tokenizer, train, model), theirs)
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)  # the data builtin keeps the column of a file's rows
    assert_same_rows(engine_rows(tmp_path / "file", tokenizer, None, scorer(tokenizer), data={"train": path}), theirs)


def test_the_tokens_are_trls(tmp_path, tokenizer):
    """prompt_ids + chosen_ids (the data builtin's split) are TRL's chosen_ids (prompt + chosen tokenized whole),
    text, implicit prompt and conversations; the batches the model sees are TRL's."""
    for rows in (pair_rows(), pair_rows(implicit=True), pair_rows(chat=True)):
        _, trainer = trl_rows(tmp_path, tokenizer, Dataset.from_list(rows), scorer(tokenizer), max_steps=1)
        run = engine.Run({"plugins": ["reward"], "data": {"packing": False},
                          "train": {**SCHEDULE, "output_dir": str(tmp_path / "engine")}},
                         model=scorer(tokenizer), tokenizer=tokenizer, train_dataset=Dataset.from_list(rows))
        run.setup()
        ours = [{"chosen_ids": e["prompt_ids"] + e["chosen_ids"], "rejected_ids": e["prompt_ids"] + e["rejected_ids"]}
                for e in run.train_dataset]
        assert ours == [{k: e[k] for k in ("chosen_ids", "rejected_ids")} for e in trainer.train_dataset]
        mine, theirs = run.data_collator(list(run.train_dataset)), trainer.data_collator(list(trainer.train_dataset))
        assert all(torch.equal(mine[k], theirs[k]) for k in ("input_ids", "attention_mask"))


def test_pairs_longer_than_max_length_are_cut_or_left_out_as_trl_counted(tmp_path, tokenizer, caplog):
    rows = pair_rows()
    rows[3] = {**rows[3], "chosen": rows[3]["chosen"] + " is" * 40}
    train = Dataset.from_list(rows)
    model = scorer(tokenizer)
    theirs, trainer = trl_rows(tmp_path, tokenizer, train, copy.deepcopy(model), max_length=24)
    assert len(trainer.train_dataset) == 15  # TRL left one out, without a word
    with caplog.at_level(logging.INFO, logger="engine"):
        ours = engine_rows(tmp_path, tokenizer, train, copy.deepcopy(model), data={"max_length": 24,
                                                                                   "truncation": "drop"})
    assert_same_rows(ours, theirs)
    assert "1 of 16 pairs (the first row 3" in caplog.text and "left out" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine"):
        run = engine_run(tmp_path / "cut", tokenizer, train, model, data={"max_length": 24})
    assert "cut to it" in caplog.text and len(run.train_dataset) == 16
    assert run.data_collator([run.train_dataset[3]])["input_ids"].shape[1] == 24


def test_evaluation_logs_the_reward_metrics_and_the_pad_token_is_set(tmp_path, tokenizer):
    model = scorer(tokenizer)
    model.config.pad_token_id = None  # TRL sets it from the tokenizer; so does the plugin
    mapping = {"plugins": ["reward"], "data": {"packing": False},
               "train": {**SCHEDULE, "output_dir": str(tmp_path), "eval_strategy": "steps", "eval_steps": 2}}
    run = engine.Run(mapping, model=model, tokenizer=tokenizer, train_dataset=Dataset.from_list(pair_rows()),
                     eval_dataset=Dataset.from_list(pair_rows(8)))
    run.train()
    assert model.config.pad_token_id == tokenizer.pad_token_id
    evaluated = next(entry for entry in run.state.log_history if "eval_loss" in entry)
    assert {"eval_accuracy", "eval_margin", "eval_min_reward", "eval_mean_reward", "eval_max_reward"} <= set(evaluated)


# ---------------------------------------------------------------------------- bad input, refused before training


def refused(tmp_path, tokenizer, rows=None, model=None, reward=None, data=None, train=None, plugins=("reward",),
            **run_kwargs):
    mapping = {"plugins": list(plugins), "reward": reward or {},
               "data": {"packing": False, "max_length": 128, **(data or {})},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "out"), **(train or {})}}
    if rows is not None:
        run_kwargs["train_dataset"] = Dataset.from_list(rows)
    return refusal(mapping, model=model, tokenizer=tokenizer, **run_kwargs)


def test_bad_input_is_refused_in_one_line(tmp_path, tokenizer):
    pairs = pair_rows(4)
    model = scorer(tokenizer)
    causal = transformers.LlamaForCausalLM(model.config)
    assert "set train.task = \"sequence-classification\"" in refused(tmp_path, tokenizer, pairs, causal)
    assert "num_labels = 3" in refused(tmp_path, tokenizer, pairs, scorer(tokenizer, num_labels=3))
    folder = tmp_path / "causal"
    causal.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert "set train.num_labels = 1" in refused(
        tmp_path, tokenizer, pairs, train={"model": str(folder), "task": "sequence-classification"})
    assert "train.task" in refused(tmp_path, tokenizer, pairs, train={"model": str(folder)})
    assert "set data.packing = false" in refused(tmp_path, tokenizer, pairs, model, data={"packing": True})
    assert "no 'rejected'" in refused(tmp_path, tokenizer, [{"prompt": p["prompt"], "chosen": p["chosen"]}
                                                            for p in pairs], model)
    bad_margin = [{**p, "margin": None if i == 2 else 1.0} for i, p in enumerate(pairs)]
    assert "row 2 (counted from 0): 'margin' holds None" in refused(tmp_path, tokenizer, bad_margin, model)
    assert "data.truncation" in refused(tmp_path, tokenizer, model=model, data={
        "train": write_jsonl(tmp_path / "plain.jsonl", pairs), "streaming": True, "truncation": "drop"})
    assert "reward with peft is not supported yet" in refused(tmp_path, tokenizer, pairs, model,
                                                              plugins=["reward", "peft"])
    assert "set data.padding_free = false" in refused(tmp_path, tokenizer, pairs, model, data={"padding_free": True})
    long_prompt = [{**pairs[0], "prompt": "word " * 200}] + pairs[1:]
    assert "row 0" in refused(tmp_path, tokenizer, long_prompt, model)
    short = [{**p, "chosen": p["chosen"] + " is" * 40} for p in pairs]
    assert "all 4 of 4 pairs" in refused(tmp_path, tokenizer, short, model, data={"max_length": 24,
                                                                                   "truncation": "drop"})


def test_a_model_built_from_a_causal_lm_folder_trains(tmp_path, tokenizer):
    """TRL's usual start: the folder an SFT run wrote, loaded as a sequence classifier with a new score head."""
    folder = tmp_path / "causal"
    transformers.LlamaForCausalLM(scorer(tokenizer).config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    path = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    mapping = {"plugins": ["reward"], "data": {"packing": False, "train": path},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "out"), "model": str(folder),
                         "task": "sequence-classification", "num_labels": 1}}
    run = engine.Run(mapping)
    run.train()
    assert type(run.model).__name__ == "LlamaForSequenceClassification"
    assert run.model.config.pad_token_id == tokenizer.pad_token_id
    assert {"accuracy", "margin", "mean_reward"} <= set(run.state.log_history[0])
