"""``cpo``: contrastive preference optimization, and SimPO, as TRL 1.16's ``experimental.cpo.CPOTrainer``
computes them.

    plugins = ["cpo"]

    [data]
    train = "pairs.jsonl"     # prompt, chosen, rejected
    packing = false

    [cpo]
    beta = 0.1
    loss_type = "sigmoid"     # or hinge, ipo, simpo (SimPO: usually with cpo_alpha = 0), alphapo
    cpo_alpha = 1.0           # the weight of the chosen completions' negative log-likelihood

No reference model. The loss is ``loss_type``'s loss of the policy's log-probabilities of the chosen and
rejected completions (summed over their tokens; averaged over them for ipo and simpo, TRL's
``average_log_prob``), plus ``cpo_alpha`` times the chosen completions' negative log-likelihood per token.
``alpha`` != 0 reshapes the rewards as AlphaPO does; ``loss_type = "alphapo"`` is TRL's shorthand for
simpo with ``cpo_alpha = 0``. The data builtin tokenizes the pairs (engine/builtin/data/preference.py);
each batch is its chosen rows then its rejected rows, cut to ``data.max_length``.

Logged as TRL logs them: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``,
``nll_loss`` (``eval_`` + each after an evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import ConfigError, hookimpl, option
from engine.kit.preference import MetricMeans, PairsPlugin, check_causal_lm_rows, token_logps

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
AVERAGED = ("ipo", "simpo")  # the losses of log-probabilities averaged over each completion's tokens


@dataclass
class CPOOptions:
    """``[cpo]``: CPOConfig's training keys, with its names and defaults."""

    beta: float = option(0.1, min=0, help="the temperature of the loss (IPO: its tau)")
    label_smoothing: float = option(0.0, min=0, below=1, help=(
        "sigmoid and simpo: the probability that a label is flipped (the conservative loss)"))
    loss_type: str = option("sigmoid", help=(
        f"the loss: {', '.join(LOSS_TYPES)}, or alphapo (simpo with cpo_alpha = 0, TRL's shorthand)"))
    disable_dropout: bool = option(True, help="dropout off in the model (TRL's default)")
    cpo_alpha: float = option(1.0, min=0, help=(
        "the weight of the chosen completions' negative log-likelihood (the BC regulariser; 0 for SimPO)"))
    simpo_gamma: float = option(0.5, help="simpo: the target reward margin")
    alpha: float = option(0.0, help=(
        "AlphaPO's reward shape, r = (1 - p^-alpha) / alpha, for every loss type; 0: the log-probability"))

    def __post_init__(self):
        if self.loss_type == "alphapo":  # TRL's CPOConfig: the shorthand for SimPO without the NLL term
            self.loss_type, self.cpo_alpha = "simpo", 0.0


def check_options(options: CPOOptions) -> None:
    if options.loss_type not in LOSS_TYPES:
        raise ConfigError(f"cpo.loss_type: {options.loss_type!r} is no CPO loss; choose from "
                          f"{', '.join(LOSS_TYPES)} or alphapo")
    if options.loss_type in ("hinge", "ipo") and options.label_smoothing > 0:
        raise ConfigError(f"cpo.label_smoothing: the {options.loss_type} loss has no label smoothing (TRL ignores "
                          f"it); set it to 0, or use loss_type = \"sigmoid\"")
    if options.loss_type in ("ipo", "simpo") and options.beta == 0:
        raise ConfigError(f"cpo.beta: the {options.loss_type} loss divides by it; set it above 0")


class CPO(PairsPlugin):
    """The plugin: one instance per run."""

    name = "cpo"

    def __init__(self) -> None:
        self.metrics = MetricMeans()

    @hookimpl
    def plugin_options(self):
        return CPOOptions

    @hookimpl
    def configure(self, run):
        check_options(run.config.section("cpo"))
        check_causal_lm_rows(run, "cpo")

    @hookimpl
    def plan_lines(self, run):
        options = run.config.section("cpo")
        extra = f", gamma {options.simpo_gamma:g}" if options.loss_type == "simpo" else ""
        shape = f", AlphaPO alpha {options.alpha:g}" if options.alpha else ""
        return [f"loss {options.loss_type} (beta {options.beta:g}{extra}{shape}) + {options.cpo_alpha:g} * chosen "
                "NLL; no reference model"]

    @hookimpl
    def compute_loss(self, run, model, batch, num_items_in_batch):
        options = run.config.section("cpo")
        outputs = []

        def forward(**inputs):  # the model, keeping its full logits: TRL's logits/* include the last position
            outputs.append(model(**inputs))
            return outputs[-1]

        found = token_logps(forward, batch)
        logits = outputs[0].logits if hasattr(outputs[0], "logits") else outputs[0][0]
        rows = len(found.logps) // 2
        sums = found.sums / found.lengths if options.loss_type in AVERAGED else found.sums
        chosen, rejected = sums.chunk(2)
        if options.cpo_alpha == 0:
            nll = torch.zeros((), device=chosen.device)
        else:  # the chosen completions' mean cross-entropy per token
            nll = -found.logps[:rows].sum() / found.mask[:rows].sum()
        losses, chosen_rewards, rejected_rewards = cpo_loss(options, chosen, rejected)
        loss = losses.mean() + options.cpo_alpha * nll
        with torch.no_grad():
            self.metrics.add(model.training, **{
                "rewards/chosen": chosen_rewards.mean(),
                "rewards/rejected": rejected_rewards.mean(),
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                "logps/chosen": chosen.mean(),
                "logps/rejected": rejected.mean(),
                # TRL's: the mean over every position, prompt and padding included
                "logits/chosen": logits[:rows].float().mean(),
                "logits/rejected": logits[rows:].float().mean(),
                "nll_loss": nll,
            })
        return loss

    @hookimpl
    def collect_metrics(self, run, prefix):
        return self.metrics.collect(run, prefix)


def cpo_loss(options: CPOOptions, chosen: torch.Tensor, rejected: torch.Tensor):
    """(per-pair losses, chosen rewards, rejected rewards), TRL's ``CPOTrainer.cpo_loss``."""
    beta, smoothing = options.beta, options.label_smoothing
    if options.alpha != 0:  # AlphaPO: r = (1 - p^-alpha) / alpha
        chosen_scores = (1 - torch.exp(chosen).pow(-options.alpha)) / options.alpha
        rejected_scores = (1 - torch.exp(rejected).pow(-options.alpha)) / options.alpha
    else:
        chosen_scores, rejected_scores = chosen, rejected
    logits = chosen_scores - rejected_scores
    if options.loss_type in ("sigmoid", "simpo"):
        if options.loss_type == "simpo":
            logits = logits - options.simpo_gamma / beta
        losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
    elif options.loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:  # ipo
        losses = (logits - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_scores.detach(), beta * rejected_scores.detach()
