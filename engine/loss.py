"""Label conventions shared by the loop and loss plugins."""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100


def shifts_labels(model: torch.nn.Module) -> bool:
    """True when the model predicts token i+1 at position i from unshifted labels.

    Hugging Face causal LMs (``loss_type == "ForCausalLM"``, not encoder-decoder) shift inside
    their loss; their batches carry ``labels == input_ids``. Other models' labels are aligned
    with their outputs.
    """
    config = getattr(model, "config", None)
    return getattr(model, "loss_type", None) == "ForCausalLM" and not getattr(config, "is_encoder_decoder", False)


def count_items(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """Number of labels that contribute to the loss (a 0-d tensor, no host sync)."""
    if shift:
        labels = labels[..., 1:]
    return labels.ne(IGNORE_INDEX).sum()


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, an object or dict with ``logits``, or a tuple."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, (tuple, list)):
        logits = outputs[0]
    if logits is None:
        raise TypeError(f"cannot find logits in a model output of type {type(outputs).__name__}")
    return logits
