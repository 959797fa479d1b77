"""engine-lion: the Lion optimizer (Chen et al. 2023) and the PaLM z-loss, as an engine plugin.

Enable with ``plugins = ["lion"]``; select the optimizer with ``train.optim = "lion"`` and
turn the z-loss on with ``[lion] z_loss = 1e-4``. Uses only engine's public plugin API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import engine
from engine import hookimpl
from engine.loss import IGNORE_INDEX, logits_of

__version__ = "0.1.0"

PLUGIN = "lion"  # the entry-point name; also the name of the options section
name = PLUGIN  # so engine.Run(plugins=[engine_lion]) files this module under "lion" too


# ---------------------------------------------------------------------------- options


@dataclass
class LionOptions:
    """``[lion]``: Lion's momentum coefficients and the z-loss weight."""

    beta1: float = engine.option(0.9, help="interpolation of momentum and gradient for the update sign")
    beta2: float = engine.option(0.99, help="decay of the momentum (exp_avg)")
    z_loss: float = engine.option(0.0, help=(
        "PaLM z-loss weight: adds z_loss * mean(logsumexp(logits)**2) over label tokens; 0 disables"))


@hookimpl
def plugin_options():
    return LionOptions


@hookimpl
def configure(run):
    options = run.config.section(PLUGIN)
    for key in ("beta1", "beta2"):
        value = getattr(options, key)
        if not 0.0 <= value < 1.0:
            raise engine.ConfigError(f"{PLUGIN}.{key}: expected 0 <= {key} < 1, got {value}")
    if options.z_loss < 0:
        raise engine.ConfigError(f"{PLUGIN}.z_loss: expected float >= 0, got {options.z_loss}")
    train = run.config.train
    if train.optim == "lion" and engine.parse_optim_args(train.optim_args):
        raise engine.ConfigError(
            f"train.optim_args: lion takes no optim_args; set beta1/beta2 in [{PLUGIN}] "
            "(lr and weight_decay come from [train])")


# ---------------------------------------------------------------------------- optimizer


class Lion(torch.optim.Optimizer):
    """Lion: ``p -= lr * (sign(beta1*m + (1-beta1)*g) + wd * p)``; ``m = beta2*m + (1-beta2)*g``.

    The weight decay is decoupled (applied as ``p *= 1 - lr*wd`` before the signed update).
    State per parameter: ``exp_avg`` (the momentum ``m``).
    """

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas: {betas}")
        if weight_decay < 0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                if wd != 0:
                    p.mul_(1 - lr * wd)
                update = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss


def create_lion(run: Any, params: list[dict[str, Any]]) -> Lion:
    """Optimizer factory: ``params`` are ``engine.param_groups(model, train.weight_decay)``."""
    options = run.config.section(PLUGIN)
    return Lion(params, lr=run.config.train.learning_rate, betas=(options.beta1, options.beta2))


@hookimpl
def register_optimizers(register):
    register("lion", create_lion)


# ---------------------------------------------------------------------------- loss


def z_loss_terms(logits: torch.Tensor, labels: torch.Tensor, shift: bool,
                 label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of token CE, sum of logsumexp(logits)**2, number of label tokens) over non-ignored labels."""
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_labels = labels.reshape(-1)
    mask = flat_labels.ne(IGNORE_INDEX)
    ce = torch.nn.functional.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX,
                                           label_smoothing=label_smoothing, reduction="sum")
    lse = torch.logsumexp(flat_logits, dim=-1)
    z = (lse.square() * mask).sum()
    return ce, z, mask.sum()


@hookimpl
def compute_loss(run, model, batch, num_items_in_batch):
    weight = run.config.section(PLUGIN).z_loss
    if weight <= 0:
        return None  # the builtin loss answers
    labels = batch.get("labels")
    if labels is None:
        return None
    outputs = model(**{k: v for k, v in batch.items() if k != "labels"})
    ce, z, count = z_loss_terms(logits_of(outputs), labels, run.label_shift,
                                run.config.train.label_smoothing_factor)
    denominator = num_items_in_batch if num_items_in_batch is not None else count
    return (ce + weight * z) / denominator
