"""``orpo``: odds ratio preference optimization, as TRL 1.16's ``experimental.orpo.ORPOTrainer`` computes it.

    plugins = ["orpo"]

    [data]
    train = "pairs.jsonl"     # prompt, chosen, rejected
    packing = false

    [orpo]
    beta = 0.1                # the paper's lambda: the weight of the odds-ratio term

No reference model. The loss is the chosen rows' negative log-likelihood (over prompt and completion,
as TRL computes it) minus ``beta`` times the mean log-sigmoid of the log odds ratio of the chosen and
rejected completions, whose log-probabilities are averaged over their tokens (TRL's
``average_log_prob=True``). The data builtin tokenizes the pairs (engine/builtin/data/preference.py);
each batch is its chosen rows then its rejected rows, cut to ``data.max_length``.

Logged as TRL logs them: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``,
``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen`` (``eval_`` + each after an evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import hookimpl, option
from engine.kit.preference import MetricMeans, PairsPlugin, check_causal_lm_rows, token_logps


@dataclass
class ORPOOptions:
    """``[orpo]``: ORPOConfig's training keys, with its names and defaults."""

    beta: float = option(0.1, min=0, help=(
        "the weight of the odds-ratio term against the chosen rows' negative log-likelihood (the paper's lambda)"))
    disable_dropout: bool = option(True, help="dropout off in the model (TRL's default)")


class ORPO(PairsPlugin):
    """The plugin: one instance per run."""

    name = "orpo"

    def __init__(self) -> None:
        self.metrics = MetricMeans()

    @hookimpl
    def plugin_options(self):
        return ORPOOptions

    @hookimpl
    def configure(self, run):
        check_causal_lm_rows(run, "orpo")

    @hookimpl
    def plan_lines(self, run):
        options = run.config.section("orpo")
        return [f"loss: chosen NLL - {options.beta:g} * log sigmoid(log odds ratio); no reference model"]

    @hookimpl
    def compute_loss(self, run, model, batch, num_items_in_batch):
        beta = run.config.section("orpo").beta
        found = token_logps(model, batch)
        rows = len(found.logps) // 2
        # each completion's log-probability averaged over its tokens (TRL: average_log_prob=True)
        chosen, rejected = (found.sums / found.lengths).chunk(2)
        nll = sequence_nll(found.logits[:rows], batch["input_ids"][:rows], batch["attention_mask"][:rows])
        chosen, rejected = chosen.float(), rejected.float()
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        loss = nll - (beta * ratio).mean()
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
        with torch.no_grad():
            self.metrics.add(model.training, **{
                "rewards/chosen": chosen_rewards.mean(),
                "rewards/rejected": rejected_rewards.mean(),
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                "logps/chosen": chosen.mean(),
                "logps/rejected": rejected.mean(),
                # TRL's: the mean over every position but the last, prompt and padding included
                "logits/chosen": found.logits[:rows].float().mean(),
                "logits/rejected": found.logits[rows:].float().mean(),
                "nll_loss": nll,
                "log_odds_ratio": ratio.mean(),
                "log_odds_chosen": log_odds.mean(),
            })
        return loss

    @hookimpl
    def collect_metrics(self, run, prefix):
        return self.metrics.collect(run, prefix)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, stable on both sides of -ln 2 (TRL's)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def sequence_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of every next token of the sequences, prompt included, padding not (TRL's ORPO
    NLL: ``logits`` are those that predicted positions 1..)."""
    labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
