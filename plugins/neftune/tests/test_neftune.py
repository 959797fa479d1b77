"""NEFTune: the noise of transformers' NEFTune hook, bit for bit; only while training; no hook
left behind; on the real embeddings under DDP and FSDP."""

import sys
from pathlib import Path

import pytest
import torch
from transformers.integrations.neftune import neftune_post_forward_hook

import engine
from engine import ConfigError, hookimpl
from engine.testing import launch_cases, run_steps, tiny_dataset, tiny_model

HERE = Path(__file__).parent


class Recorder:
    """Records the embeddings' output before NEFTune (with the RNG state) and after it."""

    name = "recorder"

    def __init__(self):
        self.clean, self.noised = [], []

    @hookimpl
    def on_train_start(self, run):
        embeddings = run.model.get_input_embeddings()

        def before(module, inputs, output):
            self.clean.append((output.detach().clone(), torch.get_rng_state()))

        embeddings.register_forward_hook(before, prepend=True)
        embeddings.register_forward_hook(lambda module, inputs, output: self.noised.append(output.detach().clone()))


def test_the_noise_equals_transformers_neftune_bit_for_bit(tmp_path):
    recorder = Recorder()
    run_steps(3, plugins=["neftune"], objects=[recorder], sections={"neftune": {"noise_alpha": 7.0}},
              output_dir=tmp_path, model=tiny_model(seed=0))
    assert len(recorder.clean) == len(recorder.noised) == 3
    embeddings = torch.nn.Embedding(1, 1)
    embeddings.neftune_noise_alpha = 7.0
    for (clean, rng_state), noised in zip(recorder.clean, recorder.noised):
        torch.set_rng_state(rng_state)
        expected = neftune_post_forward_hook(embeddings, None, clean)
        assert torch.equal(noised, expected)
        assert not torch.equal(noised, clean)


def test_noise_only_while_training_and_no_hook_left(tmp_path):
    model = tiny_model(seed=0)
    run = run_steps(4, plugins=["neftune"], output_dir=tmp_path / "a", model=model)
    plain = run_steps(4, output_dir=tmp_path / "b", model=tiny_model(seed=0))
    noised_losses = [r["loss"] for r in run.state.log_history if "loss" in r]
    plain_losses = [r["loss"] for r in plain.state.log_history if "loss" in r]
    assert noised_losses[0] != plain_losses[0]  # the noise acts from the first step
    assert not model.get_input_embeddings()._forward_hooks  # removed when train() returned
    # evaluation is untouched: the same weights evaluate the same with and without the plugin
    with_plugin = run_steps(2, plugins=["neftune"], output_dir=tmp_path / "c", model=tiny_model(seed=0),
                            eval_dataset=tiny_dataset(size=8, seed=1), train={"learning_rate": 0.0,
                                                                            "eval_strategy": "steps"})
    without = run_steps(2, output_dir=tmp_path / "d", model=tiny_model(seed=0),
                        eval_dataset=tiny_dataset(size=8, seed=1), train={"learning_rate": 0.0, "eval_strategy": "steps"})
    evals = [[r["eval_loss"] for r in run.state.log_history if "eval_loss" in r] for run in (with_plugin, without)]
    assert evals[0] == evals[1] and len(evals[0]) == 2


def test_the_hook_is_removed_when_training_raises(tmp_path):
    class Failing:
        name = "failing"

        @hookimpl
        def on_step_end(self, run):
            if run.state.global_step == 2:
                raise RuntimeError("boom")

    model = tiny_model(seed=0)
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(5, plugins=["neftune"], objects=[Failing()], output_dir=tmp_path, model=model)
    assert not model.get_input_embeddings()._forward_hooks


CHATS = [[{"role": "user", "content": f"what follows {word}?"},
          {"role": "assistant", "content": f"{word} is followed by {following}"}]
         for word, following in zip("red green blue cyan pink gold grey teal".split(),
                                    "green blue cyan pink gold grey teal red".split())]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_instruction_tuning_on_chat_data_learns_the_answers(tmp_path):
    """The NEFTune use case: chat rows, loss on the assistant turns only, noise on the embeddings."""
    import json

    from engine.builtin.data.tokenizer import train_tokenizer

    texts = [turn["content"] for chat in CHATS for turn in chat] * 20
    tokenizer = train_tokenizer(texts, 300)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = TEMPLATE
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS * 8))
    run = engine.Run({"plugins": ["neftune"], "train": {
        "output_dir": str(tmp_path / "out"), "max_steps": 40, "learning_rate": 1e-2, "logging_steps": 10,
        "per_device_train_batch_size": 8, "save_strategy": "no", "disable_tqdm": True},
        "data": {"train": str(tmp_path / "chat.jsonl"), "max_length": 64, "packing": False,
                 "cache_dir": str(tmp_path / "cache")}},
        model=tiny_model(seed=0, vocab_size=len(tokenizer)), tokenizer=tokenizer)
    run.train()
    labels = torch.tensor(run.train_dataset[0]["labels"])
    assert (labels == -100).any() and (labels != -100).any()  # the prompt is masked, the answer learnt
    losses = [r["loss"] for r in run.state.log_history if "loss" in r]
    assert losses[-1] < losses[0] / 2, losses


def test_a_model_without_input_embeddings_is_refused_by_class(tmp_path):
    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(128, 8))
            self.head = torch.nn.Linear(8, 128)

        def forward(self, input_ids, labels=None, **kwargs):
            logits = self.head(self.weight[input_ids])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            return {"loss": loss, "logits": logits}

    with pytest.raises(ConfigError, match="plugin neftune: Bag has no input embeddings"):
        run_steps(1, plugins=["neftune"], output_dir=tmp_path, model=Bag())


def test_under_each_strategy_the_hook_sits_on_the_real_embeddings(tmp_path):
    strategies = ("ddp", "fsdp", "deepspeed")
    cases = [{"name": strategy, "steps": 2, "plugins": [strategy, "neftune"], "objects": ["hook_check:plugin"],
              "train": {"per_device_train_batch_size": 4}} for strategy in strategies]
    # DeepSpeed's CPU op is compiled once into the venv by ./dev.sh setup
    env = {"PYTHONPATH": str(HERE), "TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions")}
    trained = launch_cases(cases, tmp_path, env=env)
    assert set(trained) == set(strategies)
