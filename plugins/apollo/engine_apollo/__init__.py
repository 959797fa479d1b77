"""engine-apollo: APOLLO (apollo-torch) under transformers' ``TrainingArguments.optim`` names.

``apollo_adamw`` and ``apollo_adamw_layerwise``: AdamW whose moments for the ``nn.Linear``
weights that ``train.optim_target_modules`` selects live in a rank-``rank`` random (or SVD)
projection, used only to scale the raw gradient per channel or per tensor. Built as
transformers' Trainer builds it, with the machinery it shares with GaLore
(``engine.lowrank``); differences are in the README.
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

PLUGIN = "apollo"
name = PLUGIN
logger = logging.getLogger("engine.apollo")

NAMES = ("apollo_adamw", "apollo_adamw_layerwise")
PROJ_TYPES = ("std", "reverse_std", "left", "right")  # apollo-torch's random projector has no "full"
# train.optim_args keys, with transformers' defaults
OPTIM_ARGS = {
    "rank": Arg(int, 128, "int >= 1", lambda v: v >= 1),
    "proj": Arg(str, "random", "random | svd", lambda v: v in ("random", "svd")),
    "scale_type": Arg(str, "channel", "channel | tensor", lambda v: v in ("channel", "tensor")),
    "update_proj_gap": Arg(int, 200, "int >= 1 (steps between projection updates)", lambda v: v >= 1),
    "scale": Arg(float, 1.0, "float > 0", lambda v: v > 0),
    "proj_type": Arg(str, "std", " | ".join(PROJ_TYPES), lambda v: v in PROJ_TYPES),
}


def _make_projector(optimizer: Any, group: dict[str, Any], state: dict[str, Any]) -> Any:
    return optimizer._initialize_projector(group, state)


def _seed_like_whole_model(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, position: int) -> None:
    # APOLLOAdamW seeds each parameter's random projection with its position among all its
    # parameters; one optimizer per parameter would give every parameter seed 1 (as in Trainer)
    optimizer.state[param]["seed"] = position


def create_apollo(run: Any, params: Any, args: dict[str, Any]) -> torch.optim.Optimizer:
    """Both names; ``params`` (the engine's decay groups) are not used."""
    train = run.config.train
    cls = FAMILY.require(train.optim).APOLLOAdamW
    target_kwargs = {**args, "betas": (train.adam_beta1, train.adam_beta2), "eps": train.adam_epsilon}
    return lowrank.build(run, cls, target_kwargs, {"lr": train.learning_rate}, _make_projector,
                         per_param=_seed_like_whole_model)


def _check(run: Any, args: dict[str, Any]) -> None:
    lowrank.check(run, logger)
    if args["scale_type"] == "channel" and args["proj_type"] != "std":
        # APOLLOAdamW's channel scaling assumes std's orientation: other types fail on some shapes
        raise ConfigError(f"train.optim_args: proj_type={args['proj_type']} needs scale_type=tensor "
                          "(with scale_type=channel, apollo-torch supports proj_type=std only)")
    lowrank.warn_unused_train_keys(run, ("weight_decay",), logger,
                                   "not used: as in transformers' Trainer, APOLLO gets no weight decay")
    lowrank.warn_unused_train_keys(
        run, ("adam_beta1", "adam_beta2", "adam_epsilon"), logger,
        "only reach the projected weights, as in transformers' Trainer; the other parameters "
        "use apollo-torch's defaults (betas (0.9, 0.999), eps 1e-6)")


FAMILY = OptimizerFamily(PLUGIN, NAMES, create_apollo, library=("apollo_torch", "apollo-torch"),
                         optim_args=OPTIM_ARGS, reads=("learning_rate", "adam"), check=_check,
                         takes_target_modules=True)


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
