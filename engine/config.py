"""Run configuration: typed sections, validation, TOML run files and ``--set`` overrides.

A run is described by one mapping (a TOML file, a Python dict, or the embedded default)::

    plugins = ["neftune"]      # enabled plugins, by entry-point name
    required_plugins = ["neftune>=0.1"]   # optional: versions this run needs, checked before loading
    [train]                    # TrainConfig: model, optimizer, loop
    [data]                     # DataConfig: tokenizer and datasets
    [neftune]                  # one section per enabled plugin, validated by its schema

Every section is a dataclass. :func:`from_mapping` checks a mapping against one: unknown keys
and wrong types are :class:`~engine.errors.ConfigError` naming the key path and the expected
type. Plugins declare their own section the same way (see ``hookspecs.plugin_options``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Literal, Union

import tomllib

from .errors import ConfigError
from .util import decode_utf8, mask_secrets

CORE_SECTIONS = ("train", "data")
TOP_LEVEL_KEYS = ("plugins", "required_plugins")
# [train] keys that say how to start rather than what to train: not part of the run's identity,
# never listed as changes on resume
START_KEYS = ("resume_from_checkpoint", "overwrite_output_dir", "reset_optimizer", "output_dir")


def option(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
           min: float | None = None, max: float | None = None, below: float | None = None,
           nonempty: bool = False, secret: bool = False):
    """A dataclass field with a help text (shown by ``engine plan`` and the docs) and its valid range.

    ``min`` / ``max`` bound a number inclusively, ``below`` exclusively from above; ``nonempty``
    refuses an empty string. A value outside is refused naming its key and the range
    ("train.adam_beta1: expected float in [0, 1), got 1.5"). Floats must be finite (no nan/inf).
    ``secret`` marks a credential (a token): :func:`to_mapping` shows a set value as
    :data:`SECRET_MASK`, so it never reaches the plan, ``hyperparams.json``, checkpoints or trackers.

    Example::

        rank: int = option(128, help="projection rank", min=1)
        ratio: float = option(0.5, help="share of the tokens", min=0, max=1)
        token: str | None = option(None, help="access token", secret=True)
    """
    bounds = {"min": min, "max": max, "below": below, "nonempty": nonempty, "secret": secret}
    return field(default=default, default_factory=default_factory,
                 metadata={"help": help, **{k: v for k, v in bounds.items() if v is not None and v is not False}})


@dataclass
class TrainConfig:
    """``[train]``: the model, the optimizer and the loop. Names follow ``TrainingArguments``."""

    model: str = option("tiny-llama", nonempty=True, help=(
        "builtin config name (tiny-llama, small-llama), a local HF folder (from_pretrained), "
        "a config .json file (random weights) or 'package.module:function' returning an nn.Module"))
    model_config: dict[str, Any] = option(default_factory=dict, help=(
        "overrides applied to the model config when building from a name or .json file"))
    task: Literal["causal-lm", "sequence-classification", "token-classification", "seq2seq"] | None = option(
        None, help=("what the model learns: the AutoModelFor... class of train.model, the data's columns and the "
                    "collator; default: the task of a model given in Python or named by its config's "
                    "architectures, else causal-lm"))
    num_labels: int | None = option(None, min=1, help=(
        "classification: number of classes (default: from id2label, the data's ClassLabel names, else the "
        "largest label + 1; 1 for float labels: regression)"))
    id2label: dict[str, str] | None = option(None, help=(
        "classification: class names by id, {0 = \"neg\", 1 = \"pos\"} (default: the data's ClassLabel names)"))
    label2id: dict[str, int] | None = option(None, help=(
        "classification: class ids by name; string labels in the data are mapped with it"))
    problem_type: Literal["single_label_classification", "multi_label_classification", "regression"] | None = \
        option(None, help="sequence classification: the model's loss (default: the model's choice from the labels)")
    output_dir: str = option("output", nonempty=True, help="where metrics, checkpoints and the final model go")
    seed: int = option(42, min=0, max=2**32 - 1, help="seed for weights, data order and dropout")
    max_steps: int = option(-1, min=-1, help="total optimizer steps; > 0 overrides num_train_epochs")
    num_train_epochs: float = option(3.0, min=0, help="epochs to train when max_steps <= 0")
    per_device_train_batch_size: int = option(8, min=1, help="micro-batch size per device")
    per_device_eval_batch_size: int = option(8, min=1, help="evaluation batch size per device")
    auto_find_batch_size: bool = option(False, help=(
        "on an out-of-memory error in a training step, start the run again with per_device_train_batch_size "
        "x 0.9 (as Trainer through accelerate), until one fits; one process only"))
    gradient_accumulation_steps: int = option(1, min=1, help="micro-batches per optimizer step")
    # near 1e38 Adam's step size (lr / (1 - beta1)) overflows float32 before any loss is seen
    learning_rate: float = option(5e-5, min=0, max=1e30, help="peak learning rate")
    weight_decay: float = option(0.0, min=0, help="decoupled weight decay (not applied to biases and norms)")
    adam_beta1: float = option(0.9, min=0, below=1, help="Adam beta1")
    adam_beta2: float = option(0.999, min=0, below=1, help="Adam beta2")
    adam_epsilon: float = option(1e-8, min=0, help="Adam epsilon")
    max_grad_norm: float = option(1.0, min=0, help="clip the global gradient norm to this; 0 disables")
    optim: str = option("adamw_torch", nonempty=True, help="optimizer name, as TrainingArguments.optim")
    optim_args: str | None = option(None, help="extra optimizer arguments 'key=value,key=value'")
    optim_target_modules: list[str] | str | None = option(None, help=(
        "modules an optimizer such as GaLore applies to (regexes or names)"))
    lr_scheduler_type: str = option("linear", help=(
        "linear, cosine, constant, constant_with_warmup, polynomial or a plugin's name"))
    lr_scheduler_kwargs: dict[str, Any] = option(default_factory=dict, help=(
        "extra scheduler arguments (e.g. power, lr_end for polynomial)"))
    warmup_steps: int = option(0, min=0, help="linear warmup steps; > 0 overrides warmup_ratio")
    warmup_ratio: float = option(0.0, min=0, max=1, help="warmup as a fraction of the total steps")
    label_smoothing_factor: float = option(0.0, min=0, below=1, help="label smoothing for the default loss")
    bf16: bool = option(False, help="bfloat16 autocast (CPU or GPU)")
    fp16: bool = option(False, help="float16 autocast with loss scaling (GPU only)")
    use_cpu: bool = option(False, help="train on the CPU even when a GPU is present")
    activation_checkpointing: bool = option(False, help=(
        "recompute each block's activations in backward instead of keeping them (less memory, ~30 % "
        "more compute): HF models through activation_checkpointing_enable, any other module on its blocks"))
    activation_checkpointing_kwargs: dict[str, Any] | None = option(None, help=(
        "for activation checkpointing: every_n_layers, offload (HF models) and torch.utils.checkpoint "
        "arguments (default use_reentrant = false)"))
    gradient_checkpointing: bool | None = option(None, help=(
        "TrainingArguments' older name of activation_checkpointing"))
    gradient_checkpointing_kwargs: dict[str, Any] | None = option(None, help=(
        "TrainingArguments' older name of activation_checkpointing_kwargs"))
    torch_compile: bool = option(False, help="compile the model with torch.compile (its forward; backward follows)")
    torch_compile_backend: str | None = option(None, nonempty=True, help=(
        "torch.compile backend (inductor, aot_eager, ...); setting it turns torch_compile on"))
    torch_compile_mode: str | None = option(None, nonempty=True, help=(
        "torch.compile mode (default, reduce-overhead, max-autotune, ...); setting it turns torch_compile on"))
    strategy: str = option("auto", help=(
        "distributed strategy name; 'auto' takes the one an enabled plugin provides, else 'single'"))
    logging_steps: int = option(10, min=1, help="log metrics every N optimizer steps")
    logging_first_step: bool = option(False, help="also log after the first step")
    logging_strategy: Literal["no", "steps", "epoch"] = option("steps", help=(
        "when to log the training loss: every logging_steps steps (and the last), at each epoch's end, or never"))
    eval_strategy: Literal["no", "steps", "epoch"] = option("no", help="when to evaluate")
    eval_steps: int | None = option(None, min=1, help="evaluate every N steps (default: logging_steps)")
    eval_delay: float = option(0.0, min=0, help=(
        "no evaluation before this step (eval_strategy 'steps') or epoch (eval_strategy 'epoch')"))
    eval_on_start: bool = option(False, help="evaluate once before the first step (a sanity check)")
    save_strategy: Literal["no", "steps", "epoch", "best"] = option("steps", help=(
        "when to save a checkpoint; 'best': after each evaluation that improves metric_for_best_model"))
    save_steps: int = option(500, min=1, help="save every N steps when save_strategy = 'steps'")
    save_total_limit: int | None = option(None, min=1, help=(
        "keep at most this many checkpoints (oldest deleted first; the best one is always kept)"))
    enable_jit_checkpoint: bool = option(False, help=(
        "a SIGTERM saves a checkpoint at the end of the current step and stops the run (exit status 143), "
        "resumable with resume_from_checkpoint = true"))
    save_only_model: bool = option(False, help=(
        "checkpoints hold the model and trainer_state.json only (no optimizer, scheduler or RNG state): smaller, "
        "and load_best_model_at_end still works, but they cannot be resumed"))
    save_final_model: bool = option(True, help=(
        "save the final model (HF layout) and tokenizer to output_dir when training ends"))
    resume_from_checkpoint: bool | str | None = option(None, help=(
        "true: this run's newest checkpoint in output_dir; a path: that checkpoint; a name a plugin "
        "fetches, e.g. 'hub' (engine-hub: the repo's last-checkpoint/)"))
    overwrite_output_dir: bool = option(False, help=(
        "a fresh run into an output_dir holding another run's checkpoints or final model removes "
        "them first (only what the engine wrote) instead of refusing to start"))
    ignore_data_skip: bool = option(False, help=(
        "on resume: start the resumed epoch's data from its beginning instead of skipping the batches already "
        "trained on (faster to start, not the uninterrupted run's data)"))
    reset_optimizer: bool = option(False, help=(
        "on resume: restore weights, progress and RNG but build the optimizer and scheduler fresh, "
        "the schedule continuing at the resumed step (to change train.optim)"))
    on_nonfinite: Literal["stop", "skip"] = option("stop", help=(
        "a nan/inf loss, gradient norm or weight: 'stop' the run (exit status 3, nothing "
        "non-finite saved) or 'skip' the update (costs one host sync per step)"))
    max_skipped_in_a_row: int = option(10, min=1, help=(
        "on_nonfinite = 'skip': stop the run after this many skipped steps in a row"))
    load_best_model_at_end: bool = option(False, help=(
        "track the best checkpoint by metric_for_best_model and load it when training ends"))
    metric_for_best_model: str | None = option(None, help=(
        "evaluation metric that ranks checkpoints, e.g. 'loss' or 'eval_accuracy' "
        "(default: 'loss' when load_best_model_at_end)"))
    greater_is_better: bool | None = option(None, help=(
        "whether a larger metric_for_best_model is better (default: false for *loss, else true)"))
    label_names: list[str] | None = option(None, help=(
        "the batch keys holding the labels that evaluation and predict return as label_ids (several: a tuple) "
        "(default, as Trainer: the model's forward arguments named *label*; start_positions and end_positions "
        "for question answering)"))
    include_for_metrics: list[str] = option(default_factory=list, help=(
        "what compute_metrics gets besides predictions and labels: 'inputs' (the model's main input, as "
        "EvalPrediction.inputs) and/or 'loss' (each row's batch loss, as EvalPrediction.losses)"))
    batch_eval_metrics: bool = option(False, help=(
        "call compute_metrics after each evaluation batch (tensors; compute_result=True after the last, whose "
        "answer are the metrics) instead of once on every prediction kept in memory"))
    eval_accumulation_steps: int | None = option(None, min=1, help=(
        "Trainer's: move evaluation predictions to the CPU every N batches; the engine moves each batch's as it "
        "comes (Trainer's 1), which gives the same predictions and metrics as any N"))
    prediction_loss_only: bool = option(False, help="evaluation returns the loss only (no compute_metrics)")
    compute_metrics: str | None = option(None, help=(
        "'package.module:function' taking an EvalPrediction and returning a dict of floats"))
    predict_with_generate: bool = option(False, help=(
        "evaluation and predict: compute_metrics gets generate()'s token ids instead of logits (seq2seq and "
        "causal LMs; the loss is still computed), as Seq2SeqTrainer"))
    generation_max_length: int | None = option(None, min=1, help=(
        "predict_with_generate: generate()'s max_length (default: the generation config's)"))
    generation_num_beams: int | None = option(None, min=1, help=(
        "predict_with_generate: generate()'s num_beams (default: the generation config's)"))
    generation_config: str | dict[str, Any] | None = option(None, help=(
        "predict_with_generate: a folder holding generation_config.json, or a table of GenerationConfig values, "
        "replacing the model's generation config"))
    use_cache: bool = option(False, help=(
        "the model's config.use_cache while training and in the saved model (as Trainer sets it): the key/value "
        "cache only costs memory in a training forward"))
    torch_empty_cache_steps: int | None = option(None, min=1, help=(
        "empty the accelerator's memory cache (torch.accelerator.empty_cache) in steps 1, N+1, 2N+1 ...: less "
        "peak memory, slower steps (as Trainer's; nothing on the CPU)"))
    dataloader_num_workers: int = option(0, min=0, help="DataLoader worker processes")
    dataloader_drop_last: bool = option(False, help="drop the last incomplete batch")
    dataloader_pin_memory: bool = option(True, help="page-locked batches when training on a GPU")
    dataloader_persistent_workers: bool = option(False, help=(
        "keep the DataLoader's workers between epochs (needs dataloader_num_workers > 0)"))
    dataloader_prefetch_factor: int | None = option(None, min=1, help=(
        "batches each worker loads ahead (needs dataloader_num_workers > 0; default: torch's 2)"))
    dataloader_multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = option(None, help=(
        "start method of the DataLoader's workers (default: the platform's)"))
    dataloader_in_order: bool = option(True, help="workers' batches in sampler order (false: as they are ready)")
    data_seed: int | None = option(None, min=0, max=2**32 - 1, help=(
        "seed of the data order (default: seed): the same batches whatever the model's seed"))
    include_num_input_tokens_seen: bool | Literal["no", "all", "non_padding"] = option("no", help=(
        "log num_input_tokens_seen: every input token ('all' or true) or those the attention mask keeps "
        "('non_padding')"))
    full_determinism: bool = option(False, help=(
        "torch's deterministic algorithms and cuDNN settings for the whole process (slower; as Trainer's)"))
    bf16_full_eval: bool = option(False, help=(
        "evaluate and predict outside training with the model cast to bfloat16 (it stays so; as Trainer)"))
    fp16_full_eval: bool = option(False, help=(
        "evaluate and predict outside training with the model cast to float16 (it stays so; as Trainer)"))
    tf32: bool | None = option(None, help="allow TF32 matmuls and convolutions on Ampere+ GPUs (default: torch's)")
    train_sampling_strategy: Literal["random", "sequential", "group_by_length"] = option("random", help=(
        "order of the training examples: a seeded shuffle each epoch, the dataset's order, or 'group_by_length': "
        "that shuffle grouped into batches of similar length, longest first (less padding; Trainer's "
        "LengthGroupedSampler algorithm)"))
    length_column_name: str = option("length", nonempty=True, help=(
        "group_by_length: the dataset column holding each example's length (default: the length of its "
        "input_ids, or of the tokenizer's first model input)"))
    remove_unused_columns: bool = option(True, help=(
        "drop the columns (keys) of the examples that the model's forward does not take (label_names, label and "
        "label_ids kept) before the collator sees them, as Trainer"))
    disable_tqdm: bool = option(False, help="no console progress bar")
    skip_memory_metrics: bool = option(True, help=(
        "false: train/eval/test metrics get Trainer's memory figures ({stage}_mem_cpu_alloc_delta, "
        "_peaked_delta, and _gpu_ ones on an accelerator; needs psutil; sampling the memory slows the run)"))
    restore_callback_states_from_checkpoint: bool = option(False, help=(
        "on resume: TrainerCallbacks with state (ExportableState, e.g. EarlyStoppingCallback) get it back"))
    log_level: Literal["passive", "debug", "info", "warning", "error", "critical"] = option("passive", help=(
        "log level of the main process for the engine and transformers loggers ('passive': "
        "engine info, transformers' own default)"))
    log_level_replica: Literal["passive", "debug", "info", "warning", "error", "critical"] = option(
        "warning", help="log level of the other processes")
    log_on_each_node: bool = option(True, help=(
        "multi-node: each node's local rank 0 logs at log_level (false: only global rank 0)"))
    run_name: str | None = option(None, help="a name for trackers (default: output_dir's name)")


@dataclass
class DataConfig:
    """``[data]``: the tokenizer and the datasets."""

    train: str = option("embedded", nonempty=True, help=(
        "'embedded' (docstrings that ship with Python), a local .jsonl/.json/.csv/.parquet/.arrow/.txt "
        "file, a glob, a folder (of such files, or saved with save_to_disk), a dataset name for "
        "load_dataset, or 'package.module:function' taking the tokenizer and returning a dataset"))
    eval: str | None = option(None, help="evaluation data, same forms as train")
    eval_split: float = option(0.0, min=0, below=1, help="fraction of the train documents held out for eval when eval is unset")
    config: str | None = option(None, help="the configuration (subset) of a dataset name, as load_dataset's name")
    split: str = option("train", nonempty=True, help="split of a dataset name or saved DatasetDict used for train")
    eval_dataset_split: str = option("validation", nonempty=True, help=(
        "split of a dataset name or saved DatasetDict used for eval"))
    text_column: str = option("text", nonempty=True, help=(
        "column holding the text (rows with 'messages', 'prompt'/'completion' or 'input_ids' use those)"))
    text_pair_column: str | None = option(None, nonempty=True, help=(
        "sequence classification: the column holding each example's second text (pairs, as in GLUE)"))
    label_column: str | None = option(None, nonempty=True, help=(
        "classification: the column of labels (default: 'label' or 'labels'; token classification: 'tags', "
        "'ner_tags' or 'labels')"))
    tokens_column: str = option("tokens", nonempty=True, help="token classification: the column of words")
    label_all_tokens: bool = option(False, help=(
        "token classification: every sub-word of a word gets its label (B- becoming I-), not only the first"))
    source_column: str = option("source", nonempty=True, help="seq2seq: the column of input texts")
    target_column: str = option("target", nonempty=True, help="seq2seq: the column of target texts")
    max_target_length: int | None = option(None, min=1, help="seq2seq: tokens per target (default: max_length)")
    max_length: int = option(128, min=2, help="tokens per example")
    packing: bool | Literal["document"] = option(True, help=(
        "true: concatenate examples and cut max_length rows; false: one padded example per row; "
        "'document': whole examples packed per row, attention kept within each (padding-free)"))
    truncation: Literal["truncate", "drop"] = option("truncate", help=(
        "examples longer than max_length (packing false or 'document'): cut, or left out; counts are logged"))
    train_on_all_tokens: bool = option(False, help=(
        "chat and prompt/completion data: learn every token, not only the assistant / completion ones"))
    num_proc: int | None = option(None, min=1, help=(
        "processes for tokenizing (default: one per core up to 8 from 50,000 rows, else 1)"))
    cache_dir: str | None = option(None, help="where datasets caches files and tokenized data (default: HF_DATASETS_CACHE)")
    streaming: bool = option(False, help=(
        "read data.train as it trains (tokenized and packed on the fly), for corpora larger than memory"))
    shuffle_buffer_size: int = option(10_000, min=1, help="streaming: examples in the shuffle buffer")
    tokenizer: str = option("auto", nonempty=True, help=(
        "'auto' (the model folder's tokenizer, else train one), 'train' (refused for a pretrained train.model folder, "
        "whose weights keep their own), or a local tokenizer folder"))
    tokenizer_vocab_size: int = option(1024, min=258, help="vocabulary size of a trained tokenizer")


# ---------------------------------------------------------------------------- validation


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(item)}"
    if origin is dict:
        return "table"
    if tp is type(None):
        return "none"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` checked (and int->float widened) against type ``tp``, else raise."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp) or (Any,)
            return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return from_mapping(tp, value, path)
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{path}: expected a finite float, got {value}")
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")


def from_mapping(cls: type, data: dict[str, Any], path: str) -> Any:
    """Build dataclass ``cls`` from ``data``; ``path`` prefixes key names in errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table, got {_describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"{path}.{key}: unknown key{hint}")
    kwargs = {key: _convert(value, hints[key], f"{path}.{key}") for key, value in data.items()}
    for key, value in kwargs.items():
        _check_bounds(fields[key].metadata, value, hints[key], f"{path}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field without default was not given
        raise ConfigError(f"{path}: {exc}") from None


def check_value(cls: type, key: str, value: Any, path: str) -> Any:
    """One value for field ``key`` of dataclass ``cls``, converted and range-checked as a run file's
    value is (ints widen to float); a ConfigError naming ``path`` otherwise."""
    option = {f.name: f for f in dataclasses.fields(cls)}[key]
    tp = typing.get_type_hints(cls)[key]
    value = _convert(value, tp, path)
    _check_bounds(option.metadata, value, tp, path)
    return value


def _check_bounds(metadata: Any, value: Any, tp: Any, path: str) -> None:
    """Refuse ``value`` outside the range its :func:`option` declares."""
    if metadata.get("nonempty") and value == "":
        raise ConfigError(f"{path}: expected a non-empty string, got ''")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    low, high, below = metadata.get("min"), metadata.get("max"), metadata.get("below")
    if (low is None or value >= low) and (high is None or value <= high) and (below is None or value < below):
        return
    kind = "int" if isinstance(value, int) else "float"
    if low is not None and (high is not None or below is not None):
        expected = f"{kind} in [{low}, {high}]" if high is not None else f"{kind} in [{low}, {below})"
    elif low is not None:
        expected = f"{kind} >= {low}"
    else:
        expected = f"{kind} <= {high}" if high is not None else f"{kind} < {below}"
    raise ConfigError(f"{path}: expected {expected}, got {value}")


SECRET_MASK = "***"


def to_mapping(instance: Any) -> dict[str, Any]:
    """The dataclass as a plain dict (the inverse of :func:`from_mapping`), secrets masked: options
    declared ``secret`` and credentials by their name inside tables (a DeepSpeed config's ``api_key``)."""
    mapping = dataclasses.asdict(instance)
    for f in dataclasses.fields(instance):
        if f.metadata.get("secret") and mapping[f.name] is not None:
            mapping[f.name] = SECRET_MASK
        else:
            mapping[f.name] = mask_secrets(mapping[f.name], SECRET_MASK)
    return mapping


# ---------------------------------------------------------------------------- run files


MAX_RUN_FILE_BYTES = 1 << 20


def read_run_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML run file; a missing, special, oversized or non-UTF-8 file or a syntax error is a ConfigError.

    A UTF-8 byte-order mark (as some Windows editors write) is accepted.
    """
    path = Path(path)
    try:
        if not path.is_file():
            what = "a folder" if path.is_dir() else "not a regular file" if path.exists() else None
            if what is None:
                raise ConfigError(f"run file not found: {path}")
            raise ConfigError(f"run file {path} is {what}; name a .toml file")
        size = path.stat().st_size
        if size > MAX_RUN_FILE_BYTES:
            raise ConfigError(f"run file {path} is {size:,} bytes, more than a run file's {MAX_RUN_FILE_BYTES:,}: "
                              "is it the right file?")
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read run file {path}: {exc.strerror}") from None
    text = decode_utf8(data, f"run file {path}")
    try:
        mapping = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML syntax error: {exc}") from None
    except RecursionError:  # the parser recurses per nesting level
        mapping = None
    check_nesting(mapping, f"run file {path}")
    return mapping


MAX_NESTING = 32  # levels of tables and arrays in a run: far more than any real config has


def check_nesting(value: Any, where: str) -> None:
    """Refuse a value nested deeper than :data:`MAX_NESTING` (``None``: one that was too deep to parse),
    before code that walks it recursively overflows the stack."""
    level = [value]
    for _ in range(MAX_NESTING + 1):
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            break
    if value is None or level:
        raise ConfigError(f"{where} nests tables or arrays more than {MAX_NESTING} levels deep")


def default_run_mapping() -> dict[str, Any]:
    """The embedded default run (``engine train`` without a run file)."""
    from importlib import resources

    return tomllib.loads(resources.files("engine").joinpath("default_run.toml").read_text(encoding="utf-8"))


def parse_value(text: str) -> Any:
    """A ``--set`` value: any TOML value (1e-4, true, [1, 2], "x"), else the bare string."""
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        value = None
    check_nesting(value, f"--set value {text[:40]!r}")
    return value


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """Parse ``train.optim_args`` ("key=value,key=value") into typed values."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"train.optim_args: expected 'key=value,key=value', got {text!r} "
                              f"(bad item {item!r})")
        out[key] = parse_value(value)
    return out


def apply_overrides(raw: dict[str, Any], sets: list[str] = (), plugin_edits: list[str] = (),
                    blockable: Collection[str] = ()) -> dict[str, Any]:
    """Apply ``--set a.b=v`` and ``--plugins +x,-y`` (or ``--plugins x,y`` to replace) to ``raw``.

    ``-x`` of a ``blockable`` name (a builtin) blocks it (``"-x"`` in the list), ``+x`` lifts the
    block. Returns a new mapping; ``raw`` is not modified.
    """
    raw = _deep_copy(raw)
    if plugin_edits:
        enabled_plugins(raw)  # an edit of a malformed list would edit its characters
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.learning_rate=1e-4")
        parts = key.strip().split(".")
        if len(parts) > MAX_NESTING:
            raise ConfigError(f"--set {item[:60]!r}...: a key of more than {MAX_NESTING} parts")
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[:depth + 1])} is not a table")
            node = child
        node[parts[-1]] = parse_value(text.strip())
    for edit in plugin_edits:
        names = [n.strip() for n in edit.split(",") if n.strip()]
        if names and all(n[0] not in "+-" for n in names):
            for name in enabled_plugins(raw):
                if name not in names:
                    raw.pop(name, None)
            raw["plugins"] = names
            continue
        current = list(raw.get("plugins", []))
        before = list(current)
        for name in names:
            if name[0] == "+" and name[1:] in blockable and f"-{name[1:]}" in current:
                current.remove(f"-{name[1:]}")  # the builtin is on again
            elif name[0] == "+":
                if name[1:] not in current:
                    current.append(name[1:])
            elif name[0] == "-" and name[1:] in blockable:
                if name not in current:
                    current.append(name)  # blocks the builtin
            elif name[0] == "-":
                if name[1:] not in current:
                    raise ConfigError(f"--plugins {name}: {name[1:]!r} is not enabled (enabled: {current})")
                current.remove(name[1:])
            else:
                raise ConfigError(f"--plugins {edit!r}: mix of names with and without +/-; "
                                  "use +name,-name to edit or a plain list to replace")
        raw["plugins"] = current
        for name in before:
            if name not in current:
                raw.pop(name, None)  # a plugin switched off takes its options section with it
    enabled_plugins(raw)  # e.g. --set plugins=3
    return raw


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def enabled_plugins(raw: dict[str, Any]) -> list[str]:
    """The ``plugins`` list of a raw run mapping, checked."""
    names = raw.get("plugins", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"plugins: expected list of str, got {_describe(names)}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"plugins: {', '.join(duplicates)} listed twice")
    return list(names)


def required_plugins(raw: dict[str, Any]) -> list[str]:
    """The ``required_plugins`` list of a raw run mapping, checked for shape (the versions are
    checked against what is installed by :func:`engine.plugins.check_required_plugins`)."""
    names = raw.get("required_plugins", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"required_plugins: expected list of str like [\"galore>=0.2\"], got {_describe(names)}")
    return list(names)


@dataclass
class RunConfig:
    """The composed, validated run: core sections plus each enabled plugin's options."""

    plugins: list[str]
    train: TrainConfig
    data: DataConfig
    sections: dict[str, Any] = field(default_factory=dict)  # plugin name -> options dataclass
    required_plugins: list[str] = field(default_factory=list)  # ["galore>=0.2"]: checked before plugins load

    def section(self, plugin: str) -> Any:
        """The validated options of ``plugin`` (its ``plugin_options`` dataclass instance)."""
        try:
            return self.sections[plugin]
        except KeyError:
            raise ConfigError(f"plugin {plugin!r} declares no options or is not enabled") from None

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plugins": list(self.plugins)}
        if self.required_plugins:  # only when set: older runs' config fingerprints stay the same
            out["required_plugins"] = list(self.required_plugins)
        out.update(train=to_mapping(self.train), data=to_mapping(self.data))
        for name, options in self.sections.items():
            out[name] = to_mapping(options)
        return out


def compose(raw: dict[str, Any], schemas: dict[str, type | None]) -> RunConfig:
    """Validate a raw run mapping. ``schemas`` maps each enabled plugin to its options class."""
    plugins = enabled_plugins(raw)
    for key, value in raw.items():
        if key in TOP_LEVEL_KEYS or key in CORE_SECTIONS:
            continue
        if f"-{key}" in plugins:
            first = next(iter(value), None) if isinstance(value, dict) else None
            where = f"{key}.{first}" if first else f"[{key}]"
            raise ConfigError(f"{where}: plugin {key!r} is blocked ('-{key}' in plugins), so its options would do "
                              "nothing; remove them, or the block")
        if key not in plugins:
            known = ", ".join([*TOP_LEVEL_KEYS, *CORE_SECTIONS, *plugins])
            raise ConfigError(f"{key}: unknown section; not a core section or an enabled plugin "
                              f"(known: {known}); enable the plugin with plugins = [..., {key!r}]")
        if schemas.get(key) is None:
            raise ConfigError(f"[{key}]: plugin {key!r} takes no options")
    sections = {}
    for name in plugins:
        schema = schemas.get(name)
        if schema is not None:
            sections[name] = from_mapping(schema, raw.get(name, {}), name)
    return RunConfig(
        plugins=plugins,
        required_plugins=required_plugins(raw),
        train=from_mapping(TrainConfig, raw.get("train", {}), "train"),
        data=from_mapping(DataConfig, raw.get("data", {}), "data"),
        sections=sections,
    )


# ---------------------------------------------------------------------------- TOML output


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(key: str) -> str:
    """A TOML key: bare when it can be, else quoted."""
    return key if _BARE_KEY.fullmatch(key) else toml_value(key)


def toml_value(value: Any) -> str:
    """One value as TOML (strings with JSON's escapes, which are TOML's; inf and nan as TOML spells them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def to_toml(mapping: dict[str, Any], comments: dict[str, dict[str, str]] | None = None) -> str:
    """Write a run mapping as TOML. Unset (None) values appear as comments."""
    comments = comments or {}
    lines = []
    for key, value in mapping.items():
        if not isinstance(value, dict):
            lines.append(f"{toml_key(key)} = {toml_value(value)}")
    for section, values in mapping.items():
        if not isinstance(values, dict):
            continue
        lines.append(f"\n[{section}]")
        for key, value in values.items():
            note = comments.get(section, {}).get(key)
            suffix = f"  # {note}" if note else ""
            if value is None:
                lines.append(f"# {toml_key(key)} = (unset){suffix}")
            else:
                lines.append(f"{toml_key(key)} = {toml_value(value)}{suffix}")
    return "\n".join(lines) + "\n"
