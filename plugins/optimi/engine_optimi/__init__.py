"""engine-optimi: torch-optimi's StableAdamW under the ``TrainingArguments.optim`` name ``stable_adamw``.

Enable with ``plugins = ["optimi"]`` and ``train.optim = "stable_adamw"``. The name builds the
optimizer transformers' ``Trainer`` builds (``optimi.StableAdamW``) with the same arguments:
``lr``, ``betas`` = (``adam_beta1``, ``adam_beta2``), ``eps`` = ``adam_epsilon``, the weight
decay per parameter group (``engine.param_groups``), and from ``train.optim_args``
``decouple_lr`` (false), ``max_lr`` and ``kahan_sum`` (optimi's defaults when not given:
``max_lr`` = the learning rate with ``decouple_lr``, Kahan summation for 16-bit parameters).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import engine
from engine import OptimArg, hookimpl

__version__ = "0.1.0"

PLUGIN = "optimi"
name = PLUGIN
logger = logging.getLogger("engine.optimi")

NAMES = ("stable_adamw",)
OPTIM_ARGS = {  # Trainer's keys; None: not passed on, optimi decides
    "decouple_lr": OptimArg(bool, False, expect="true or false"),
    "max_lr": OptimArg(float, expect="float > 0", valid=lambda v: v > 0),
    "kahan_sum": OptimArg(bool, expect="true or false"),
}
_ELSEWHERE = {
    "lr": "set train.learning_rate",
    "learning_rate": "set train.learning_rate",
    "weight_decay": "set train.weight_decay (applied per parameter group, none on biases and norms)",
    "betas": "set train.adam_beta1 / train.adam_beta2",
    "beta1": "set train.adam_beta1",
    "beta2": "set train.adam_beta2",
    "eps": "set train.adam_epsilon",
}


def _optimi(optim: str) -> Any:
    return engine.require("optimi", "torch-optimi", feature=f"train.optim = {optim!r}", extra=PLUGIN)


def optim_kwargs(run: Any) -> dict[str, Any]:
    """``train.optim_args`` checked: ``decouple_lr`` always, ``max_lr`` and ``kahan_sum`` when given."""
    kwargs = engine.check_optim_args(run, OPTIM_ARGS, elsewhere=_ELSEWHERE)
    if "max_lr" in kwargs and not kwargs["decouple_lr"]:
        raise engine.ConfigError(
            f"train.optim_args: max_lr={kwargs['max_lr']} only scales fully decoupled weight decay; add "
            "decouple_lr=true, or remove max_lr")
    return kwargs


@hookimpl
def configure(run):
    train = run.config.train
    if train.optim not in NAMES:
        return
    _optimi(train.optim)
    optim_kwargs(run)


def create_stable_adamw(run: Any, params: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Factory: ``optimi.StableAdamW`` with Trainer's arguments over ``params`` (decay/no-decay groups)."""
    train = run.config.train
    kwargs = optim_kwargs(run)
    if kwargs.get("kahan_sum") and not any(p.dtype in (torch.float16, torch.bfloat16)
                                           for group in params for p in group["params"]):
        logger.warning("%s: kahan_sum applies to float16/bfloat16 parameters only and there are none here "
                       "(train.bf16 autocasts, it does not store the weights in bfloat16)", train.optim)
    if run.strategy.device.type != "cuda":
        # optimi decides on Triton before it has looked at any parameter (all() of an empty list),
        # so with triton installed (liger-kernel brings it) it would launch Triton kernels on the CPU
        kwargs["triton"] = False
    return _optimi(train.optim).StableAdamW(
        params, lr=train.learning_rate, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_epsilon,
        weight_decay=train.weight_decay, **kwargs)


@hookimpl
def register_optimizers(register):
    for optim in NAMES:
        register(optim, create_stable_adamw)
