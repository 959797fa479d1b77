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
from engine import OptimArg, OptimizerFamily, hookimpl

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


def _check(run: Any, args: dict[str, Any]) -> None:
    if "max_lr" in args and not args["decouple_lr"]:
        raise engine.ConfigError(
            f"train.optim_args: max_lr={args['max_lr']} only scales fully decoupled weight decay; add "
            "decouple_lr=true, or remove max_lr")


def create_stable_adamw(run: Any, params: list[dict[str, Any]], args: dict[str, Any]) -> torch.optim.Optimizer:
    """``optimi.StableAdamW`` with Trainer's arguments over ``params`` (decay/no-decay groups)."""
    train = run.config.train
    kwargs = dict(args)  # decouple_lr always, max_lr and kahan_sum when given
    if kwargs.get("kahan_sum") and not any(p.dtype in (torch.float16, torch.bfloat16)
                                           for group in params for p in group["params"]):
        logger.warning("%s: kahan_sum applies to float16/bfloat16 parameters only and there are none here "
                       "(train.bf16 autocasts, it does not store the weights in bfloat16)", train.optim)
    if run.strategy.device.type != "cuda":
        # optimi decides on Triton before it has looked at any parameter (all() of an empty list),
        # so with triton installed (liger-kernel brings it) it would launch Triton kernels on the CPU
        kwargs["triton"] = False
    return FAMILY.require(train.optim).StableAdamW(
        params, lr=train.learning_rate, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_epsilon,
        weight_decay=train.weight_decay, **kwargs)


FAMILY = OptimizerFamily(PLUGIN, NAMES, create_stable_adamw, library=("optimi", "torch-optimi"),
                         optim_args=OPTIM_ARGS, reads=("learning_rate", "weight_decay", "adam"), check=_check)


@hookimpl
def register_optimizers(register):
    FAMILY.register(register)


@hookimpl
def configure(run):
    FAMILY.configure(run)
