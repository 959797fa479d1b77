"""Trainer's constructor arguments given to ``Run``: the plugins they need, registered for that run only.

``Run(callbacks=...)`` gets the TrainerCallback adapter, ``Run(compute_loss_func=...)`` the loss
function's plugin, ``Run(optimizers=...)`` or ``Run(optimizer_cls_and_kwargs=...)`` the given optimizer's.
A run without them registers none of them, so it pays nothing per step.
"""

from __future__ import annotations

from engine import hookimpl

from .callbacks import PLUGIN, CallbackOptions, TrainerCallbacks
from .loss import PLUGIN_LOSS_FUNC, ComputeLossFunc
from .optimizers import GIVEN, GivenOptimizer

TRAIN_OPTIONS = CallbackOptions  # the [train] keys of the plugins it registers: engine.config.TrainConfig has them


@hookimpl
def register_argument_plugins(register, arguments):
    if arguments["callbacks"]:
        register(PLUGIN, TrainerCallbacks(arguments["callbacks"]))
    if arguments["compute_loss_func"] is not None:
        register(PLUGIN_LOSS_FUNC, ComputeLossFunc(arguments["compute_loss_func"]))
    if arguments["optimizers"] is not None or arguments["optimizer_cls_and_kwargs"] is not None:
        register(GIVEN, GivenOptimizer(arguments["optimizers"], arguments["optimizer_cls_and_kwargs"],
                                       arguments["optim_named"]))
