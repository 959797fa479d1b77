"""``peft``: LoRA, DoRA and IA3 adapters (peft), and QLoRA (a 4-bit or 8-bit bitsandbytes base).

    plugins = ["peft"]

    [peft]
    r = 16
    lora_alpha = 32
    target_modules = "all-linear"      # a list of module names, a regex, or "all-linear"
    quantize = "4bit"                  # QLoRA: train.model must be a saved model folder
    merge = true                       # also write output_dir/merged/

``patch_model`` wraps the model with ``peft.get_peft_model`` (a model given to
``engine.Run(model=...)`` that is already a ``PeftModel`` is taken as it is), and the run's
:class:`engine.ModelWeights` becomes :class:`~engine_peft.weights.AdapterWeights`: checkpoints
hold the adapter, a fingerprint of its base and the usual optimizer, scheduler, RNG and plugin
state; the final output_dir is an adapter folder that ``AutoPeftModelForCausalLM`` loads, with the
base saved in ``output_dir/base`` when it was built from a config. The wrapping is not undone
when training ends: ``run.model`` stays the trained ``PeftModel``.
"""

from __future__ import annotations

import difflib
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

import engine
from engine import ConfigError, hookimpl, option

from .weights import AdapterWeights, base_fingerprint

__version__ = "0.1.0"

logger = logging.getLogger("engine.peft")
METHODS = ("lora", "dora", "ia3")
# options only LoRA and DoRA take (IA3 has no rank, scaling or dropout)
LORA_ONLY = ("r", "lora_alpha", "lora_dropout", "bias", "use_rslora", "use_dora", "init_lora_weights",
             "layers_to_transform")
# options that build an adapter: a PeftModel given to Run(model=...) has its own config
ADAPTER_OPTIONS = (*LORA_ONLY, "method", "target_modules", "exclude_modules", "modules_to_save",
                   "layers_to_transform", "feedforward_modules", "quantize")
# the 4-bit base's options: with quantize = '8bit' or none they would be ignored
FOUR_BIT_OPTIONS = ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype")
# the layer index in a module path, as peft reads it for layers_to_transform (the first numbered part)
LAYER_INDEX = re.compile(r".*?\.[^.]*\.(\d+)\.")
# optimizers that only make sense on full weight matrices, which an adapter run freezes
FULL_MATRIX_OPTIMIZERS = "GaLore and APOLLO project the gradients of the weight matrices optim_target_modules selects"


@dataclass
class PeftOptions:
    """``[peft]``: peft's own option names; unset values are peft's defaults."""

    method: Literal["lora", "dora", "ia3"] = option("lora", help=(
        "adapter type: lora (LoraConfig), dora (LoraConfig with use_dora = true) or ia3 (IA3Config)"))
    r: int = option(8, min=1, help="LoRA rank")
    lora_alpha: float = option(8.0, min=0, help="LoRA scaling numerator: the update is scaled by lora_alpha / r")
    lora_dropout: float = option(0.0, min=0, below=1, help="dropout on the LoRA branch's input")
    target_modules: list[str] | str | None = option(None, help=(
        "modules to adapt: a list of names (a name matches a module whose path ends with it), a regex "
        "(matched against the full module path) or 'all-linear'; unset: peft's default for the model type"))
    exclude_modules: list[str] | str | None = option(None, help="modules never adapted (names or a regex)")
    modules_to_save: list[str] = option(default_factory=list, help=(
        "modules trained in full and saved with the adapter (e.g. lm_head, embed_tokens for new tokens)"))
    bias: Literal["none", "all", "lora_only"] = option("none", help="which biases train (and are saved with it)")
    use_rslora: bool = option(False, help="rank-stabilized LoRA: scale by lora_alpha / sqrt(r)")
    use_dora: bool | None = option(None, help=(
        "weight-decomposed LoRA (DoRA), peft's key for method = 'dora'; unset: true for method = 'dora'"))
    init_lora_weights: bool | Literal["gaussian", "pissa", "olora", "orthogonal"] = option(True, help=(
        "LoRA initialisation: true (B = 0, A Kaiming), false (random B: not an identity at start), "
        "gaussian, pissa, olora, orthogonal"))
    layers_to_transform: list[int] | None = option(None, help="LoRA: adapt only these layer indices")
    feedforward_modules: list[str] | str | None = option(None, help=(
        "IA3: the target modules whose input (not output) is scaled; unset: peft's default"))
    quantize: Literal["4bit", "8bit"] | None = option(None, help=(
        "QLoRA: load the base quantized by bitsandbytes (train.model must be a saved model folder)"))
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = option("nf4", help="4-bit data type")
    bnb_4bit_use_double_quant: bool = option(True, help="quantize the 4-bit quantization constants too")
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] = option("bfloat16", help=(
        "dtype of the 4-bit layers' matmuls"))
    merge: bool = option(False, help=(
        "also write the merged full model (merge_and_unload) to output_dir/merged, loadable by "
        "AutoModelForCausalLM; refused with quantize"))


def _options(run: Any) -> PeftOptions:
    return run.config.section("peft")


def _require_peft() -> None:
    """peft installed: imported when the model is wrapped (its import takes seconds, which a plan need not pay)."""
    engine.require("peft", "peft", feature="plugin peft", extra="peft", import_now=False)


def is_peft_model(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def peft_config(options: PeftOptions, token_rows: dict[str, list[int]] | None = None) -> Any:
    """The peft config the options describe (peft's own validation as a ConfigError naming the section);
    ``token_rows`` (embedding module path -> new token ids, :func:`new_token_rows`) train as peft's trainable
    tokens (IA3 has none: those modules train in full, as modules_to_save)."""
    import peft

    saved = list(options.modules_to_save)
    if token_rows and options.method == "ia3":
        saved += [path.rsplit(".", 1)[-1] for path in token_rows]
    common = {"target_modules": options.target_modules, "exclude_modules": options.exclude_modules,
              "modules_to_save": saved or None, "task_type": "CAUSAL_LM"}
    try:
        if options.method == "ia3":
            return peft.IA3Config(**common, feedforward_modules=options.feedforward_modules)
        return peft.LoraConfig(**common, layers_to_transform=options.layers_to_transform, r=options.r,
                               lora_alpha=options.lora_alpha,
                               lora_dropout=options.lora_dropout, bias=options.bias, use_rslora=options.use_rslora,
                               use_dora=options.method == "dora" or bool(options.use_dora),
                               init_lora_weights=options.init_lora_weights,
                               trainable_token_indices=token_rows or None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"peft: peft refuses this {options.method} config: {exc}") from None


def _changed_options(options: PeftOptions, names: tuple[str, ...]) -> list[str]:
    defaults = PeftOptions()
    return [name for name in names if getattr(options, name) != getattr(defaults, name)]


def new_token_rows(run: Any, model: torch.nn.Module) -> dict[str, list[int]]:
    """The embedding rows of the special tokens the [data] keys add (data.added_tokens, and data.eos_token /
    pad_token / bos_token when outside the tokenizer's base vocabulary), which the frozen base cannot learn:
    {module path: token ids} for the input embeddings and, unless tied to them (peft then follows the tie),
    the output embeddings. Modules in peft.modules_to_save train in full already."""
    data, tokenizer = run.config.data, run.tokenizer
    named = [*getattr(data, "added_tokens", []),
             *(getattr(data, key, None) for key in ("eos_token", "pad_token", "bos_token"))]
    if tokenizer is None or not hasattr(model, "get_input_embeddings"):
        return {}
    ids = [i for i in dict.fromkeys(tokenizer.convert_tokens_to_ids([t for t in named if t]))
           if i is not None and i >= tokenizer.vocab_size]
    if not ids:
        return {}
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    modules = [inputs] if outputs is None or outputs.weight is inputs.weight else [inputs, outputs]
    paths = [path for module in modules for path, each in model.named_modules() if each is module]
    return {path: ids for path in paths if not _saved(_options(run).modules_to_save, path)}


def wrap(model: torch.nn.Module, options: PeftOptions, token_rows: dict[str, list[int]] | None = None) -> Any:
    """``get_peft_model``, refusing options that name modules or layers the model does not have (peft
    drops those silently) and target modules that end up adapting nothing; ``token_rows`` as :func:`peft_config`."""
    import peft

    config = peft_config(options, token_rows)
    _check_module_names(model, options)
    try:
        with warnings.catch_warnings():  # peft asks transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:  # NoMatchingPeftModuleError is a ValueError
        if "not found in the base model" in str(exc) or "No modules were targeted" in str(exc):
            _refuse_unknown(model, "target_modules", options.target_modules)
        raise ConfigError(f"peft: peft cannot wrap {type(model).__name__}: {exc}") from None
    _check_targeted(wrapped, model, options)
    return wrapped


def _module_paths(model: torch.nn.Module) -> list[str]:
    return [path for path, _ in model.named_modules() if path]


def _leaf_names(model: torch.nn.Module, adaptable: bool) -> list[str]:
    """The last parts of the model's module paths (of its linear, embedding and conv modules: those
    peft can adapt), without layer numbers."""
    names = {path.rsplit(".", 1)[-1] for path, module in model.named_modules()
             if path and (not adaptable or isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d))
                          or type(module).__name__ in ("Conv1D", "Linear4bit", "Linear8bitLt"))}
    return sorted(name for name in names if not name.isdigit())


def _refuse_unknown(model: torch.nn.Module, key: str, name: str) -> None:
    """A module name (or regex) that matches nothing: the closest name, and the names there are."""
    if key == "modules_to_save":
        kind, leaves = "modules", _leaf_names(model, adaptable=False)
    else:
        kind, leaves = "linear and embedding modules", _leaf_names(model, adaptable=True)
    close = difflib.get_close_matches(name.rsplit(".", 1)[-1], leaves, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"peft.{key}: {name!r} matches no module of {type(model).__name__}{hint}; its {kind} are "
                      f"{', '.join(leaves)}")


def _names(value: list[str] | str | None) -> list[str]:
    """The module names of an option given as a list (a string is a regex, or 'all-linear')."""
    return list(value) if isinstance(value, list) else []


def _selects(name: str, path: str) -> bool:
    """peft's rule for target_modules and exclude_modules: the path, or its last parts."""
    return path == name or path.endswith(f".{name}")


def _saved(names: list[str], path: str) -> bool:
    """peft's rule for keeping modules_to_save out of the adapter: the module or a part of it."""
    return any(re.match(rf"(^|.*\.){re.escape(name)}($|\..*)", path) for name in names)


def _check_module_names(model: torch.nn.Module, options: PeftOptions) -> None:
    """Refuse a module name that matches nothing, and a target module the other options take away again."""
    paths = _module_paths(model)
    for name in options.modules_to_save:  # peft matches these by the end of the path
        if not any(path.endswith(name) for path in paths):
            _refuse_unknown(model, "modules_to_save", name)
    for key in ("target_modules", "exclude_modules"):
        for name in _names(getattr(options, key)):
            if not any(_selects(name, path) for path in paths):
                _refuse_unknown(model, key, name)
    if isinstance(options.exclude_modules, str) and not any(re.fullmatch(options.exclude_modules, p) for p in paths):
        raise ConfigError(f"peft.exclude_modules: the regex {options.exclude_modules!r} matches no module path of "
                          f"{type(model).__name__} (it must match a whole path, e.g. 'model.layers.0.mlp.up_proj')")
    excluded = _names(options.exclude_modules)
    for name in _names(options.target_modules):
        selected = [path for path in paths if _selects(name, path)]
        if all(_saved(options.modules_to_save, path) for path in selected):
            raise ConfigError(f"peft.modules_to_save and peft.target_modules both name {name!r}: a module is either "
                              "trained in full (modules_to_save) or adapted (target_modules); remove it from one")
        if all(any(_selects(other, path) for other in excluded) for path in selected):
            raise ConfigError(f"peft.exclude_modules excludes every module peft.target_modules = {name!r} selects, "
                              "so it would adapt nothing; remove it from one of them")


def _check_targeted(wrapped: Any, model: torch.nn.Module, options: PeftOptions) -> None:
    """Options that act on the adapted modules only (IA3's feedforward modules, LoRA's layers) must
    find some among them."""
    targeted = list(getattr(wrapped, "targeted_module_names", []))
    feedforward = options.feedforward_modules
    if options.method == "ia3" and feedforward is not None:
        regex = isinstance(feedforward, str)  # else names, matched by the end of the path
        for name in [feedforward] if regex else feedforward:
            if not any(re.fullmatch(name, path) if regex else path.endswith(name) for path in targeted):
                leaves = sorted({path.rsplit(".", 1)[-1] for path in targeted})
                raise ConfigError(f"peft.feedforward_modules: {name!r} matches none of the adapted modules "
                                  f"({', '.join(leaves)}: peft.target_modules); name one of them, or add it to "
                                  "target_modules")
    if options.layers_to_transform:
        adapted = {int(m.group(1)) for path in targeted if (m := LAYER_INDEX.match(path))}
        missing = sorted(set(options.layers_to_transform) - adapted)
        if missing:
            layers = sorted({int(m.group(1)) for path in _module_paths(model) if (m := LAYER_INDEX.match(f"{path}."))})
            shown = f"{layers[0]}-{layers[-1]}" if layers else "none"
            raise ConfigError(f"peft.layers_to_transform: no module of layer {', '.join(map(str, missing))} is "
                              f"adapted; {type(model).__name__} has layers {shown}")


def describe(model: Any) -> list[str]:
    """What the adapter does to ``model``: type, matched modules, trainable parameters (for the plan and the log)."""
    trainable, total = model.get_nb_trainable_parameters()
    config = model.peft_config[model.active_adapter]
    matched = list(getattr(model, "targeted_module_names", []))
    shown = ", ".join(matched[:8]) + (f", ... ({len(matched)} in all)" if len(matched) > 8 else "")
    kind = config.peft_type.value + (" (DoRA)" if getattr(config, "use_dora", False) else "")
    in_full = f"; trained in full: {', '.join(sorted(config.modules_to_save))}" if config.modules_to_save else ""
    rows = getattr(config, "trainable_token_indices", None) or {}
    if rows:
        in_full += f"; new token rows trained: {len(next(iter(rows.values())))} in {', '.join(rows)}"
    return [f"{kind} adapter on {len(matched)} modules: {shown}{in_full}",
            f"trainable parameters {trainable:,} of {total:,} ({100 * trainable / total:.4f} %)"]


def _model_source(run: Any) -> Path | None:
    """The folder the base comes from, when there is one (configure time)."""
    if run.model is None:
        spec = run.config.train.model
    else:  # a given model: the folder it was loaded from, if any
        config = getattr(run.model, "config", None)
        if is_peft_model(run.model):
            config = getattr(run.model.get_base_model(), "config", None)
        spec = getattr(config, "_name_or_path", "") or ""
    return Path(spec) if spec and Path(spec).is_dir() else None


def _quantization_config(options: PeftOptions) -> Any:
    import transformers

    if options.quantize == "8bit":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=options.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=options.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=getattr(torch, options.bnb_4bit_compute_dtype))


def _check_composition(run: Any, options: PeftOptions) -> None:
    """Refuse what cannot train an adapter, with the reason."""
    train = run.config.train
    from engine.kit.distributed import strategy_name

    strategy = strategy_name(run)
    if strategy in ("fsdp", "deepspeed"):
        raise ConfigError(f"plugin peft: strategy {strategy!r} writes its own sharded checkpoints, which do not "
                          "hold adapters yet; use strategy 'single' or 'ddp'")
    entry = run.registries["optimizer"].get(train.optim)
    if entry.takes_target_modules:
        raise ConfigError(f"train.optim: {train.optim!r} cannot train adapters: {FULL_MATRIX_OPTIMIZERS}, and with "
                          "peft those are frozen (only the small adapter matrices train); use adamw_torch")
    if options.method == "dora" and options.use_dora is False:
        raise ConfigError("peft.use_dora = false contradicts peft.method = 'dora' (DoRA is LoRA with use_dora = "
                          "true); remove use_dora, or set method = 'lora'")
    if options.layers_to_transform and isinstance(options.target_modules, str):
        raise ConfigError(f"peft.layers_to_transform picks layers of the modules a list of names selects, but "
                          f"peft.target_modules = {options.target_modules!r} is a string (a regex, or 'all-linear'); "
                          "give target_modules as names, e.g. ['q_proj', 'v_proj']")
    changed = _changed_options(options, FOUR_BIT_OPTIONS)
    if changed and options.quantize != "4bit":
        raise ConfigError(f"peft.{changed[0]}: an option of the 4-bit base, but peft.quantize is "
                          f"{options.quantize!r}; set quantize = '4bit', or remove {changed[0]}")
    if options.method == "ia3":
        changed = _changed_options(options, LORA_ONLY)
        if changed:
            raise ConfigError(f"peft.{changed[0]}: a LoRA option; method = 'ia3' takes target_modules, "
                              "exclude_modules, feedforward_modules, modules_to_save")
    elif options.feedforward_modules is not None:
        raise ConfigError(f"peft.feedforward_modules: an IA3 option; method is {options.method!r}")
    if options.quantize:
        if options.merge:
            raise ConfigError("peft.merge: a quantized base cannot be merged exactly (the merged weights would be "
                              "re-quantized); train with quantize, then merge the adapter into the full-precision "
                              "base with PeftModel.from_pretrained(base, output_dir).merge_and_unload()")
        if run.model is not None:
            raise ConfigError("peft.quantize: the model was given to Run(model=...) already built; load it quantized "
                              "yourself (from_pretrained(..., quantization_config=BitsAndBytesConfig(...))) or set "
                              "train.model to its folder")
        if _model_source(run) is None:
            raise ConfigError(f"peft.quantize: train.model = {train.model!r} is built from a config with random "
                              "weights, so there are no weights to quantize; name a saved model folder "
                              "(train.model = 'path/to/model'), or drop quantize")
        engine.require("bitsandbytes", "bitsandbytes", feature="peft.quantize", extra="peft")


def _plan_notes(run: Any, options: PeftOptions) -> list[str]:
    """Build the adapter on a model without weights (meta device): it refuses target modules that
    match nothing before anything loads, and says what will train."""
    import transformers

    if run.model is not None:
        config = getattr(run.model, "config", None)
    else:
        from engine.kit.models import model_config

        config = model_config(run.config.train)
    if config is None:
        return ["the model comes from a factory; its adapter is described when it is built"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    notes = describe(wrap(model, options))
    if options.quantize:
        notes.append(f"base loaded {options.quantize} by bitsandbytes (QLoRA), prepared for k-bit training")
    return notes


@hookimpl
def plugin_options():
    return PeftOptions


@hookimpl
def configure(run):
    _require_peft()
    options = _options(run)
    if run.model is not None and is_peft_model(run.model):
        changed = _changed_options(options, ADAPTER_OPTIONS)
        if changed:
            raise ConfigError(f"peft.{changed[0]}: the model given to Run(model=...) is already a PeftModel with its "
                              "own adapter config; remove the adapter options from [peft]")
        return
    _check_composition(run, options)
    _plan_notes(run, options)  # builds the adapter on a meta model: target modules matching nothing are refused now


@hookimpl
def checkpoint_weights(run):
    return AdapterWeights(_options(run).merge, _model_source(run))


@hookimpl
def plan_lines(run):
    if run.model is not None and is_peft_model(run.model):
        return describe(run.model)
    return _plan_notes(run, _options(run))


@hookimpl
def model_load_kwargs(run):
    """QLoRA: the base loads quantized, never at full size first."""
    options = _options(run)
    return {"quantization_config": _quantization_config(options)} if options.quantize else None


@hookimpl(tryfirst=True)
def patch_model(run, model):
    """Wrap the model first, so the other patches (NEFTune, activation checkpointing) see the base
    modules the adapter sits on. With frozen embeddings, reentrant activation checkpointing needs
    grads at the blocks' inputs: transformers' activation_checkpointing_enable (the builtin patch)
    turns them on for models that take input_ids."""
    import peft

    options = _options(run)
    if not is_peft_model(model):
        if options.quantize:
            model = peft.prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=bool(run.config.train.activation_checkpointing))
        model = wrap(model, options, new_token_rows(run, model))
    run.model = model
    source = run.weights.source
    run.weights.fingerprint = base_fingerprint(model, str(source) if source else run.config.train.model)
    for line in describe(model):
        logger.info("peft: %s", line)
