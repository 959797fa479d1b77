"""``kto``: Kahneman-Tversky optimization, as TRL 1.16's ``KTOTrainer`` computes it.

    plugins = ["kto"]

    [data]
    train = "feedback.jsonl"   # prompt, completion, label (true: desirable): text or conversations
    packing = false

    [train]
    train_sampling_strategy = "sequential"   # the KL term pairs each row with its batch neighbour

    [kto]
    beta = 0.1
    loss_type = "kto"          # or "apo_zero_unpaired"

The data builtin tokenizes the rows as TRL does (engine/builtin/data/preference.py). Paired rows
(prompt, chosen, rejected) are unpaired as TRL's ``unpair_preference_dataset`` does: per 1,000 pairs,
their chosen completions (desirable) then their rejected ones. The KL term is estimated, as TRL does,
from mismatched rows: within each run of ``per_device_train_batch_size`` rows of the data, every
prompt gets the completion of the row before it (the first, the last's). The policy's and the
reference's log-probabilities of those rows give ``kl``, the batch mean of their difference, clamped
at 0 (and averaged over processes, as TRL's gather does).

The reference is, in this order: with the peft plugin, the base model with the adapter off (no
second copy); else a frozen copy of the starting weights. ``precompute_ref_log_probs`` runs it once
over the data before training (cached with the tokenized data by datasets) and frees it.
Checkpoints record the reference's fingerprint: a resume against another reference is refused.

Logged as TRL logs them, each the mean over the batches since the last log of the batch's figure
over every process (a batch without desirable rows adds nothing to ``rewards/chosen``, ...):
``kl``, ``entropy``, ``logits/chosen``, ``logits/rejected``, ``rewards/chosen``, ``rewards/rejected``,
``rewards/margins`` (of the batches holding both), ``logps/chosen``, ``logps/rejected``
(``eval_`` + each after an evaluation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from engine import ConfigError, hookimpl, option
from engine.kit.preference import (
    PAIR_COLUMNS, UNPAIRED_COLUMNS, CompletionCollator, Reference, check_causal_lm_rows, check_reference_options,
    disable_dropout, pad_token_id, reference_plan, token_logps,
)

logger = logging.getLogger("engine.kto")

KL_COLUMN = "KL_completion_ids"  # TRL's name: the completion of the row before, within a batch of the data
REFERENCE_COLUMNS = ("ref_logps", "ref_KL_logps")  # precomputed reference log-probs (TRL's names)
UNPAIR_BATCH = 1000  # TRL unpairs with datasets' default map batch size: per 1,000 pairs, chosen then rejected
SEQUENCE_KEYS = ("input_ids", "attention_mask", "completion_mask")


@dataclass
class KTOOptions:
    """``[kto]``: KTOConfig's training keys, with its names and defaults."""

    beta: float = option(0.1, min=0, help="how far the policy may move from the reference (higher: less)")
    loss_type: Literal["kto", "apo_zero_unpaired"] = option("kto", help=(
        "kto (the KTO paper's, with the KL term) or apo_zero_unpaired (APO-zero, unpaired; no KL term)"))
    desirable_weight: float = option(1.0, min=0, help="the weight of the desirable rows' losses")
    undesirable_weight: float = option(1.0, min=0, help="the weight of the undesirable rows' losses")
    precompute_ref_log_probs: bool = option(False, help=(
        "run the reference once over the data before training, cached with it, and free it"))
    precompute_ref_batch_size: int | None = option(None, min=1, help=(
        "the batch size of that pass (default: per_device_train_batch_size / per_device_eval_batch_size)"))
    disable_dropout: bool = option(True, help="dropout off in the policy and the reference (TRL's default)")
    ref_model: str | None = option(None, help=(
        "the reference model (a folder or hub name); default: the base with the adapter off (peft), else a "
        "frozen copy of the starting weights"))
    sync_ref_model: bool = option(False, help="TR-DPO's reference updates: not supported yet (must be false)")

    @property
    def calculate_kl(self) -> bool:
        return self.loss_type != "apo_zero_unpaired"


class KTO:
    """The plugin: one instance per run."""

    name = "kto"

    def __init__(self) -> None:
        self.metrics = BatchFigures()
        self.reference = Reference()

    # ------------------------------------------------------------------ composition

    @hookimpl
    def plugin_options(self):
        return KTOOptions

    @hookimpl
    def configure(self, run):
        options, train = run.config.section("kto"), run.config.train
        if options.sync_ref_model:
            raise ConfigError("kto.sync_ref_model: TR-DPO's reference updates are not supported yet; set it to false")
        check_causal_lm_rows(run, "kto")
        if options.calculate_kl:
            if train.train_sampling_strategy != "sequential":
                raise ConfigError(
                    f"train.train_sampling_strategy: loss_type {options.loss_type!r} estimates the KL term from each "
                    "row paired with its neighbour's completion in a fixed-order batch, which "
                    f"{train.train_sampling_strategy!r} breaks; set train.train_sampling_strategy = \"sequential\" "
                    "(or kto.loss_type = \"apo_zero_unpaired\")")
            if train.per_device_train_batch_size <= 1:
                raise ConfigError(
                    "train.per_device_train_batch_size: kto needs at least 2 rows per batch (with one, the KL term "
                    "is the reward itself); raise it, or set kto.loss_type = \"apo_zero_unpaired\"")
        check_reference_options(run, "kto", options.ref_model, options.precompute_ref_log_probs)

    @hookimpl
    def plan_lines(self, run):
        options = run.config.section("kto")
        reference = reference_plan(run, options.ref_model, options.precompute_ref_log_probs)
        kl = "with the KL term of mismatched rows" if options.calculate_kl else "no KL term"
        return [f"loss {options.loss_type} ({kl}), beta {options.beta:g}, desirable weight "
                f"{options.desirable_weight:g}, undesirable weight {options.undesirable_weight:g}; {reference}"]

    # ------------------------------------------------------------------ data

    @hookimpl(wrapper=True)
    def prepare_dataset(self, run, dataset, key):
        """The examples the data builtin made, unpaired (paired rows) and with their KL completions."""
        prepared = yield
        options = run.config.section("kto")
        found = dataset if prepared is None else prepared
        if isinstance(found, dict):
            return {name: unpaired_examples(d, options, run.config.train.per_device_train_batch_size)
                    for name, d in found.items()}
        return unpaired_examples(found, options, run.config.train.per_device_train_batch_size)

    @hookimpl
    def keep_columns(self, run):
        return [*UNPAIRED_COLUMNS, KL_COLUMN, *REFERENCE_COLUMNS]

    @hookimpl
    def create_collator(self, run):
        return UnpairedCollator(pad_token_id(run.tokenizer), run.config.data.max_length,
                                run.config.section("kto").calculate_kl, self.reference.table)

    @hookimpl
    def on_build_end(self, run):
        check_unpaired(run.train_dataset, "train dataset")
        evaluation = run.eval_dataset if isinstance(run.eval_dataset, dict) else {"eval dataset": run.eval_dataset}
        for name, dataset in evaluation.items():
            check_unpaired(dataset, name)
        warn_about_weights(run.train_dataset, run.config.section("kto"))

    # ------------------------------------------------------------------ the reference

    @hookimpl(trylast=True)
    def patch_model(self, run, model):
        """After the other patches (peft wraps the model first): the reference is decided, and precomputed,
        before the strategy wraps the model and before a resume restores weights."""
        options = run.config.section("kto")
        undo = disable_dropout(run.model) if options.disable_dropout else None
        self.reference.setup(run, options.ref_model, options.disable_dropout, "kto.ref_model")
        if options.precompute_ref_log_probs:
            collator = UnpairedCollator(pad_token_id(run.tokenizer), run.config.data.max_length, options.calculate_kl)
            columns = REFERENCE_COLUMNS if options.calculate_kl else REFERENCE_COLUMNS[:1]
            self.reference.precompute(run, collator, lambda scorer, batch: self._reference_sums(scorer, batch, options),
                                      columns, options.precompute_ref_batch_size, row_key,
                                      settings=str(options.calculate_kl))
        return undo

    def _reference_sums(self, scorer, batch, options):
        found = {"ref_logps": token_logps(scorer, sequences(batch)).sums}
        if options.calculate_kl:
            found["ref_KL_logps"] = token_logps(scorer, sequences(batch, "KL_")).sums
        return found

    def _reference_logps(self, run, model, batch, options):
        """The reference's log-probabilities of the batch's completions and of its KL rows (None without)."""
        if "ref_logps" in batch:
            return batch["ref_logps"], batch.get("ref_KL_logps")
        with self.reference.scoring(run, model) as scorer:
            found = self._reference_sums(scorer, batch, options)
        return found["ref_logps"], found.get("ref_KL_logps")

    @hookimpl
    def checkpoint_state(self, run):
        return self.reference.state()

    @hookimpl
    def load_checkpoint_state(self, run, state):
        self.reference.check(state)

    # ------------------------------------------------------------------ the loss

    @hookimpl
    def compute_loss(self, run, model, batch, num_items_in_batch):
        options = run.config.section("kto")
        beta = options.beta
        needed = ["label", *(f"KL_{key}" for key in SEQUENCE_KEYS if options.calculate_kl)]
        if any(key not in batch for key in needed):
            raise ConfigError(f"kto: the batches lack {', '.join(k for k in needed if k not in batch)}; a data_collator "
                              "given to Run must make them as engine_kto.UnpairedCollator does, or leave it unset")
        if options.calculate_kl:  # the policy on the mismatched rows: no gradient (TRL)
            with torch.no_grad():
                kl_logps = token_logps(model, sequences(batch, "KL_")).sums
        found = token_logps(model, sequences(batch))
        logps = found.sums
        ref_logps, ref_kl_logps = self._reference_logps(run, model, batch, options)
        desirable = batch["label"].to(device=logps.device, dtype=torch.bool)
        chosen_idx = torch.nonzero(desirable, as_tuple=False).view(-1)
        rejected_idx = torch.nonzero(~desirable, as_tuple=False).view(-1)
        chosen, rejected = logps.index_select(0, chosen_idx), logps.index_select(0, rejected_idx)
        ref_chosen = ref_logps.to(logps.device).index_select(0, chosen_idx)
        ref_rejected = ref_logps.to(logps.device).index_select(0, rejected_idx)

        if options.calculate_kl:
            kl = (kl_logps - ref_kl_logps.to(kl_logps.device)).mean().detach()
            if run.strategy.world_size > 1:  # TRL gathers it before the loss uses it
                kl = run.strategy.reduce(kl, "mean")
            kl = kl.clamp(min=0)
        else:
            kl = torch.zeros((), device=logps.device)
        chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
        if options.loss_type == "kto":  # Eqn (7) of the KTO paper
            chosen_losses = 1 - torch.sigmoid(beta * (chosen_logratios - kl))
            rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_logratios))
        else:  # apo_zero_unpaired
            chosen_losses = 1 - torch.sigmoid(beta * chosen_logratios)
            rejected_losses = torch.sigmoid(beta * rejected_logratios)
        losses = torch.cat((options.desirable_weight * chosen_losses, options.undesirable_weight * rejected_losses), 0)

        with torch.no_grad():
            mask, log_probs = found.mask, found.log_probs
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            mean_logits = found.logits.float().mean(-1)
            chosen_mask = mask.index_select(0, chosen_idx).bool()
            rejected_mask = mask.index_select(0, rejected_idx).bool()
            self.metrics.add(model.training, kl.float(), {
                "entropy": ((entropy * mask).sum(), mask.sum()),
                "logits/chosen": (mean_logits.index_select(0, chosen_idx)[chosen_mask].sum(), chosen_mask.sum()),
                "logits/rejected": (mean_logits.index_select(0, rejected_idx)[rejected_mask].sum(),
                                    rejected_mask.sum()),
                "rewards/chosen": ((beta * chosen_logratios).nansum(), chosen_idx.numel()),
                "logps/chosen": (chosen.nansum(), chosen_idx.numel()),
                "rewards/rejected": ((beta * rejected_logratios).nansum(), rejected_idx.numel()),
                "logps/rejected": (rejected.nansum(), rejected_idx.numel()),
            })
        return losses.nanmean()

    @hookimpl
    def collect_metrics(self, run, prefix):
        return self.metrics.collect(run, prefix)


# ---------------------------------------------------------------------------- the data


def _unpair(batch: dict[str, list]) -> dict[str, list]:
    """Pairs as unpaired rows: the chosen completions (desirable) then the rejected ones (TRL's ``_unpair_row``)."""
    size = len(batch["chosen_ids"])
    rows = {"prompt_ids": batch["prompt_ids"] * 2, "completion_ids": batch["chosen_ids"] + batch["rejected_ids"],
            "label": [True] * size + [False] * size}
    rows.update({name: values * 2 for name, values in batch.items() if name not in PAIR_COLUMNS})
    return rows


def _add_kl_completions(batch: dict[str, list]) -> dict[str, list]:
    """Each row's KL completion: the previous row's, the first row's the last's (TRL's ``add_kl_completion_ids``)."""
    completions = batch["completion_ids"]
    return {**batch, KL_COLUMN: [completions[-1]] + completions[:-1]}


def unpaired_examples(dataset: Any, options: KTOOptions, batch_size: int) -> Any:
    """A datasets object of preference examples made unpaired, with its KL completions (as TRL makes them);
    other datasets as they are (the collator then pairs within each batch)."""
    names = list(getattr(dataset, "column_names", None) or [])
    if not names or not hasattr(dataset, "map"):
        return dataset
    if set(PAIR_COLUMNS) <= set(names) and "completion_ids" not in names:
        dataset = dataset.map(_unpair, batched=True, batch_size=UNPAIR_BATCH, remove_columns=names)
        names = list(dataset.column_names or [])
    if options.calculate_kl and set(UNPAIRED_COLUMNS) <= set(names) and KL_COLUMN not in names:
        dataset = dataset.map(_add_kl_completions, batched=True, batch_size=batch_size)
    return dataset


def check_unpaired(dataset: Any, key: str) -> None:
    """Refuse examples that are not unpaired rows, before training."""
    if dataset is None:
        return
    names = getattr(dataset, "column_names", None)
    if names is None:
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
            return  # a stream: its first example is not read ahead
        try:
            first = dataset[0]
        except (IndexError, KeyError):
            return
        names = list(first) if hasattr(first, "keys") else []
    missing = [name for name in UNPAIRED_COLUMNS if name not in names]
    if missing:
        raise ConfigError(f"kto learns from unpaired rows: prompt, completion, label (true: desirable), or pairs of "
                          f"prompt, chosen, rejected, which it unpairs; the {key} holds {', '.join(names) or 'none'} "
                          f"(no {', '.join(missing)}); give such rows")


def warn_about_weights(dataset: Any, options: KTOOptions) -> None:
    """TRL's warning when desirable and undesirable rows are unbalanced and the weights do not make up for it."""
    if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__") or "label" not in dataset.column_names:
        return
    labels = dataset["label"]
    desirable = max(sum(labels), 1)
    undesirable = max(len(labels) - desirable, 1)
    if desirable == undesirable:
        return
    ratio_d, ratio_u = undesirable * options.undesirable_weight / desirable, desirable * options.desirable_weight / undesirable
    d_low, d_high = round(ratio_d, 2), round(ratio_d * 1.33, 2)
    u_low, u_high = round(ratio_u / 1.33, 2), round(ratio_u, 2)
    if not (d_low <= options.desirable_weight <= d_high or u_low <= options.undesirable_weight <= u_high):
        logger.warning(f"kto: {desirable} desirable and {undesirable} undesirable rows, but the weights do not make "
                       f"up for it; set EITHER kto.desirable_weight in [{d_low}, {d_high}] OR kto.undesirable_weight "
                       f"in [{u_low}, {u_high}] (not both)")


@dataclass
class UnpairedCollator(CompletionCollator):
    """TRL's ``DataCollatorForUnpairedPreference``: the kit's completion batch, plus (``calculate_kl``) the KL rows
    (``KL_input_ids``, ``KL_attention_mask``, ``KL_completion_mask``: each prompt with its ``KL_completion_ids``,
    or, for examples without them, the previous example's completion), and the reference log-probs: the examples'
    (``ref_logps``, ``ref_KL_logps``) or the precomputed ones, found by the rows' token ids."""

    calculate_kl: bool = True
    table: dict[tuple, tuple[float, ...]] = field(default_factory=dict)

    def __call__(self, examples):
        batch = super().__call__(examples)
        if self.calculate_kl:
            if KL_COLUMN in examples[0]:
                completions = [e[KL_COLUMN] for e in examples]
            else:
                completions = [examples[-1]["completion_ids"]] + [e["completion_ids"] for e in examples[:-1]]
            mismatched = super().__call__([{"prompt_ids": e["prompt_ids"], "completion_ids": c, "label": e["label"]}
                                           for e, c in zip(examples, completions)])
            batch.update({f"KL_{k}": mismatched[k] for k in SEQUENCE_KEYS})
            if "ref_KL_logps" in examples[0]:
                batch["ref_KL_logps"] = torch.tensor([float(e["ref_KL_logps"]) for e in examples])
        if self.table and "ref_logps" not in batch:
            found = [self.table[row_key(e)] for e in examples]
            batch["ref_logps"] = torch.tensor([values[0] for values in found])
            if self.calculate_kl:
                batch["ref_KL_logps"] = torch.tensor([values[1] for values in found])
        return batch


def row_key(example: dict[str, Any]) -> tuple:
    return tuple(tuple(example[c]) for c in ("prompt_ids", "completion_ids", KL_COLUMN) if c in example)


def sequences(batch: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The batch's completion rows (``prefix`` "KL_": its mismatched rows) as the kit's ``token_logps`` reads them."""
    return {key: batch[f"{prefix}{key}"] for key in SEQUENCE_KEYS}


# ---------------------------------------------------------------------------- the metrics


class BatchFigures:
    """TRL's KTO metrics: each batch's figure is a sum over every process divided by a count over every process
    (``kl`` is the batch's already), and a log row holds each figure's mean over the batches that had one
    (a count of 0 adds nothing; ``entropy`` adds 0.0; ``rewards/margins``: the batches with both kinds of rows).
    Kept as tensors (no host sync per step); one reduction per log row."""

    NAMES = ("entropy", "logits/chosen", "logits/rejected", "rewards/chosen", "logps/chosen", "rewards/rejected",
             "logps/rejected")

    def __init__(self) -> None:
        self._rows: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        self._kl: dict[bool, list[torch.Tensor]] = {True: [], False: []}

    def add(self, training: bool, kl: torch.Tensor, figures: dict[str, tuple[Any, Any]]) -> None:
        values = []
        for name in self.NAMES:
            total, count = figures[name]
            total = total.detach().float().reshape(())
            values += [total, torch.as_tensor(count, dtype=torch.float32, device=total.device).reshape(())]
        self._rows[training].append(torch.stack(values))
        self._kl[training].append(kl.detach().float().reshape(()))

    def collect(self, run: Any, prefix: str) -> dict[str, float]:
        training = not prefix
        rows, kls = self._rows[training], self._kl[training]
        self._rows[training], self._kl[training] = [], []
        if not rows:
            return {}
        table = torch.stack(rows)  # [batches, 2 * names]: each name's sum and count
        if run.strategy.world_size > 1:
            table = run.strategy.reduce(table.to(run.strategy.device), "sum")
        table = table.double().cpu()
        sums, counts = table[:, 0::2], table[:, 1::2]
        per_batch: dict[str, list[float]] = {name: [] for name in (*self.NAMES, "rewards/margins")}
        for batch_sums, batch_counts in zip(sums.tolist(), counts.tolist()):
            figures = dict(zip(self.NAMES, zip(batch_sums, batch_counts)))
            for name, (total, count) in figures.items():
                if count > 0:
                    per_batch[name].append(total / count)
                elif name == "entropy":
                    per_batch[name].append(0.0)
            if figures["rewards/chosen"][1] > 0 and figures["rewards/rejected"][1] > 0:
                per_batch["rewards/margins"].append(per_batch["rewards/chosen"][-1] - per_batch["rewards/rejected"][-1])
        per_batch["kl"] = torch.stack(kls).double().cpu().tolist()
        return {name: round(sum(values) / len(values), 6) for name, values in sorted(per_batch.items()) if values}
