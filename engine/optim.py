"""Helpers optimizer plugins share: parameter groups and ``optim_args`` parsing."""

from __future__ import annotations

import re
from typing import Any

import torch

from .config import parse_value
from .errors import ConfigError

# Parameter names (lower-cased, full path) that get no weight decay, as in transformers' Trainer.
_NO_DECAY_PATTERNS = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that take weight decay: Trainer.get_decay_parameter_names' rule.

    Excluded: parameters of ``nn.LayerNorm`` modules and names matching bias / layernorm /
    rmsnorm / norm patterns (so RMSNorm weights are excluded by name).
    """
    layer_norm_params = {
        f"{module_name}.{param_name}" if module_name else param_name
        for module_name, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)
        for param_name, _ in module.named_parameters(recurse=False)
    }
    return {name for name, _ in model.named_parameters()
            if name not in layer_norm_params and not any(p.search(name.lower()) for p in _NO_DECAY_PATTERNS)}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters split into a decay group and a no-decay group, as Trainer does."""
    decay = decay_parameter_names(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """Parse ``train.optim_args`` ("key=value,key=value") into typed values."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"train.optim_args: expected 'key=value,key=value', got {text!r} "
                              f"(bad item {item!r})")
        out[key] = parse_value(value)
    return out
