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
from engine.optim import OptimArg, check_optim_args, param_groups

_FLOAT = OptimArg(float)
_BOOL = OptimArg(bool)
# optim name -> keys train.optim_args may set (as in Trainer's handlers)
_OPTIM_ARGS: dict[str, dict[str, OptimArg]] = {
    "adamw_torch": {},
    "adamw_torch_fused": {},
    "adafactor": {},
    "sgd": {"momentum": _FLOAT, "dampening": _FLOAT, "weight_decay": _FLOAT, "nesterov": _BOOL},
    "adagrad": {"lr_decay": _FLOAT, "weight_decay": _FLOAT, "eps": _FLOAT},
    "rmsprop": {"momentum": _FLOAT, "alpha": _FLOAT, "eps": _FLOAT, "weight_decay": _FLOAT, "centered": _BOOL},
}


def _optim_args(run: Any) -> dict[str, Any]:
    return check_optim_args(run, _OPTIM_ARGS[run.config.train.optim])


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
    train = run.config.train
    entry = run.registries["optimizer"].get(train.optim)
    if entry.plugin == "builtin.optimizers":
        _optim_args(run)  # refuse bad optim_args now, not after the model loaded
    if train.optim_target_modules is not None and not entry.takes_target_modules:  # Trainer ignores it
        raise ConfigError(f"train.optim_target_modules: {train.optim} optimizes every parameter and takes no "
                          "target modules (GaLore and APOLLO names do); remove optim_target_modules")


@hookimpl(trylast=True)
def create_optimizer(run):
    entry = run.registries["optimizer"].get(run.config.train.optim)
    return entry.factory(run, _groups(run))
