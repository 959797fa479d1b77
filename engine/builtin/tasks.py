"""Tasks: what a model learns (``train.task``), and what follows from it.

====================== ====================================== ===================================== =============================
task                   model class (``train.model``)          rows (``[data]`` columns)             default collator
====================== ====================================== ===================================== =============================
causal-lm              ``AutoModelForCausalLM``               text, chat, prompt/completion         the data builtin's
sequence-classification ``AutoModelForSequenceClassification`` text (+ text pair) and a label        ``DataCollatorWithPadding``
token-classification   ``AutoModelForTokenClassification``    words and one tag per word            ``DataCollatorForTokenClassification``
seq2seq                ``AutoModelForSeq2SeqLM``              source and target texts               ``DataCollatorForSeq2Seq``
====================== ====================================== ===================================== =============================

The datasets layer tokenizes each task's rows as transformers' example scripts do
(``engine.builtin.data.task_rows``); rows that already hold ``input_ids`` are used as they are.
This module holds the rest: which task, the model class, class names and ids and the collators
(the generation behind ``train.predict_with_generate`` is engine/builtin/generation.py). It is the
task builtin: it answers ``resolve_task`` and ``create_collator`` and checks the task's keys at
configure, and the model against the task's data once it is built.

Without ``train.task`` a model given in Python, or the ``architectures`` of a model's config,
says the task (``BertForSequenceClassification`` -> sequence-classification); else causal-lm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch

from engine import hookimpl
from engine.builtin.data.task_rows import class_names, configured_id2label
from engine.builtin.generation import check_generation_values, generation
from engine.config import option
from engine.errors import ConfigError
from engine.kit.models import model_config
from engine.loss import IGNORE_INDEX
from engine.util import is_datasets_object

if TYPE_CHECKING:  # TrainConfig is assembled from the builtins' options: not at import
    from engine.config import TrainConfig

CAUSAL_LM, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, SEQ2SEQ = (
    "causal-lm", "sequence-classification", "token-classification", "seq2seq")
AUTO_CLASSES = {CAUSAL_LM: "AutoModelForCausalLM", SEQUENCE_CLASSIFICATION: "AutoModelForSequenceClassification",
                TOKEN_CLASSIFICATION: "AutoModelForTokenClassification", SEQ2SEQ: "AutoModelForSeq2SeqLM"}
CLASSIFICATION = (SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION)
# the end of a transformers class name -> its task
CLASS_SUFFIXES = {"ForSequenceClassification": SEQUENCE_CLASSIFICATION, "ForTokenClassification": TOKEN_CLASSIFICATION,
                  "ForConditionalGeneration": SEQ2SEQ, "ForCausalLM": CAUSAL_LM, "LMHeadModel": CAUSAL_LM}


# ---------------------------------------------------------------------------- which task


def task_of_class(name: str, config: Any = None) -> str | None:
    """The task a model class name says, else an encoder-decoder config's (seq2seq), else None."""
    for suffix, task in CLASS_SUFFIXES.items():
        if name.endswith(suffix):
            return SEQ2SEQ if task == SEQ2SEQ and not getattr(config, "is_encoder_decoder", True) else task
    return SEQ2SEQ if getattr(config, "is_encoder_decoder", False) else None


def task_of(train: TrainConfig, model: torch.nn.Module | None, config: Any = None) -> str:
    """``train.task``, else what the given ``model`` or the ``architectures`` of the model config
    ``config`` (for a model the run builds) say, else causal-lm. A given model of another task
    than ``train.task`` is refused."""
    if model is not None:
        config = getattr(model, "config", None)
        inferred = task_of_class(type(model).__name__, config)
        if train.task and inferred and inferred != train.task:
            raise ConfigError(f"train.task = {train.task!r}, but the model given is a {type(model).__name__} "
                              f"({inferred}); set train.task = {inferred!r} or pass a {train.task} model")
        return train.task or inferred or CAUSAL_LM
    if train.task:
        return train.task
    for name in getattr(config, "architectures", None) or ():
        found = task_of_class(name, config)
        if found:
            return found
    return task_of_class("", config) or CAUSAL_LM


def auto_class(task: str) -> Any:
    import transformers

    return getattr(transformers, AUTO_CLASSES[task])


def check_task_keys(train: TrainConfig, task: str) -> None:
    """The ``[train]`` keys that only some tasks take (checks that need no model, data nor weights)."""
    if train.predict_with_generate and task in CLASSIFICATION:
        raise ConfigError(f"train.predict_with_generate: a {task} model cannot generate; "
                          "set predict_with_generate = false")
    if task not in CLASSIFICATION:
        given = [key for key in ("num_labels", "id2label", "label2id", "problem_type") if getattr(train, key) is not None]
        if given:
            raise ConfigError(f"train.{given[0]}: only for classification, but the task is {task}; "
                              "set train.task = 'sequence-classification' or 'token-classification'")
    if train.problem_type and task != SEQUENCE_CLASSIFICATION:
        raise ConfigError("train.problem_type: only for sequence-classification")
    configured_id2label(train)


def check_can_generate(model: torch.nn.Module, key: str) -> None:
    """``train.predict_with_generate`` needs a model with ``generate()``."""
    can = getattr(model, "can_generate", None)
    if not callable(getattr(model, "generate", None)) or (callable(can) and not can()):
        raise ConfigError(f"train.predict_with_generate: the model ({key}, a {type(model).__name__}) cannot "
                          "generate (it has no generate() or can_generate() is false); use a seq2seq or causal LM, "
                          "or set predict_with_generate = false")


def fill_pad_token_id(model: torch.nn.Module, tokenizer: Any, task: str) -> None:
    """A sequence classifier scores each row at its last token before the padding, which it finds by
    config.pad_token_id (transformers refuses batches of 2 or more without one): set from the
    tokenizer when the config has none, as Trainer users do; refused when neither has one."""
    config = getattr(model, "config", None)
    if task != "sequence-classification" or config is None or getattr(config, "pad_token_id", 0) is not None:
        return
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        raise ConfigError("the model's config has no pad_token_id, which sequence classification needs to find each "
                          "row's last token, and the tokenizer has no pad token to take it from; set the tokenizer's "
                          "pad token (e.g. tokenizer.pad_token = tokenizer.eos_token) or config.pad_token_id")
    config.pad_token_id = pad_id


# ---------------------------------------------------------------------------- labels


def label_names(dataset: Any, task: str) -> list[str] | None:
    """The class names a prepared dataset's ``labels`` (or ``label``) column carries as a ClassLabel."""
    if task not in CLASSIFICATION or not is_datasets_object(dataset) or not dataset.features:
        return None
    column = next((name for name in ("labels", "label") if name in dataset.features), None)
    return class_names(dataset.features[column], task) if column else None


def _label_values(dataset: Any) -> Any:
    """The ``labels`` of a prepared datasets object as one flat numpy array (None: not countable here)."""
    import pyarrow as pa

    if not is_datasets_object(dataset) or not hasattr(dataset, "data") or "labels" not in dataset.column_names:
        return None
    column = dataset.data.column("labels").combine_chunks()
    while isinstance(column, (pa.ListArray, pa.LargeListArray)):
        column = column.flatten()
    return column.to_numpy(zero_copy_only=False)


def label_settings(train: TrainConfig, task: str, names: list[str] | None, dataset: Any) -> dict[str, Any]:
    """num_labels, id2label, label2id and problem_type for a classifier built by the engine: from
    ``[train]``, else the data's ClassLabel names, else the labels themselves (largest + 1; float
    labels: one output, regression), as transformers' run_glue / run_ner decide."""
    if task not in CLASSIFICATION:
        return {}
    id2label = configured_id2label(train) or (dict(enumerate(names)) if names else None)
    num_labels = train.num_labels
    problem_type = train.problem_type
    if num_labels is None and id2label is not None:
        num_labels = len(id2label)
    if num_labels is None:
        values = _label_values(dataset)
        if values is None:
            raise ConfigError("train.num_labels: the number of classes cannot be read from this data; set it")
        if values.dtype.kind == "f":
            num_labels, problem_type = 1, problem_type or "regression"
        else:
            values = values[values != IGNORE_INDEX]
            num_labels = int(values.max()) + 1 if len(values) else 1
    if id2label is not None and len(id2label) != num_labels:
        raise ConfigError(f"train.num_labels = {num_labels}, but there are {len(id2label)} class names "
                          "(train.id2label / label2id / the data's ClassLabel); make them agree")
    settings: dict[str, Any] = {"num_labels": num_labels}
    if id2label is not None:
        settings.update(id2label=id2label, label2id={name: i for i, name in id2label.items()})
    if problem_type:
        settings["problem_type"] = problem_type
    return settings


def check_labels(dataset: Any, num_labels: int, key: str) -> None:
    """Refuse class ids outside ``0 .. num_labels - 1`` (float labels: regression or multi-label, not ids)."""
    values = _label_values(dataset)
    if values is None or values.dtype.kind == "f" or num_labels == 1:
        return
    values = values[values != IGNORE_INDEX]
    if not len(values):
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= num_labels:
        bad = low if low < 0 else high
        raise ConfigError(f"{key}: label {bad} is outside the model's {num_labels} classes (0 to {num_labels - 1}); "
                          "set train.num_labels or id2label, or fix the labels")


# ---------------------------------------------------------------------------- collators


class _AsDict:
    """A transformers collator whose BatchEncoding comes back as a plain dict of tensors."""

    def __init__(self, collator: Callable[[list[Any]], Any]):
        self.collator = collator

    def __call__(self, features: list[Any]) -> dict[str, torch.Tensor]:
        return dict(self.collator(features))


def collator(task: str, tokenizer: Any, model: torch.nn.Module | None) -> Callable[[list[Any]], Any] | None:
    """transformers' padding collator for ``task`` (None: the engine's default collator)."""
    if task == CAUSAL_LM or tokenizer is None:
        return None
    if tokenizer.pad_token is None:
        raise ConfigError(f"the tokenizer has no pad token, which {task} batches are padded with; set one "
                          "(tokenizer.pad_token = tokenizer.eos_token), or pass data_collator=")
    import transformers

    if task == SEQUENCE_CLASSIFICATION:
        return _AsDict(transformers.DataCollatorWithPadding(tokenizer))
    if task == TOKEN_CLASSIFICATION:
        return _AsDict(transformers.DataCollatorForTokenClassification(tokenizer))
    seq2seq_model = model if callable(getattr(model, "prepare_decoder_input_ids_from_labels", None)) else None
    return _AsDict(transformers.DataCollatorForSeq2Seq(tokenizer, model=seq2seq_model))


# ---------------------------------------------------------------------------- the plugin


@dataclass
class TaskOptions:
    """``[train]`` keys of builtin.tasks: the task and the classes of a classification task (the data and model
    builtins read them too, so a block does not refuse them)."""

    task: Literal["causal-lm", "sequence-classification", "token-classification", "seq2seq"] | None = option(
        None, shared=True, help=(
            "what the model learns: the AutoModelFor... class of train.model, the data's columns and the "
            "collator; default: the task of a model given in Python or named by its config's "
            "architectures, else causal-lm"))
    num_labels: int | None = option(None, shared=True, min=1, help=(
        "classification: number of classes (default: from id2label, the data's ClassLabel names, else the "
        "largest label + 1; 1 for float labels: regression)"))
    id2label: dict[str, str] | None = option(None, shared=True, help=(
        "classification: class names by id, {0 = \"neg\", 1 = \"pos\"} (default: the data's ClassLabel names)"))
    label2id: dict[str, int] | None = option(None, shared=True, help=(
        "classification: class ids by name; string labels in the data are mapped with it"))
    problem_type: Literal["single_label_classification", "multi_label_classification", "regression"] | None = \
        option(None, shared=True, help="sequence classification: the model's loss (default: the model's choice from the labels)")


class Tasks:
    """The task builtin, one per run (it remembers whether the model was given, for its messages)."""

    TRAIN_OPTIONS = TaskOptions  # the [train] keys it reads: engine.config.TrainConfig has them

    def __init__(self) -> None:
        self.model_given = False

    @hookimpl(tryfirst=True)  # before the other plugins' checks, as when the run composed them itself
    def configure(self, run):
        train = run.config.train
        self.model_given = run.model is not None
        if isinstance(train.generation_config, dict):
            check_generation_values(train.generation_config, "train.generation_config")
        if train.task or run.model is not None:  # else the model's config says it, read in setup
            check_task_keys(train, run.task)

    @hookimpl
    def resolve_task(self, run):
        train = run.config.train
        config = model_config(train) if run.model is None and not train.task else None
        return task_of(train, run.model, config)

    @hookimpl(tryfirst=True)
    def on_build_start(self, run):
        check_task_keys(run.config.train, run.task)

    @hookimpl
    def on_model_built(self, run):
        """Class ids within the model's classes; a model that can generate for predict_with_generate; a
        sequence classifier's pad token id."""
        train, task, model = run.config.train, run.task, run.model
        fill_pad_token_id(model, run.tokenizer, task)
        if train.predict_with_generate:
            check_can_generate(model, "the model given" if self.model_given else "train.model")
            generation(train, model)  # its settings refused now, not at the first evaluation
        num_labels = getattr(getattr(model, "config", None), "num_labels", None)
        if task not in CLASSIFICATION or not isinstance(num_labels, int):
            return
        check_labels(run.train_dataset, num_labels, "data.train")
        evaluation = run.eval_dataset if isinstance(run.eval_dataset, dict) else {None: run.eval_dataset}
        for name, dataset in evaluation.items():
            check_labels(dataset, num_labels, "data.eval" if name is None else f"eval_dataset[{name!r}]")

    @hookimpl
    def create_collator(self, run):
        return collator(run.task, run.tokenizer, run.model)
