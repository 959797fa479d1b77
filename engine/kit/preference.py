"""What preference-tuning plugins (dpo, kto, orpo, cpo, reward) share: batches of completions, their
log-probabilities, the reference model, and metrics averaged between log rows.

The data builtin tokenizes preference rows (``prompt``/``chosen``/``rejected``, or KTO's
``prompt``/``completion``/``label``) into :data:`PAIR_COLUMNS` / :data:`UNPAIRED_COLUMNS` examples, as
TRL 1.16 does. A plugin then::

    @hookimpl
    def keep_columns(run):
        return list(PAIR_COLUMNS) + list(REFERENCE_COLUMNS)

    @hookimpl
    def create_collator(run):
        return PairCollator(run.tokenizer.pad_token_id, run.config.data.max_length)

    @hookimpl
    def compute_loss(run, model, batch, num_items_in_batch):
        logps = completion_logps(model, batch)            # [chosen rows; rejected rows]
        ...
        self.metrics.add(model.training, **{"rewards/margins": margins.mean()})

    @hookimpl
    def collect_metrics(run, prefix):
        return self.metrics.collect(run, prefix)
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from engine import hookimpl
from engine.errors import ConfigError
from engine.util import is_peft_model

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")  # what the data builtin makes of preference rows
UNPAIRED_COLUMNS = ("prompt_ids", "completion_ids", "label")  # ... of unpaired rows (KTO)
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # precomputed reference log-probs
LOSS_ONLY_KEYS = ("completion_mask", "label", *REFERENCE_COLUMNS, "ref_logps")  # batch keys the model never sees


def _padded(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)


@dataclass
class PairCollator:
    """TRL's ``DataCollatorForPreference``: ``input_ids``, ``attention_mask`` and ``completion_mask`` of the
    chosen rows then the rejected rows (prompt + completion, cut to ``max_length`` keeping the start, padded
    on the right), with the precomputed reference log-probs where the examples hold them."""

    pad_token_id: int
    max_length: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, masks = [], []
        for side in ("chosen_ids", "rejected_ids"):
            for example in examples:
                sequences.append((list(example["prompt_ids"]) + list(example[side]))[:self.max_length])
                masks.append(([0] * len(example["prompt_ids"]) + [1] * len(example[side]))[:self.max_length])
        batch = {"input_ids": _padded(sequences, self.pad_token_id),
                 "attention_mask": _padded([[1] * len(s) for s in sequences], 0),
                 "completion_mask": _padded(masks, 0)}
        for column in REFERENCE_COLUMNS:
            if column in examples[0]:
                batch[column] = torch.tensor([float(example[column]) for example in examples])
        return batch


@dataclass
class CompletionCollator:
    """Unpaired rows (KTO): ``input_ids``, ``attention_mask`` and ``completion_mask`` of prompt + completion (cut
    to ``max_length`` keeping the start, padded on the right) and ``label`` (1: desirable), with precomputed
    reference log-probs (``ref_logps``) where the examples hold them."""

    pad_token_id: int
    max_length: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = [(list(e["prompt_ids"]) + list(e["completion_ids"]))[:self.max_length] for e in examples]
        masks = [([0] * len(e["prompt_ids"]) + [1] * len(e["completion_ids"]))[:self.max_length] for e in examples]
        batch = {"input_ids": _padded(sequences, self.pad_token_id),
                 "attention_mask": _padded([[1] * len(s) for s in sequences], 0),
                 "completion_mask": _padded(masks, 0),
                 "label": torch.tensor([bool(e["label"]) for e in examples])}
        if "ref_logps" in examples[0]:
            batch["ref_logps"] = torch.tensor([float(e["ref_logps"]) for e in examples])
        return batch


def pad_token_id(tokenizer: Any) -> int:
    """The id batches are padded with, as TRL's trainers pick it: the tokenizer's pad token, else its eos."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def pair_key(example: dict[str, Any]) -> tuple:
    """A pair's token ids: what :attr:`Reference.table` files its precomputed figures under."""
    return tuple(tuple(example[column]) for column in PAIR_COLUMNS)


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch without the keys only the loss reads (masks, labels, reference log-probs)."""
    return {key: value for key, value in batch.items() if key not in LOSS_ONLY_KEYS}


@dataclass
class TokenLogps:
    """A forward's per-token figures over the completion tokens (positions 1.., aligned with ``mask``)."""

    logps: torch.Tensor  # [B, T-1] log-probability of each next token, 0 outside the completion
    mask: torch.Tensor  # [B, T-1] 1 on completion tokens
    logits: torch.Tensor  # [B, T-1, V] the logits that predicted them
    log_probs: torch.Tensor  # [B, T-1, V] their log-softmax, float32 (kept for the backward anyway)

    @property
    def sums(self) -> torch.Tensor:
        return self.logps.sum(dim=1)

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)


def token_logps(model: torch.nn.Module, batch: dict[str, Any]) -> TokenLogps:
    """Run ``model`` on the batch (``use_cache`` off) and return the completion tokens' log-probabilities."""
    outputs = model(**model_inputs(batch), use_cache=False)
    logits = (outputs.logits if hasattr(outputs, "logits") else outputs[0])[:, :-1]
    mask = batch["completion_mask"][:, 1:]
    targets = batch["input_ids"][:, 1:].masked_fill(mask == 0, 0)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    logps = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return TokenLogps(logps * mask, mask, logits, log_probs)


def completion_metrics(found: TokenLogps) -> dict[str, torch.Tensor]:
    """``entropy`` and ``mean_token_accuracy`` of the completions (of the first half: the chosen rows, for
    pairs), as TRL logs them; no gradient."""
    with torch.no_grad():
        mask, log_probs = found.mask.bool(), found.log_probs
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return {"entropy": entropy[mask].sum() / mask.sum().clamp(min=1)}


def mean_logits(found: TokenLogps, rows: slice) -> torch.Tensor:
    """The mean logit over the vocabulary, averaged over the completion tokens of ``rows`` (TRL's
    ``logits/chosen``, ``logits/rejected``)."""
    with torch.no_grad():
        mask = found.mask[rows].bool()
        return found.logits[rows].float().mean(-1)[mask].sum() / mask.sum().clamp(min=1)


def top1_accuracy(found: TokenLogps, input_ids: torch.Tensor, rows: slice) -> torch.Tensor:
    """The share of completion tokens of ``rows`` the model ranks first (TRL's ``mean_token_accuracy``)."""
    with torch.no_grad():
        mask = found.mask[rows].bool()
        right = found.logits[rows].argmax(-1) == input_ids[rows, 1:]
        return (right & mask).sum() / mask.sum().clamp(min=1)


class MetricMeans:
    """Figures noted each batch (0-d tensors, no host sync), averaged over the batches since the last
    :meth:`collect` and over processes: training's and evaluation's kept apart."""

    def __init__(self) -> None:
        self._sums: dict[bool, dict[str, torch.Tensor]] = {True: {}, False: {}}
        self._counts: dict[bool, int] = {True: 0, False: 0}

    def add(self, training: bool, **values: torch.Tensor) -> None:
        sums = self._sums[training]
        for name, value in values.items():
            value = value.detach().float()
            sums[name] = sums[name] + value if name in sums else value
        self._counts[training] += 1

    def collect(self, run: Any, prefix: str) -> dict[str, float]:
        training = not prefix
        sums, count = self._sums[training], self._counts[training]
        self._sums[training], self._counts[training] = {}, 0
        if not count:
            return {}
        names = sorted(sums)
        means = torch.stack([sums[name] for name in names]) / count
        if run.strategy.world_size > 1:
            means = run.strategy.reduce(means.to(run.strategy.device), "mean")
        return {name: round(float(value), 6) for name, value in zip(names, means.tolist())}


class PairsPlugin:
    """The hooks a plugin learning from pairs shares (orpo, cpo): the pairs' columns kept, their collator,
    dropout off when its section's ``disable_dropout`` says so. Subclass it, naming the plugin (``name``)."""

    name = ""

    @hookimpl
    def keep_columns(self, run: Any) -> list[str]:
        return list(PAIR_COLUMNS)

    @hookimpl
    def create_collator(self, run: Any) -> PairCollator:
        return PairCollator(pad_token_id(run.tokenizer), run.config.data.max_length)

    @hookimpl
    def patch_model(self, run: Any, model: torch.nn.Module) -> Callable[[], None] | None:
        return disable_dropout(model) if run.config.section(self.name).disable_dropout else None


def check_causal_lm_rows(run: Any, plugin: str) -> None:
    """Refuse, at configure, a run a preference plugin cannot train: another task than causal-lm, or packed rows."""
    if run.task != "causal-lm":
        raise ConfigError(f"train.task: {plugin} trains causal language models, but the task is {run.task!r}; set "
                          "train.task = \"causal-lm\" (a reward model of pairs: the reward plugin)")
    if run.config.data.packing:
        raise ConfigError(f"data.packing: {plugin} scores each row's completion on its own, so rows are never "
                          "packed; set data.packing = false")


def disable_dropout(model: torch.nn.Module) -> Callable[[], None]:
    """Every dropout of ``model`` at p = 0 (TRL's ``disable_dropout_in_model``, its trainers' default); returns
    the undo (a ``patch_model`` answer)."""
    changed = [(module, module.p) for module in model.modules() if isinstance(module, torch.nn.Dropout)]
    for module, _ in changed:
        module.p = 0.0

    def undo() -> None:
        for module, p in changed:
            module.p = p

    return undo


# ---------------------------------------------------------------------------- the reference model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` that never trains: eval mode, no gradients."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model of a peft model: its adapters off for the duration."""
    with model.disable_adapter():
        yield


def weights_fingerprint(model: torch.nn.Module, skip: Callable[[str], bool] = lambda name: False) -> str:
    """A short fingerprint of a model's weights (each tensor's name, shape and float64 sum): a resume checks
    that its reference is the one the run started with."""
    digest = hashlib.sha256()
    names, sums = [], []
    for name, tensor in model.state_dict().items():
        if skip(name) or not torch.is_tensor(tensor) or not tensor.is_floating_point():
            continue
        names.append(f"{name}:{tuple(tensor.shape)}")
        sums.append(tensor.detach().double().sum())
    digest.update("\n".join(names).encode())
    if sums:
        digest.update(torch.stack(sums).cpu().numpy().round(6).tobytes())
    return digest.hexdigest()[:16]


def is_adapter_name(name: str) -> bool:
    """Whether a peft model's state-dict key is an adapter's (the base weights are the reference)."""
    return "lora_" in name or ".default." in name or "modules_to_save" in name


def check_vocabulary(run: Any, ref_model: str, key: str) -> None:
    """Refuse, at configure, a reference model (``key``: its option) whose vocabulary differs from the policy's."""
    from transformers import AutoConfig

    from engine.kit.models import model_config

    try:
        reference = AutoConfig.from_pretrained(ref_model)
    except Exception as exc:  # not a model folder or name that loads
        raise ConfigError(f"{key}: {ref_model!r} has no model config that loads ({type(exc).__name__}); give a "
                          "model folder or hub name") from None
    policy = model_config(run.config.train, run.tokenizer)
    sizes = (getattr(policy, "vocab_size", None), getattr(reference, "vocab_size", None))
    if None not in sizes and sizes[0] != sizes[1]:
        raise ConfigError(f"{key}: {ref_model!r} has a vocabulary of {sizes[1]} tokens, the policy {sizes[0]}; the "
                          "reference must score the same token ids: give a model of the same tokenizer")


def check_reference_options(run: Any, plugin: str, ref_model: str | None, precompute: bool) -> None:
    """Refuse, at configure, a reference the run cannot have: one unsharded under FSDP/DeepSpeed (only the
    adapter-off base is, with peft), or a ``ref_model`` of another vocabulary."""
    from engine import strategy_name

    strategy = strategy_name(run)
    if strategy in ("fsdp", "deepspeed"):
        if precompute:
            raise ConfigError(f"{plugin}.precompute_ref_log_probs: not supported under train.strategy = {strategy!r} "
                              "yet (the reference runs unsharded before training); train an adapter instead")
        if "peft" not in run.config.plugins or ref_model is not None:
            raise ConfigError(f"{plugin}: under train.strategy = {strategy!r} a reference model of its own is not "
                              "sharded yet; train an adapter (plugins = [\"peft\"]), whose base with the adapter "
                              "off is the reference")
    if ref_model is not None:
        check_vocabulary(run, ref_model, f"{plugin}.ref_model")


def reference_plan(run: Any, ref_model: str | None, precompute: bool) -> str:
    """What ``engine plan`` says of the reference a run will have."""
    found = ref_model or ("the base with the adapter off" if "peft" in run.config.plugins
                          else "a frozen copy of the starting weights")
    return f"reference: {found}" + (", its log-probs precomputed" if precompute else "")


class Reference:
    """The reference model of a preference run, decided by :meth:`setup` in ``patch_model`` (after peft wrapped the
    model, before the strategy wraps it and before a resume restores trained weights): a model of its own
    (``ref_model``: a folder or hub name), else the base with the adapter off (a peft model: no second copy),
    else a frozen copy of the starting weights. Its fingerprint goes into checkpoints (:meth:`state`,
    :meth:`check`). :meth:`precompute` runs it once over the run's data, cached, and frees it."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None  # a model of its own; None: the adapter off, or precomputed
        self.kind = ""  # how the reference is had, for messages
        self.fingerprint: str | None = None
        self.table: dict[tuple, tuple[float, ...]] = {}  # precomputed figures by example (the collator adds them)

    def setup(self, run: Any, ref_model: str | None, no_dropout: bool, key: str) -> None:
        policy, device = run.model, run.strategy.device
        if ref_model is not None:
            self.model, self.kind = _load_reference(ref_model, policy, key).to(device), ref_model
        elif is_peft_model(policy):
            self.kind, self.fingerprint = "the base with the adapter off", weights_fingerprint(policy, is_adapter_name)
            return
        else:
            self.model, self.kind = frozen_copy(policy).to(device), "a frozen copy of the starting weights"
        if no_dropout:
            disable_dropout(self.model)
        self.fingerprint = weights_fingerprint(self.model)

    @contextlib.contextmanager
    def scoring(self, run: Any, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The module that scores as the reference, without gradients: its own model, or ``model`` (the policy,
        maybe wrapped by the strategy) with the adapter of ``run.model`` off."""
        with torch.no_grad():
            if self.model is not None:
                yield self.model
            else:
                with adapter_disabled(run.model):
                    yield model

    def precompute(self, run: Any, collator: Callable[[list[Any]], Any],
                   forward: Callable[[torch.nn.Module, dict[str, Any]], dict[str, torch.Tensor]],
                   columns: tuple[str, ...], batch_size: int | None, key_of: Callable[[dict[str, Any]], tuple],
                   settings: str = "") -> None:
        """``forward(scorer, batch)`` (the figures of ``columns``) of every example of the run's train and
        evaluation data, filled into :attr:`table` under ``key_of(example)``; cached by datasets under the data's
        and the reference's fingerprints (and ``settings``), so that a second start or a resume reads them. The
        reference's own model is freed after."""
        train = run.config.train
        datasets = [(run.train_dataset, train.per_device_train_batch_size)]
        evaluation = run.eval_dataset if isinstance(run.eval_dataset, dict) else {"eval": run.eval_dataset}
        datasets += [(d, train.per_device_eval_batch_size) for d in evaluation.values() if d is not None]
        scorer = self.model if self.model is not None else run.model.to(run.strategy.device)
        was_training = scorer.training
        scorer.eval()
        try:
            for dataset, size in datasets:
                found = _precompute(dataset, collator, lambda batch: self._forward(run, scorer, forward, batch),
                                    columns, f"{self.fingerprint}{settings}", batch_size or size, run.strategy.device)
                for row in found:
                    self.table[key_of(row)] = tuple(row[column] for column in columns)
        finally:
            scorer.train(was_training)
        self.model = None  # freed: its figures are in the batches

    def _forward(self, run: Any, scorer: torch.nn.Module, forward: Callable[..., dict[str, torch.Tensor]],
                 batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        with self.scoring(run, scorer) as reference:
            return forward(reference, batch)

    def state(self) -> dict[str, Any]:
        return {"reference": self.fingerprint}

    def check(self, state: dict[str, Any]) -> None:
        """Refuse a resume whose reference differs from the one its checkpoint recorded."""
        kept = state.get("reference")
        if kept is not None and kept != self.fingerprint:
            raise ConfigError(f"the checkpoint was trained against another reference ({self.kind}: fingerprint "
                              f"{kept}, now {self.fingerprint}); resume with the run's own train.model and reference "
                              "settings, or start a new run")


def _load_reference(name: str, policy: torch.nn.Module, key: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(name, dtype=next(policy.parameters()).dtype)
    size, found = policy.get_input_embeddings().weight.shape[0], reference.get_input_embeddings().weight.shape[0]
    if found != size:
        raise ConfigError(f"{key}: {name!r} has {found} token embeddings, the policy {size}; give a model of the "
                          "same tokenizer")
    return frozen_copy(reference)


def _precompute(dataset: Any, collator: Callable[[list[Any]], Any], forward: Callable[[dict[str, Any]], dict[str, Any]],
               columns: tuple[str, ...], fingerprint: str, batch_size: int, device: torch.device) -> Any:
    """``dataset`` (a ``datasets.Dataset``) with ``columns`` added: ``forward(batch)`` (no gradient) of each
    batch, in order. Cached by datasets under ``fingerprint`` (the dataset's and the reference's): a
    second start, or a resume, reads them back instead of running the reference again."""
    import datasets

    if not isinstance(dataset, datasets.Dataset):
        raise ConfigError(f"precompute_ref_log_probs: needs a dataset with a length (a datasets.Dataset), got a "
                          f"{type(dataset).__name__}; set it to false")
    source = dataset.select_columns([c for c in dataset.column_names if c not in columns])

    def add(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        examples = [{name: batch[name][i] for name in batch} for i in range(len(indices))]
        with torch.no_grad():
            found = forward({k: v.to(device) if torch.is_tensor(v) else v for k, v in collator(examples).items()})
        return {name: found[name].float().cpu().tolist() for name in columns}

    return source.map(add, batched=True, batch_size=batch_size, with_indices=True,
                      new_fingerprint=hashlib.sha256(f"{source._fingerprint}{fingerprint}".encode()).hexdigest()[:16],
                      desc="reference log-probs")
