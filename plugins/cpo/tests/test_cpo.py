"""engine-cpo against TRL 1.16's experimental CPOTrainer: the same rows, the same tiny Llama (same initial
weights), the same schedule give the same per-step losses and the metrics TRL logs. Then bad input refused.

Tokenization: CPOTrainer tokenizes with its own ``tokenize_row`` (prompt and prompt + completion without
special tokens, the tokenizer's bos prepended to the prompt, eos appended to each completion); the data
builtin as DPOTrainer does. On a tokenizer without a bos token and text rows both give the same ids (checked
below; where they differ: plugins/orpo/tests, whose ORPOTrainer tokenizes as CPOTrainer does), so
the parity runs use that tokenizer.

Both sides read the rows in order (``train_sampling_strategy = "sequential"``), float32 on CPU. Tolerance: the
engine logs values rounded to 6 decimals, and sums log-probabilities in another order than TRL's
selective_log_softmax; the largest measured difference is 3.8e-6 (alphapo's grad_norm).
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
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 2e-5
SCHEDULE = PARITY_SCHEDULE
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss")


def pair_rows(count: int = 16) -> list[dict]:
    return preference_rows(count)


@pytest.fixture(scope="module")
def tokenizer():
    """The dpo tests' tokenizer without its bos token (it is eos as well, and never added on encode; TRL's
    CPO would prepend it to every prompt, the data builtin not)."""
    tokenizer = preference_tokenizer()
    tokenizer.bos_token = None
    return tokenizer


def trl_trainer(tmp_path, tokenizer, train, model, **cpo):
    args = CPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      gradient_checkpointing=False, max_length=128, **{**SCHEDULE, **cpo})
    return CPOTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)


def engine_run(tmp_path, tokenizer, train, model, **cpo):
    mapping = {"plugins": ["cpo"], "data": {"packing": False, "max_length": 128}, "cpo": cpo,
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "engine"), "save_final_model": False}}
    run = engine.Run(mapping, model=model, tokenizer=tokenizer, train_dataset=train)
    run.train()
    return run


def test_tokenization_matches_cpo_trainer(tmp_path, tokenizer):
    """Each row's prompt + completion ids and where the completion starts (TRL's labels: -100 over the prompt)."""
    train = Dataset.from_list(pair_rows())
    theirs = trl_trainer(tmp_path, tokenizer, train, llama_for(tokenizer)).train_dataset
    mapping = {"plugins": ["cpo"], "data": {"packing": False, "max_length": 128},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "engine")}}
    run = engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer, train_dataset=train)
    run.setup()  # the data builtin's examples, no training
    ours = run.train_dataset
    assert len(ours) == len(theirs) == 16
    for mine, other in zip(ours, theirs):
        assert mine["prompt_ids"] == other["prompt_input_ids"]
        for side in ("chosen", "rejected"):
            assert mine["prompt_ids"] + mine[f"{side}_ids"] == other[f"{side}_input_ids"]
            assert [-100] * len(mine["prompt_ids"]) + mine[f"{side}_ids"] == other[f"{side}_labels"]


CASES = {
    "sigmoid": {"loss_type": "sigmoid"},
    "hinge": {"loss_type": "hinge", "cpo_alpha": 0.5},
    "ipo": {"loss_type": "ipo"},
    "simpo": {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0},
    "simpo_smoothed_with_nll": {"loss_type": "simpo", "label_smoothing": 0.1, "simpo_gamma": 1.0},
    "alphapo": {"loss_type": "alphapo", "alpha": 0.25, "beta": 2.0},
}


@pytest.mark.parametrize("cpo", list(CASES.values()), ids=list(CASES))
def test_losses_and_metrics_match_cpo_trainer(tmp_path, tokenizer, cpo):
    train = Dataset.from_list(pair_rows())
    model = llama_for(tokenizer)
    trainer = trl_trainer(tmp_path, tokenizer, train, copy.deepcopy(model), **cpo)
    trainer.train()
    theirs = logged_rows(trainer.state.log_history, COMPARED)
    ours = logged_rows(engine_run(tmp_path, tokenizer, train, model, **cpo).state.log_history, COMPARED)
    assert len(ours) == len(theirs) == SCHEDULE["max_steps"]
    assert ours[0]["loss"] != ours[-1]["loss"]
    for mine, other in zip(ours, theirs):
        assert set(mine) == set(other) == set(COMPARED), sorted(set(COMPARED) ^ set(mine))
        np.testing.assert_allclose([mine[k] for k in COMPARED], [other[k] for k in COMPARED], rtol=0,
                                   atol=TOLERANCE, err_msg=str([(k, mine[k], other[k]) for k in COMPARED]))


def test_evaluation_logs_the_metrics(tmp_path, tokenizer):
    mapping = {"plugins": ["cpo"], "cpo": {"loss_type": "simpo", "cpo_alpha": 0.0},
               "data": {"packing": False, "max_length": 128},
               "train": {**SCHEDULE, "output_dir": str(tmp_path), "eval_strategy": "steps", "eval_steps": 2}}
    run = engine.Run(mapping, model=llama_for(tokenizer), tokenizer=tokenizer,
                     train_dataset=Dataset.from_list(pair_rows()),
                     eval_dataset=Dataset.from_list(pair_rows(8)))
    run.train()
    evaluated = next(entry for entry in run.state.log_history if "eval_loss" in entry)
    assert {"eval_nll_loss", "eval_rewards/margins", "eval_logps/chosen"} <= set(evaluated)
    assert evaluated["eval_nll_loss"] == 0.0


def refused(tmp_path, tokenizer, rows, cpo=None, data=None):
    mapping = {"plugins": ["cpo"], "cpo": cpo or {}, "data": {"packing": False, "max_length": 128, **(data or {})},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "out")}}
    return refusal(mapping, model=llama_for(tokenizer), tokenizer=tokenizer, train_dataset=Dataset.from_list(rows))


def test_bad_input_is_refused_in_one_line(tmp_path, tokenizer):
    pairs = pair_rows(4)
    no_rejected = [{"prompt": p["prompt"], "chosen": p["chosen"]} for p in pairs]
    assert "no 'rejected'" in refused(tmp_path, tokenizer, no_rejected)
    long_prompt = [{**pairs[0], "prompt": "word " * 200}] + pairs[1:]
    assert "leaves no completion token" in refused(tmp_path, tokenizer, long_prompt)
    assert "set data.packing = false" in refused(tmp_path, tokenizer, pairs, data={"packing": True})
    message = refused(tmp_path, tokenizer, pairs, cpo={"loss_type": "kto_pair"})
    assert "cpo.loss_type" in message and "is no CPO loss" in message and "simpo" in message
    assert "cpo.label_smoothing" in refused(tmp_path, tokenizer, pairs, cpo={"loss_type": "hinge", "label_smoothing": 0.1})
    assert "cpo.beta" in refused(tmp_path, tokenizer, pairs, cpo={"loss_type": "simpo", "beta": 0.0})
    assert "cpo.cpo_alpha" in refused(tmp_path, tokenizer, pairs, cpo={"cpo_alpha": -1.0})
