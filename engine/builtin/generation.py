"""``train.predict_with_generate``: the generation builtin answers ``prediction_step`` first.

With ``predict_with_generate`` an evaluation's or prediction's predictions are ``generate()``'s
token ids (as Seq2SeqTrainer's), and the loss is ``compute_loss``'s as for any batch; without
it, or when only the loss is wanted, this builtin lets the evaluation builtin answer with logits.
The settings (``train.generation_config``, ``generation_max_length``, ``generation_num_beams``)
are read once per evaluation or prediction pass, at its first batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine import hookimpl
from engine.builtin.evaluation import labels_of
from engine.config import option
from engine.errors import ConfigError
from engine.state import RunView

if TYPE_CHECKING:  # TrainConfig is assembled from the builtins' options: not at import
    from engine.config import TrainConfig


@dataclass
class GenerationOptions:
    """``[train]`` keys of builtin.generation: evaluating with generate()."""

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


class PredictWithGenerate:
    """Per run: the generation settings of the current pass, read at its first batch."""

    TRAIN_OPTIONS = GenerationOptions  # the [train] keys it reads: engine.config.TrainConfig has them

    def __init__(self) -> None:
        self.settings: Generation | None = None
        self.pad_id = 0

    @hookimpl
    def on_eval_mode(self, run: RunView) -> None:
        self.settings = None  # each pass starts in eval mode: read the model's generation config afresh

    @hookimpl(tryfirst=True)
    def prediction_step(self, run: RunView, model: torch.nn.Module, batch: dict[str, Any], num_items_in_batch: Any,
                        prediction_loss_only: bool) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        if prediction_loss_only or not run.config.train.predict_with_generate:
            return None
        if self.settings is None:
            self.settings = generation(run.config.train, run.model)
            pad_id = getattr(run.tokenizer, "pad_token_id", None)
            self.pad_id = pad_id if pad_id is not None else getattr(run.model.config, "pad_token_id", None) or 0
        with run.strategy.autocast():
            loss = run.hook.compute_loss(run=run, model=model, batch=batch, num_items_in_batch=num_items_in_batch)
            tokens = generate(run.model, batch, self.settings, self.pad_id)
        return loss, tokens, labels_of(batch, run.label_names)


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
