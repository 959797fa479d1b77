"""TRL's ``SFTConfig`` and ``ModelConfig`` fields, TRL's ``ScriptArguments`` and the alignment handbook's
recipe keys, answered as :mod:`engine.builtin.trainer_args` answers ``TrainingArguments``.

``SFTConfig`` is a ``TrainingArguments`` subclass: its ``TrainingArguments`` fields keep that table's
answers (``bf16`` excepted: SFTConfig's default ``None`` means bf16 unless fp16), and :data:`SFT_FIELDS`
answers the fields it adds. A handbook recipe mixes the three dataclasses in one YAML (plus its
``dataset_mixer`` / ``dataset_mixture``): :func:`sft_defaults` fills in what a recipe leaves out with
TRL's defaults, so that the run file reproduces SFTTrainer's behaviour where the engine's defaults
differ (``max_length`` 1024, packing off, the loss over the whole conversation).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path
from typing import Any, Callable

from engine.errors import ConfigError
from engine.kit.mappings import ACCEPTED, BUILTIN, PLUGIN, REFUSED, Answer, Conversion, accepted, builtin, flag, refused
from engine.util import write_json

PEFT_ENABLED_BY = {"peft": "use_peft = true (ModelConfig), or Axolotl's adapter: lora | qlora"}


def data_key(key: str, note: str = "", convert: Any = None, legacy_defaults: tuple[Any, ...] = ()) -> Answer:
    """A ``[data]`` key (``key`` without its section)."""
    return Answer(ACCEPTED, (f"data.{key}",), note=note, convert=convert, legacy_defaults=legacy_defaults)


def peft_key(*keys: str, note: str = "", convert: Any = None) -> Answer:
    return Answer(PLUGIN, tuple(f"peft.{key}" for key in keys), ("peft",), note, convert)


# ---------------------------------------------------------------------------- converters


def _max_length(c: Conversion, name: str, value: Any) -> None:
    if value is None:
        raise ConfigError("TRL does not truncate (None); the engine's examples have a length: set data.max_length")
    c.set("data.max_length", value)


def packing_value(packing: bool, strategy: str) -> bool | str:
    """The engine's data.packing for TRL's packing / packing_strategy: the same rows (tests/test_trl_parity.py)."""
    if not packing:
        return False
    return "bfd_split" if strategy == "bfd-requeue" else strategy  # TRL's older name of bfd_split


def _packing(c: Conversion, name: str, value: Any) -> None:
    args = c.arguments
    packing, padding_free = flag(args.get("packing", False)), flag(args.get("padding_free", False))
    strategy = args.get("packing_strategy", "bfd")
    if strategy not in ("bfd", "bfd_split", "bfd-requeue", "wrapped"):
        raise ConfigError("expected 'bfd', 'bfd_split' or 'wrapped'")
    result = packing_value(packing, strategy)
    note = {False: "one example per row, as SFTConfig's default packing = false",
            "bfd": "TRL's best-fit decreasing packing, padding-free", "bfd_split": "TRL's bfd_split",
            "wrapped": "TRL's wrapped: concatenated and cut at max_length"}
    c.set("data.packing", result, note=note[result])
    if padding_free and result in (False, "wrapped"):  # the bfd packings are padding-free already
        c.set("data.padding_free", True, note="TRL's padding_free: each batch flattened into one row")


def _read_with(c: Conversion, name: str, value: Any) -> None:
    """A field another field's converter reads (which writes the key once, as that field's value)."""


def _loss_coverage(c: Conversion, name: str, value: Any) -> None:
    """TRL: the loss covers the whole conversation of chat rows unless assistant_only_loss, and the completion of
    prompt/completion rows unless completion_only_loss is false; data.train_on_all_tokens = "chat" is the default."""
    args = c.arguments
    assistant_only = flag(args.get("assistant_only_loss", False))
    completion_only = args.get("completion_only_loss")
    completion_only = True if completion_only is None else flag(completion_only)
    if assistant_only and not completion_only:
        raise ConfigError("assistant_only_loss with completion_only_loss = false (chat rows their assistant turns, "
                          "prompt/completion rows every token) has no one value: set data.train_on_all_tokens for "
                          "the run's data (false: assistant turns, true: every token)")
    coverage = False if assistant_only else "chat" if completion_only else True
    c.set("data.train_on_all_tokens", coverage, note={
        False: "the assistant turns and completions only", True: "every token of every row",
        "chat": "chat rows every token, prompt/completion rows their completion, as SFTTrainer's default"}[coverage])


def _dataset_kwargs(c: Conversion, name: str, value: Any) -> None:
    if value is None:  # TRL 1.16 encodes text and prompt/completion rows with the tokenizer's special tokens
        c.set("data.add_special_tokens", True, note="as SFTTrainer encodes text and prompt/completion rows (its bos)")
        return
    if not isinstance(value, dict):
        raise ConfigError("expected a table")
    for key, item in value.items():
        if key == "add_special_tokens":
            c.set("data.add_special_tokens", flag(item))
        elif key == "append_concat_token" and item is False:
            continue  # older TRL: no EOS between packed examples; the engine's packing adds none of its own
        else:
            c.lose(f"{name}.{key} = {json.dumps(item, default=str)}",
                   "no counterpart: the engine prepares the dataset itself (data.add_special_tokens is the one key)")


def _special_token(c: Conversion, name: str, value: Any) -> None:
    """SFTConfig's eos_token / pad_token; its defaults '<EOS_TOKEN>' and '<PAD_TOKEN>' stand for the tokenizer's own."""
    if value is not None and value != f"<{name.upper()}>":
        c.set(f"data.{name}", value)


def _truncation_mode(c: Conversion, name: str, value: Any) -> None:
    if value != "keep_start":
        raise ConfigError("the engine truncates the end of an example (keep_start), or data.truncation = 'drop'")
    c.set("data.truncation", "truncate")


def _bf16(c: Conversion, name: str, value: Any) -> None:
    """SFTConfig's bf16 default None: bf16 unless fp16 (Axolotl's 'auto' too: bf16 where the GPU has it)."""
    if value in (None, "auto"):
        if not c.arguments.get("fp16"):
            c.set("train.bf16", True, note="SFTConfig's default (None: bf16 unless fp16); on a GPU without bf16, "
                                           "set train.bf16 = false" if value is None else
                  "Axolotl's 'auto': bf16 where the GPU supports it; set false for such a GPU")
        return
    c.set("train.bf16", flag(value))


def _use_peft(c: Conversion, name: str, value: Any) -> None:
    if flag(value):
        c.enable("peft")


def _lora_task_type(c: Conversion, name: str, value: Any) -> None:
    if value != "CAUSAL_LM":
        raise ConfigError("the peft plugin adapts causal language models (CAUSAL_LM) only")


def _quantize(c: Conversion, name: str, value: Any) -> None:
    if flag(value):
        c.set("peft.quantize", "4bit" if "4bit" in name else "8bit",
              note="QLoRA's base quantized by bitsandbytes: train.model must be a saved model folder")


def _four_bit_option(key: str) -> Any:
    """A converter writing ``peft.<key>`` when the base loads in 4 bits (TRL ignores it otherwise, and the peft
    plugin refuses it without ``quantize``)."""
    def convert(c: Conversion, name: str, value: Any) -> None:
        if not flag(c.arguments.get("load_in_4bit", False)):
            raise ConfigError("an option of the 4-bit base, which load_in_4bit does not ask for")
        c.set(f"peft.{key}", flag(value) if isinstance(value, bool) else value)
    return convert


def _dtype(c: Conversion, name: str, value: Any) -> None:
    """TRL loads the weights in ``dtype`` and computes QLoRA's 4-bit matmuls in it."""
    if value in (None, "auto", "float32"):
        return
    if c.arguments.get("load_in_4bit") and value in ("bfloat16", "float16"):
        c.set("peft.bnb_4bit_compute_dtype", value, note="the 4-bit layers' compute dtype, as TRL's "
                                                         "get_quantization_config")
        return
    raise ConfigError("the engine keeps float32 weights and trains under autocast: train.bf16 = true (or fp16) is "
                      "the nearest")


def _dataset_name(c: Conversion, name: str, value: Any) -> None:
    if value is None:
        return
    c.set("data.train", value)
    if c.arguments.get("eval_strategy", "no") != "no":  # trl's sft.py evaluates on dataset_test_split
        c.set("data.eval", value, note="sft.py evaluates on dataset_test_split of dataset_name")


def _dataset_mixer(c: Conversion, name: str, value: Any) -> None:
    """The handbook's older ``dataset_mixer`` {name: fraction} with ``dataset_splits``: train splits mixed
    with the fractions, test splits whole."""
    if not isinstance(value, dict) or not value:
        raise ConfigError("expected a table of dataset name -> fraction")
    splits = c.arguments.get("dataset_splits") or ["train", "test"]
    train = [s for s in splits if "train" in s]
    test = [s for s in splits if "test" in s]
    if len(train) != 1:
        raise ConfigError(f"dataset_splits {splits}: the engine reads one train split per source")
    configs = c.arguments.get("dataset_configs") or [None] * len(value)
    sources = [{"source": ds, "split": train[0], **({"config": cfg} if cfg else {}),
                **({"weight": float(frac)} if frac != 1 else {})} for (ds, frac), cfg in zip(value.items(), configs)]
    _write_sources(c, sources)
    if test:
        first = next(iter(value))
        c.set("data.eval", first, note=f"the handbook evaluates on the {test[0]} split of every dataset; data.eval "
                                        "is one source: the first one's")
        c.set("data.eval_dataset_split", test[0])
        if len(value) > 1:
            c.lose(f"{name} test splits of {', '.join(list(value)[1:])}",
                   "data.eval is one source: only the first dataset's test split is evaluated")


def _dataset_mixture(c: Conversion, name: str, value: Any) -> None:
    """TRL's ``DatasetMixtureConfig`` (the handbook's ``dataset_mixture``): datasets with id, config, split,
    columns and weight, and test_split_size."""
    if not isinstance(value, dict) or not isinstance(value.get("datasets"), list):
        raise ConfigError("expected a table with a list of datasets")
    sources = []
    for item in value["datasets"]:
        if not isinstance(item, dict) or not item.get("id") and not item.get("path"):
            raise ConfigError("each dataset needs an id")
        source = {"source": item.get("id") or item.get("path")}
        source.update({key: item[key] for key in ("config", "split", "columns", "weight") if item.get(key) is not None})
        sources.append(source)
    _write_sources(c, sources)
    if value.get("test_split_size"):
        c.set("data.eval_split", value["test_split_size"], note="held out of the mixture, as the handbook's")


def _write_sources(c: Conversion, sources: list[dict[str, Any]]) -> None:
    """One source without a weight: data.train (and data.split / data.config); several: [[data.mixture]]."""
    if len(sources) == 1 and "weight" not in sources[0] and "columns" not in sources[0]:
        source = sources[0]
        c.set("data.train", source["source"])
        for key in ("split", "config"):
            if key in source:
                c.set(f"data.{key}", source[key])
    else:
        c.set("data.mixture", sources, note="the sources mixed with their weights (fractions of rows kept)")


def _dataset_splits(c: Conversion, name: str, value: Any) -> None:
    if not c.arguments.get("dataset_mixer"):
        raise ConfigError("read with dataset_mixer only")


def _chat_template(c: Conversion, name: str, value: Any) -> None:
    if value is not None:
        c.set("data.chat_template", value, note="inline Jinja" if "{%" in str(value) or "{{" in str(value) else "")


# ---------------------------------------------------------------------------- the tables

_LOST_DATA_PREP = "the engine prepares the data itself; no counterpart"
_ATTENTION = ("no run-file key picks the attention implementation: from_pretrained's default (sdpa where the model "
              "has it) is used; a plugin's model_load_kwargs hook can set it")

SFT_FIELDS: dict[str, Answer] = {
    "bf16": accepted("bf16", convert=_bf16, note="None (SFTConfig's default): true unless fp16"),
    "max_length": data_key("max_length", convert=_max_length,
                           note="TRL's default 1024 is written: the engine's is 128"),
    "packing": Answer(ACCEPTED, ("data.packing", "data.padding_free"), convert=_packing, note=(
        "false (TRL's default) is written: the engine packs by default; with packing_strategy and padding_free")),
    "packing_strategy": data_key("packing", convert=_read_with, note="'bfd', 'bfd_split', 'wrapped': the same name"),
    "padding_free": data_key("padding_free", convert=_read_with, note="data.padding_free with packing off or "
                                                                      "'wrapped'; the bfd packings are padding-free"),
    "completion_only_loss": data_key("train_on_all_tokens", convert=_read_with, note=(
        "with assistant_only_loss: false = loss on the completion / assistant turns only")),
    "assistant_only_loss": data_key("train_on_all_tokens", convert=_loss_coverage, note=(
        "TRL's default: 'chat' (chat rows learn every token); true -> false")),
    "dataset_text_field": data_key("text_column"),
    "dataset_num_proc": data_key("num_proc"),
    "dataset_kwargs": Answer(ACCEPTED, ("data.add_special_tokens",), convert=_dataset_kwargs,
                             note="add_special_tokens -> data.add_special_tokens; other keys have no counterpart"),
    "eos_token": data_key("eos_token", convert=_special_token, note="TRL's '<EOS_TOKEN>': the tokenizer's own"),
    "pad_token": data_key("pad_token", convert=_special_token, note="TRL's '<PAD_TOKEN>': the tokenizer's own"),
    "chat_template_path": data_key("chat_template", convert=_chat_template, note="a template file or a known name"),
    "truncation_mode": data_key("truncation", convert=_truncation_mode, note="'keep_start' only"),
    "model_init_kwargs": refused("no [train] key passes from_pretrained keywords; a plugin's model_load_kwargs hook "
                                 "does"),
    "trust_remote_code": refused("the engine never runs a model repository's code: build the model in "
                                 "'package.module:function' (train.model)"),
    "router_aux_loss_coef": refused("no MoE router loss in the engine's loss"),
    "shuffle_dataset": refused("the engine's sampler shuffles every epoch (seeded by data_seed); there is no "
                               "extra shuffle of the dataset before packing"),
    "pad_to_multiple_of": Answer(BUILTIN, legacy_defaults=("auto", None),
                                 note="batches are padded to their longest example (TRL's 'auto' off Neuron)"),
    "eval_packing": Answer(BUILTIN, legacy_defaults=(None,), note="evaluation data is packed as data.packing says"),
    "loss_type": Answer(REFUSED, legacy_defaults=("nll",), note="the engine's loss is the token-mean NLL ('nll'); "
                                                                 "no 'dft'"),
    "activation_offloading": refused("no activation offloading: use train.activation_checkpointing"),
    # older TRL names
    "max_seq_length": data_key("max_length", convert=_max_length, legacy_defaults=(None,),
                               note="TRL's older name of max_length"),
    "dataset_batch_size": Answer(REFUSED, legacy_defaults=(1000, None), note=_LOST_DATA_PREP),
    "num_of_sequences": Answer(REFUSED, legacy_defaults=(1024, None), note=_LOST_DATA_PREP),
    "chars_per_token": Answer(REFUSED, legacy_defaults=(3.6, None), note=_LOST_DATA_PREP),
}

MODEL_FIELDS: dict[str, Answer] = {
    "model_name_or_path": accepted("model"),
    "model_revision": refused("train.model is a local folder or a name: download that revision"),
    "dtype": Answer(PLUGIN, ("peft.bnb_4bit_compute_dtype",), ("peft",), convert=_dtype, note=(
        "with load_in_4bit: QLoRA's compute dtype; else no counterpart: the engine keeps float32 weights and trains "
        "under autocast (train.bf16)")),
    "attn_implementation": refused(_ATTENTION),
    "use_peft": Answer(PLUGIN, (), ("peft",), convert=_use_peft, note="true enables the peft plugin"),
    "lora_r": peft_key("r"),
    "lora_alpha": peft_key("lora_alpha"),
    "lora_dropout": peft_key("lora_dropout"),
    "lora_target_modules": peft_key("target_modules"),
    "lora_modules_to_save": peft_key("modules_to_save"),
    "lora_task_type": peft_key(convert=_lora_task_type, note="CAUSAL_LM only"),
    "use_rslora": peft_key("use_rslora"),
    "use_dora": peft_key("use_dora"),
    "load_in_4bit": peft_key("quantize", convert=_quantize, note="true -> quantize = '4bit' (QLoRA)"),
    "load_in_8bit": peft_key("quantize", convert=_quantize, note="true -> quantize = '8bit'"),
    "bnb_4bit_quant_type": peft_key("bnb_4bit_quant_type", convert=_four_bit_option("bnb_4bit_quant_type")),
    "use_bnb_nested_quant": peft_key("bnb_4bit_use_double_quant",
                                     convert=_four_bit_option("bnb_4bit_use_double_quant"),
                                     note="with load_in_4bit, TRL's default false is written: the plugin's is true"),
    "lora_target_parameters": refused("peft's target_parameters (MoE expert weights) is not a [peft] key"),
    "bnb_4bit_quant_storage": refused("the 4-bit weights are stored as bitsandbytes packs them (uint8)"),
    # older ModelConfig and the handbook's ModelArguments
    "torch_dtype": Answer(PLUGIN, ("peft.bnb_4bit_compute_dtype",), ("peft",), convert=_dtype,
                          legacy_defaults=(None, "auto", "float32"), note="older name of dtype"),
    "use_flash_attention_2": Answer(REFUSED, legacy_defaults=(False,), note=_ATTENTION),
    "tokenizer_name_or_path": data_key("tokenizer", legacy_defaults=(None,)),
    "model_code_revision": Answer(REFUSED, legacy_defaults=(None, "main"), note="no remote code is run"),
}

_MIXER_KEYS = ("data.mixture", "data.split", "data.config")  # written by dataset_mixer, which reads them

SCRIPT_FIELDS: dict[str, Answer] = {
    # TRL's ScriptArguments (trl/scripts/sft.py)
    "dataset_name": Answer(ACCEPTED, ("data.train", "data.eval"), convert=_dataset_name),
    "dataset_config": data_key("config"),
    "dataset_train_split": data_key("split"),
    "dataset_test_split": data_key("eval_dataset_split"),
    "dataset_streaming": data_key("streaming"),
    "ignore_bias_buffers": builtin("the ddp plugin wraps the model as it is"),
    # the alignment handbook's recipe keys
    "dataset_mixture": Answer(ACCEPTED, ("data.mixture", "data.train", "data.split", "data.config", "data.eval_split"),
                              convert=_dataset_mixture, legacy_defaults=(None,),
                              note="[[data.mixture]] (one source without weight: data.train)"),
    "dataset_mixer": Answer(ACCEPTED, ("data.mixture", "data.train", "data.split", "data.config", "data.eval",
                                       "data.eval_dataset_split"), convert=_dataset_mixer, legacy_defaults=(None,),
                            note="the handbook's older mixture, with dataset_splits"),
    "dataset_splits": Answer(ACCEPTED, _MIXER_KEYS, convert=_dataset_splits, legacy_defaults=(None,),
                             note="read with dataset_mixer"),
    "dataset_configs": Answer(ACCEPTED, _MIXER_KEYS, convert=_dataset_splits, legacy_defaults=(None,),
                              note="read with dataset_mixer"),
    "chat_template": data_key("chat_template", convert=_chat_template, legacy_defaults=(None,),
                              note="inline Jinja, as the recipe holds it"),
    "text_column": data_key("text_column", legacy_defaults=("text",)),
    "preprocessing_num_workers": data_key("num_proc", legacy_defaults=(None,)),
    "truncation_side": Answer(REFUSED, legacy_defaults=(None, "right"), note="the engine truncates the end"),
    "auto_insert_empty_system_msg": Answer(REFUSED, legacy_defaults=(True,),
                                           note="the chat template alone decides a system turn"),
}

SFT_ANSWERS = {**SFT_FIELDS, **MODEL_FIELDS, **SCRIPT_FIELDS}


def is_sft(arguments: dict[str, Any]) -> bool:
    """Whether ``arguments`` holds any field of TRL's (not only TrainingArguments)."""
    return any(name in SFT_ANSWERS and name != "bf16" for name in arguments)


def cached_defaults(compute: Callable[[], dict[str, Any]], libraries: tuple[str, ...]) -> dict[str, Any]:
    """``compute()``, a library's config defaults as JSON holds them, kept per version of ``libraries`` in the
    user's cache (``$XDG_CACHE_HOME/engine``, else ``~/.cache/engine``): computing them imports the library's
    config classes, 5-15 s (transformers' TrainingArguments imports the integration of every tracker
    installed), which only the first conversion pays. Nothing is kept where the cache cannot be written."""
    from importlib.metadata import version

    versions = "-".join(f"{name}{version(name)}" for name in libraries)
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "engine"
    path = folder / f"{compute.__name__}-{versions}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    defaults = json.loads(json.dumps(compute(), default=str))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_json(path, defaults)
    except OSError:
        pass
    return defaults


def sft_defaults() -> dict[str, Any]:
    """SFTConfig's, ModelConfig's and ScriptArguments' field defaults (SFTConfig's ``bf16`` None: its
    __post_init__ would make it true, which a default instance refuses on a CPU), as a dump holds them."""
    return cached_defaults(_sft_defaults, ("trl", "transformers"))


def _sft_defaults() -> dict[str, Any]:
    from trl import SFTConfig

    return trl_defaults(SFTConfig)


def trl_defaults(config_class: type) -> dict[str, Any]:
    """The field defaults of TRL's ``config_class`` (SFTConfig, DPOConfig), ModelConfig and ScriptArguments, as a
    dump holds them (``bf16`` None: true unless fp16)."""
    from trl import ModelConfig, ScriptArguments

    defaults: dict[str, Any] = {}
    for cls in (config_class, ModelConfig, ScriptArguments):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                defaults[f.name] = f.default_factory()
    # as a dump holds the fields it rewrites (hub_token masked, accelerator_config filled in, debug a list)
    defaults.update(json.loads(config_class(output_dir="trainer_output", bf16=False).to_json_string()))
    defaults["bf16"] = None
    return json.loads(json.dumps(defaults, default=str))


# ---------------------------------------------------------------------------- TRL's command line


def parse_command_line(text: str | list[str]) -> dict[str, Any]:
    """``--key value`` / ``--flag`` arguments (a list, or a shell command line with ``\\`` continuations and
    ``#`` comment lines) as a dict of typed values; a flag without a value is true."""
    if isinstance(text, str):
        lines = [line.split("#", 1)[0] if line.lstrip().startswith("#") else line for line in text.splitlines()]
        tokens = shlex.split(" ".join(line.rstrip().rstrip("\\") for line in lines))
    else:
        tokens = list(text)
    while tokens and not tokens[0].startswith("--"):  # `python trl/scripts/sft.py` or `trl sft`
        tokens.pop(0)
    arguments: dict[str, Any] = {}
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"TRL command line: {token!r} is not an --argument")
        key, equals, value = token[2:].partition("=")
        values = [value] if equals else []
        while not equals and index + 1 < len(tokens) and not tokens[index + 1].startswith("--"):
            index += 1
            values.append(tokens[index])
        typed = [_typed(v) for v in values]
        arguments[key.replace("-", "_")] = True if not typed else typed[0] if len(typed) == 1 else typed
        index += 1
    return arguments


def _typed(text: str) -> Any:
    """A command-line value as HfArgumentParser reads it for its field: a bool, a number, None or the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text in ("None", "none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
