"""Torch optimizers under their ``TrainingArguments.optim`` names.

Hyper-parameters come from ``[train]`` (learning_rate, weight_decay, adam_*) and
``train.optim_args`` as transformers' Trainer builds them: the weight decay is applied per
parameter group (see :func:`engine.optim.param_groups`), Adam names take no optim_args, SGD,
Adagrad and RMSprop take the keys listed below.
"""

from __future__ import annotations

from typing import Any

import torch

from engine import hookimpl
from engine.errors import ConfigError
from engine.optim import param_groups, parse_optim_args

# optim name -> keys train.optim_args may set (as in Trainer's handlers)
_OPTIM_ARGS = {
    "adamw_torch": (),
    "adamw_torch_fused": (),
    "adafactor": (),
    "sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr_decay", "weight_decay", "eps"),
    "rmsprop": ("momentum", "alpha", "eps", "weight_decay", "centered"),
}
_BOOL_ARGS = ("nesterov", "centered")


def _optim_args(run: Any) -> dict[str, Any]:
    name = run.config.train.optim
    args = parse_optim_args(run.config.train.optim_args)
    allowed = _OPTIM_ARGS[name]
    for key, value in args.items():
        if key not in allowed:
            takes = ", ".join(allowed) if allowed else "no optim_args"
            raise ConfigError(f"train.optim_args: {name} takes {takes}; got {key!r}")
        expected = bool if key in _BOOL_ARGS else float
        if expected is bool and isinstance(value, str) and value.lower() in ("true", "false"):
            args[key] = value.lower() == "true"
        elif expected is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            args[key] = float(value)
        elif not isinstance(value, expected):
            raise ConfigError(f"train.optim_args: {key} expects {expected.__name__}, got {value!r}")
    return args


def _groups(run: Any) -> list[dict[str, Any]]:
    return param_groups(run.model, run.config.train.weight_decay)


def adamw(run: Any, params: list[dict[str, Any]], fused: bool = False) -> torch.optim.Optimizer:
    t = run.config.train
    kwargs = {"fused": True} if fused else {}
    return torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                             eps=t.adam_epsilon, **kwargs)


def adafactor(run: Any, params: list[dict[str, Any]]) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=run.config.train.learning_rate, scale_parameter=False, relative_step=False)


def _plain(cls: type) -> Any:
    def factory(run: Any, params: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return cls(params, lr=run.config.train.learning_rate, **_optim_args(run))

    return factory


@hookimpl
def register_optimizers(register):
    register("adamw_torch", adamw)
    register("adamw_torch_fused", lambda run, params: adamw(run, params, fused=True))
    register("adafactor", adafactor)
    register("sgd", _plain(torch.optim.SGD))
    register("adagrad", _plain(torch.optim.Adagrad))
    register("rmsprop", _plain(torch.optim.RMSprop))


@hookimpl
def configure(run):
    entry = run.registries["optimizer"].get(run.config.train.optim)
    if entry.plugin == "builtin.optimizers":
        _optim_args(run)  # refuse bad optim_args now, not after the model loaded


@hookimpl(trylast=True)
def create_optimizer(run):
    entry = run.registries["optimizer"].get(run.config.train.optim)
    return entry.factory(run, _groups(run))
