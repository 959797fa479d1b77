"""engine-bnb: the bitsandbytes optimizers under their ``TrainingArguments.optim`` names.

Enable with ``plugins = ["bnb"]`` and pick a name with ``train.optim`` (``adamw_8bit``,
``paged_lion_32bit``, ``ademamix``, ...). Each name builds the same bitsandbytes optimizer, with
the same arguments, as transformers' ``Trainer`` (``get_optimizer_cls_and_kwargs`` and
``create_optimizer``):

* ``lr`` = ``train.learning_rate``; weight decay per parameter group (``engine.param_groups``);
* AdamW: ``betas`` = (``adam_beta1``, ``adam_beta2``), ``eps`` = ``adam_epsilon``;
  Lion: the same ``betas``, no ``eps``; RMSprop: only ``optim_args`` (``alpha``, ``eps``,
  ``momentum``; bitsandbytes' defaults otherwise); AdEMAMix: ``optim_args`` ``beta1``,
  ``beta2``, ``beta3``, ``alpha``, ``eps``, ``t_alpha``, ``t_beta3`` over the adam_* defaults;
* ``optim_bits`` 8 or 32 from the name, ``is_paged`` for ``paged_*`` names;
* with 8-bit state, ``nn.Embedding`` weights keep 32-bit state (Trainer's override).

Paged state needs CUDA: on the CPU the optimizer is built unpaged, and this plugin says so
once per process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from engine import hookimpl
from engine.optim import OptimArg, check_optim_args
from engine.util import require

__version__ = "0.1.0"

logger = logging.getLogger("engine.bnb")  # printed as "engine: <message>"

PLUGIN = "bnb"  # the entry-point name
name = PLUGIN  # so engine.Run(plugins=[engine_bnb]) files this module under "bnb" too


# ---------------------------------------------------------------------------- names


@dataclass(frozen=True)
class Spec:
    """What a name means: bitsandbytes family, state bits, paging (Trainer reads them off the name)."""

    family: str
    optim_bits: int
    is_paged: bool = False


OPTIMIZERS: dict[str, Spec] = {
    "adamw_8bit": Spec("adamw", 8),
    "adamw_bnb_8bit": Spec("adamw", 8),
    "paged_adamw_8bit": Spec("adamw", 8, True),
    "paged_adamw_32bit": Spec("adamw", 32, True),
    "lion_8bit": Spec("lion", 8),
    "lion_32bit": Spec("lion", 32),
    "paged_lion_8bit": Spec("lion", 8, True),
    "paged_lion_32bit": Spec("lion", 32, True),
    "rmsprop_8bit": Spec("rmsprop", 8),  # not a transformers name: an alias of rmsprop_bnb_8bit
    "rmsprop_bnb": Spec("rmsprop", 32),
    "rmsprop_bnb_8bit": Spec("rmsprop", 8),
    "rmsprop_bnb_32bit": Spec("rmsprop", 32),
    "ademamix": Spec("ademamix", 32),
    "ademamix_8bit": Spec("ademamix", 8),
    "paged_ademamix_8bit": Spec("ademamix", 8, True),
    "paged_ademamix_32bit": Spec("ademamix", 32, True),
}


# ---------------------------------------------------------------------------- optim_args

_UNIT = OptimArg(float, expect="float in [0, 1)", valid=lambda v: 0 <= v < 1)
_NON_NEGATIVE = OptimArg(float, expect="float >= 0", valid=lambda v: v >= 0)
_STEPS = OptimArg(int, expect="int >= 1", valid=lambda v: v >= 1)


def _adamw_kwargs(train: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {"betas": (train.adam_beta1, train.adam_beta2), "eps": train.adam_epsilon}


def _lion_kwargs(train: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {"betas": (train.adam_beta1, train.adam_beta2)}


def _rmsprop_kwargs(train: Any, args: dict[str, Any]) -> dict[str, Any]:
    return dict(args)  # Trainer passes optim_args only: bitsandbytes' alpha=0.99, eps=1e-8 otherwise


def _ademamix_kwargs(train: Any, args: dict[str, Any]) -> dict[str, Any]:
    kwargs = {
        "betas": (args.get("beta1", train.adam_beta1), args.get("beta2", train.adam_beta2),
                  args.get("beta3", 0.9999)),
        "alpha": args.get("alpha", 5.0),
        "eps": args.get("eps", train.adam_epsilon),
    }
    kwargs.update({key: args[key] for key in ("t_alpha", "t_beta3") if key in args})
    return kwargs


@dataclass(frozen=True)
class Family:
    cls: str  # class name in bitsandbytes.optim
    kwargs: Callable[[Any, dict[str, Any]], dict[str, Any]]  # (train config, typed optim_args) -> kwargs
    optim_args: dict[str, OptimArg]  # keys train.optim_args may set
    uses_adam_args: bool  # reads train.adam_beta1 / adam_beta2 (and adam_epsilon)
    pageable: bool = True  # takes is_paged (bitsandbytes' RMSprop does not)


FAMILIES = {
    "adamw": Family("AdamW", _adamw_kwargs, {}, True),
    "lion": Family("Lion", _lion_kwargs, {}, True),
    "rmsprop": Family("RMSprop", _rmsprop_kwargs, {
        "alpha": OptimArg(float, expect="float in (0, 1)", valid=lambda v: 0 < v < 1),
        "eps": _NON_NEGATIVE, "momentum": _UNIT}, False, pageable=False),
    "ademamix": Family("AdEMAMix", _ademamix_kwargs, {
        "beta1": _UNIT, "beta2": _UNIT, "beta3": _UNIT, "alpha": _NON_NEGATIVE, "eps": _NON_NEGATIVE,
        "t_alpha": _STEPS, "t_beta3": _STEPS}, True),
}

# Keys people carry over from other optimizers, and where they go instead.
_ELSEWHERE = {
    "lr": "set train.learning_rate",
    "learning_rate": "set train.learning_rate",
    "weight_decay": "set train.weight_decay (applied per parameter group, none on biases and norms)",
    "optim_bits": "the name sets it: *_8bit or *_32bit",
    "is_paged": "the name sets it: paged_*",
    "centered": "bitsandbytes has no centered RMSprop; use optim = \"rmsprop\" (torch)",
}
_ADAM_ELSEWHERE = {  # for the families that read train.adam_*
    "betas": "set train.adam_beta1 / train.adam_beta2",
    "beta1": "set train.adam_beta1",
    "beta2": "set train.adam_beta2",
    "eps": "set train.adam_epsilon (Lion has no eps)",
}


def optim_args(run: Any) -> dict[str, Any]:
    """``train.optim_args`` for the run's bnb optimizer, typed and checked (ConfigError naming the key)."""
    family = FAMILIES[OPTIMIZERS[run.config.train.optim].family]
    return check_optim_args(run, family.optim_args,
                            elsewhere={**_ELSEWHERE, **(_ADAM_ELSEWHERE if family.uses_adam_args else {})})


def _bnb_optim(optim: str) -> Any:
    return require("bitsandbytes.optim", "bitsandbytes", feature=f"train.optim = {optim!r}", extra=PLUGIN)


# ---------------------------------------------------------------------------- factory

_paged_cpu_warned = False  # the paged-on-CPU warning is said once per process


def _warn_paged_on_cpu(optim: str) -> None:
    global _paged_cpu_warned
    if _paged_cpu_warned:
        return
    _paged_cpu_warned = True
    logger.warning(
        "%s: paged optimizer state needs CUDA (unified memory); the parameters are on the CPU, so "
        "bitsandbytes keeps the state in ordinary CPU memory instead. Training is the same as with "
        "the non-paged optimizer; only the paging is off. (Said once per process.)", optim)


def _embeddings_in_32bit(bnb_optim: Any, model: torch.nn.Module) -> None:
    """Trainer's rule for 8-bit optimizers: ``nn.Embedding`` weights keep 32-bit state."""
    manager = bnb_optim.GlobalOptimManager.get_instance()
    registered = {(id(module), attr) for module, attr, _ in manager.module_weight_config_triple}
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and (id(module), "weight") not in registered:
            manager.register_module_override(module, "weight", {"optim_bits": 32})


def create(optim: str, run: Any, params: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Optimizer factory for name ``optim``: ``params`` are ``engine.param_groups`` groups."""
    bnb_optim = _bnb_optim(optim)
    spec, train = OPTIMIZERS[optim], run.config.train
    family = FAMILIES[spec.family]
    kwargs = {"lr": train.learning_rate, **family.kwargs(train, optim_args(run)),
              "optim_bits": spec.optim_bits}
    paged = spec.is_paged
    if paged and any(p.device.type == "cpu" for group in params for p in group["params"]):
        # unpaged outright: bitsandbytes' AdEMAMix asks for managed (CUDA) memory for tensors of
        # >= 100k elements whatever their device, and fails on a CPU-only build
        _warn_paged_on_cpu(optim)
        paged = False
    if family.pageable:
        kwargs["is_paged"] = paged
    optimizer = getattr(bnb_optim, family.cls)(params, **kwargs)
    if spec.optim_bits == 8 and run.model is not None:
        _embeddings_in_32bit(bnb_optim, run.model)
    return optimizer


@hookimpl
def register_optimizers(register):
    for optim in OPTIMIZERS:
        register(optim, partial(create, optim))


@hookimpl
def configure(run):
    train = run.config.train
    if train.optim not in OPTIMIZERS:
        return
    _bnb_optim(train.optim)
    optim_args(run)
