"""engine-galore: GaLore optimizers (galore-torch) under transformers' ``TrainingArguments.optim`` names.

``galore_adamw``, ``galore_adamw_8bit``, ``galore_adafactor`` and each ``*_layerwise``: the
gradients of the ``nn.Linear`` weights that ``train.optim_target_modules`` selects are projected
to rank ``rank`` (``train.optim_args``), so their optimizer state is low-rank. Built exactly as
transformers' Trainer builds them; differences (all refusals or fixes) are in the README.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine import ConfigError, hookimpl
from engine.kit import lowrank
from engine.optim import OptimArg as Arg
from engine.optim import OptimizerFamily

__version__ = "0.1.0"

PLUGIN = "galore"
name = PLUGIN
logger = logging.getLogger("engine.galore")

# optim name (without _layerwise) -> galore_torch class name
CLASSES = {"galore_adamw": "GaLoreAdamW", "galore_adamw_8bit": "GaLoreAdamW8bit",
           "galore_adafactor": "GaLoreAdafactor"}
NAMES = tuple(base + suffix for base in CLASSES for suffix in ("", lowrank.LAYERWISE))
PROJ_TYPES = ("std", "reverse_std", "right", "left", "full")
# train.optim_args keys, with transformers' defaults
OPTIM_ARGS = {
    "rank": Arg(int, 128, "int >= 1", lambda v: v >= 1),
    "update_proj_gap": Arg(int, 200, "int >= 1 (steps between projection updates)", lambda v: v >= 1),
    "scale": Arg(float, 0.25, "float > 0", lambda v: v > 0),
    "proj_type": Arg(str, "std", " | ".join(PROJ_TYPES), lambda v: v in PROJ_TYPES),
}


def _make_projector(optimizer: Any, group: dict[str, Any], state: dict[str, Any]) -> Any:
    from galore_torch.galore_projector import GaLoreProjector

    return GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                           proj_type=group["proj_type"])


def create_galore(run: Any, params: Any, args: dict[str, Any]) -> torch.optim.Optimizer:
    """Every GaLore name; ``params`` (the engine's decay groups) are not used."""
    name = run.config.train.optim
    base = name.removesuffix(lowrank.LAYERWISE)
    cls = getattr(FAMILY.require(name), CLASSES[base])
    optimizer_kwargs: dict[str, Any] = {"lr": run.config.train.learning_rate}
    if base == "galore_adafactor":
        # Trainer sets these for galore_adafactor only, so galore_adafactor_layerwise fails there
        optimizer_kwargs.update(scale_parameter=False, relative_step=False)
    return lowrank.build(run, cls, args, optimizer_kwargs, _make_projector)


def _check(run: Any, args: dict[str, Any]) -> None:
    train = run.config.train
    lowrank.check(run, logger)
    if "8bit" in train.optim and (train.use_cpu or not torch.cuda.is_available()):
        raise ConfigError(f"train.optim: {train.optim} needs a CUDA device (galore-torch's GaLoreAdamW8bit "
                          "calls torch.cuda.synchronize() every step); on CPU use "
                          f"{train.optim.replace('_8bit', '')}")
    defaults = "GaLoreAdamW8bit: weight_decay 0.01" if "8bit" in train.optim else "no weight decay"
    lowrank.warn_unused_train_keys(
        run, ("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"), logger,
        f"not used: as in transformers' Trainer, GaLore optimizers get only learning_rate from [train] and "
        f"otherwise galore-torch's defaults ({defaults})")


FAMILY = OptimizerFamily(PLUGIN, NAMES, create_galore, library=("galore_torch", "galore-torch"),
                         optim_args=OPTIM_ARGS, check=_check, takes_target_modules=True)


@hookimpl
def register_optimizers(register):
    FAMILY.register(register)


@hookimpl
def configure(run):
    FAMILY.configure(run)


@hookimpl(wrapper=True)
def training_step(run, batches, num_items_in_batch):
    return lowrank.without_grad_norm(run, (yield))


@hookimpl
def on_train_start(run):
    lowrank.attach(run)


@hookimpl
def on_train_end(run):
    lowrank.detach(run)


@hookimpl
def load_checkpoint_state(run, state):
    lowrank.restore(run)
