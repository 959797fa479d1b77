"""The same objective as TRL's ``SFTTrainer``: on the same tiny Llama (same initial weights), the same
rows and the same schedule, the run ``engine.migrate`` converts from the same ``SFTConfig`` gives
the same per-step training losses as ``trl.SFTTrainer`` (docs/getting-started.md, "The same objective as
TRL's SFTTrainer", lists which keys reproduce which SFTConfig setting). Text, prompt/completion and
conversational rows; packing off, TRL's ``bfd``, ``bfd_split`` and ``wrapped`` packing, ``padding_free``,
``assistant_only_loss`` and ``completion_only_loss``; the tokenizer's bos.

Both sides read the examples in order (``train_sampling_strategy = "sequential"``), in float32 on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import engine
from engine.builtin.data.tokenizer import train_tokenizer

trl = pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6  # one epoch of 48 rows in batches of 8
# Per-step training losses, engine vs SFTTrainer: the engine logs them rounded to 6 decimals (5e-7), and TRL's
# fused LM head sums the log-probabilities in another order than the model's own loss; measured differences
# are at most 9.6e-7 (float32, CPU).
LOSS_TOLERANCE = 2e-6
SCHEDULE = {"max_steps": STEPS, "per_device_train_batch_size": 8, "learning_rate": 3e-3, "logging_steps": 1,
            "optim": "adamw_torch", "save_strategy": "no", "train_sampling_strategy": "sequential", "seed": 0,
            "disable_tqdm": True, "lr_scheduler_type": "linear", "warmup_steps": 0}
# Assistant turns inside {% generation %}, as TRL's assistant_only_loss needs; the engine finds the same spans.
CHATML = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
          "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n"
          "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# As TRL's Qwen2.5 training template marks them: the block starts before the newline that ends the generation
# prompt, so the newline is learnt, which the turn's span after the generation prompt would leave out.
MARKED_FROM_HEADER = CHATML.replace("assistant\n{% generation %}{{ m['content'] }}",
                                    "assistant{% generation %}{{ '\\n' + m['content'] }}")


def reversals(count: int = 48) -> list[dict[str, str]]:
    lines = (ROOT / "examples" / "data" / "reversals.jsonl").read_text().splitlines()[:count]
    return [json.loads(line) for line in lines]


def rows(kind: str):
    """48 rows of ``kind``: 'text', 'prompt_completion' or 'chat', from the same word reversals."""
    import datasets

    pairs = reversals()
    if kind == "text":
        return datasets.Dataset.from_list([{"text": f"{p['source']} reversed is {p['target']}"} for p in pairs])
    if kind == "prompt_completion":
        # the prompt's last space and the completion's first word make one token, which TRL learns
        return datasets.Dataset.from_list([{"prompt": f"{p['source']} reversed ", "completion": f"is {p['target']}"}
                                           for p in pairs])
    return datasets.Dataset.from_list([{"messages": [
        {"role": "system", "content": "You reverse words."}, {"role": "user", "content": p["source"]},
        {"role": "assistant", "content": p["target"]}]} for p in pairs])


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def chat_tokenizer():
    """A byte-level BPE tokenizer trained on the rows, with ChatML's special tokens and template."""
    pairs = reversals()
    tokenizer = train_tokenizer([f"{p['source']} reversed is {p['target']}" for p in pairs] +
                                ["system user assistant You reverse words."], 300)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def bos_tokenizer():
    """The same, adding its bos in front of every text it encodes, as Llama's tokenizer does."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = chat_tokenizer()
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    return tokenizer


def llama(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def losses(log_history):
    return [entry["loss"] for entry in log_history if "loss" in entry and "train_loss" not in entry]


def sft_config(tmp_path, **sft):
    return trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, **{**SCHEDULE, **sft})


def sft_trainer(tmp_path, tokenizer, train, **sft):
    trainer = trl.SFTTrainer(model=llama(tokenizer), args=sft_config(tmp_path, **sft), train_dataset=train,
                             processing_class=tokenizer)
    trainer.train()
    return losses(trainer.state.log_history)


def engine_losses(tmp_path, tokenizer, train, expected, **sft):
    """The engine's per-step losses, its run converted from the same ``SFTConfig`` by ``engine.migrate``, which
    writes the ``expected`` [data] values (docs/getting-started.md lists them)."""
    mapping = engine.migrate(sft_config(tmp_path, **sft)).mapping
    assert {key: mapping["data"].get(key, False) for key in expected} == expected
    if sft.get("max_length", 1024) is None:  # TRL's "no truncation", which the engine's examples cannot have
        mapping["data"]["max_length"] = 1024  # longer than every example: nothing is cut
    mapping["train"].update(output_dir=str(tmp_path / "engine"), save_final_model=False)
    run = engine.Run(mapping, model=llama(tokenizer), tokenizer=tokenizer, train_dataset=train)
    run.train()
    return losses(run.state.log_history)


def assert_same_losses(ours, theirs, steps=STEPS):
    """The same losses at every step, ``steps`` of them (None: as many on both sides, at least 3)."""
    assert len(ours) == len(theirs)
    assert len(ours) == steps if steps else len(ours) >= 3
    assert ours[0] != ours[-1]  # it trains
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=LOSS_TOLERANCE)


# ---------------------------------------------------------------------------- packing off


@pytest.mark.parametrize("kind, sft, data", [
    ("text", {}, {"packing": False, "max_length": 1024}),
    ("prompt_completion", {}, {"packing": False, "train_on_all_tokens": "chat"}),
    ("prompt_completion", {"completion_only_loss": False}, {"packing": False, "train_on_all_tokens": True}),
    ("chat", {}, {"packing": False, "train_on_all_tokens": "chat"}),
    ("chat", {"assistant_only_loss": True}, {"packing": False, "train_on_all_tokens": False}),
])
def test_unpacked_matches_sft_trainer(tmp_path, tokenizer, kind, sft, data):
    train = rows(kind)
    assert_same_losses(engine_losses(tmp_path, tokenizer, train, data, **sft),
                       sft_trainer(tmp_path, tokenizer, train, **sft))


def test_generation_blocks_match_sft_trainer(tmp_path):
    """assistant_only_loss learns what the template's {% generation %} blocks hold, and so does the engine."""
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = MARKED_FROM_HEADER
    train = rows("chat")
    assert_same_losses(engine_losses(tmp_path, tokenizer, train, {"train_on_all_tokens": False},
                                     assistant_only_loss=True),
                       sft_trainer(tmp_path, tokenizer, train, assistant_only_loss=True))


@pytest.mark.parametrize("kind", ["text", "prompt_completion"])
def test_bos_of_the_tokenizer_matches_sft_trainer(tmp_path, bos_tokenizer, kind):
    """SFTTrainer encodes text and prompt/completion rows with the tokenizer's special tokens: a bos first."""
    train = rows(kind)
    assert bos_tokenizer(train[0][next(iter(train.column_names))])["input_ids"][0] == bos_tokenizer.bos_token_id
    assert_same_losses(engine_losses(tmp_path, bos_tokenizer, train, {"add_special_tokens": True}),
                       sft_trainer(tmp_path, bos_tokenizer, train))


# ---------------------------------------------------------------------------- packing and padding-free

# One epoch of the packed rows in batches of 2: every row, the tail of 'wrapped' included, is trained on.
EPOCH = {"max_steps": -1, "num_train_epochs": 1, "per_device_train_batch_size": 2}


@pytest.mark.parametrize("kind, sft, data", [
    ("text", {"padding_free": True, "max_length": None}, {"packing": False, "padding_free": True}),
    ("chat", {"padding_free": True, "max_length": None, "assistant_only_loss": True},
     {"packing": False, "padding_free": True, "train_on_all_tokens": False}),
    ("text", {"packing": True, "max_length": 64}, {"packing": "bfd", "max_length": 64}),
    ("prompt_completion", {"packing": True, "max_length": 64}, {"packing": "bfd", "max_length": 64}),
    ("chat", {"packing": True, "max_length": 64, "assistant_only_loss": True}, {"packing": "bfd", "max_length": 64}),
    ("chat", {"packing": True, "packing_strategy": "bfd_split", "max_length": 16},
     {"packing": "bfd_split", "max_length": 16, "train_on_all_tokens": "chat"}),
    ("text", {"packing": True, "packing_strategy": "wrapped", "max_length": 32},
     {"packing": "wrapped", "max_length": 32}),
    ("prompt_completion", {"packing": True, "packing_strategy": "wrapped", "max_length": 32},
     {"packing": "wrapped", "max_length": 32}),
    ("text", {"packing": True, "packing_strategy": "wrapped", "padding_free": True, "max_length": 32},
     {"packing": "wrapped", "padding_free": True, "max_length": 32}),
])
def test_packed_matches_sft_trainer(tmp_path, tokenizer, kind, sft, data):
    train = rows(kind)
    assert_same_losses(engine_losses(tmp_path, tokenizer, train, data, **EPOCH, **sft),
                       sft_trainer(tmp_path, tokenizer, train, **EPOCH, **sft), steps=None)


def test_bfd_packs_the_rows_of_trl():
    """``packing = "bfd"`` / ``"bfd_split"``'s packer makes TRL's rows, in TRL's order, from lengths with many
    ties (and, for bfd_split, many longer than a row)."""
    import datasets

    from engine.builtin.data.packing import _pack_best_fit

    lengths = np.random.default_rng(0).integers(1, 40, size=300)
    ids = [list(range(start, start + n)) for start, n in zip(np.cumsum(lengths) - lengths, lengths)]
    for strategy, length in (("bfd", 64), ("bfd_split", 24)):
        theirs = trl.pack_dataset(datasets.Dataset.from_dict({"input_ids": ids}), length, strategy)
        ours = _pack_best_fit({"input_ids": ids}, length=length, split=strategy == "bfd_split")
        assert ours["input_ids"] == theirs["input_ids"]
        assert ours["position_ids"] == [[p for n in row for p in range(n)] for row in theirs["seq_lengths"]]
