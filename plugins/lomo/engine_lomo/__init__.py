"""engine-lomo: LOMO and AdaLomo (``lomo-optim``), which fuse the update into backward.

Enable with ``plugins = ["lomo"]`` and ``train.optim = "lomo"`` or ``"adalomo"``. The plugin
owns the training step: each parameter is updated as soon as its gradient is computed, so no
gradient and (for LOMO) no optimizer state is ever held for the whole model. With
``train.max_grad_norm > 0`` a first backward measures the global gradient norm (two backward
passes per step, as the LOMO paper does); ``max_grad_norm = 0`` skips it.

Refused in ``configure``: gradient accumulation, fp16, distributed strategies and
``train.weight_decay`` (see README).
"""

from __future__ import annotations

from typing import Any

import engine
from engine import OptimArg, OptimizerFamily, hookimpl

__version__ = "0.1.0"

PLUGIN = "lomo"
name = PLUGIN
NAMES = ("lomo", "adalomo")

_POSITIVE = OptimArg(float, expect="float > 0", valid=lambda v: v > 0)
_WEIGHT_DECAY = OptimArg(float, expect="float >= 0", valid=lambda v: v >= 0)
# optim name -> train.optim_args keys it takes (keyword arguments of the lomo_optim class).
# Trainer passes no optim_args to LOMO; these expose the library's own options.
OPTIM_ARGS = {
    "lomo": {"clip_grad_value": _POSITIVE, "weight_decay": _WEIGHT_DECAY},
    "adalomo": {"clip_grad_value": _POSITIVE, "weight_decay": _WEIGHT_DECAY, "clip_threshold": _POSITIVE,
                "decay_rate": OptimArg(float, expect="float < 0 (beta2 = 1 - step**decay_rate)",
                                       valid=lambda v: v < 0),
                "loss_scale": _POSITIVE},
}


def _check_fused(run: Any, args: dict[str, Any]) -> None:
    """What an update inside backward cannot do: accumulation, fp16, per-group weight decay, several processes."""
    train = run.config.train
    fused = f"{train.optim} updates the weights inside backward"
    if train.gradient_accumulation_steps > 1:
        raise engine.ConfigError(
            f"train.gradient_accumulation_steps: {fused}, so gradients cannot be accumulated; "
            f"set gradient_accumulation_steps = 1 (got {train.gradient_accumulation_steps}) and raise "
            "per_device_train_batch_size instead")
    if train.fp16:
        raise engine.ConfigError(f"train.fp16: {train.optim} cannot use fp16 loss scaling (the update "
                                 "runs inside backward); set fp16 = false and use bf16 = true")
    if train.weight_decay > 0:
        raise engine.ConfigError(
            f"train.weight_decay: {train.optim} cannot exclude biases and norms from weight decay, and "
            f"Trainer ignores weight_decay for it; set weight_decay = 0 (got {train.weight_decay}), or "
            f"optim_args = 'weight_decay={train.weight_decay}' to decay every parameter")
    strategy = engine.strategy_name(run)
    if strategy != "single":
        raise engine.ConfigError(
            f"train.strategy: {fused}, before any gradient is reduced across processes, so it runs "
            f"on one device only (strategy 'single'); got {strategy!r}: remove the strategy plugin or "
            "choose another optimizer")


def create_lomo(run: Any, params: Any, args: dict[str, Any]) -> Any:
    """``lomo`` and ``adalomo``: the library class with the whole model, as Trainer does.

    ``params`` (the decay/no-decay groups) is not used: LOMO hooks the model's parameters itself.
    """
    if run.strategy.world_size > 1:
        raise engine.ConfigError(f"train.strategy: {run.config.train.optim} runs on one process only")
    train = run.config.train
    FAMILIES[train.optim].require(train.optim)
    from . import fused  # imports lomo_optim

    cls = fused.AdaLomo if train.optim == "adalomo" else fused.Lomo
    clip = train.max_grad_norm if train.max_grad_norm > 0 else None
    return cls(run.model, lr=train.learning_rate, clip_grad_norm=clip, **args)


FAMILIES = {optim: OptimizerFamily(PLUGIN, (optim,), create_lomo, library=("lomo_optim", "lomo-optim"),
                                   optim_args=table, check=_check_fused)
            for optim, table in OPTIM_ARGS.items()}


@hookimpl
def register_optimizers(register):
    for family in FAMILIES.values():
        family.register(register)


@hookimpl
def configure(run):
    for family in FAMILIES.values():
        family.configure(run)


@hookimpl
def training_step(run, batches, num_items_in_batch):
    """The fused step: [grad_norm backward,] fused backward + update; the loop steps the scheduler.

    The learning rate is the optimizer's current one (what the scheduler set), the value
    Trainer passes to ``fused_backward`` (``lr_scheduler.get_last_lr()[0]``).
    """
    if run.config.train.optim not in NAMES:
        return None  # another optimizer: the builtin step answers
    (batch,) = batches  # configure refused gradient accumulation
    optimizer, strategy = run.optimizer, run.strategy
    with strategy.autocast():
        loss = run.hook.compute_loss(run=run, model=run.wrapped_model, batch=batch,
                                     num_items_in_batch=num_items_in_batch)
    grad_norm = optimizer.grad_norm(loss) if optimizer.clip_grad_norm else None
    optimizer.fused_backward(loss, optimizer.param_groups[0]["lr"])
    optimizer.step()  # a no-op that tells the LR scheduler a step happened
    return engine.StepOutput(loss.detach(), grad_norm)
