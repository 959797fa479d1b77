"""engine-grokadamw: GrokAdamW (``grokadamw``) with configurable grokking signals.

Enable with ``plugins = ["grokadamw"]`` and ``train.optim = "grokadamw"``. Hyper-parameters
follow Trainer: ``train.optim_args`` keys ``alpha_init``, ``lamb``, ``gamma``,
``grokking_signal_decay_rate``, ``gradient_clipping``; the signal functions come from
``[grokadamw] signals``. The optimizer state survives checkpoints (the library's own
``state_dict`` round trip resets it; see :class:`engine_grokadamw.optimizer.GrokAdamW`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import engine
from engine import OptimArg, OptimizerFamily, hookimpl, load_callable

__version__ = "0.1.0"

PLUGIN = "grokadamw"
name = PLUGIN

# train.optim_args keys, with Trainer's defaults
OPTIM_ARGS = {
    "alpha_init": OptimArg(float, 0.98, "float in [0, 1]", lambda v: 0.0 <= v <= 1.0),
    "lamb": OptimArg(float, 2.0),
    "gamma": OptimArg(float, 0.1, "float in [0, 1]", lambda v: 0.0 <= v <= 1.0),
    "grokking_signal_decay_rate": OptimArg(float, 0.1),
    "gradient_clipping": OptimArg(float, 1.0, "float >= 0 (0 disables the per-parameter clipping)",
                                  lambda v: v >= 0.0),
}
BUILTIN_SIGNALS = ("loss_gap",)


@dataclass
class GrokAdamWOptions:
    """``[grokadamw]``: where the grokking signal comes from."""

    signals: list[str] = engine.option(default_factory=list, help=(
        "grokking signal functions, averaged: 'loss_gap' (max(0, eval_loss - loss) / max of both, "
        "from the latest logged losses) or 'package.module:function' called with the run and returning "
        "a float or None; empty (Trainer's default): no signal, alpha stays alpha_init"))


@hookimpl
def plugin_options():
    return GrokAdamWOptions


def _library() -> Any:
    """``engine_grokadamw.optimizer`` (imports grokadamw), or a MissingDependencyError naming the extra."""
    FAMILY.require("grokadamw")
    from . import optimizer

    return optimizer


def _signal_factories(run: Any) -> list[Any]:
    """For each entry of ``[grokadamw] signals``: a callable ``make(run) -> signal function``."""
    makers = []
    for index, spec in enumerate(run.config.section(PLUGIN).signals):
        key = f"{PLUGIN}.signals[{index}]"
        if spec == "loss_gap":
            makers.append(lambda run: _library().LossGap(run))
        elif ":" in spec:
            fn = load_callable(spec, key)
            makers.append(lambda run, fn=fn: functools.partial(fn, run))
        else:
            raise engine.ConfigError(f"{key}: unknown signal {spec!r}; use one of {', '.join(BUILTIN_SIGNALS)} "
                                     "or 'package.module:function' (called with the run, returns a float or None)")
    return makers


def create_grokadamw(run: Any, params: list[dict[str, Any]], args: dict[str, Any]) -> Any:
    """Trainer's GrokAdamW (decay/no-decay groups, lr, optim_args over Trainer's defaults) plus the signals.

    Trainer passes no betas and eps (the library's defaults equal [train]'s defaults); the
    engine passes ``adam_beta1``, ``adam_beta2`` and ``adam_epsilon`` so that setting them has
    an effect.
    """
    train = run.config.train
    fns = [make(run) for make in _signal_factories(run)]
    return _library().GrokAdamW(params, lr=train.learning_rate, betas=(train.adam_beta1, train.adam_beta2),
                                eps=train.adam_epsilon, grokking_signal_fns=fns or None, **args)


FAMILY = OptimizerFamily(PLUGIN, ("grokadamw",), create_grokadamw, library=("grokadamw", "grokadamw"),
                         optim_args=OPTIM_ARGS, reads=("learning_rate", "weight_decay", "adam"))


@hookimpl
def register_optimizers(register):
    FAMILY.register(register)


@hookimpl
def configure(run):
    _signal_factories(run)  # refuse bad signal specs even when another optimizer is chosen
    FAMILY.configure(run)
