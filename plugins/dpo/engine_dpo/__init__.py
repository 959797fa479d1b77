"""``dpo``: direct preference optimization, as TRL 1.16's ``DPOTrainer`` computes it.

    plugins = ["dpo"]

    [data]
    train = "pairs.jsonl"     # prompt, chosen, rejected: text or conversations
    packing = false

    [dpo]
    beta = 0.1
    loss_type = ["sigmoid"]   # TRL's names; several are summed with loss_weights

The data builtin tokenizes the pairs as TRL does (engine/builtin/data/preference.py); each batch is
its chosen rows then its rejected rows, cut to ``data.max_length``. The loss compares the policy's
log-probabilities of the completions with the reference model's, which is, in this order: the
model ``ref_model`` names; with the peft plugin, the base model with the adapter off (no second
copy); else a frozen copy of the starting weights. ``precompute_ref_log_probs`` runs the reference
once over the data before training (cached with the tokenized data by datasets) and frees it.
Checkpoints record the reference's fingerprint: a resume against another reference is refused.

Logged as TRL logs them: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``,
``entropy`` and ``mean_token_accuracy`` (``eval_`` + each after an evaluation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from engine import ConfigError, hookimpl, option
from engine.kit.preference import (
    PAIR_COLUMNS, REFERENCE_COLUMNS, MetricMeans, PairCollator, Reference, check_causal_lm_rows,
    check_reference_options, completion_metrics, disable_dropout, mean_logits, pad_token_id, pair_key, reference_plan, token_logps,
    top1_accuracy,
)

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
# the losses built on the chosen-rejected score difference: the only ones an f-divergence generalises (TRL)
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


@dataclass
class DPOOptions:
    """``[dpo]``: DPOConfig's training keys, with its names and defaults."""

    beta: float = option(0.1, min=0, help="how far the policy may move from the reference (IPO: its tau)")
    loss_type: list[str] = option(default_factory=lambda: ["sigmoid"], help=(
        f"the loss, or several summed with loss_weights (RPO: ['sigmoid', 'sft']): {', '.join(LOSS_TYPES)}"))
    loss_weights: list[float] | None = option(None, help="a weight per loss_type (default 1.0 each)")
    label_smoothing: float = option(0.0, min=0, below=1, help=(
        "robust: the probability that a label is flipped, in [0, 0.5); exo_pair: its epsilon (> 0)"))
    ld_alpha: float | None = option(None, min=0, max=1, help=(
        "LD-DPO: the weight of completion tokens beyond the shorter completion's length (None: 1)"))
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = option(
        "reverse_kl", help="the f-divergence regulariser (f-DPO); reverse_kl is DPO's")
    f_alpha_divergence_coef: float = option(0.5, help="alpha of alpha_divergence")
    discopop_tau: float = option(0.05, min=0, help="the temperature of the discopop loss")
    ref_model: str | None = option(None, help=(
        "the reference model (a folder or hub name); default: the base with the adapter off (peft), else a "
        "frozen copy of the starting weights"))
    precompute_ref_log_probs: bool = option(False, help=(
        "run the reference once over the data before training, cached with it, and free it"))
    precompute_ref_batch_size: int | None = option(None, min=1, help=(
        "the batch size of that pass (default: per_device_train_batch_size / per_device_eval_batch_size)"))
    disable_dropout: bool = option(True, help="dropout off in the policy and the reference (TRL's default)")

    def __post_init__(self):
        if isinstance(self.loss_type, str):  # TRL takes one name as a string too
            self.loss_type = [self.loss_type]


def check_options(options: DPOOptions) -> None:
    unknown = [name for name in options.loss_type if name not in LOSS_TYPES]
    if unknown or not options.loss_type:
        raise ConfigError(f"dpo.loss_type: {', '.join(map(repr, unknown)) or 'none given'} is no DPO loss; "
                          f"choose from {', '.join(LOSS_TYPES)}")
    if options.loss_weights is not None and len(options.loss_weights) != len(options.loss_type):
        raise ConfigError(f"dpo.loss_weights: {len(options.loss_weights)} weights for {len(options.loss_type)} "
                          "loss types; give one per dpo.loss_type")
    if "exo_pair" in options.loss_type and options.label_smoothing == 0:
        raise ConfigError("dpo.label_smoothing: exo_pair needs it above 0 (the EXO paper uses 1e-3)")
    if "robust" in options.loss_type and options.label_smoothing >= 0.5:
        raise ConfigError(f"dpo.label_smoothing: robust needs it in [0, 0.5), got {options.label_smoothing}")
    if options.f_divergence_type != "reverse_kl":
        others = [name for name in options.loss_type if name not in F_DIVERGENCE_LOSSES]
        if others:
            raise ConfigError(f"dpo.f_divergence_type: {options.f_divergence_type!r} generalises only "
                              f"{', '.join(F_DIVERGENCE_LOSSES)}, not {', '.join(others)}; set it to 'reverse_kl'")


class DPO:
    """The plugin: one instance per run."""

    name = "dpo"

    def __init__(self) -> None:
        self.metrics = MetricMeans()
        self.reference = Reference()
        self.ld_alpha: float | None = None  # dpo.ld_alpha, for the reference's sums too

    # ------------------------------------------------------------------ composition

    @hookimpl
    def plugin_options(self):
        return DPOOptions

    @hookimpl
    def configure(self, run):
        options = run.config.section("dpo")
        check_options(options)
        self.ld_alpha = options.ld_alpha
        check_causal_lm_rows(run, "dpo")
        check_reference_options(run, "dpo", options.ref_model, options.precompute_ref_log_probs)

    @hookimpl
    def plan_lines(self, run):
        options = run.config.section("dpo")
        weights = options.loss_weights or [1.0] * len(options.loss_type)
        losses = " + ".join(f"{w:g} * {name}" for name, w in zip(options.loss_type, weights))
        return [f"loss {losses}, beta {options.beta:g}; "
                + reference_plan(run, options.ref_model, options.precompute_ref_log_probs)]

    # ------------------------------------------------------------------ data

    @hookimpl
    def keep_columns(self, run):
        return [*PAIR_COLUMNS, *REFERENCE_COLUMNS]

    @hookimpl
    def create_collator(self, run):
        return LookupCollator(pad_token_id(run.tokenizer), run.config.data.max_length, self.reference.table)

    # ------------------------------------------------------------------ the reference

    @hookimpl(trylast=True)
    def patch_model(self, run, model):
        """After the other patches (peft wraps the model first): the reference is decided, and precomputed,
        before the strategy wraps the model and before a resume restores weights."""
        options = run.config.section("dpo")
        undo = disable_dropout(run.model) if options.disable_dropout else None
        self.reference.setup(run, options.ref_model, options.disable_dropout, "dpo.ref_model")
        if options.precompute_ref_log_probs:
            collator = PairCollator(pad_token_id(run.tokenizer), run.config.data.max_length)
            self.reference.precompute(run, collator, self._reference_sums,
                                      REFERENCE_COLUMNS, options.precompute_ref_batch_size, pair_key,
                                      settings=str(options.ld_alpha))
        return undo

    def _reference_sums(self, scorer, batch):
        chosen, rejected = sequence_logps(token_logps(scorer, batch), self.ld_alpha).chunk(2)
        return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

    def _reference_logps(self, run, model, batch):
        if REFERENCE_COLUMNS[0] in batch:
            return batch[REFERENCE_COLUMNS[0]], batch[REFERENCE_COLUMNS[1]]
        with self.reference.scoring(run, model) as scorer:
            found = self._reference_sums(scorer, batch)
        return found["ref_chosen_logps"], found["ref_rejected_logps"]

    @hookimpl
    def checkpoint_state(self, run):
        return self.reference.state()

    @hookimpl
    def load_checkpoint_state(self, run, state):
        self.reference.check(state)

    # ------------------------------------------------------------------ the loss

    @hookimpl
    def compute_loss(self, run, model, batch, num_items_in_batch):
        options = run.config.section("dpo")
        found = token_logps(model, batch)
        chosen, rejected = sequence_logps(found, options.ld_alpha).chunk(2)
        ref_chosen, ref_rejected = self._reference_logps(run, model, batch)
        loss = dpo_loss(options, chosen, rejected, ref_chosen, ref_rejected, found, batch["completion_mask"])
        rows = len(chosen)
        chosen_rewards = options.beta * (chosen - ref_chosen).detach()
        rejected_rewards = options.beta * (rejected - ref_rejected).detach()
        self.metrics.add(model.training, **completion_metrics(found), **{
            "logits/chosen": mean_logits(found, slice(0, rows)),
            "logits/rejected": mean_logits(found, slice(rows, None)),
            "mean_token_accuracy": top1_accuracy(found, batch["input_ids"], slice(0, rows)),
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": chosen.detach().mean(),
            "logps/rejected": rejected.detach().mean(),
        })
        return loss

    @hookimpl
    def collect_metrics(self, run, prefix):
        return self.metrics.collect(run, prefix)


# ---------------------------------------------------------------------------- the pieces


class LookupCollator(PairCollator):
    """The pair collator, adding each pair's precomputed reference log-probs (found by its token ids)."""

    def __init__(self, pad_token_id: int, max_length: int | None, table: dict[tuple, tuple[float, float]]):
        super().__init__(pad_token_id, max_length)
        self.table = table

    def __call__(self, examples):
        batch = super().__call__(examples)
        if self.table:
            found = [self.table[pair_key(example)] for example in examples]
            batch["ref_chosen_logps"] = torch.tensor([chosen for chosen, _ in found])
            batch["ref_rejected_logps"] = torch.tensor([rejected for _, rejected in found])
        return batch


def sequence_logps(found, ld_alpha: float | None) -> torch.Tensor:
    """Each row's completion log-probability: the sum over its tokens; with LD-DPO's ``ld_alpha`` the tokens
    beyond the shorter completion of its pair weighted by it."""
    if ld_alpha is None:
        return found.sums
    positions = found.mask.cumsum(dim=1)
    chosen_lengths, rejected_lengths = found.lengths.long().chunk(2)
    shared = torch.minimum(chosen_lengths, rejected_lengths).repeat(2).unsqueeze(1)
    shared_mask = (positions > 0) & (positions <= shared)
    tail_mask = positions > shared
    return (found.logps * shared_mask).sum(1) + ld_alpha * (found.logps * tail_mask).sum(1)


def _scores(options: DPOOptions, chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor):
    kind = options.f_divergence_type
    if kind == "reverse_kl":
        return chosen_logratios, rejected_logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-chosen_logratios), 1 - torch.exp(-rejected_logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(chosen_logratios), math.log(2) + F.logsigmoid(rejected_logratios)
    alpha = options.f_alpha_divergence_coef  # alpha_divergence
    if abs(alpha - 1.0) < 1e-6:
        return chosen_logratios, rejected_logratios
    scale = 1.0 / (alpha - 1.0)

    def score(logratios):
        clamp = {torch.float16: 11.0}.get(logratios.dtype, 80.0)
        grown = torch.exp(torch.clamp(((alpha - 1.0) * logratios).float(), max=clamp)) - 1.0
        return grown.to(logratios.dtype) * scale

    return score(chosen_logratios), score(rejected_logratios)


def dpo_loss(options: DPOOptions, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, found, completion_mask: torch.Tensor) -> torch.Tensor:
    """The weighted sum of ``options.loss_type``'s losses, each the mean over the pairs (TRL's formulas)."""
    beta, smoothing = options.beta, options.label_smoothing
    chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
    chosen_scores, rejected_scores = _scores(options, chosen_logratios, rejected_logratios)
    delta = chosen_scores - rejected_scores
    chosen_tokens, rejected_tokens = completion_mask.sum(dim=1).clamp(min=1.0).chunk(2)
    weights = options.loss_weights or [1.0] * len(options.loss_type)
    total = 0.0
    for name, weight in zip(options.loss_type, weights):
        if name == "sigmoid":
            per_pair = -F.logsigmoid(beta * delta)
        elif name == "hinge":
            per_pair = torch.relu(1 - beta * delta)
        elif name in ("ipo", "sigmoid_norm"):  # scores averaged over each completion's tokens
            normalised = chosen_scores / chosen_tokens - rejected_scores / rejected_tokens
            per_pair = (normalised - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * normalised)
        elif name == "exo_pair":
            epsilon = torch.tensor(smoothing, device=delta.device)
            per_pair = (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-epsilon))
                        + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(epsilon)))
        elif name == "nca_pair":
            chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
            per_pair = (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                        - 0.5 * F.logsigmoid(-rejected_rewards))
        elif name == "robust":
            per_pair = (-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)) \
                / (1 - 2 * smoothing)
        elif name == "bco_pair":
            per_pair = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        elif name == "sppo_hard":
            per_pair = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif name in ("aot", "aot_unpaired"):
            if name == "aot":
                sorted_delta = torch.sort(chosen - rejected, dim=0)[0] - torch.sort(ref_chosen - ref_rejected, dim=0)[0]
            else:
                sorted_delta = torch.sort(chosen_logratios, dim=0)[0] - torch.sort(rejected_logratios, dim=0)[0]
            per_pair = (-F.logsigmoid(beta * sorted_delta) * (1 - smoothing)
                        - F.logsigmoid(-beta * sorted_delta) * smoothing)
        elif name == "apo_zero":
            per_pair = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
        elif name == "apo_down":
            per_pair = torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(
                beta * (chosen_logratios - rejected_logratios))
        elif name == "discopop":
            logits = delta * beta
            modulation = torch.sigmoid(logits / options.discopop_tau)
            per_pair = -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
        else:  # sft: the chosen completions' negative log-likelihood per token
            rows = len(chosen)
            mask = found.mask[:rows].bool()
            per_pair = (-found.logps[:rows][mask].mean()).expand(rows)
        total = total + per_pair.mean() * weight
    return total
