"""Evaluation and prediction: the builtin answer to the ``evaluate``, ``predict`` and ``prediction_step`` hooks.

One pass over a dataset: every process takes an equal share of the rows (the repeats that makes at
the end are masked), each batch goes through ``prediction_step`` (loss, predictions, labels) under
``no_grad``, and the pass gives the token-weighted loss, and ``compute_metrics``' answer on the
predictions gathered back in dataset order (``include_for_metrics``, ``batch_eval_metrics``,
``prediction_loss_only`` as Trainer). The builtin ``prediction_step`` returns the logits of the
forward ``compute_loss`` runs (caught by a forward hook, so predictions cost no second forward);
with ``train.predict_with_generate`` the generation builtin answers first with ``generate()``'s
tokens (engine/builtin/generation.py).
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine import hookimpl
from engine.builtin import memory
from engine.config import option
from engine.errors import ConfigError
from engine.interval import collected_metrics
from engine.kit.loaders import EpochSampler, loader_data, loader_options
from engine.loss import IGNORE_INDEX, count_items, logits_of
from engine.metrics import EvalPrediction
from engine.state import PredictionOutput, RunView
from engine.util import call_user


@dataclass
class EvaluationOptions:
    """``[train]`` keys of builtin.evaluation: the evaluation pass and what compute_metrics gets."""

    per_device_eval_batch_size: int = option(8, shared=True, min=1, help="evaluation batch size per device")
    include_for_metrics: list[str] = option(default_factory=list, help=(
        "what compute_metrics gets besides predictions and labels: 'inputs' (the model's main input, as "
        "EvalPrediction.inputs) and/or 'loss' (each row's batch loss, as EvalPrediction.losses)"))
    batch_eval_metrics: bool = option(False, help=(
        "call compute_metrics after each evaluation batch (tensors; compute_result=True after the last, whose "
        "answer are the metrics) instead of once on every prediction kept in memory"))
    eval_accumulation_steps: int | None = option(None, shared=True, min=1, help=(
        "Trainer's: move evaluation predictions to the CPU every N batches; the engine moves each batch's as it "
        "comes (Trainer's 1), which gives the same predictions and metrics as any N"))
    prediction_loss_only: bool = option(False, help="evaluation returns the loss only (no compute_metrics)")
    bf16_full_eval: bool = option(False, shared=True, help=(
        "evaluate and predict outside training with the model cast to bfloat16 (it stays so; as Trainer)"))
    fp16_full_eval: bool = option(False, shared=True, help=(
        "evaluate and predict outside training with the model cast to float16 (it stays so; as Trainer)"))


TRAIN_OPTIONS = EvaluationOptions  # the [train] keys it reads: engine.config.TrainConfig has them


@hookimpl(tryfirst=True)  # its keys checked before the enabled plugins' configure, as the kernel's are
def configure(run: RunView) -> None:
    train = run.config.train
    unknown = [name for name in train.include_for_metrics if name not in ("inputs", "loss")]
    if unknown:
        raise ConfigError(f"train.include_for_metrics: {', '.join(map(repr, unknown))} is not one of 'inputs', 'loss'")
    if train.bf16_full_eval and train.fp16_full_eval:
        raise ConfigError("train.bf16_full_eval and train.fp16_full_eval are both true; pick one")


@hookimpl(trylast=True)
def evaluate(run: RunView, dataset: Any, prefix: str, report: bool, in_training: bool) -> dict[str, float]:
    """Evaluate ``dataset`` (None: the run's eval data; a dict evaluates each, prefixed).

    ``report``: send the metrics to ``log_metrics`` and ``on_evaluate`` (``engine evaluate``, a
    job of its own, does not).
    """
    if not in_training:
        cast_for_full_eval(run)
    dataset = dataset if dataset is not None else run.eval_dataset
    if dataset is None:
        raise ConfigError("no evaluation data: set data.eval or data.eval_split, or pass eval_dataset")
    metrics: dict[str, float] = {}
    tracker = memory.track(run, "eval")  # None during training, as Trainer
    try:
        run.hook.on_eval_mode(run=run)
        parts = dataset.items() if isinstance(dataset, dict) else [(None, dataset)]
        for name, part in parts:
            part_prefix = f"{prefix}_{name}" if name else prefix
            part_metrics, _, _ = _evaluate_one(run, part, part_prefix, want_predictions=False)
            metrics.update(part_metrics, **collected_metrics(run, part_prefix))
        metrics = _report(run, metrics) if report else {**metrics, "epoch": round(run.state.epoch, 4)}
    finally:
        memory.finish(run, tracker, metrics)  # returned, not logged, as Trainer
    return metrics


def cast_for_full_eval(run: RunView) -> None:
    """``bf16_full_eval`` / ``fp16_full_eval``: cast the model in place before an evaluation or prediction
    outside training (Run.evaluate, Run.predict, ``engine evaluate``), as Trainer does."""
    train = run.config.train
    if train.bf16_full_eval:
        if run.strategy.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("train.bf16_full_eval: this GPU does not support bfloat16; use train.fp16_full_eval")
        run.model.to(torch.bfloat16)
    elif train.fp16_full_eval:
        run.model.to(torch.float16)


@hookimpl(trylast=True)
def predict(run: RunView, dataset: Any, prefix: str) -> PredictionOutput:
    """Logits, labels and metrics over ``dataset`` (see :meth:`Run.predict`)."""
    cast_for_full_eval(run)
    tracker = memory.track(run, "test")
    metrics: dict[str, float] = {}
    try:
        run.hook.on_eval_mode(run=run)
        measured, predictions, label_ids = _evaluate_one(run, dataset, prefix, want_predictions=True)
        measured.update(collected_metrics(run, prefix))
        # returned, not logged (as Trainer.predict); not an evaluation, which early stopping counts
        metrics.update(measured, epoch=round(run.state.epoch, 4))
        run.hook.on_predict(run=run, metrics=metrics)
    finally:
        memory.finish(run, tracker, metrics)  # returned, not logged, as Trainer
    return PredictionOutput(predictions, label_ids, metrics)


@hookimpl(trylast=True)
def prediction_step(run: RunView, model: torch.nn.Module, batch: dict[str, Any], num_items_in_batch: Any,
                    prediction_loss_only: bool) -> tuple[torch.Tensor, Any, Any]:
    """``compute_loss``, and the logits of the forward it ran (through preprocess_logits_for_metrics)."""
    compute_loss = functools.partial(run.hook.compute_loss, run=run, model=model, batch=batch,
                                     num_items_in_batch=num_items_in_batch)
    if prediction_loss_only:
        with run.strategy.autocast():
            return compute_loss(), None, None
    outputs: list[Any] = []
    handle = model.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        with run.strategy.autocast():
            loss = compute_loss()
            if not outputs:  # a loss plugin that did not call the model
                model(**batch)
    finally:
        handle.remove()
    labels = labels_of(batch, run.label_names)
    found = _predictions_of(run.model, outputs[-1])
    if run.preprocess_logits_for_metrics is not None:  # e.g. argmax: keep less per batch
        found = run.preprocess_logits_for_metrics(found, labels)
    return loss, found, labels


def _report(run: RunView, metrics: dict[str, float]) -> dict[str, float]:
    state = run.state
    metrics["epoch"] = round(state.epoch, 4)
    state.log_history.append({"step": state.global_step, **metrics})
    if run.strategy.is_main_process:
        run.isolated_hooks.call("log_metrics", metrics=metrics, step=state.global_step)
    run.hook.on_evaluate(run=run, metrics=metrics)
    return metrics


def _evaluate_one(run: Any, dataset: Any, prefix: str, want_predictions: bool) -> tuple[dict[str, float], Any, Any]:
    """Token-weighted loss (and compute_metrics) over ``dataset``; predictions and labels when wanted."""

    strategy, model, train_cfg = run.strategy, run.wrapped_model, run.config.train
    dataset, collator = loader_data(run, dataset, f"{prefix} dataset")
    sampler = None
    length = 0
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        length = len(dataset)
        # every process gets an equal share (sharded models need the same forwards everywhere),
        # so up to world_size - 1 samples repeat at the end: their labels are masked below
        sampler = EpochSampler(length, 0, False, strategy.rank, strategy.world_size)
    loader = torch.utils.data.DataLoader(dataset, batch_size=train_cfg.per_device_eval_batch_size,
                                         sampler=sampler, collate_fn=collator, **loader_options(run),
                                         generator=torch.Generator().manual_seed(train_cfg.seed))
    prediction_step, on_prediction_step = run.hook.prediction_step, run.hook.on_prediction_step
    total = len(loader) if sampler is not None else None
    use_metrics = run.compute_metrics is not None and not train_cfg.prediction_loss_only
    collect = use_metrics or (want_predictions and not train_cfg.prediction_loss_only)
    loss_sum = torch.zeros((), dtype=torch.float64)
    weight_sum = torch.zeros((), dtype=torch.float64)
    predictions, label_ids = [], []
    # train.include_for_metrics: the model's main inputs and each row's batch loss, as Trainer
    inputs: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    include = set(train_cfg.include_for_metrics) if use_metrics else set()
    main_input = getattr(run.model, "main_input_name", "input_ids")
    # logits as float32 on the host; what preprocess_logits_for_metrics made, and token ids, as they are
    as_is = run.preprocess_logits_for_metrics is not None

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu() if as_is or not tensor.is_floating_point() else tensor.float().cpu()

    # train.batch_eval_metrics: compute_metrics sees each batch (tensors), compute_result=True for the last;
    # its last answer is the metrics. Batches are kept only for predict's output then.
    per_batch = use_metrics and train_cfg.batch_eval_metrics
    if per_batch:
        function = run.compute_metrics
        if "compute_result" not in _parameters(function):
            raise ConfigError(f"train.batch_eval_metrics: {run.compute_metrics_key} must take a compute_result "
                              "argument (true after the last batch: return the metrics then)")
        if strategy.world_size > 1:
            raise ConfigError("train.batch_eval_metrics: not supported with several processes yet (each would see "
                              "its own batches only); set it to false")
    keep = not per_batch or want_predictions
    pending = computed = None
    samples = 0
    started = time.perf_counter()
    with torch.no_grad():
        for index, batch in enumerate(loader, 1):
            batch = strategy.to_device(batch)
            rows = len(next(iter(batch.values())))
            if sampler is not None and strategy.world_size > 1 and "labels" in batch:
                positions = strategy.rank + strategy.world_size * torch.arange(samples, samples + rows)
                if bool((positions >= length).any()):  # a repeat: no loss, no items
                    batch["labels"] = batch["labels"].clone()
                    batch["labels"][(positions >= length).to(batch["labels"].device)] = IGNORE_INDEX
            num_items = count_items(batch["labels"], run.label_shift) if "labels" in batch else None
            loss, found, labels = prediction_step(run=run, model=model, batch=batch, num_items_in_batch=num_items,
                                                  prediction_loss_only=not collect)
            weight = num_items if num_items is not None else rows
            if float(weight) > 0:  # a batch of repeats only has no loss to add
                loss_sum += loss.detach().double().cpu() * float(weight)
            weight_sum += float(weight)
            samples += rows
            if collect:
                batch_inputs = batch[main_input] if "inputs" in include else None
                batch_losses = loss.detach().float().repeat(rows) if "loss" in include else None
                if per_batch:
                    if pending is not None:
                        computed = _call_metrics(run, pending, compute_result=False)
                    pending = EvalPrediction(found, labels, batch_inputs, batch_losses)
                if keep:
                    predictions.append(_nested(to_host, found))
                    if labels is not None:
                        label_ids.append(_nested(lambda t: t.cpu(), labels))
                    if batch_inputs is not None:
                        inputs.append(batch_inputs.cpu())
                    if batch_losses is not None:
                        losses.append(batch_losses.cpu())
            on_prediction_step(run=run, step=index, total=total)
    if pending is not None:
        computed = _call_metrics(run, pending, compute_result=True)
    loss_sum = strategy.reduce(loss_sum.to(strategy.device), "sum").cpu()
    weight_sum = strategy.reduce(weight_sum.to(strategy.device), "sum").cpu()
    runtime = time.perf_counter() - started
    metrics = {
        f"{prefix}_loss": round(float(loss_sum / weight_sum), 6) if weight_sum > 0 else float("nan"),
        f"{prefix}_runtime": round(runtime, 4),
        f"{prefix}_samples_per_second": round(samples / runtime, 3) if runtime else 0.0,
    }
    if not collect:
        return metrics, None, None
    all_predictions = _concat_nested(predictions) if predictions else None
    all_labels = _concat_nested(label_ids) if label_ids else None
    all_inputs = _concat_padded(inputs) if inputs else None
    all_losses = torch.cat(losses).numpy() if losses else None
    if strategy.world_size > 1 and sampler is not None:
        all_predictions, all_labels, all_inputs, all_losses = _gather_in_order(
            strategy, (all_predictions, all_labels, all_inputs, all_losses), length)
    if use_metrics and not per_batch:
        computed = _call_metrics(run, EvalPrediction(all_predictions, all_labels, all_inputs, all_losses))
    for key, value in (computed or {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:  # batch_eval_metrics' tensors, as Trainer
            value = value.item()
        metrics[key if key.startswith(prefix + "_") else f"{prefix}_{key}"] = value
    return metrics, all_predictions, all_labels


def _parameters(function: Any) -> Any:
    try:
        return inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature (a builtin)
        return {}


def _call_metrics(run: Any, prediction: EvalPrediction, **keywords: Any) -> dict[str, Any]:
    """compute_metrics on ``prediction``; its answer checked to be a dict of metric name -> value."""
    function = run.compute_metrics
    name = run.config.train.compute_metrics if run.compute_metrics_key == "train.compute_metrics" else \
        getattr(function, "__qualname__", type(function).__name__)
    computed = call_user(run.compute_metrics_key, name, functools.partial(function, **keywords) if keywords
                         else function, prediction)
    if not isinstance(computed, dict) or not all(isinstance(k, str) for k in computed):
        raise ConfigError(f"{run.compute_metrics_key}: {name} returned {type(computed).__name__}, expected a dict "
                          "of metric name -> number")
    return computed


def _gather_in_order(strategy: Any, arrays: tuple[Any, ...], length: int) -> tuple[Any, ...]:
    """Every process's rows of each of ``arrays`` (None stays None), back in dataset order, without the
    repeats of the equal shares.

    Process r holds rows r, r + world_size, r + 2 * world_size, ... of the dataset.
    """
    import numpy

    parts = strategy.gather_object(arrays)
    world = strategy.world_size

    def merged(arrays: list[Any]) -> Any:
        width = max(a.shape[1] for a in arrays) if arrays[0].ndim > 1 else None
        out = None
        for rank, array in enumerate(arrays):
            if width is not None and array.shape[1] < width:  # ragged sequences: pad as _concat_padded does
                pad = [(0, 0), (0, width - array.shape[1])] + [(0, 0)] * (array.ndim - 2)
                array = numpy.pad(array, pad, constant_values=-100)
            if out is None:
                out = numpy.empty((length, *array.shape[1:]), dtype=array.dtype)
            rows = numpy.arange(rank, rank + world * len(array), world)
            keep = rows < length
            out[rows[keep]] = array[keep]
        return out

    def merged_nested(arrays: list[Any]) -> Any:  # a tuple (several outputs or label names): element by element
        if isinstance(arrays[0], tuple):
            return tuple(merged([array[i] for array in arrays]) for i in range(len(arrays[0])))
        return merged(arrays)

    return tuple(None if array is None else merged_nested([part[i] for part in parts])
                 for i, array in enumerate(arrays))


def _predictions_of(model: Any, outputs: Any) -> Any:
    """The model's logits; for an output without ``logits`` (e.g. question answering's start_logits and
    end_logits) a tuple of its tensors but the loss and the config's keys_to_ignore_at_inference, as Trainer."""
    if isinstance(outputs, dict) and outputs.get("logits") is None:
        ignore = getattr(getattr(model, "config", None), "keys_to_ignore_at_inference", None) or []
        found = tuple(v.detach() for k, v in outputs.items() if k not in (*ignore, "loss") and torch.is_tensor(v))
        return found[0] if len(found) == 1 else found
    return logits_of(outputs).detach()


def labels_of(batch: dict[str, Any], names: list[str]) -> Any:
    """The batch's labels under train.label_names (a tuple for several names); None unless all are there."""
    if not names or any(batch.get(name) is None for name in names):
        return None
    return batch[names[0]] if len(names) == 1 else tuple(batch[name] for name in names)


def _nested(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    return tuple(function(v) for v in value) if isinstance(value, tuple) else function(value)


def _concat_nested(items: list[Any]) -> Any:
    """:func:`_concat_padded` of each batch's tensors, or of each element of their tuples (a tuple then)."""
    if isinstance(items[0], tuple):
        return tuple(_concat_padded([item[i] for item in items]) for i in range(len(items[0])))
    return _concat_padded(items)


def _concat_padded(tensors: list[torch.Tensor]) -> Any:
    """Concatenate along dim 0, right-padding dim 1 with -100 when lengths differ; numpy out."""
    if tensors[0].dim() > 1:
        width = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]), value=-100)
                   if t.shape[1] < width else t for t in tensors]
    return torch.cat(tensors).numpy()
