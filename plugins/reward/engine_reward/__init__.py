"""``reward``: a pairwise reward model, as TRL 1.16's ``RewardTrainer`` trains one.

    plugins = ["reward"]

    [train]
    model = "sft-output"             # a causal LM folder: its score head starts new, as in TRL
    task = "sequence-classification"
    num_labels = 1

    [data]
    train = "pairs.jsonl"            # prompt, chosen, rejected: text or conversations
    packing = false

    [reward]
    center_rewards_coefficient = 0.01

The data builtin tokenizes the pairs (engine/builtin/data/preference.py): ``prompt_ids + chosen_ids`` is
the token sequence TRL tokenizes as ``prompt + chosen`` (the split is only where they diverge). Each
batch is its chosen sequences then its rejected ones; the model's one output at each sequence's last
token is its reward, and the loss is ``-logsigmoid(r_chosen - r_rejected [- margin])`` averaged over
the pairs (+ ``center_rewards_coefficient * mean((r_chosen + r_rejected) ** 2)``). Pairs longer than
``data.max_length`` are cut to it, keeping the start (``data.truncation = "truncate"``, the default),
or left out as TRL leaves them out (``"drop"``); either way counted in the log.

Logged as TRL logs them: ``accuracy``, ``margin``, ``min_reward``, ``mean_reward``, ``max_reward``
(``eval_`` + each after an evaluation). LoRA: a peft model of task type SEQ_CLS given to ``Run(model=...)``
(the peft plugin wraps causal LMs only, yet).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine import ConfigError, hookimpl, option
from engine.kit.preference import PAIR_COLUMNS, MetricMeans, disable_dropout

logger = logging.getLogger("engine.reward")

SEQUENCE_CLASSIFICATION = "sequence-classification"
MARGIN = "margin"  # the optional column: how far the chosen reward must exceed the rejected one


@dataclass
class RewardOptions:
    """``[reward]``: RewardConfig's training keys, with its names and defaults (its data keys are ``[data]``'s:
    max_length, eos_token, pad_token, chat_template, num_proc)."""

    center_rewards_coefficient: float | None = option(None, min=0, help=(
        "weight of mean((r_chosen + r_rejected)^2) added to the loss, pulling rewards toward mean zero "
        "(Eisenstein et al. 2023; 0.01 recommended); None: off"))
    disable_dropout: bool = option(True, help="dropout off in the model (TRL's default)")


class Reward:
    """The plugin: one instance per run."""

    name = "reward"

    def __init__(self) -> None:
        self.metrics = MetricMeans()

    # ------------------------------------------------------------------ composition

    @hookimpl
    def plugin_options(self):
        return RewardOptions

    @hookimpl
    def configure(self, run):
        train, data = run.config.train, run.config.data
        if run.task != SEQUENCE_CLASSIFICATION:
            given = f" (the model given is a {type(run.model).__name__})" if run.model is not None else ""
            raise ConfigError(f"train.task: reward trains a sequence classifier with one output, but the task is "
                              f"{run.task!r}{given}; set train.task = \"{SEQUENCE_CLASSIFICATION}\" and "
                              "train.num_labels = 1 (a causal LM's folder gets a new score head), or pass a "
                              "...ForSequenceClassification model")
        if run.model is not None:
            labels = getattr(getattr(run.model, "config", None), "num_labels", None)
            if labels != 1:
                raise ConfigError(f"reward: the model given has num_labels = {labels}, but a reward model outputs "
                                  "one score per sequence; pass a model built with num_labels=1")
        elif train.num_labels != 1:
            raise ConfigError(f"train.num_labels: a reward model outputs one score per sequence, got "
                              f"{train.num_labels}; set train.num_labels = 1")
        if "peft" in run.config.plugins and not hasattr(run.model, "peft_config"):  # a peft model given is used
            raise ConfigError("plugins: reward with peft is not supported yet (the peft plugin adapts causal LMs "
                              "only, task_type CAUSAL_LM); train the whole model, or pass a peft model of task_type "
                              "SEQ_CLS (get_peft_model) as Run(model=...)")
        if data.packing:
            raise ConfigError("data.packing: reward models score each sequence whole, never packed; set "
                              "data.packing = false")
        if data.padding_free:
            raise ConfigError("data.padding_free: a sequence classifier reads each row's last token before the "
                              "padding, so its batches are padded; set data.padding_free = false")
        if data.streaming and data.truncation == "drop":
            raise ConfigError("data.truncation: \"drop\" is not applied to streamed pairs yet (they are cut to "
                              "data.max_length); set data.truncation = \"truncate\", or data.streaming = false")

    @hookimpl
    def plan_lines(self, run):
        options, data = run.config.section("reward"), run.config.data
        center = options.center_rewards_coefficient
        loss = "-logsigmoid(r_chosen - r_rejected [- margin])" + (
            f" + {center:g} * mean((r_chosen + r_rejected)^2)" if center is not None else "")
        cut = "cut to it" if data.truncation == "truncate" else "left out"
        return [f"loss {loss}; pairs longer than data.max_length = {data.max_length}: {cut}"]

    # ------------------------------------------------------------------ data

    @hookimpl(wrapper=True)
    def prepare_dataset(self, run, dataset, key):
        """Around the data builtin: pairs longer than data.max_length cut (counted) or left out
        (data.truncation = "drop")."""
        prepared = yield
        return fit_pairs(run.config.data, dataset if prepared is None else prepared, key)

    @hookimpl
    def keep_columns(self, run):
        return [*PAIR_COLUMNS, MARGIN]

    @hookimpl
    def create_collator(self, run):
        return RewardCollator(pad_token_id(run), run.config.data.max_length)

    # ------------------------------------------------------------------ the model

    @hookimpl
    def on_model_built(self, run):
        """The pad token the batches are padded with is the model's (TRL: the tokenizer's pad, else its eos):
        a sequence classifier finds each row's last token by it."""
        config = getattr(run.model, "config", None)
        if config is None:
            return
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        found = pad_token_id(run)
        if getattr(text, "pad_token_id", None) not in (None, found):
            logger.info("reward: the model's pad_token_id %s set to the tokenizer's, %s, which pads the batches",
                        text.pad_token_id, found)
        text.pad_token_id = found

    @hookimpl
    def patch_model(self, run, model):
        if run.config.section("reward").disable_dropout:
            return disable_dropout(model)
        return None

    # ------------------------------------------------------------------ the loss

    @hookimpl
    def compute_loss(self, run, model, batch, num_items_in_batch):
        options = run.config.section("reward")
        inputs = {name: value for name, value in batch.items() if name != MARGIN}
        outputs = model(**inputs, use_cache=False)
        logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
        chosen, rejected = logits.squeeze(-1).chunk(2)
        difference = chosen - rejected
        loss = -F.logsigmoid(difference - batch[MARGIN] if MARGIN in batch else difference).mean()
        if options.center_rewards_coefficient is not None:
            loss = loss + options.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
        with torch.no_grad():
            self.metrics.add(model.training, min_reward=logits.min(), mean_reward=logits.mean(),
                             max_reward=logits.max(), accuracy=(chosen > rejected).float().mean(),
                             margin=difference.mean())
        return loss

    @hookimpl
    def collect_metrics(self, run, prefix):
        return self.metrics.collect(run, prefix)


# ---------------------------------------------------------------------------- the pieces


@dataclass
class RewardCollator:
    """TRL's reward ``DataCollatorForPreference``: ``input_ids`` and ``attention_mask`` of the chosen sequences
    (prompt + chosen) then the rejected ones, cut to ``max_length`` keeping the start, padded on the right;
    ``margin`` where the examples hold one."""

    pad_token_id: int
    max_length: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = [(list(example["prompt_ids"]) + list(example[side]))[:self.max_length]
                     for side in ("chosen_ids", "rejected_ids") for example in examples]
        width = max(len(sequence) for sequence in sequences)
        batch = {"input_ids": torch.tensor([s + [self.pad_token_id] * (width - len(s)) for s in sequences]),
                 "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])}
        if MARGIN in examples[0]:
            batch[MARGIN] = torch.tensor([float(example[MARGIN]) for example in examples], dtype=torch.float)
        return batch


def pad_token_id(run) -> int:
    """The id batches are padded with, as TRL picks it: the tokenizer's pad token, else its eos; the model's
    config.pad_token_id where there is no tokenizer (rows of token ids)."""
    tokenizer = run.tokenizer
    for found in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if found is not None:
            return found
    config = getattr(run.model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = getattr(text, "pad_token_id", None)
    if found is None:
        raise ConfigError("reward: neither the tokenizer (pad or eos token) nor the model's config.pad_token_id "
                          "gives the id that pads the batches, which the model needs to find each row's last "
                          "token; set data.pad_token, or pass tokenizer=")
    return found


def fit_pairs(data: Any, prepared: Any, key: str) -> Any:
    """``prepared`` (the data builtin's pairs of token ids) with its pairs longer than ``data.max_length`` counted
    and cut (by the collator) or left out."""
    import datasets

    if isinstance(prepared, dict):
        return {name: fit_pairs(data, each, f"{key}[{name!r}]") for name, each in prepared.items()}
    if isinstance(prepared, datasets.IterableDataset):  # a stream: its pairs seen one by one, as they come
        if data.truncation == "drop":  # not counted: a stream has no length
            return prepared.filter(lambda example: not set(PAIR_COLUMNS) <= set(example)
                                   or pair_length(example) <= data.max_length)
        return prepared
    if not isinstance(prepared, datasets.Dataset) or not set(PAIR_COLUMNS) <= set(prepared.column_names):
        return prepared  # not preference pairs: another plugin's business, or refused by the data builtin
    return fit_lengths(data, prepared, key)


def pair_length(example: dict[str, Any]) -> int:
    return len(example["prompt_ids"]) + max(len(example["chosen_ids"]), len(example["rejected_ids"]))


def fit_lengths(data: Any, pairs: Any, key: str) -> Any:
    """Pairs whose prompt + chosen or prompt + rejected is longer than data.max_length: counted, and left out
    where data.truncation = "drop" (TRL's RewardTrainer filters them), else cut by the collator."""
    import numpy as np
    import pyarrow.compute as pc

    table = pairs.data
    lengths = pc.list_value_length(table.column("prompt_ids")).to_numpy() + np.maximum(
        pc.list_value_length(table.column("chosen_ids")).to_numpy(),
        pc.list_value_length(table.column("rejected_ids")).to_numpy())
    too_long = np.flatnonzero(lengths > data.max_length)
    if not len(too_long):
        return pairs
    where = (f"{len(too_long)} of {len(lengths)} pairs (the first row {int(too_long[0])}, the longest "
             f"{int(lengths.max())} tokens) are longer than data.max_length = {data.max_length}")
    if data.truncation == "drop":
        if len(too_long) == len(lengths):
            raise ConfigError(f"{key}: all {where}; raise data.max_length, or set data.truncation = \"truncate\"")
        logger.info("%s: %s: left out (data.truncation = \"drop\", as TRL)", key, where)
        return pairs.select(np.flatnonzero(lengths <= data.max_length))
    logger.info("%s: %s: cut to it, keeping the start (data.truncation = \"drop\" leaves them out, as TRL)",
                key, where)
    return pairs
