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
from engine.optim import OptimArg, OptimizerFamily

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


# ---------------------------------------------------------------------------- keyword arguments

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


def create(cls: str, kwargs: Callable[[Any, dict[str, Any]], dict[str, Any]], pageable: bool,
           run: Any, params: list[dict[str, Any]], args: dict[str, Any]) -> torch.optim.Optimizer:
    """``bitsandbytes.optim.<cls>`` for the run's name over ``params`` (``engine.param_groups`` groups):
    ``kwargs(train config, checked optim_args)`` and Trainer's lr, optim_bits and is_paged
    (``pageable``: the class takes it; bitsandbytes' RMSprop does not)."""
    optim, train = run.config.train.optim, run.config.train
    spec = OPTIMIZERS[optim]
    bnb_optim = FAMILIES[spec.family].require(optim)
    options = {"lr": train.learning_rate, **kwargs(train, args), "optim_bits": spec.optim_bits}
    paged = spec.is_paged
    if paged and any(p.device.type == "cpu" for group in params for p in group["params"]):
        # unpaged outright: bitsandbytes' AdEMAMix asks for managed (CUDA) memory for tensors of
        # >= 100k elements whatever their device, and fails on a CPU-only build
        _warn_paged_on_cpu(optim)
        paged = False
    if pageable:
        options["is_paged"] = paged
    optimizer = getattr(bnb_optim, cls)(params, **options)
    if spec.optim_bits == 8 and run.model is not None:
        _embeddings_in_32bit(bnb_optim, run.model)
    return optimizer


# ---------------------------------------------------------------------------- families

# Keys people carry over from other optimizers, and where they go instead (besides the core's
# hints for learning_rate, weight_decay and the adam_* settings).
_ELSEWHERE = {
    "optim_bits": "the name sets it: *_8bit or *_32bit",
    "is_paged": "the name sets it: paged_*",
    "centered": "bitsandbytes has no centered RMSprop; use optim = \"rmsprop\" (torch)",
}


def _family(family: str, cls: str, kwargs: Callable[[Any, dict[str, Any]], dict[str, Any]],
            optim_args: dict[str, OptimArg] | None = None, reads_adam: bool = True, pageable: bool = True,
            elsewhere: dict[str, str] | None = None) -> OptimizerFamily:
    """The names of one bitsandbytes class, sharing its optim_args table."""
    return OptimizerFamily(
        PLUGIN, tuple(name for name, spec in OPTIMIZERS.items() if spec.family == family),
        partial(create, cls, kwargs, pageable), library=("bitsandbytes.optim", "bitsandbytes"),
        optim_args=optim_args or {}, reads=("learning_rate", "weight_decay") + (("adam",) if reads_adam else ()),
        elsewhere={**_ELSEWHERE, **(elsewhere or {})})


FAMILIES = {
    "adamw": _family("adamw", "AdamW", _adamw_kwargs),
    "lion": _family("lion", "Lion", _lion_kwargs, elsewhere={"eps": "bitsandbytes' Lion has no eps"}),
    "rmsprop": _family("rmsprop", "RMSprop", _rmsprop_kwargs, {
        "alpha": OptimArg(float, expect="float in (0, 1)", valid=lambda v: 0 < v < 1),
        "eps": _NON_NEGATIVE, "momentum": _UNIT}, reads_adam=False, pageable=False),
    "ademamix": _family("ademamix", "AdEMAMix", _ademamix_kwargs, {
        "beta1": _UNIT, "beta2": _UNIT, "beta3": _UNIT, "alpha": _NON_NEGATIVE, "eps": _NON_NEGATIVE,
        "t_alpha": _STEPS, "t_beta3": _STEPS}),
}


@hookimpl
def register_optimizers(register):
    for family in FAMILIES.values():
        family.register(register)


@hookimpl
def configure(run):
    for family in FAMILIES.values():
        family.configure(run)
