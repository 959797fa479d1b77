"""engine-orpo against TRL 1.16's experimental ORPOTrainer: the same rows, the same tiny Llama (same initial
weights), the same schedule give the same per-step losses and the metrics TRL logs. Then bad input refused.

Tokenization: ORPOTrainer tokenizes with its own ``tokenize_row`` (prompt and prompt + completion without
special tokens, the tokenizer's bos prepended to the prompt, eos appended to each completion); the data
builtin as DPOTrainer does. On a tokenizer without a bos token and text rows both give the same ids (checked
below; ``test_where_the_tokenization_differs_from_orpo_trainer`` shows the two differences the README
names), so the parity runs use that tokenizer.

Both sides read the rows in order (``train_sampling_strategy = "sequential"``), float32 on CPU. Tolerance: the
engine logs values rounded to 6 decimals, and sums log-probabilities in another order than TRL's
selective_log_softmax; the largest measured difference is 7.6e-7.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest

from datasets import Dataset

import engine
from engine.testing import PARITY_SCHEDULE, llama_for, logged_rows, preference_rows, preference_tokenizer, refusal

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 2e-5
SCHEDULE = PARITY_SCHEDULE
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss", "log_odds_ratio",
            "log_odds_chosen")


def pair_rows(count: int = 16) -> list[dict]:
    return preference_rows(count)


def chat_rows(count: int = 16) -> list[dict]:
    return preference_rows(count, "chat")


@pytest.fixture(scope="module")
def tokenizer():
    """The preference tokenizer without its bos token (it is eos as well, and never added on encode; TRL's ORPO
    would prepend it to every prompt, the data builtin not)."""
    tokenizer = preference_tokenizer()
    tokenizer.bos_token = None
    return tokenizer


def trl_trainer(tmp_path, tokenizer, train, model, **orpo):
    args = ORPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      gradient_checkpointing=False, max_length=128, **{**SCHEDULE, **orpo})
    return ORPOTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)


def engine_run(tmp_path, tokenizer, train, model, schedule=None, **orpo):
    mapping = {"plugins": ["orpo"], "data": {"packing": False, "max_length": 128}, "orpo": orpo,
               "train": {**SCHEDULE, **(schedule or {}), "output_dir": str(tmp_path / "engine"),
                         "save_final_model": False}}
    run = engine.Run(mapping, model=model, tokenizer=tokenizer, train_dataset=train)
    run.train()
    return run


def engine_examples(tmp_path, tokenizer, rows):
    """The examples the data builtin makes of ``rows`` for the plugin (setup only, no training)."""
    mapping = {"plugins": ["orpo"], "data": {"packing": False, "max_length": 128},
               "train": {**SCHEDULE, "per_device_train_batch_size": 2, "output_dir": str(tmp_path / "engine")}}
    run = engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer, train_dataset=Dataset.from_list(rows))
    run.setup()
    return run.train_dataset


def test_tokenization_matches_orpo_trainer(tmp_path, tokenizer):
    """Each row's prompt + completion ids and where the completion starts (TRL's labels: -100 over the prompt)."""
    theirs = trl_trainer(tmp_path, tokenizer, Dataset.from_list(pair_rows()), llama_for(tokenizer)).train_dataset
    ours = engine_examples(tmp_path, tokenizer, pair_rows())
    assert len(ours) == len(theirs) == 16
    for mine, other in zip(ours, theirs):
        assert mine["prompt_ids"] == other["prompt_input_ids"]
        for side in ("chosen", "rejected"):
            assert mine["prompt_ids"] + mine[f"{side}_ids"] == other[f"{side}_input_ids"]
            assert [-100] * len(mine["prompt_ids"]) + mine[f"{side}_ids"] == other[f"{side}_labels"]
        assert mine["chosen_ids"][-1] == tokenizer.eos_token_id


def test_where_the_tokenization_differs_from_orpo_trainer(tmp_path, tokenizer):
    """The differences the README names: TRL prepends a tokenizer's bos to every prompt (the data builtin adds
    what the tokenizer adds on encode, with data.add_special_tokens), and appends eos to conversations after
    the chat template's end of turn (the data builtin takes the template's tokens as they are)."""
    with_bos = copy.deepcopy(tokenizer)
    with_bos.bos_token = "<|endoftext|>"  # the engine's trained tokenizers: bos = eos, never added on encode
    theirs = trl_trainer(tmp_path, with_bos, Dataset.from_list(pair_rows(4)), llama_for(with_bos)).train_dataset
    for mine, other in zip(engine_examples(tmp_path, with_bos, pair_rows(4)), theirs):
        assert other["chosen_input_ids"] == [with_bos.bos_token_id] + mine["prompt_ids"] + mine["chosen_ids"]
    conversations = chat_rows(4)
    theirs = trl_trainer(tmp_path, tokenizer, Dataset.from_list(conversations), llama_for(tokenizer)).train_dataset
    for mine, other in zip(engine_examples(tmp_path, tokenizer, conversations), theirs):
        assert other["chosen_input_ids"] == mine["prompt_ids"] + mine["chosen_ids"] + [tokenizer.eos_token_id]


@pytest.mark.parametrize("beta, schedule", [(0.1, {}), (1.0, {}),
                                            (0.5, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2})],
                         ids=["beta0.1", "beta1", "accumulated"])
def test_losses_and_metrics_match_orpo_trainer(tmp_path, tokenizer, beta, schedule):
    train = Dataset.from_list(pair_rows())
    model = llama_for(tokenizer)
    trainer = trl_trainer(tmp_path, tokenizer, train, copy.deepcopy(model), beta=beta, **schedule)
    trainer.train()
    theirs = logged_rows(trainer.state.log_history, COMPARED)
    ours = logged_rows(engine_run(tmp_path, tokenizer, train, model, schedule, beta=beta).state.log_history, COMPARED)
    assert len(ours) == len(theirs) == SCHEDULE["max_steps"]
    assert ours[0]["loss"] != ours[-1]["loss"]
    for mine, other in zip(ours, theirs):
        assert set(mine) == set(other) == set(COMPARED), sorted(set(COMPARED) ^ set(mine))
        np.testing.assert_allclose([mine[k] for k in COMPARED], [other[k] for k in COMPARED], rtol=0,
                                   atol=TOLERANCE, err_msg=str([(k, mine[k], other[k]) for k in COMPARED]))


def test_evaluation_logs_the_metrics(tmp_path, tokenizer):
    mapping = {"plugins": ["orpo"], "data": {"packing": False, "max_length": 128},
               "train": {**SCHEDULE, "output_dir": str(tmp_path), "eval_strategy": "steps", "eval_steps": 2}}
    run = engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer,
                     train_dataset=Dataset.from_list(pair_rows()),
                     eval_dataset=Dataset.from_list(pair_rows(8)))
    run.train()
    evaluated = next(entry for entry in run.state.log_history if "eval_loss" in entry)
    assert {"eval_nll_loss", "eval_log_odds_ratio", "eval_rewards/margins"} <= set(evaluated)


def refused(tmp_path, tokenizer, rows, orpo=None, data=None, train=None):
    mapping = {"plugins": ["orpo"], "orpo": orpo or {}, "data": {"packing": False, "max_length": 128, **(data or {})},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "out"), **(train or {})}}
    return refusal(mapping, model=llama_for(tokenizer), tokenizer=tokenizer, train_dataset=Dataset.from_list(rows))


def test_bad_input_is_refused_in_one_line(tmp_path, tokenizer):
    pairs = pair_rows(4)
    no_rejected = [{"prompt": p["prompt"], "chosen": p["chosen"]} for p in pairs]
    assert "no 'rejected'" in refused(tmp_path, tokenizer, no_rejected)
    long_prompt = [{**pairs[0], "prompt": "word " * 200}] + pairs[1:]
    assert "leaves no completion token" in refused(tmp_path, tokenizer, long_prompt)
    assert "set data.packing = false" in refused(tmp_path, tokenizer, pairs, data={"packing": True})
    assert "orpo.beta" in refused(tmp_path, tokenizer, pairs, orpo={"beta": -1.0})
    assert "orpo" in refused(tmp_path, tokenizer, pairs, orpo={"loss_type": "sigmoid"})
