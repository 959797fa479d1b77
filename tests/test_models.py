"""train.model forms, builtin optimizers against Trainer's, precision settings."""

import json

import pytest
import torch

from engine import ConfigError, Run
from engine.config import TrainConfig
from engine.builtin.models import build_model
from engine.testing import run_steps, tiny_dataset, tiny_model


def test_builtin_name_uses_tokenizer_vocab_and_overrides():
    class Tok:
        pad_token_id, bos_token_id, eos_token_id = 1, 0, 0

        def __len__(self):
            return 300

    model = build_model(TrainConfig(model="tiny-llama", model_config={"num_hidden_layers": 1}), Tok())
    assert model.config.vocab_size == 300 and model.config.num_hidden_layers == 1
    assert model.config.pad_token_id == 1


def test_local_folder_loads_pretrained_weights(tmp_path):
    original = tiny_model()
    original.save_pretrained(tmp_path)
    loaded = build_model(TrainConfig(model=str(tmp_path)))
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_config_json_builds_random_weights(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
                                  "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64}))
    model = build_model(TrainConfig(model=str(config)))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 16


def test_callable_returns_the_model(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def build(tokenizer):\n"
        "    return torch.nn.Linear(2, 2)\n"
        "def not_a_model(tokenizer):\n"
        "    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(build_model(TrainConfig(model="my_models:build")), torch.nn.Linear)
    with pytest.raises(ConfigError, match="train.model: my_models:not_a_model returned int, expected a torch.nn.Module"):
        build_model(TrainConfig(model="my_models:not_a_model"))
    with pytest.raises(ConfigError, match="train.model: module 'my_models' has no attribute 'absent'"):
        build_model(TrainConfig(model="my_models:absent"))


@pytest.mark.parametrize("spec, message", [
    ("gpt-17", "train.model: 'gpt-17' is not a folder, a .json config"),
    ("missing.json", "train.model: config file not found: missing.json"),
])
def test_bad_model_specs(spec, message):
    with pytest.raises(ConfigError, match=message):
        build_model(TrainConfig(model=spec))


def test_unknown_model_config_key():
    with pytest.raises(ConfigError, match="train.model_config: llama config has no key 'hiden_size'"):
        build_model(TrainConfig(model="tiny-llama", model_config={"hiden_size": 8}))


@pytest.mark.parametrize("optim, optim_args", [
    ("adamw_torch", None), ("adamw_torch_fused", None), ("adafactor", None),
    ("sgd", "momentum=0.9,nesterov=True"), ("adagrad", "lr_decay=0.01"), ("rmsprop", "alpha=0.95,centered=True"),
])
def test_builtin_optimizers_match_trainer_and_train(tmp_path, optim, optim_args):
    from transformers import Trainer, TrainingArguments

    train = {"optim": optim, "optim_args": optim_args, "learning_rate": 3e-3, "weight_decay": 0.01,
             "adam_beta1": 0.8, "adam_epsilon": 1e-6}
    run = run_steps(25, output_dir=tmp_path, train=train)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True,
                             **{k: v for k, v in train.items() if v is not None})
    reference_cls, reference_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, run.model)
    assert type(run.optimizer) is reference_cls
    reference = reference_cls(
        [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in run.optimizer.param_groups],
        **reference_kwargs)
    for ours, theirs in zip(run.optimizer.param_groups, reference.param_groups):
        assert {k: v for k, v in ours.items() if k not in ("params", "initial_lr")} == \
               {k: v for k, v in theirs.items() if k != "params"} | {"lr": ours["lr"]}
    decay, no_decay = run.optimizer.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all("norm" in n for n, p in run.model.named_parameters()
               if any(p is q for q in no_decay["params"]))
    losses = [e["loss"] for e in run.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]


def test_bf16_autocast_trains_on_cpu(tmp_path):
    run = run_steps(10, output_dir=tmp_path, train={"bf16": True})
    losses = [e["loss"] for e in run.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    assert next(run.model.parameters()).dtype == torch.float32  # autocast: weights stay fp32


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_fp16_needs_a_gpu():
    run = Run({"train": {"fp16": True}}, model=tiny_model(), train_dataset=tiny_dataset())
    with pytest.raises(ConfigError, match="train.fp16 needs a CUDA device; on CPU use train.bf16 = true"):
        run.setup()
    with pytest.raises(ConfigError, match="train.bf16 and train.fp16 are both true"):
        Run({"train": {"fp16": True, "bf16": True}})
