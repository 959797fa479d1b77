"""``neftune``: NEFTune, noisy embeddings for instruction fine-tuning (TrainingArguments'
``neftune_noise_alpha``).

While the model trains, uniform noise in ``[-1, 1] * noise_alpha / sqrt(L * d)`` (L: the
sequence length, d: the embedding width) is added to the input embeddings' output, as
transformers' NEFTune hook does; in eval mode (evaluation, prediction) nothing is added. The
forward hook is put on the model's ``get_input_embeddings()`` through ``patch_model`` (before a
strategy wraps the model, so under DDP/FSDP it sits on the real embedding module; a PEFT model
hands out its base model's embeddings) and removed when training ends, also by an error.

    plugins = ["neftune"]

    [neftune]
    noise_alpha = 5.0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import ConfigError, hookimpl, option


@dataclass
class NEFTuneOptions:
    """``[neftune]``"""

    noise_alpha: float = option(5.0, min=0, help=(
        "noise scale alpha: noise is uniform in [-1, 1] * alpha / sqrt(sequence length * embedding dim) "
        "(TrainingArguments.neftune_noise_alpha; the paper uses 5-15)"))


def add_noise(noise_alpha: float, module: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    """The embeddings' forward hook: noised output in training mode, the output as is otherwise."""
    if not module.training:
        return output
    # computed as transformers does (a float32 sqrt), so the bound is the same to the last bit
    bound = noise_alpha / torch.tensor(output.size(1) * output.size(2)).sqrt()
    return output + torch.zeros_like(output).uniform_(-bound, bound)


def input_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output is the input embeddings; a model without one is refused by class."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = None
    if get is not None:
        try:
            embeddings = get()
        except NotImplementedError:
            embeddings = None
    if not isinstance(embeddings, torch.nn.Module):
        raise ConfigError(f"plugin neftune: {type(model).__name__} has no input embeddings "
                          "(get_input_embeddings() returns none); NEFTune noises the token embeddings")
    return embeddings


@hookimpl
def plugin_options():
    return NEFTuneOptions


@hookimpl
def patch_model(run, model):
    alpha = run.config.section("neftune").noise_alpha
    handle = input_embeddings(model).register_forward_hook(
        lambda module, inputs, output: add_noise(alpha, module, inputs, output))
    return handle.remove


@hookimpl
def trainer_argument_mappings():
    from .mappings import TRAINER_ARGUMENTS  # for engine migrate only: runs do not load it

    return TRAINER_ARGUMENTS
