"""Builtin model patches: activation checkpointing (HF models and any module with a block stack)
and torch.compile are applied while training, leave the loss as it was, and are undone after."""

import pytest
import torch

from engine import ConfigError, Run, hookimpl
from engine.testing import run_steps, tiny_dataset, tiny_model


class ForwardCounter:
    """Counts forward calls of a part of each block during training (a recomputed block shows twice:
    the checkpoint wraps the block's forward, so the block's own hooks run once, its parts' twice)."""

    name = "forward_counter"

    def __init__(self, blocks_of):
        self.blocks_of = blocks_of
        self.calls: dict[int, int] = {}
        self.active_during_training = None

    @hookimpl
    def on_train_start(self, run):
        for index, block in enumerate(self.blocks_of(run.model)):
            block.register_forward_pre_hook(lambda module, args, index=index: self._count(index))

    def _count(self, index):
        self.calls[index] = self.calls.get(index, 0) + 1


def _losses(run):
    return [r["loss"] for r in run.state.log_history if "loss" in r]


def test_activation_checkpointing_recomputes_each_layer_and_keeps_the_loss(tmp_path):
    layers = lambda model: [layer.mlp for layer in model.model.layers]
    plain_counter, counter = ForwardCounter(layers), ForwardCounter(layers)
    plain = run_steps(3, objects=[plain_counter], output_dir=tmp_path / "plain", model=tiny_model(seed=0))
    model = tiny_model(seed=0)
    patched = run_steps(3, objects=[counter], output_dir=tmp_path / "patched", model=model,
                        train={"gradient_checkpointing": True})
    assert plain_counter.calls == {0: 3, 1: 3}
    assert counter.calls == {0: 6, 1: 6}  # forward, and again in backward
    assert max(abs(a - b) for a, b in zip(_losses(plain), _losses(patched))) < 1e-6
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in model.model.layers)  # undone


def test_every_n_layers(tmp_path):
    counter = ForwardCounter(lambda model: [layer.mlp for layer in model.model.layers])
    run_steps(2, objects=[counter], output_dir=tmp_path, model=tiny_model(seed=0, num_hidden_layers=4),
              train={"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 2}})
    assert counter.calls == {0: 4, 1: 2, 2: 4, 3: 2}


class Blocks(torch.nn.Module):
    """Not a transformers model: embeddings, a stack of MLP blocks, a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(128, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                                              torch.nn.Linear(64, 32)) for _ in range(3))
        self.head = torch.nn.Linear(32, 128)

    def forward(self, input_ids, labels=None, attention_mask=None):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        logits = self.head(hidden)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 ignore_index=-100)
        return {"loss": loss, "logits": logits}


def test_any_module_gets_its_block_stack_checkpointed(tmp_path):
    first_layers = lambda model: [block[0] for block in model.blocks]
    counter, plain_counter = ForwardCounter(first_layers), ForwardCounter(first_layers)
    plain = run_steps(2, objects=[plain_counter], output_dir=tmp_path / "plain", model=Blocks())
    model = Blocks()
    patched = run_steps(2, objects=[counter], output_dir=tmp_path / "patched", model=model,
                        train={"activation_checkpointing": True})
    assert plain_counter.calls == {0: 2, 1: 2, 2: 2} and counter.calls == {0: 4, 1: 4, 2: 4}
    assert max(abs(a - b) for a, b in zip(_losses(plain), _losses(patched))) < 1e-6
    assert not any("forward" in vars(block) for block in model.blocks)  # undone


def test_torch_compile_is_applied_and_undone(tmp_path):
    import torch._dynamo

    seen = []

    class Probe:
        name = "probe"

        @hookimpl
        def on_step_end(self, run):
            seen.append(run.model._compiled_call_impl is not None)

    torch._dynamo.reset()
    plain = run_steps(3, output_dir=tmp_path / "plain", model=tiny_model(seed=0))
    model = tiny_model(seed=0)
    compiled = run_steps(3, objects=[Probe()], output_dir=tmp_path / "compiled", model=model,
                         train={"torch_compile_backend": "aot_eager"})
    assert seen == [True, True, True] and model._compiled_call_impl is None
    assert compiled.config.train.torch_compile is True  # the backend turned it on, as in TrainingArguments
    assert max(abs(a - b) for a, b in zip(_losses(plain), _losses(compiled))) < 1e-5


@pytest.mark.parametrize("train, message", [
    ({"torch_compile_backend": "fastest"}, "train.torch_compile_backend: unknown backend 'fastest'; torch has"),
    ({"torch_compile_mode": "fastest"}, "train.torch_compile_mode: unknown mode 'fastest'; inductor has default, "),
    ({"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 0}},
     r"activation_checkpointing_kwargs.every_n_layers: expected int >= 1, got 0"),
    ({"gradient_checkpointing": True, "activation_checkpointing": True, "gradient_checkpointing_kwargs": {"a": 1},
      "activation_checkpointing_kwargs": {"b": 2}}, "gradient_checkpointing_kwargs = .* disagree"),
])
def test_bad_values_are_refused(tmp_path, train, message):
    with pytest.raises(ConfigError, match=message):
        run = Run({"train": {"output_dir": str(tmp_path), "max_steps": 1, **train}}, model=tiny_model(),
                  train_dataset=tiny_dataset())
        run.setup()


def test_a_module_without_blocks_is_refused(tmp_path):
    class Flat(Blocks):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList()

    with pytest.raises(ConfigError, match="train.activation_checkpointing: Flat has no stack of blocks"):
        run_steps(1, output_dir=tmp_path, model=Flat(), train={"activation_checkpointing": True})
