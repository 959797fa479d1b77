"""Axolotl's config keys, answered for ``engine migrate`` (an Axolotl YAML: ``base_model``, ``datasets``,
``micro_batch_size``, ``sequence_len``, ...).

Where Axolotl's key means a ``TrainingArguments`` or TRL ``ModelConfig`` field, its answer is that field's
(``micro_batch_size`` is ``per_device_train_batch_size``, ``optimizer`` is ``optim``, ``lora_r`` is
``lora_r``); the rest are answered here. :data:`AXOLOTL_DEFAULTS` holds Axolotl's defaults that differ
from the engine's (``axolotl/utils/schemas/config.py`` and ``training.py``): a config that leaves them
out still gets them.
"""

from __future__ import annotations

import math
from typing import Any

from engine.builtin.trainer_args import FIELDS, answer_for
from engine.errors import ConfigError
from engine.kit.mappings import ACCEPTED, PLUGIN, REFUSED, Answer, Conversion, accepted, flag, refused
from engine.tooling.sft_args import MODEL_FIELDS, SFT_FIELDS, data_key, peft_key

AXOLOTL_DEFAULTS = {"sequence_len": 512, "sample_packing": False, "bf16": "auto", "num_epochs": 1.0,
                    "micro_batch_size": 1, "gradient_accumulation_steps": 1, "optimizer": "adamw_torch_fused",
                    "lr_scheduler": "cosine", "train_on_inputs": False, "val_set_size": 0.0,
                    "output_dir": "./model-out", "weight_decay": 0.0}
# Axolotl's dataset types and the engine's data.format for each
FORMATS = {"alpaca": "alpaca", "sharegpt": "sharegpt", "chat_template": "chat", "input_output": "input_output",
           "completion": "text"}


def _adapter(c: Conversion, name: str, value: Any) -> None:
    if value is None:
        return
    if value not in ("lora", "qlora"):
        raise ConfigError("the peft plugin takes lora and qlora adapters")
    c.enable("peft")
    if value == "qlora" and not c.arguments.get("load_in_4bit"):
        raise ConfigError("qlora needs load_in_4bit: true, as Axolotl requires")


def _target_linear(c: Conversion, name: str, value: Any) -> None:
    if value is not None and flag(value):
        c.set("peft.target_modules", "all-linear")


def _packing(c: Conversion, name: str, value: Any) -> None:
    if value in (None, False):
        c.set("data.packing", False, note="Axolotl's default: one example per row")
        return
    flag(value)
    c.set("data.packing", "bfd", note="Axolotl's sample packing is multipack (whole examples bin-packed, "
                                      "padding-free attention): the nearest is 'bfd' (best-fit decreasing)")


def _eval_packing(c: Conversion, name: str, value: Any) -> None:
    if value is not None and bool(value) != bool(c.arguments.get("sample_packing")):
        raise ConfigError("the engine packs evaluation data as data.packing says")


def _per_epoch(c: Conversion, name: str, value: Any) -> None:
    """``evals_per_epoch`` / ``saves_per_epoch``: N evaluations (saves) an epoch."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("expected a whole number >= 1")
    what = "eval" if name.startswith("eval") else "save"
    max_steps = c.arguments.get("max_steps") or 0
    if value == 1:
        c.set(f"train.{what}_strategy", "epoch")
    elif max_steps > 0:
        epochs = c.arguments.get("num_epochs") or 1
        steps = max(1, math.ceil(max_steps / (value * epochs)))
        c.set(f"train.{what}_strategy", "steps")
        c.set(f"train.{what}_steps", steps, note=f"max_steps {max_steps} / ({value} x {epochs} epochs)")
    else:
        raise ConfigError(f"train.{what}_steps is a step count, and the steps per epoch depend on the data: set "
                          f"train.{what}_strategy = 'steps' and {what}_steps = (steps per epoch) / {value}")


def _special_tokens(c: Conversion, name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ConfigError("expected a table of pad_token, eos_token, bos_token")
    for key, token in value.items():
        if key not in ("pad_token", "eos_token", "bos_token"):
            c.lose(f"{name}.{key}", "the engine sets pad_token, eos_token and bos_token (data.*)")
        elif token is not None:
            c.set(f"data.{key}", token)


def _wandb(c: Conversion, name: str, value: Any) -> None:
    if value is None:
        return
    c.enable("wandb")
    c.set(f"wandb.{name.removeprefix('wandb_')}", value)


def _hub_model_id(c: Conversion, name: str, value: Any) -> None:
    if value is not None:
        c.enable("hub")
        c.set("hub.repo", value, note="Axolotl pushes when hub_model_id is set")


def _chat_template_jinja(c: Conversion, name: str, value: Any) -> None:
    if value is not None:
        c.set("data.chat_template", value, note="inline Jinja")


def _chat_template(c: Conversion, name: str, value: Any) -> None:
    from engine.builtin.data.templates import KNOWN_NAMES

    if value is None or value == "jinja":  # jinja: chat_template_jinja holds it
        return
    if value not in KNOWN_NAMES:
        raise ConfigError(f"no engine template has that name (known: {', '.join(KNOWN_NAMES)}); give its Jinja as "
                          "chat_template_jinja (Axolotl's templates/<name>.jinja), or a file as data.chat_template")
    c.set("data.chat_template", value, note="Axolotl's template name")


def _datasets(c: Conversion, name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not value or not all(isinstance(item, dict) for item in value):
        raise ConfigError("expected a list of datasets, each with a path")
    sources = [_source(item) for item in value]
    if len(sources) == 1:
        for key, item in sources[0].items():
            c.set("data.train" if key == "source" else f"data.{key}", item)
    else:
        c.set("data.mixture", sources, note="one [[data.mixture]] table per dataset, each with its format")


def _source(item: dict[str, Any]) -> dict[str, Any]:
    """One of Axolotl's datasets as a source: path, split, config and its prompt format's keys."""
    if not item.get("path"):
        raise ConfigError("each dataset needs a path")
    kind = item.get("type")
    if not isinstance(kind, str) or kind not in FORMATS:
        raise ConfigError(f"dataset type {kind!r}: the engine's formats are Axolotl's {', '.join(FORMATS)}")
    source: dict[str, Any] = {"source": item["path"], "format": FORMATS[kind]}
    if item.get("split"):
        source["split"] = item["split"]
    if item.get("name"):
        source["config"] = item["name"]
    if kind == "completion":
        source["text_column"] = item.get("field") or "text"
    if kind == "chat_template":
        mappings = item.get("message_property_mappings") or {}
        for key, engine_key in (("field_messages", "messages_column"), ("message_field_role", "role_key"),
                                ("message_field_content", "content_key")):
            if item.get(key):
                source[engine_key] = item[key]
        if mappings.get("role"):
            source["role_key"] = mappings["role"]
        if mappings.get("content"):
            source["content_key"] = mappings["content"]
        if item.get("roles"):
            source["roles"] = item["roles"]
    return source


_DATA_KEYS = ("data.train", "data.split", "data.config", "data.format", "data.text_column", "data.messages_column",
              "data.role_key", "data.content_key", "data.roles", "data.mixture")
_ATTENTION = "no run-file key picks the attention implementation: from_pretrained's default (sdpa) is used"


def _legacy(answer: Answer, *defaults: Any) -> Answer:
    return Answer(answer.kind, answer.keys, answer.plugins, answer.note, answer.convert, (None, *defaults))


def _refused(note: str, *defaults: Any) -> Answer:
    return Answer(REFUSED, note=note, legacy_defaults=(None, *defaults))


AXOLOTL_FIELDS: dict[str, Answer] = {
    "base_model": accepted("model"),
    "tokenizer_config": data_key("tokenizer"),
    "micro_batch_size": FIELDS["per_device_train_batch_size"],
    "gradient_accumulation_steps": FIELDS["gradient_accumulation_steps"],
    "num_epochs": FIELDS["num_train_epochs"],
    "max_steps": FIELDS["max_steps"],
    "optimizer": FIELDS["optim"],
    "lr_scheduler": FIELDS["lr_scheduler_type"],
    "lr_scheduler_kwargs": FIELDS["lr_scheduler_kwargs"],
    "learning_rate": FIELDS["learning_rate"],
    "warmup_steps": FIELDS["warmup_steps"],
    "warmup_ratio": FIELDS["warmup_steps"],
    "weight_decay": FIELDS["weight_decay"],
    "adam_beta1": FIELDS["adam_beta1"],
    "adam_beta2": FIELDS["adam_beta2"],
    "adam_epsilon": FIELDS["adam_epsilon"],
    "max_grad_norm": FIELDS["max_grad_norm"],
    "sequence_len": data_key("max_length", note="Axolotl's default 512 is written: the engine's is 128"),
    "sample_packing": data_key("packing", convert=_packing, note="true -> 'bfd' (multipack's nearest); false is written"),
    "eval_sample_packing": Answer(ACCEPTED, ("data.packing",), convert=_eval_packing, legacy_defaults=(None,),
                                  note="evaluation data is packed as data.packing says"),
    "pad_to_sequence_len": _refused("the engine pads a batch to its longest row: the loss is the same, only the "
                                    "shapes differ", False),
    "val_set_size": data_key("eval_split"),
    "datasets": Answer(ACCEPTED, _DATA_KEYS, convert=_datasets, note=(
        "one dataset: data.train + data.format (alpaca, sharegpt, chat_template -> chat, input_output, completion -> "
        "text); several: [[data.mixture]]")),
    "test_datasets": _refused("data.eval is one source without a format of its own: set data.eval"),
    "dataset_prepared_path": _refused("the engine caches the tokenized data in data.cache_dir (datasets' cache)"),
    "dataset_processes": data_key("num_proc"),
    "shuffle_merged_datasets": _refused("the sampler shuffles the whole mixture every epoch", True),
    "output_dir": FIELDS["output_dir"],
    "seed": FIELDS["seed"],
    "adapter": Answer(PLUGIN, (), ("peft",), convert=_adapter, note="lora | qlora enable the peft plugin"),
    "lora_model_dir": _refused("an adapter to start from is not loaded by the peft plugin"),
    "lora_r": MODEL_FIELDS["lora_r"],
    "lora_alpha": MODEL_FIELDS["lora_alpha"],
    "lora_dropout": MODEL_FIELDS["lora_dropout"],
    "lora_target_modules": MODEL_FIELDS["lora_target_modules"],
    "lora_target_linear": peft_key("target_modules", convert=_target_linear, note="true -> 'all-linear'"),
    "lora_modules_to_save": MODEL_FIELDS["lora_modules_to_save"],
    "peft_use_dora": MODEL_FIELDS["use_dora"],
    "peft_use_rslora": MODEL_FIELDS["use_rslora"],
    "lora_fan_in_fan_out": _refused("peft detects Conv1D layers itself", False),
    "load_in_4bit": MODEL_FIELDS["load_in_4bit"],
    "load_in_8bit": MODEL_FIELDS["load_in_8bit"],
    "bf16": SFT_FIELDS["bf16"],
    "fp16": _legacy(FIELDS["fp16"]),
    "tf32": _legacy(FIELDS["tf32"]),
    "gradient_checkpointing": FIELDS["gradient_checkpointing"],
    "gradient_checkpointing_kwargs": FIELDS["gradient_checkpointing_kwargs"],
    "logging_steps": _legacy(FIELDS["logging_steps"]),
    "eval_steps": _legacy(FIELDS["eval_steps"]),
    "save_steps": _legacy(FIELDS["save_steps"]),
    "eval_strategy": _legacy(FIELDS["eval_strategy"]),
    "save_strategy": _legacy(FIELDS["save_strategy"]),
    "save_total_limit": _legacy(FIELDS["save_total_limit"]),
    "evals_per_epoch": Answer(ACCEPTED, ("train.eval_strategy", "train.eval_steps"), convert=_per_epoch,
                              legacy_defaults=(None,), note="1: eval_strategy 'epoch'; N with max_steps: eval_steps"),
    "saves_per_epoch": Answer(ACCEPTED, ("train.save_strategy", "train.save_steps"), convert=_per_epoch,
                              legacy_defaults=(None,), note="1: save_strategy 'epoch'; N with max_steps: save_steps"),
    "resume_from_checkpoint": _legacy(FIELDS["resume_from_checkpoint"]),
    "train_on_inputs": data_key("train_on_all_tokens"),
    "chat_template": data_key("chat_template", convert=_chat_template, legacy_defaults=(None,)),
    "chat_template_jinja": data_key("chat_template", convert=_chat_template_jinja, legacy_defaults=(None,)),
    "special_tokens": Answer(ACCEPTED, ("data.pad_token", "data.eos_token", "data.bos_token"), convert=_special_tokens,
                             legacy_defaults=(None,), note="pad_token, eos_token, bos_token -> data.*"),
    "tokens": data_key("added_tokens", legacy_defaults=(None,)),
    "wandb_project": Answer(PLUGIN, ("wandb.project",), ("wandb",), convert=_wandb, legacy_defaults=(None,)),
    "wandb_entity": Answer(PLUGIN, ("wandb.entity",), ("wandb",), convert=_wandb, legacy_defaults=(None,)),
    "wandb_name": Answer(PLUGIN, ("wandb.name",), ("wandb",), convert=_wandb, legacy_defaults=(None,)),
    "wandb_watch": _refused("the wandb plugin logs metrics, not gradients or parameters"),
    "wandb_log_model": _refused("the wandb plugin uploads no model artifact"),
    "wandb_mode": _refused("set WANDB_MODE where the run starts"),
    "wandb_run_id": _refused("the wandb plugin names its run (wandb.name)"),
    "hub_model_id": Answer(PLUGIN, ("hub.repo",), ("hub",), convert=_hub_model_id, legacy_defaults=(None,)),
    "hub_strategy": _legacy(answer_for("hub_strategy") or refused("")),
    "deepspeed": _legacy(answer_for("deepspeed") or refused("")),
    "fsdp": _legacy(answer_for("fsdp") or refused("")),
    "fsdp_config": _legacy(answer_for("fsdp_config") or refused("")),
    "torch_compile": _legacy(FIELDS["torch_compile"]),
    "neftune_noise_alpha": _legacy(answer_for("neftune_noise_alpha") or refused("")),
    "flash_attention": _refused(_ATTENTION, False),
    "sdp_attention": _refused(_ATTENTION, False),
    "xformers_attention": _refused(_ATTENTION, False),
    "strict": _refused("the engine refuses an unknown key always", False),
    "loss_watchdog_threshold": _refused("the engine stops on a non-finite loss (train.on_nonfinite), not above a "
                                        "threshold"),
    "loss_watchdog_patience": _refused("the engine stops on a non-finite loss (train.on_nonfinite)"),
    "early_stopping_patience": _refused("not converted: the engine's early stopping has its own patience key"),
    "dataloader_num_workers": _legacy(FIELDS["dataloader_num_workers"]),
    "dataloader_pin_memory": _legacy(FIELDS["dataloader_pin_memory"]),
    "dataloader_prefetch_factor": _legacy(FIELDS["dataloader_prefetch_factor"]),
    "dataloader_drop_last": _legacy(FIELDS["dataloader_drop_last"]),
}
