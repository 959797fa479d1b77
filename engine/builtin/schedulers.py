"""Learning-rate schedules with linear warmup, as transformers' ``get_scheduler`` defines them.

Each is a ``LambdaLR`` over the optimizer's base learning rates, stepped once per optimizer
step. Extra arguments come from ``train.lr_scheduler_kwargs``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from engine import hookimpl
from engine.config import option
from engine.errors import ConfigError


@dataclass
class SchedulerOptions:
    """``[train]`` keys of builtin.schedulers: its schedules' extra arguments."""

    lr_scheduler_kwargs: dict[str, Any] = option(default_factory=dict, help=(
        "extra scheduler arguments (e.g. power, lr_end for polynomial)"))


TRAIN_OPTIONS = SchedulerOptions  # the [train] keys it reads: engine.config.TrainConfig has them


def _warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, *, warmup: int, total: int, num_cycles: float) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


def _polynomial(step: int, *, warmup: int, total: int, lr_init: float, lr_end: float, power: float) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    if step > total:
        return lr_end / lr_init
    decay = (lr_init - lr_end) * (1 - (step - warmup) / (total - warmup)) ** power + lr_end
    return decay / lr_init


def _schedule(fn, **fixed):
    """A scheduler factory: ``factory(optimizer, num_warmup_steps, num_training_steps, **kwargs)``.

    The schedule is evaluated at the start, the end of warmup and the end, so arguments of the
    wrong type are refused here, naming ``train.lr_scheduler_kwargs``, not at some later step.
    """

    def checked(optimizer, num_warmup_steps, num_training_steps, **kwargs):
        try:
            lam = fn(optimizer, num_warmup_steps, num_training_steps, **fixed, **kwargs)
            for step in (0, num_warmup_steps, num_training_steps):
                float(lam(step))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"train.lr_scheduler_kwargs: {kwargs} do not fit {fn.__name__}: {exc}") from None
        return lam

    def factory(optimizer, num_warmup_steps, num_training_steps, **kwargs):
        return LambdaLR(optimizer, checked(optimizer, num_warmup_steps, num_training_steps, **kwargs))

    factory.check = checked  # configure's check, on what the schedule reads of an optimizer (its defaults)
    return factory


def linear(optimizer, warmup, total):
    return functools.partial(_linear, warmup=warmup, total=total)


def cosine(optimizer, warmup, total, num_cycles=0.5):
    return functools.partial(_cosine, warmup=warmup, total=total, num_cycles=num_cycles)


def constant(optimizer, warmup, total):
    return _constant


def constant_with_warmup(optimizer, warmup, total):
    return functools.partial(_constant_with_warmup, warmup=warmup)


def polynomial(optimizer, warmup, total, lr_end=1e-7, power=1.0):
    lr_init = optimizer.defaults["lr"]
    if not lr_init > lr_end:
        raise ConfigError(f"train.lr_scheduler_kwargs.lr_end ({lr_end}) must be smaller than "
                          f"train.learning_rate ({lr_init})")
    return functools.partial(_polynomial, warmup=warmup, total=total, lr_init=lr_init, lr_end=lr_end, power=power)


@hookimpl
def register_schedulers(register):
    for fn in (linear, cosine, constant, constant_with_warmup, polynomial):
        register(fn.__name__, _schedule(fn))


@hookimpl
def configure(run):
    train = run.config.train
    entry = run.registries["scheduler"].get(train.lr_scheduler_type)
    if entry.builtin:  # its arguments checked now, without a torch optimizer (whose first one imports dynamo: ~2 s)
        steps = max(train.max_steps, 1)
        defaults_only = SimpleNamespace(defaults={"lr": train.learning_rate})
        entry.factory.check(defaults_only, min(train.warmup_steps, steps), steps, **train.lr_scheduler_kwargs)


@hookimpl(trylast=True)
def create_scheduler(run, optimizer):
    entry = run.registries["scheduler"].get(run.config.train.lr_scheduler_type)
    return entry.factory(optimizer, run.num_warmup_steps, run.num_training_steps,
                         **run.config.train.lr_scheduler_kwargs)
