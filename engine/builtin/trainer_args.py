"""Every ``transformers.TrainingArguments`` field, answered: what the engine does with it.

A builtin plugin: its ``check_raw_config`` refuses a ``[train]`` key that is a TrainingArguments
field but no ``[train]`` key with this table's answer (where it goes, or why not), before
anything loads. One :class:`~engine.kit.mappings.Answer` per field, of five kinds:

* ``accepted``: a ``[train]`` key with Trainer's meaning (the same name, or the engine's name for it);
* ``plugin``: provided by a named plugin, the value going to a key of that plugin's section;
* ``builtin``: the engine always behaves as Trainer's default does; there is no switch;
* ``refused``: no counterpart, with the reason and what to use instead;
* ``not yet``: no counterpart yet (a plain Trainer feature the engine is still to implement).

:data:`FIELDS` covers the installed transformers' fields exactly (a test walks
``dataclasses.fields(TrainingArguments)``, so a new release shows its new names at once);
:data:`SEQ2SEQ_FIELDS` those ``Seq2SeqTrainingArguments`` adds; :data:`LEGACY` answers names of
older releases found in older dumps. ``engine migrate`` (:mod:`engine.tooling.migration`)
converts a ``TrainingArguments`` dump with it, and ``docs/generate_trainer_arguments.py`` renders
it into ``docs/trainer-arguments.md``. Converters write through a
:class:`~engine.kit.mappings.Conversion` (see :mod:`engine.kit.mappings`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from engine import hookimpl
from engine.catalogue import UNSUPPORTED_OPTIMIZERS, provider_of
from engine.config import option
from engine.errors import ConfigError
from engine.kit.mappings import (ACCEPTED, BUILTIN, PLUGIN, REFUSED, Answer, Conversion, accepted, builtin, flag,
                                 load_json, plugin, plugin_mappings, refused, unavailable, write)

TRANSFORMERS_VERSION = "5.24"  # FIELDS answers this release's TrainingArguments
# What a first-party plugin answers for `engine migrate` (its hook trainer_argument_mappings): asked when
# installed, else named with its extra.
TRAINER_FIELDS = {  # TrainingArguments field -> the plugin that answers it
    "fsdp": "fsdp", "fsdp_config": "fsdp", "deepspeed": "deepspeed", "ddp_find_unused_parameters": "ddp",
    "ddp_bucket_cap_mb": "ddp", "ddp_broadcast_buffers": "ddp", "ddp_static_graph": "ddp",
    "use_liger_kernel": "liger", "liger_kernel_config": "liger", "neftune_noise_alpha": "neftune",
    "project": "trackio", "trackio_space_id": "trackio", "trackio_bucket_id": "trackio",
    "trackio_static_space_id": "trackio", "push_to_hub": "hub", "hub_token": "hub", "hub_private_repo": "hub",
    "hub_model_id": "hub", "hub_strategy": "hub", "hub_always_push": "hub", "hub_revision": "hub",
    "logging_dir": "tensorboard",
}

# Trainer's report_to names -> the tracker plugin of each (transformers' INTEGRATION_TO_CALLBACK)
REPORT_TO = {
    "azure_ml": "azureml", "clearml": "clearml", "codecarbon": "codecarbon", "comet_ml": "comet", "dagshub": "dagshub",
    "dvclive": "dvclive", "flyte": "flyte", "kubeflow": "kubeflow", "mlflow": "mlflow", "neptune": "neptune",
    "swanlab": "swanlab", "tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb",
}
TRACKERS = tuple(REPORT_TO.values())
# report_to "all" takes these only where the variable is set (Trainer: a Kubeflow TrainJob sets it) and the
# second is not true
ALL_WHEN_SET = {"kubeflow": ("KUBEFLOW_TRAINER_SERVER_URL", "DISABLE_KUBEFLOW_INTEGRATION")}
STRATEGIES = ("deepspeed", "fsdp", "ddp")  # one per run; when several are asked for, the first wins (as Trainer)
# what enables each plugin under Trainer: said when an option of a plugin that is not enabled is dropped
ENABLED_BY = {
    "hub": "push_to_hub = true", "liger": "use_liger_kernel = true", "neftune": "neftune_noise_alpha",
    "fsdp": "fsdp", "deepspeed": "deepspeed", "ddp": "a run on several processes without fsdp or deepspeed",
    **{tracker: f"report_to {name!r}" for name, tracker in REPORT_TO.items()},
}


@dataclasses.dataclass
class SearchOptions:
    """``[train]`` keys of ``Run.hyperparameter_search`` (engine/tooling/search.py), which no run reads itself."""

    ray_scope: Literal["last", "all", "avg", "last-5-avg", "last-10-avg"] | None = option(None, shared=True, help=(
        "the Ray backend of Run.hyperparameter_search ranks trials by their last objective ('last'), their best "
        "('all') or an average (Ray's get_best_result scope); default: $RAY_SCOPE, else 'last'"))


TRAIN_OPTIONS = SearchOptions  # engine.config.TrainConfig has them


# ---------------------------------------------------------------------------- converters


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < 1:
        raise ConfigError("expected a whole number of steps, or a ratio in (0, 1)")
    return int(value)


def _steps_or_ratio(c: Conversion, name: str, value: Any) -> None:
    """``logging_steps`` / ``eval_steps`` / ``save_steps``: a step count, or below 1 a ratio of the total steps."""
    if value is None:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1:
        max_steps = c.arguments.get("max_steps", -1)
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= 0:
            raise ConfigError(f"a ratio of the total steps, which depend on the data when max_steps is unset; "
                              f"set train.{name} to a step count")
        steps = math.ceil(max_steps * value)  # as Trainer's TrainerState.compute_steps
        c.set(c.answer.keys[0], steps, note=f"{value} x max_steps {max_steps}, rounded up as Trainer does")
        return
    c.set(c.answer.keys[0], _count(value))


def _warmup(c: Conversion, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError("expected a step count or a ratio in [0, 1)")
    if 0 < value < 1:
        c.set("train.warmup_ratio", float(value))
    else:
        c.set("train.warmup_steps", int(value))  # Trainer: int(warmup_steps)


def _eval_strategy(c: Conversion, name: str, value: Any) -> None:
    write(c, name, value)
    if value not in ("no", None):  # `engine plan` refuses evaluation without data
        c.placeholder("data.eval_split", 0.1, "Trainer evaluated the eval_dataset it was given, which "
                                              "TrainingArguments does not hold: a fraction of data.train held out, "
                                              "or data.eval = a file, glob or dataset name")


def _optim(c: Conversion, name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError("expected an optimizer name, e.g. 'adamw_torch'")
    if value in UNSUPPORTED_OPTIMIZERS:
        raise ConfigError(UNSUPPORTED_OPTIMIZERS[value])
    provider = provider_of("optimizer", value)
    if provider is not None:
        c.enable(provider)
    if provider == "schedulefree":
        c.set("schedulefree.keep_scheduler", True, note="Trainer applies lr_scheduler_type on top of it")
    c.set("train.optim", value)


_BATCH_REBALANCE = ("'batch_rebalance' is refused: it deals whole batches out across processes and accumulation "
                    "steps by token count, which the engine's per-example, resumable sampler does not do")


def _sampling_strategy(c: Conversion, name: str, value: Any) -> None:
    if value == "batch_rebalance":
        raise ConfigError(_BATCH_REBALANCE)
    write(c, name, value)


def _group_by_length(c: Conversion, name: str, value: Any) -> None:
    """The older boolean that train_sampling_strategy = 'group_by_length' replaced."""
    if flag(value):
        c.set("train.train_sampling_strategy", "group_by_length")


def _include_inputs(c: Conversion, name: str, value: Any) -> None:
    """The older boolean that include_for_metrics replaced."""
    if flag(value):
        c.set("train.include_for_metrics", ["inputs"])


def _json_table(c: Conversion, name: str, value: Any) -> None:
    """A dict field Trainer also takes as a JSON string (lr_scheduler_kwargs)."""
    if isinstance(value, str):
        value = load_json(value, "expected a table or a JSON object, got a string that")
        if not isinstance(value, dict):
            raise ConfigError("expected a table or a JSON object")
    write(c, name, value)


def _report_to(c: Conversion, name: str, value: Any) -> None:
    names = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError("expected an integration name or a list of them")
    trackers = []
    for integration in dict.fromkeys(names):
        if integration == "all":  # Trainer: every installed integration; here every installed tracker plugin
            trackers += installed_trackers()
        elif integration in REPORT_TO:
            trackers.append(REPORT_TO[integration])
        elif integration in TRACKERS:  # a plugin's own name (comet for comet_ml)
            trackers.append(integration)
        elif integration != "none":
            c.lose(f"report_to {integration!r}", f"no engine plugin reports to {integration}; report_to names "
                                                 f"{', '.join(REPORT_TO)} (a new tracker implements log_metrics, "
                                                 "docs/hooks.md)")
    for tracker in dict.fromkeys(trackers):
        c.enable(tracker)


def installed_trackers() -> list[str]:
    """The tracker plugins installed here, as report_to "all" takes them: kubeflow only inside a Kubeflow
    TrainJob (KUBEFLOW_TRAINER_SERVER_URL set, DISABLE_KUBEFLOW_INTEGRATION not true), as Trainer."""
    import os

    from engine.plugins import installed_plugins

    installed = installed_plugins()
    def available(tracker: str) -> bool:
        if tracker not in ALL_WHEN_SET:
            return True
        needed, disabled = ALL_WHEN_SET[tracker]
        return bool(os.environ.get(needed)) and os.environ.get(disabled, "").upper() not in ("1", "ON", "YES", "TRUE")

    return [t for t in TRACKERS if t in installed and available(t)]


def report_to_names(plugins: list[str]) -> list[str]:
    """Trainer's report_to list for a run with these plugins enabled (comet_ml for comet, ...)."""
    names = {tracker: name for name, tracker in REPORT_TO.items()}
    return [names[plugin] for plugin in plugins if plugin in names]


def _ddp_timeout(c: Conversion, name: str, value: Any) -> None:
    for strategy in STRATEGIES:  # init_process_group's timeout under Trainer: the enabled strategy's
        c.set(f"{strategy}.timeout", value)


# ---------------------------------------------------------------------------- the table


@hookimpl
def check_raw_config(raw: dict[str, Any]) -> None:
    """A ``[train]`` key that is not one but is a ``TrainingArguments`` field is refused with this table's
    answer (where it goes, or why not), never with a near name (``save_only_model`` is not ``save_final_model``)."""
    from engine.config import TrainConfig

    train = raw.get("train")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in train if isinstance(train, dict) else ():
        answer = answer_for(key) if key not in known else None
        if answer is not None:
            owner = "Seq2SeqTrainingArguments" if key in SEQ2SEQ_FIELDS else "TrainingArguments"
            raise ConfigError(f"train.{key}: not a [train] key; {owner}.{key}: {answer.describe(key)}")


def provided() -> Answer:
    """A field its plugin answers (hook ``trainer_argument_mappings``); ``TRAINER_FIELDS`` names the plugin."""
    return Answer(PLUGIN, convert=_not_installed)


def _not_installed(c: Conversion, name: str, value: Any) -> None:
    raise ConfigError(f"mapped by plugin {c.answer.plugins[0]}, {unavailable(c.answer.plugins[0])}")


def _named(table: dict[str, Answer]) -> dict[str, Answer]:
    """Accepted fields' own [train] key filled in, and the plugin of each field a plugin answers."""
    return {name: dataclasses.replace(a, keys=(f"train.{name}",)) if a.kind == ACCEPTED and not a.keys
            else dataclasses.replace(a, plugins=(TRAINER_FIELDS[name],)) if a.kind == PLUGIN and not a.plugins
            else a for name, a in table.items()}


_STEP_NOTE = "below 1, a ratio of max_steps (converted to steps when max_steps is set)"
_STRATEGY_NOTE = "the engine picks nccl on GPU, gloo on CPU"
_OPTIMIZER_PLUGINS = ("bnb", "galore", "apollo", "lomo", "grokadamw", "schedulefree", "torchao", "optimi")

FIELDS: dict[str, Answer] = _named({
    "output_dir": accepted(),
    "per_device_train_batch_size": accepted(),
    "num_train_epochs": accepted(),
    "max_steps": accepted(),
    "learning_rate": accepted(),
    "lr_scheduler_type": accepted(note="linear, cosine, constant, constant_with_warmup, polynomial, or a "
                                       "plugin's name (register_schedulers)"),
    "lr_scheduler_kwargs": accepted(convert=_json_table),
    "warmup_steps": accepted("warmup_steps", "warmup_ratio", convert=_warmup,
                             note="a value below 1 is a ratio: [train] warmup_ratio"),
    "optim": Answer(ACCEPTED, ("train.optim", "schedulefree.keep_scheduler"), _OPTIMIZER_PLUGINS, convert=_optim,
                    note="a name from an optimizer plugin enables it (galore_adamw -> galore, adamw_8bit -> bnb, "
                         "...); hardware-specific names are refused with what to use instead"),
    "optim_args": accepted(),
    "weight_decay": accepted(),
    "adam_beta1": accepted(),
    "adam_beta2": accepted(),
    "adam_epsilon": accepted(),
    "optim_target_modules": accepted(),
    "gradient_accumulation_steps": accepted(),
    "average_tokens_across_devices": builtin(
        "the loss is normalized by the item count of the whole global batch, on any number of processes"),
    "max_grad_norm": accepted(),
    "label_smoothing_factor": accepted(),
    "bf16": accepted(),
    "fp16": accepted(),
    "bf16_full_eval": accepted(),
    "fp16_full_eval": accepted(),
    "tf32": accepted(),
    "activation_checkpointing": accepted(),
    "activation_checkpointing_kwargs": accepted(),
    "gradient_checkpointing": accepted("activation_checkpointing"),
    "gradient_checkpointing_kwargs": accepted("activation_checkpointing_kwargs"),
    "torch_compile": accepted(),
    "torch_compile_backend": accepted(),
    "torch_compile_mode": accepted(),
    "use_liger_kernel": provided(),
    "liger_kernel_config": provided(),
    "use_cache": accepted(note="set on the model's config, so the saved config.json holds it too, as under Trainer"),
    "neftune_noise_alpha": provided(),
    "torch_empty_cache_steps": accepted(),
    "auto_find_batch_size": accepted(note="x 0.9 per out-of-memory error, as accelerate's helper; the retry starts "
                                          "from the run's start, so it equals a run with the batch that fit; one "
                                          "process only"),
    "logging_strategy": accepted(),
    "logging_steps": accepted(convert=_steps_or_ratio, note=_STEP_NOTE),
    "logging_first_step": accepted(),
    "log_on_each_node": accepted(),
    "logging_nan_inf_filter": refused("the engine does not average non-finite losses away: a nan/inf loss stops "
                                      "the run (exit status 3), or train.on_nonfinite = 'skip' skips the step"),
    "include_num_input_tokens_seen": accepted(),
    "log_level": accepted(),
    "log_level_replica": accepted(),
    "disable_tqdm": accepted(),
    "report_to": plugin(TRACKERS, convert=_report_to,
                        note="a run file enables trackers by name (plugins = [\"tensorboard\"]); each of Trainer's 14 "
                             "integrations enables its plugin (comet_ml: comet, azure_ml: azureml, the others by their "
                             "own name), 'all' the installed ones"),
    "run_name": accepted(note="the trackers' run name"),
    "project": provided(),
    "trackio_space_id": provided(),
    "trackio_bucket_id": provided(),
    "trackio_static_space_id": provided(),
    "eval_strategy": accepted(convert=_eval_strategy),
    "eval_steps": accepted(convert=_steps_or_ratio, note=_STEP_NOTE),
    "eval_delay": accepted(),
    "per_device_eval_batch_size": accepted(),
    "prediction_loss_only": accepted(),
    "eval_on_start": accepted(),
    "eval_do_concat_batches": builtin("evaluation concatenates the batches' predictions and labels"),
    "eval_use_gather_object": builtin("evaluation gathers every process's predictions with gather_object, in order"),
    "eval_accumulation_steps": accepted(note=(
        "checked (an int >= 1), with the same results whatever its value: the engine moves each evaluation "
        "batch's predictions, labels, inputs and losses to the CPU as it comes, as Trainer does with 1; a larger "
        "value (or none) only keeps them on the device longer, and their concatenation is the same")),
    "include_for_metrics": accepted(),
    "batch_eval_metrics": accepted(note="one process only so far"),
    "save_only_model": accepted(note="such a checkpoint is refused by resume_from_checkpoint"),
    "save_strategy": accepted(),
    "save_steps": accepted(convert=_steps_or_ratio, note=_STEP_NOTE),
    "save_on_each_node": builtin("a checkpoint is written once per run (its metadata by the main process), "
                                 "not once per node: put output_dir on storage every node sees"),
    "save_total_limit": accepted(),
    "enable_jit_checkpoint": accepted(),
    "push_to_hub": provided(),
    "hub_token": provided(),
    "hub_private_repo": provided(),
    "hub_model_id": provided(),
    "hub_strategy": provided(),
    "hub_always_push": provided(),
    "hub_revision": provided(),
    "load_best_model_at_end": accepted(),
    "metric_for_best_model": accepted(),
    "greater_is_better": accepted(),
    "ignore_data_skip": accepted(),
    "restore_callback_states_from_checkpoint": accepted(),
    "full_determinism": accepted(),
    "seed": accepted(),
    "data_seed": accepted(),
    "use_cpu": accepted(),
    "accelerator_config": refused("the engine does not train through Accelerate's Accelerator (split_batches, "
                                  "dispatch_batches, even_batches ...); its samplers are seeded and resume exactly"),
    "parallelism_config": refused("tensor, context and sequence parallelism are not supported; the strategy "
                                  "plugins are ddp, fsdp and deepspeed"),
    "dataloader_drop_last": accepted(),
    "dataloader_num_workers": accepted(),
    "dataloader_pin_memory": accepted(),
    "dataloader_persistent_workers": accepted(),
    "dataloader_prefetch_factor": accepted(),
    "dataloader_multiprocessing_context": accepted(),
    "dataloader_in_order": accepted(),
    "remove_unused_columns": accepted(note=(
        "for the train, evaluation and predict loaders: a datasets.Dataset loses the columns, other datasets' "
        "examples the keys (RemoveColumnsCollator) that the model's forward does not take, label_names, label "
        "and label_ids kept (before the collator, so what it adds stays)")),
    "label_names": accepted(),
    "train_sampling_strategy": accepted(convert=_sampling_strategy, note=(
        "'random', 'sequential' or 'group_by_length': Trainer's get_length_grouped_indices over the engine's "
        "shuffle, seeded by data_seed and the epoch, so a resume is exact (Trainer draws its shuffle from the "
        "global RNG, which data_seed does not seed: its order differs); evaluation keeps the dataset's order "
        "(Trainer groups it too). " + _BATCH_REBALANCE)),
    "length_column_name": accepted(note=(
        "group_by_length: read before remove_unused_columns drops it (Trainer 5.24 reads it after, so only with "
        "remove_unused_columns = false or a forward taking it); without it, the length of each example's "
        "input_ids (the tokenizer's first model input)")),
    "ddp_find_unused_parameters": provided(),
    "ddp_bucket_cap_mb": provided(),
    "ddp_broadcast_buffers": provided(),
    "ddp_static_graph": provided(),
    "ddp_backend": builtin(_STRATEGY_NOTE),
    "ddp_timeout": plugin(STRATEGIES, *(f"{s}.timeout" for s in STRATEGIES), convert=_ddp_timeout,
                          note="[ddp], [fsdp] or [deepspeed] timeout, whichever strategy the run uses"),
    "fsdp": provided(),
    "fsdp_config": provided(),
    "deepspeed": provided(),
    "debug": refused("underflow_overflow: the engine stops on a non-finite loss, gradient norm or weight instead "
                     "(exit status 3); tpu_metrics_debug: no TPU"),
    "skip_memory_metrics": accepted(note="Trainer's init_mem_* and before_init_mem_* figures are not reported"),
    "do_train": refused("a flag for training scripts, not used by Trainer: run `engine train RUN.toml`"),
    "do_eval": refused("a flag for training scripts, not used by Trainer: run `engine evaluate RUN.toml`, or "
                       "set train.eval_strategy"),
    "do_predict": refused("a flag for training scripts, not used by Trainer: call Run.predict(dataset)"),
    "resume_from_checkpoint": accepted(note="a checkpoint folder; true: this run's newest"),
    "local_rank": refused("the engine reads LOCAL_RANK from the launcher's environment (torchrun)"),
})

# names of older transformers releases (in older dumps); answers for the names they became
LEGACY: dict[str, Answer] = _named({
    "evaluation_strategy": dataclasses.replace(accepted("eval_strategy", convert=_eval_strategy),
                                               legacy_defaults=("no", None)),
    "warmup_ratio": dataclasses.replace(accepted(), legacy_defaults=(0.0,)),
    "no_cuda": dataclasses.replace(accepted("use_cpu"), legacy_defaults=(False,)),
    "per_gpu_train_batch_size": dataclasses.replace(accepted("per_device_train_batch_size"), legacy_defaults=(None,)),
    "per_gpu_eval_batch_size": dataclasses.replace(accepted("per_device_eval_batch_size"), legacy_defaults=(None,)),
    "torchdynamo": dataclasses.replace(accepted("torch_compile_backend"), legacy_defaults=(None,)),
    "overwrite_output_dir": Answer(REFUSED, legacy_defaults=(False,), note=(
        "a flag of the example scripts, not of Trainer; the engine refuses a fresh run into another run's "
        "folder: pass --set train.overwrite_output_dir=true when you mean to remove that run's output")),
    "logging_dir": dataclasses.replace(provided(), legacy_defaults=(None,)),
    "fsdp_transformer_layer_cls_to_wrap": Answer(REFUSED, legacy_defaults=(None,), note=(
        "set [fsdp] wrap_modules (default: the model's _no_split_modules)")),
    "fsdp_min_num_params": Answer(REFUSED, legacy_defaults=(0,), note=(
        "the fsdp plugin shards transformer blocks; no size-based wrapping")),
    "push_to_hub_model_id": Answer(REFUSED, legacy_defaults=(None,), note="set [hub] repo = 'user/model'"),
    "push_to_hub_organization": Answer(REFUSED, legacy_defaults=(None,), note="set [hub] repo = 'org/model'"),
    "push_to_hub_token": Answer(REFUSED, legacy_defaults=(None, "<PUSH_TO_HUB_TOKEN>"), note="set HF_TOKEN"),
    "save_safetensors": Answer(BUILTIN, legacy_defaults=(True,), note="weights are always saved as safetensors"),
    "include_inputs_for_metrics": dataclasses.replace(accepted("include_for_metrics", convert=_include_inputs,
                                                               note="true: include_for_metrics = ['inputs']"),
                                                      legacy_defaults=(False,)),
    "include_tokens_per_second": Answer(BUILTIN, legacy_defaults=(False,), note=(
        "always measured: tokens_per_second at each log step, train_tokens_per_second in the final metrics")),
    "group_by_length": dataclasses.replace(accepted("train_sampling_strategy", convert=_group_by_length,
                                                    note="true: train_sampling_strategy = 'group_by_length'"),
                                           legacy_defaults=(False,)),
    "half_precision_backend": Answer(REFUSED, legacy_defaults=("auto",), note="mixed precision is torch.autocast"),
    "fp16_backend": Answer(REFUSED, legacy_defaults=("auto",), note="mixed precision is torch.autocast"),
    "fp16_opt_level": Answer(REFUSED, legacy_defaults=("O1",), note="apex is not supported; fp16 is torch.autocast"),
    "tpu_num_cores": Answer(REFUSED, legacy_defaults=(None,), note="no TPU"),
    "tpu_metrics_debug": Answer(REFUSED, legacy_defaults=(False,), note="no TPU"),
    "use_mps_device": Answer(REFUSED, legacy_defaults=(False,), note="the engine trains on CUDA or the CPU"),
    "use_ipex": Answer(REFUSED, legacy_defaults=(False,), note="Intel Extension for PyTorch is not supported"),
    "jit_mode_eval": Answer(REFUSED, legacy_defaults=(False,), note="no TorchScript evaluation"),
    "past_index": Answer(REFUSED, legacy_defaults=(-1,), note="no past/mems inputs (Transformer-XL, XLNet)"),
    "ray_scope": dataclasses.replace(accepted(note="read by Run.hyperparameter_search(backend='ray')"),
                                     legacy_defaults=("last",)),
    "mp_parameters": Answer(REFUSED, legacy_defaults=("",), note="no SageMaker model parallelism"),
    "use_legacy_prediction_loop": Answer(REFUSED, legacy_defaults=(False,), note="one prediction loop"),
    "dispatch_batches": Answer(REFUSED, legacy_defaults=(None,), note="no Accelerate dataloader dispatching"),
    "split_batches": Answer(REFUSED, legacy_defaults=(None, False), note="no Accelerate batch splitting"),
    "sharded_ddp": Answer(REFUSED, legacy_defaults=("", [], None), note="fairscale is gone: use plugin fsdp"),
    "adafactor": Answer(REFUSED, legacy_defaults=(False,), note="optim = 'adafactor' (older dumps hold both)"),
})


# the fields Seq2SeqTrainingArguments adds (a Seq2SeqTrainer run: train.task = "seq2seq")
SEQ2SEQ_FIELDS: dict[str, Answer] = _named({
    "sortish_sampler": builtin("Seq2SeqTrainer reads it nowhere (transformers 5.24: only the field is left), so "
                               "true changes nothing under Trainer either; batches of similar length: "
                               "train_sampling_strategy = 'group_by_length'"),
    "predict_with_generate": accepted(note="evaluation's compute_metrics gets generate()'s token ids"),
    "generation_max_length": accepted(),
    "generation_num_beams": accepted(),
    "generation_config": accepted(note="a folder holding generation_config.json, or a table of its values"),
})


def answer_for(name: str) -> Answer | None:
    """The answer for a TrainingArguments or Seq2SeqTrainingArguments field name (current or older), or None;
    for a field a plugin answers, the installed plugin's answer."""
    answer = FIELDS.get(name) or SEQ2SEQ_FIELDS.get(name) or LEGACY.get(name)
    if answer is not None and answer.convert is _not_installed:
        return plugin_mappings(answer.plugins[0], "trainer_argument_mappings").get(name, answer)
    return answer

