"""engine-schedulefree: Schedule-Free AdamW, SGD and RAdam (``schedulefree``).

Enable with ``plugins = ["schedulefree"]`` and ``train.optim = "schedule_free_adamw"``,
``"schedule_free_sgd"`` or ``"schedule_free_radam"``. A Schedule-Free optimizer trains at
one point (y) and evaluates at another (x, the average of the iterates): the plugin calls
``optimizer.train()`` / ``optimizer.eval()`` in ``on_train_mode`` / ``on_eval_mode``, so
evaluation, checkpoints and the final model use x, and training continues from y.

It needs no learning-rate schedule: unless ``[schedulefree] keep_scheduler = true``, a
``train.lr_scheduler_type`` other than ``constant`` is replaced by ``constant`` with one
warning (warmup stays: the optimizer's own ``warmup_steps``; for RAdam, which has none, a
``constant_with_warmup`` schedule).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import engine
from engine import OptimArg, OptimizerFamily, hookimpl

__version__ = "0.1.0"

PLUGIN = "schedulefree"
name = PLUGIN
logger = logging.getLogger("engine.schedulefree")

# optim name -> (schedulefree class, takes betas/eps, takes warmup_steps): Trainer's choices
NAMES = {
    "schedule_free_adamw": ("AdamWScheduleFree", True, True),
    "schedule_free_sgd": ("SGDScheduleFree", False, True),
    "schedule_free_radam": ("RAdamScheduleFree", True, False),
}
_NON_NEGATIVE = {"expect": "float >= 0", "valid": lambda v: v >= 0}
# keys Trainer reads, with its defaults
OPTIM_ARGS = {"weight_lr_power": OptimArg(float, 2.0, **_NON_NEGATIVE), "r": OptimArg(float, 0.0, **_NON_NEGATIVE)}


@dataclass
class ScheduleFreeOptions:
    """``[schedulefree]``: what happens to ``train.lr_scheduler_type``."""

    keep_scheduler: bool = engine.option(False, help=(
        "true: apply train.lr_scheduler_type on top of the optimizer, as Trainer does; false: replace a "
        "non-constant schedule by a constant learning rate (one warning)"))


@hookimpl
def plugin_options():
    return ScheduleFreeOptions


def _library(optim: str) -> Any:
    schedulefree = FAMILY.require(optim)
    if not hasattr(schedulefree, "RAdamScheduleFree"):
        raise engine.MissingDependencyError(
            "train.optim: schedulefree >= 1.4 is needed (RAdamScheduleFree): pip install -U 'engine[schedulefree]'")
    return schedulefree


def constant_schedule(run: Any) -> str | None:
    """The schedule that replaces ``train.lr_scheduler_type``, or None to keep it."""
    train = run.config.train
    if run.config.section(PLUGIN).keep_scheduler or train.optim not in NAMES:
        return None
    _, _, has_warmup = NAMES[train.optim]
    warmup = train.warmup_steps > 0 or train.warmup_ratio > 0
    target = "constant_with_warmup" if warmup and not has_warmup else "constant"
    return None if train.lr_scheduler_type == target else target


def _check(run: Any, args: dict[str, Any]) -> None:
    train = run.config.train
    _library(train.optim)
    target = constant_schedule(run)
    if target is not None:
        logger.warning(
            "%s needs no learning-rate schedule: using %s instead of train.lr_scheduler_type %r%s. Set "
            "train.lr_scheduler_type = %r to silence this, or [schedulefree] keep_scheduler = true to apply "
            "%r on top as Trainer does", train.optim, target, train.lr_scheduler_type,
            " (the optimizer does the warmup)" if target == "constant" and (train.warmup_steps or train.warmup_ratio)
            else "", target, train.lr_scheduler_type)


def create_schedule_free(run: Any, params: list[dict[str, Any]], args: dict[str, Any]) -> Any:
    """The class and keyword arguments Trainer uses, with ``params`` (decay/no-decay groups) and
    ``args`` (``weight_lr_power`` and ``r``: Trainer's defaults updated by ``train.optim_args``).

    Warmup is ``run.num_warmup_steps`` (``warmup_steps``, else ``warmup_ratio`` of the run).
    """
    train = run.config.train
    class_name, adam, has_warmup = NAMES[train.optim]
    kwargs: dict[str, Any] = {"lr": train.learning_rate, "weight_decay": train.weight_decay}
    if adam:
        kwargs.update(betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_epsilon)
    if has_warmup:
        kwargs["warmup_steps"] = run.num_warmup_steps
    return getattr(_library(train.optim), class_name)(params, **kwargs, **args)


FAMILY = OptimizerFamily(PLUGIN, tuple(NAMES), create_schedule_free, library=("schedulefree", "schedulefree"),
                         optim_args=OPTIM_ARGS, reads=("learning_rate", "weight_decay"), check=_check)


@hookimpl
def register_optimizers(register):
    FAMILY.register(register)


@hookimpl
def configure(run):
    FAMILY.configure(run)


@hookimpl
def create_scheduler(run, optimizer):
    target = constant_schedule(run)
    if target is None:
        return None  # the builtin builds train.lr_scheduler_type
    return run.registries["scheduler"].get(target).factory(optimizer, run.num_warmup_steps, run.num_training_steps)


@hookimpl
def on_train_mode(run):
    if run.config.train.optim in NAMES and run.optimizer is not None:
        run.optimizer.train()  # parameters <- y, where gradients are taken


@hookimpl
def on_eval_mode(run):
    if run.config.train.optim in NAMES and run.optimizer is not None:
        run.optimizer.eval()  # parameters <- x, the averaged iterate
