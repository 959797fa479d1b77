"""Tasks: what a model learns (``train.task``), and what follows from it.

====================== ====================================== ===================================== =============================
task                   model class (``train.model``)          rows (``[data]`` columns)             default collator
====================== ====================================== ===================================== =============================
causal-lm              ``AutoModelForCausalLM``               text, chat, prompt/completion         the engine's (engine/data.py)
sequence-classification ``AutoModelForSequenceClassification`` text (+ text pair) and a label        ``DataCollatorWithPadding``
token-classification   ``AutoModelForTokenClassification``    words and one tag per word            ``DataCollatorForTokenClassification``
seq2seq                ``AutoModelForSeq2SeqLM``              source and target texts               ``DataCollatorForSeq2Seq``
====================== ====================================== ===================================== =============================

The datasets layer tokenizes each task's rows as transformers' example scripts do
(``engine.data.prepare_task_rows``); rows that already hold ``input_ids`` are used as they are.
This module holds the rest: which task, the model class, class names and ids, the collators
and the generation behind ``train.predict_with_generate``.

Without ``train.task`` a model given in Python, or the ``architectures`` of a model's config,
says the task (``BertForSequenceClassification`` -> sequence-classification); else causal-lm.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from .config import TrainConfig
from .errors import ConfigError
from .loss import IGNORE_INDEX

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


def resolve_task(train: TrainConfig, model: torch.nn.Module | None, config: Any = None) -> str:
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


def configure(train: TrainConfig, task: str) -> None:
    """Checks that need no model, data nor weights (at Run construction)."""
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
    _id2label(train)


def check_can_generate(model: torch.nn.Module, key: str) -> None:
    """``train.predict_with_generate`` needs a model with ``generate()``."""
    can = getattr(model, "can_generate", None)
    if not callable(getattr(model, "generate", None)) or (callable(can) and not can()):
        raise ConfigError(f"train.predict_with_generate: the model ({key}, a {type(model).__name__}) cannot "
                          "generate (it has no generate() or can_generate() is false); use a seq2seq or causal LM, "
                          "or set predict_with_generate = false")


# ---------------------------------------------------------------------------- labels


def _id2label(train: TrainConfig) -> dict[int, str] | None:
    """``train.id2label`` with int keys (TOML keys are strings), or inverted ``label2id``; checked."""
    if train.id2label is not None:
        try:
            mapping = {int(key): str(name) for key, name in train.id2label.items()}
        except ValueError:
            raise ConfigError(f"train.id2label: keys are class ids (0, 1, ...), got {list(train.id2label)}") from None
        if sorted(mapping) != list(range(len(mapping))):
            raise ConfigError(f"train.id2label: expected ids 0 to {len(mapping) - 1}, got {sorted(mapping)}")
        return mapping
    if train.label2id is not None:
        mapping = {int(i): name for name, i in train.label2id.items()}
        if sorted(mapping) != list(range(len(train.label2id))):
            raise ConfigError(f"train.label2id: expected ids 0 to {len(train.label2id) - 1} once each, "
                              f"got {sorted(train.label2id.values())}")
        return mapping
    return None


def label_ids_by_name(train: TrainConfig) -> dict[str, int] | None:
    """The class ids that string labels in the data map to (``train.label2id`` or ``id2label``)."""
    id2label = _id2label(train)
    return None if id2label is None else {name: i for i, name in id2label.items()}


def label_names(dataset: Any, task: str) -> list[str] | None:
    """The class names a prepared dataset's ``labels`` (or ``label``) column carries as a ClassLabel."""
    from .data import class_names, is_datasets_object

    if task not in CLASSIFICATION or not is_datasets_object(dataset) or not dataset.features:
        return None
    column = next((name for name in ("labels", "label") if name in dataset.features), None)
    return class_names(dataset.features[column], task) if column else None


def _label_values(dataset: Any) -> Any:
    """The ``labels`` of a prepared datasets object as one flat numpy array (None: not countable here)."""
    import pyarrow as pa

    from .data import is_datasets_object

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
    id2label = _id2label(train) or (dict(enumerate(names)) if names else None)
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


# ---------------------------------------------------------------------------- generation


DEFAULT_MAX_LENGTH = 20  # generate()'s max_length when no generation config sets one


class Generation(NamedTuple):
    """How evaluation generates: the generation config and the ``generate()`` keywords on top of it."""

    config: Any  # transformers.GenerationConfig
    kwargs: dict[str, int]  # max_length, num_beams (Seq2SeqTrainer's gen_kwargs)


# GenerationConfig values by type (its defaults are all None, so they do not tell): minimum, or None
_GENERATION_INTS = {"max_length": 1, "max_new_tokens": 1, "min_length": 0, "min_new_tokens": 0, "num_beams": 1,
                    "num_beam_groups": 1, "num_return_sequences": 1, "top_k": 0, "no_repeat_ngram_size": 0}
_GENERATION_FLOATS = {"temperature": 0.0, "top_p": 0.0, "min_p": 0.0, "typical_p": 0.0, "repetition_penalty": 0.0,
                      "length_penalty": None, "diversity_penalty": 0.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                      "max_time": 0.0}
_GENERATION_BOOLS = ("do_sample", "use_cache", "renormalize_logits", "remove_invalid_values")


def check_generation_values(values: dict[str, Any], key: str) -> None:
    """The common generate() settings in ``values`` have their type and range (``key``: where they were set),
    so a wrong one is refused before training rather than when generation first runs."""
    for name, value in values.items():
        if name in _GENERATION_INTS:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= _GENERATION_INTS[name]
            expected = f"an int >= {_GENERATION_INTS[name]}"
        elif name in _GENERATION_FLOATS:
            low = _GENERATION_FLOATS[name]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
                (low is None or value >= low)
            expected = "a finite number" + (f" >= {low:g}" if low is not None else "")
        elif name in _GENERATION_BOOLS:
            ok, expected = isinstance(value, bool), "true or false"
        else:
            continue
        if not ok:
            raise ConfigError(f"{key}.{name}: expected {expected}, got {type(value).__name__} {value!r}")
    if values.get("do_sample") and values.get("temperature") is not None and values["temperature"] <= 0:
        raise ConfigError(f"{key}: temperature = {values['temperature']} with do_sample = true cannot sample; "
                          "set do_sample = false for greedy decoding, or a temperature > 0")


def generation(train: TrainConfig, model: torch.nn.Module) -> Generation:
    """``train.generation_config`` (a folder replaces the model's generation config, a table
    updates a copy of it), with ``generation_max_length`` / ``generation_num_beams`` as
    ``generate()`` keywords, as Seq2SeqTrainer passes them."""
    import copy

    from transformers import GenerationConfig

    spec = train.generation_config
    if isinstance(spec, str):
        try:
            config = GenerationConfig.from_pretrained(spec)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"train.generation_config: no generation_config.json to read in {spec}: "
                              f"{str(exc).splitlines()[0]}") from None
    else:
        config = copy.deepcopy(getattr(model, "generation_config", None) or GenerationConfig())
        if spec:
            known = GenerationConfig().to_dict()
            unknown = sorted(name for name in spec if name not in known)
            if unknown:
                raise ConfigError(f"train.generation_config: GenerationConfig has no key {unknown[0]!r}")
            check_generation_values(spec, "train.generation_config")
            try:
                config.update(**spec)
                config.validate(strict=True)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"train.generation_config: GenerationConfig refuses {spec}: "
                                  f"{str(exc).strip().splitlines()[0]}") from None
    # what the model's own generation config adds to the table counts too (its do_sample, say)
    check_generation_values({k: v for k, v in config.to_dict().items() if v is not None}, "train.generation_config")
    kwargs = {"max_length": train.generation_max_length, "num_beams": train.generation_num_beams}
    return Generation(config, {key: value for key, value in kwargs.items() if value is not None})


def generate(model: torch.nn.Module, batch: dict[str, torch.Tensor], generation: Generation,
             pad_token_id: int) -> torch.Tensor:
    """Generated ids for ``batch`` as Seq2SeqTrainer's prediction_step makes them: from the batch's
    inputs (not its labels, nor decoder inputs made from them), right-padded with ``pad_token_id``
    to the generation config's max_length (20 unless it sets one; generation_max_length does not
    change it), or its max_new_tokens + 1."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels = batch.get("labels")
    if labels is not None and "decoder_input_ids" in inputs and inputs["decoder_input_ids"].shape == labels.shape:
        inputs = {k: v for k, v in inputs.items() if k not in ("decoder_input_ids", "decoder_attention_mask")}
    generated = model.generate(**inputs, generation_config=generation.config, **generation.kwargs)
    config = generation.config
    width = config.max_length or DEFAULT_MAX_LENGTH
    if generated.shape[-1] >= width and config.max_new_tokens is not None:
        width = config.max_new_tokens + 1
    if generated.shape[-1] < width:
        padded = generated.new_full((generated.shape[0], width), pad_token_id)
        padded[:, : generated.shape[-1]] = generated
        generated = padded
    return generated
