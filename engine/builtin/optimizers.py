"""Torch optimizers under their ``TrainingArguments.optim`` names.

Hyper-parameters come from ``[train]`` (learning_rate, weight_decay, adam_*) and
``train.optim_args`` as transformers' Trainer builds them: the weight decay is applied per
parameter group (see :func:`engine.optim.param_groups`), Adam names take no optim_args, SGD,
Adagrad and RMSprop take the keys listed below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine import hookimpl
from engine.config import option
from engine.errors import ConfigError
from engine.optim import OptimArg, OptimizerFamily, param_groups

PLUGIN = "builtin.optimizers"
_FLOAT = OptimArg(float)
_BOOL = OptimArg(bool)


@dataclass
class OptimizerOptions:
    """``[train]`` keys of builtin.optimizers: the optimizers' hyper-parameters (engine.optim and the optimizer
    plugins read them too, answering create_optimizer in its place, so a block does not refuse them)."""

    # near 1e38 Adam's step size (lr / (1 - beta1)) overflows float32 before any loss is seen
    learning_rate: float = option(5e-5, shared=True, min=0, max=1e30, help="peak learning rate")
    weight_decay: float = option(0.0, shared=True, min=0, help="decoupled weight decay (not applied to biases and norms)")
    adam_beta1: float = option(0.9, shared=True, min=0, below=1, help="Adam beta1")
    adam_beta2: float = option(0.999, shared=True, min=0, below=1, help="Adam beta2")
    adam_epsilon: float = option(1e-8, shared=True, min=0, help="Adam epsilon")
    optim_args: str | None = option(None, shared=True, help="extra optimizer arguments 'key=value,key=value'")
    optim_target_modules: list[str] | str | None = option(None, shared=True, help=(
        "modules an optimizer such as GaLore applies to (regexes or names)"))


TRAIN_OPTIONS = OptimizerOptions  # the [train] keys it reads: engine.config.TrainConfig has them


def adamw(run: Any, params: list[dict[str, Any]], args: dict[str, Any]) -> torch.optim.Optimizer:
    t = run.config.train
    kwargs = {"fused": True} if t.optim == "adamw_torch_fused" else {}
    return torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                             eps=t.adam_epsilon, **kwargs)


def adafactor(run: Any, params: list[dict[str, Any]], args: dict[str, Any]) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=run.config.train.learning_rate, scale_parameter=False, relative_step=False)


def _plain(cls: type, optim_args: dict[str, OptimArg]) -> OptimizerFamily:
    """A torch optimizer that takes the learning rate and ``optim_args`` (as in Trainer's handlers)."""

    def build(run: Any, params: list[dict[str, Any]], args: dict[str, Any]) -> torch.optim.Optimizer:
        return cls(params, lr=run.config.train.learning_rate, **args)

    return OptimizerFamily(PLUGIN, (cls.__name__.lower(),), build, optim_args=optim_args,
                           reads=("learning_rate", "weight_decay"))


FAMILIES = (
    OptimizerFamily(PLUGIN, ("adamw_torch", "adamw_torch_fused"), adamw,
                    reads=("learning_rate", "weight_decay", "adam")),
    OptimizerFamily(PLUGIN, ("adafactor",), adafactor, reads=("learning_rate", "weight_decay")),
    _plain(torch.optim.SGD, {"momentum": _FLOAT, "dampening": _FLOAT, "weight_decay": _FLOAT, "nesterov": _BOOL}),
    _plain(torch.optim.Adagrad, {"lr_decay": _FLOAT, "weight_decay": _FLOAT, "eps": _FLOAT}),
    _plain(torch.optim.RMSprop, {"momentum": _FLOAT, "alpha": _FLOAT, "eps": _FLOAT, "weight_decay": _FLOAT,
                                 "centered": _BOOL}),
)


@hookimpl
def register_optimizers(register):
    for family in FAMILIES:
        family.register(register)


@hookimpl
def configure(run):
    train = run.config.train
    entry = run.registries["optimizer"].get(train.optim)  # an unknown name is refused here, with the known ones
    for family in FAMILIES:
        family.configure(run)  # bad optim_args are refused now, not after the model loaded
    if train.optim_target_modules is not None and not entry.takes_target_modules:  # Trainer ignores it
        raise ConfigError(f"train.optim_target_modules: {train.optim} optimizes every parameter and takes no "
                          "target modules (GaLore and APOLLO names do); remove optim_target_modules")


@hookimpl(trylast=True)
def create_optimizer(run):
    entry = run.registries["optimizer"].get(run.config.train.optim)
    return entry.factory(run, param_groups(run.model, run.config.train.weight_decay))


GIVEN = "builtin.given_optimizer"


class GivenOptimizer:
    """``Run(optimizers=(optimizer, scheduler))`` or ``Run(optimizer_cls_and_kwargs=(cls, kwargs))``, as Trainer
    takes them: used instead of ``train.optim`` (a scheduler of None: ``train.lr_scheduler_type`` builds one).

    Checkpointed like the others; the optimizer's class is recorded, and a resume with another class is
    refused. A run file that names ``train.optim`` too must name this optimizer's class.
    """

    def __init__(self, optimizers: tuple[Any, Any] | None, cls_and_kwargs: tuple[type, dict[str, Any]] | None,
                 optim_named: bool):
        if optimizers is not None and cls_and_kwargs is not None:
            raise ConfigError("Run: optimizers and optimizer_cls_and_kwargs both give the optimizer; pass one")
        if optimizers is not None and (not isinstance(optimizers, (tuple, list)) or len(optimizers) != 2):
            raise ConfigError(f"Run: optimizers: expected (optimizer, scheduler), got {type(optimizers).__name__}")
        self.optimizer, self.scheduler = optimizers if optimizers is not None else (None, None)
        self.cls_and_kwargs = cls_and_kwargs
        self.optim_named = optim_named

    @property
    def optimizer_class(self) -> type:
        return type(self.optimizer) if self.optimizer is not None else self.cls_and_kwargs[0]

    @hookimpl
    def create_optimizer(self, run):
        train = run.config.train
        if self.optimizer is not None:
            optimizer = self.optimizer
        else:
            cls, kwargs = self.cls_and_kwargs
            optimizer = cls(param_groups(run.model, train.weight_decay), **kwargs)
        if self.optim_named:  # what train.optim builds (constructed only: states are made at the first step)
            named = run.registries["optimizer"].get(train.optim).factory(run, param_groups(run.model, 0.0))
            if type(named) is not type(optimizer):
                raise ConfigError(f"train.optim = {train.optim!r} makes a {type(named).__qualname__}, but Run() was "
                                  f"given a {type(optimizer).__qualname__}; remove train.optim or pass that optimizer")
        return optimizer

    @hookimpl
    def create_scheduler(self, run, optimizer):
        return self.scheduler

    @hookimpl
    def checkpoint_state(self, run):
        return {"optimizer_class": _qualified(self.optimizer_class)}

    @hookimpl
    def load_checkpoint_state(self, run, state):
        saved = state.get("optimizer_class")
        if saved is not None and saved != _qualified(self.optimizer_class):
            raise ConfigError(f"the checkpoint was trained with a {saved} optimizer; this run is given a "
                              f"{_qualified(self.optimizer_class)}: pass the same optimizer class to resume")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
