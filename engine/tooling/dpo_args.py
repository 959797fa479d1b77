"""TRL's ``DPOConfig`` fields (and the alignment handbook's DPO recipe keys), answered as
:mod:`engine.tooling.sft_args` answers ``SFTConfig``: a DPO run file (``plugins = ["dpo"]``, its ``[dpo]``
section, the pairs' ``[data]``) that trains the objective ``DPOTrainer`` trains (plugins/dpo/tests).

``DPOConfig`` is a ``TrainingArguments`` subclass: its ``TrainingArguments`` fields keep that table's answers,
the fields it shares with ``SFTConfig`` (``max_length``, ``dataset_num_proc``, ``model_init_kwargs``, ...)
keep SFT's, and :data:`DPO_FIELDS` answers the rest. What a recipe leaves out is DPOConfig's default
(:func:`dpo_defaults`: ``learning_rate`` 1e-6, ``max_length`` 1024, ``beta`` 0.1, ...).
"""

from __future__ import annotations

from typing import Any

from engine.kit.mappings import BUILTIN, PLUGIN, REFUSED, Answer, Conversion, refused
from engine.tooling.sft_args import MODEL_FIELDS, SCRIPT_FIELDS, SFT_FIELDS, cached_defaults, trl_defaults

# fields only DPOConfig (and older DPO recipes) have: their presence says a DPO config
DPO_ONLY = ("beta", "precompute_ref_log_probs", "f_divergence_type", "ld_alpha", "rpo_alpha", "reference_free",
            "max_prompt_length", "use_weighting", "sync_ref_model", "ref_model_init_kwargs", "discopop_tau")


def dpo_key(key: str, note: str = "", convert: Any = None, legacy_defaults: tuple[Any, ...] = ()) -> Answer:
    return Answer(PLUGIN, (f"dpo.{key}",), ("dpo",), note, convert, legacy_defaults)


def _loss_type(c: Conversion, name: str, value: Any) -> None:
    """Always present (DPOConfig's default ['sigmoid']): it enables the dpo plugin, and the pairs are not packed."""
    c.enable("dpo")
    c.set("dpo.loss_type", [value] if isinstance(value, str) else list(value))
    c.set("data.packing", False, note="pairs are never packed (the engine packs by default)")


def _rpo_alpha(c: Conversion, name: str, value: Any) -> None:
    """Older TRL's RPO: the sigmoid loss plus rpo_alpha times the chosen completions' NLL, which TRL 1.16 writes as
    loss_type ['sigmoid', 'sft'] with loss_weights [1, rpo_alpha]."""
    if value is None:
        return
    c.enable("dpo")
    c.set("dpo.loss_type", ["sigmoid", "sft"], note="RPO, as TRL 1.16 writes it")
    c.set("dpo.loss_weights", [1.0, float(value)])


DPO_FIELDS: dict[str, Answer] = {
    "beta": dpo_key("beta"),
    "loss_type": Answer(PLUGIN, ("dpo.loss_type", "data.packing"), ("dpo",), convert=_loss_type,
                        note="the same names; enables the dpo plugin, and data.packing = false"),
    "loss_weights": dpo_key("loss_weights"),
    "label_smoothing": dpo_key("label_smoothing"),
    "ld_alpha": dpo_key("ld_alpha"),
    "f_divergence_type": dpo_key("f_divergence_type"),
    "f_alpha_divergence_coef": dpo_key("f_alpha_divergence_coef"),
    "discopop_tau": dpo_key("discopop_tau"),
    "precompute_ref_log_probs": dpo_key("precompute_ref_log_probs"),
    "precompute_ref_batch_size": dpo_key("precompute_ref_batch_size"),
    "disable_dropout": dpo_key("disable_dropout"),
    "truncation_mode": Answer(BUILTIN, legacy_defaults=("keep_start",),
                              note="keep_start only: prompt + completion cut at data.max_length"),
    "padding_free": Answer(BUILTIN, legacy_defaults=(False,), note="batches are padded (TRL 1.16 falls back to "
                                                                   "padding too)"),
    "use_weighting": Answer(REFUSED, legacy_defaults=(False,), note="WPO weighting is not in the dpo plugin yet"),
    "sync_ref_model": Answer(REFUSED, legacy_defaults=(False,), note="TR-DPO's reference syncing is not in the dpo "
                                                                     "plugin yet"),
    "ref_model_mixup_alpha": Answer(REFUSED, legacy_defaults=(0.6,), note="read with sync_ref_model only"),
    "ref_model_sync_steps": Answer(REFUSED, legacy_defaults=(512,), note="read with sync_ref_model only"),
    # older TRL DPOConfig fields, as handbook recipes hold them
    "rpo_alpha": Answer(PLUGIN, ("dpo.loss_type", "dpo.loss_weights"), ("dpo",), convert=_rpo_alpha,
                        legacy_defaults=(None,), note="loss_type ['sigmoid', 'sft'] with loss_weights [1, rpo_alpha]"),
    "max_prompt_length": Answer(REFUSED, legacy_defaults=(None,), note=(
        "prompts are not cut on their own: a row whose prompt leaves no completion token within data.max_length "
        "is refused, naming it")),
    "max_completion_length": Answer(REFUSED, legacy_defaults=(None,), note="prompt + completion are cut at "
                                                                           "data.max_length"),
    "reference_free": Answer(REFUSED, legacy_defaults=(False,), note="the dpo plugin always has a reference"),
    "ref_model_init_kwargs": refused("no [dpo] key passes from_pretrained keywords; dpo.ref_model names the model"),
    "generate_during_eval": Answer(REFUSED, legacy_defaults=(False,), note="the samples plugin generates"),
    "use_logits_to_keep": Answer(BUILTIN, legacy_defaults=(False,), note="the logits of every position are used"),
}


def dpo_answer(name: str) -> Answer | None:
    """The answer for a DPOConfig field, a ModelConfig / ScriptArguments / recipe key, or an SFT field DPOConfig
    shares; None for others (TrainingArguments' table answers those)."""
    return DPO_FIELDS.get(name) or MODEL_FIELDS.get(name) or SCRIPT_FIELDS.get(name) or \
        (SFT_FIELDS.get(name) if name in _SHARED_WITH_SFT else None)


_SHARED_WITH_SFT = ("bf16", "max_length", "dataset_num_proc", "model_init_kwargs", "trust_remote_code",
                    "router_aux_loss_coef", "pad_to_multiple_of", "activation_offloading", "pad_token")


def is_dpo(arguments: dict[str, Any]) -> bool:
    """Whether ``arguments`` hold a field only a DPO config has."""
    return any(name in arguments for name in DPO_ONLY)


def dpo_defaults() -> dict[str, Any]:
    """DPOConfig's, ModelConfig's and ScriptArguments' field defaults, as a dump holds them."""
    return cached_defaults(_dpo_defaults, ("trl", "transformers"))


def _dpo_defaults() -> dict[str, Any]:
    from trl import DPOConfig

    return trl_defaults(DPOConfig)
