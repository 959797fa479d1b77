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
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import engine
from engine import ConfigError
from engine.testing import chatml_tokenizer

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 2e-5
SCHEDULE = {"max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-3, "logging_steps": 1,
            "optim": "adamw_torch", "save_strategy": "no", "train_sampling_strategy": "sequential", "seed": 0,
            "disable_tqdm": True, "lr_scheduler_type": "linear", "warmup_steps": 0}
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss")


def reversals(count: int = 16) -> list[dict[str, str]]:
    lines = (ROOT / "examples" / "data" / "reversals.jsonl").read_text().splitlines()[:count]
    return [json.loads(line) for line in lines]


def pair_rows(count: int = 16) -> list[dict]:
    """Word reversals as preference pairs: the reversal chosen, the word itself rejected."""
    return [{"prompt": f"{p['source']} reversed ", "chosen": f"is {p['target']}", "rejected": f"is {p['source']}"}
            for p in reversals(count)]


def dataset(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


@pytest.fixture(scope="module")
def tokenizer():
    """The dpo tests' tokenizer without its bos token (it is eos as well, and never added on encode; TRL's
    CPO would prepend it to every prompt, the data builtin not)."""
    pairs = reversals()
    tokenizer = chatml_tokenizer([f"{p['source']} reversed is {p['target']}" for p in pairs] + ["user assistant reverse"])
    tokenizer.bos_token = None
    return tokenizer


def llama(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id)
    return transformers.LlamaForCausalLM(config)


def logged(log_history):
    return [{k: v for k, v in entry.items() if k in COMPARED} for entry in log_history
            if "loss" in entry and "train_loss" not in entry]


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
    train = dataset(pair_rows())
    theirs = trl_trainer(tmp_path, tokenizer, train, llama(tokenizer)).train_dataset
    mapping = {"plugins": ["cpo"], "data": {"packing": False, "max_length": 128},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "engine")}}
    run = engine.Run(mapping, model=llama(tokenizer), tokenizer=tokenizer, train_dataset=train)
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
    train = dataset(pair_rows())
    model = llama(tokenizer)
    trainer = trl_trainer(tmp_path, tokenizer, train, copy.deepcopy(model), **cpo)
    trainer.train()
    theirs = logged(trainer.state.log_history)
    ours = logged(engine_run(tmp_path, tokenizer, train, model, **cpo).state.log_history)
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
    run = engine.Run(mapping, model=llama(tokenizer), tokenizer=tokenizer, train_dataset=dataset(pair_rows()),
                     eval_dataset=dataset(pair_rows(8)))
    run.train()
    evaluated = next(entry for entry in run.state.log_history if "eval_loss" in entry)
    assert {"eval_nll_loss", "eval_rewards/margins", "eval_logps/chosen"} <= set(evaluated)
    assert evaluated["eval_nll_loss"] == 0.0


def refused(tmp_path, tokenizer, rows, cpo=None, data=None):
    mapping = {"plugins": ["cpo"], "cpo": cpo or {}, "data": {"packing": False, "max_length": 128, **(data or {})},
               "train": {**SCHEDULE, "output_dir": str(tmp_path / "out")}}
    with pytest.raises(ConfigError) as error:
        engine.Run(mapping, model=llama(tokenizer), tokenizer=tokenizer, train_dataset=dataset(rows)).train()
    assert not (tmp_path / "out" / "checkpoint-1").exists()
    message = str(error.value)
    assert "\n" not in message
    return message


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
