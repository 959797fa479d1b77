"""engine-torchao: torchao's low-bit AdamW under the ``TrainingArguments.optim`` names.

Enable with ``plugins = ["torchao"]`` and ``train.optim = "adamw_torch_4bit"`` or
``"adamw_torch_8bit"``. Each name builds the optimizer transformers' ``Trainer`` builds
(``torchao.optim.AdamW4bit`` / ``AdamW8bit``) with the same arguments: ``lr``, ``betas`` =
(``adam_beta1``, ``adam_beta2``), ``eps`` = ``adam_epsilon``, the weight decay per parameter
group (``engine.param_groups``), and from ``train.optim_args`` ``block_size`` (256) and
``bf16_stochastic_round`` (false).

torchao quantizes the two Adam moments block-wise, only for tensors of at least 4096 elements
whose size ``block_size`` divides; other tensors keep float state. The update runs through
``torch.compile``: on CUDA it needs Triton, on the CPU a C++ compiler (checked in ``configure``).
The first step compiles (seconds to a minute); the learning rate lives in a tensor
(``param_groups[i]["lr"]``), which schedulers update in place.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from typing import Any

import torch

import engine
from engine import OptimArg, OptimizerFamily, hookimpl

__version__ = "0.1.0"

PLUGIN = "torchao"
name = PLUGIN
logger = logging.getLogger("engine.torchao")

NAMES = {"adamw_torch_4bit": "AdamW4bit", "adamw_torch_8bit": "AdamW8bit"}  # optim -> torchao.optim class
MIN_TORCHAO = "0.11.0"  # the first release with torchao.optim (earlier: torchao.prototype.low_bit_optim)
MIN_NUMEL = 4096  # torchao quantizes the state of tensors with at least this many elements

OPTIM_ARGS = {  # Trainer's keys and defaults (block_size 256 for both names)
    "block_size": OptimArg(int, 256, "int >= 1", lambda v: v >= 1),
    "bf16_stochastic_round": OptimArg(bool, False, expect="true or false"),
}


def _optim_module(optim: str) -> Any:
    """``torchao.optim``, or MissingDependencyError naming the extra (too old: ``pip install -U``)."""
    FAMILY.require(optim)
    try:
        return importlib.import_module("torchao.optim")
    except ImportError as exc:
        raise engine.MissingDependencyError(
            f"train.optim = {optim!r}: torchao >= {MIN_TORCHAO} is needed (torchao.optim; found torchao "
            f"{importlib.metadata.version('torchao')}: {exc}): pip install -U 'engine[{PLUGIN}]'") from exc


def _cpu_compiler_missing() -> str | None:
    """Why torch.compile cannot build CPU kernels here (no C++ compiler), or None."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor import cpp_builder, exc
    except ImportError:  # another torch layout: let torch.compile speak for itself
        return None
    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return f"no C++ compiler found (tried {[c for c in inductor_config.cpp.cxx if c]})"
    return None


def _check(run: Any, args: dict[str, Any]) -> None:
    train = run.config.train
    _optim_module(train.optim)
    if train.use_cpu or not torch.cuda.is_available():
        missing = _cpu_compiler_missing()
        if missing is not None:
            raise engine.ConfigError(
                f"train.optim = {train.optim!r}: torchao runs the update through torch.compile, which on the "
                f"CPU needs a C++ compiler: {missing}. Install g++ (or set CXX), train on a GPU, or use "
                "adamw_torch / adamw_8bit (engine[bnb]) on the CPU")


def create_low_bit_adamw(run: Any, params: list[dict[str, Any]], args: dict[str, Any]) -> torch.optim.Optimizer:
    """``AdamW4bit`` / ``AdamW8bit`` with Trainer's arguments over ``params`` (decay/no-decay groups);
    ``args``: ``block_size`` and ``bf16_stochastic_round``, Trainer's defaults updated by optim_args."""
    train = run.config.train
    optimizer = getattr(_optim_module(train.optim), NAMES[train.optim])(
        params, lr=train.learning_rate, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_epsilon,
        **args)
    tensors = [p for group in params for p in group["params"]]
    block = args["block_size"]
    if not any(p.numel() >= MIN_NUMEL and p.numel() % block == 0 for p in tensors):
        logger.warning("%s: no parameter has >= %d elements divisible by block_size %d, so every tensor keeps "
                       "32-bit Adam state (no memory saved)", train.optim, MIN_NUMEL, block)
    if args["bf16_stochastic_round"] and not any(p.dtype == torch.bfloat16 for p in tensors):
        logger.warning("%s: bf16_stochastic_round applies to bfloat16 parameters only; these are %s "
                       "(train.bf16 autocasts, it does not store the weights in bfloat16)", train.optim,
                       ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in tensors})))
    return optimizer


FAMILY = OptimizerFamily(
    PLUGIN, tuple(NAMES), create_low_bit_adamw, library=("torchao", "torchao"), optim_args=OPTIM_ARGS,
    reads=("learning_rate", "weight_decay", "adam"), check=_check,
    elsewhere={"amsgrad": "Trainer does not pass amsgrad for these names"})


@hookimpl
def register_optimizers(register):
    FAMILY.register(register)


@hookimpl
def configure(run):
    FAMILY.configure(run)
