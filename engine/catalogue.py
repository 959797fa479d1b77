"""First-party plugins: which distribution and pip extra provide which plugin and names.

Used only to turn "unknown name" errors into instructions ("optim 'galore_adamw' comes from
engine-galore: pip install 'engine[galore]'"). Nothing here is imported or installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FirstParty:
    extra: str
    provides: dict[str, tuple[str, ...]] = field(default_factory=dict)  # registry kind -> names

    @property
    def distribution(self) -> str:
        return f"engine-{self.extra}"

    @property
    def install(self) -> str:
        return f"pip install 'engine[{self.extra}]'"


_BNB_OPTIMIZERS = (
    "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit",
    "lion_32bit", "paged_lion_8bit", "paged_lion_32bit", "rmsprop_8bit", "rmsprop_bnb",
    "rmsprop_bnb_8bit", "rmsprop_bnb_32bit", "ademamix", "ademamix_8bit", "paged_ademamix_8bit",
    "paged_ademamix_32bit",
)
_GALORE_OPTIMIZERS = tuple(
    name + suffix
    for name in ("galore_adamw", "galore_adamw_8bit", "galore_adafactor")
    for suffix in ("", "_layerwise")
)

FIRST_PARTY: dict[str, FirstParty] = {
    "neftune": FirstParty("neftune"),
    "peft": FirstParty("peft"),
    "liger": FirstParty("liger"),
    "bnb": FirstParty("bnb", {"optimizer": _BNB_OPTIMIZERS}),
    "galore": FirstParty("galore", {"optimizer": _GALORE_OPTIMIZERS}),
    "lomo": FirstParty("lomo", {"optimizer": ("lomo", "adalomo")}),
    "grokadamw": FirstParty("grokadamw", {"optimizer": ("grokadamw",)}),
    "schedulefree": FirstParty("schedulefree", {"optimizer": (
        "schedule_free_adamw", "schedule_free_sgd", "schedule_free_radam")}),
    "apollo": FirstParty("apollo", {"optimizer": ("apollo_adamw", "apollo_adamw_layerwise")}),
    "torchao": FirstParty("torchao", {"optimizer": ("adamw_torch_4bit", "adamw_torch_8bit")}),
    "optimi": FirstParty("optimi", {"optimizer": ("stable_adamw",)}),
    "ddp": FirstParty("ddp", {"strategy": ("ddp",)}),
    "fsdp": FirstParty("fsdp", {"strategy": ("fsdp",)}),
    "deepspeed": FirstParty("deepspeed", {"strategy": ("deepspeed",)}),
    "hub": FirstParty("hub"),
    "tensorboard": FirstParty("tensorboard"),
    "mlflow": FirstParty("mlflow"),
    "wandb": FirstParty("wandb"),
    "trackio": FirstParty("trackio"),
}


# TrainingArguments.optim names tied to hardware or libraries this engine does not support, and
# what to use instead.
UNSUPPORTED_OPTIMIZERS = {
    "adamw_torch_xla": "TPU/XLA is not supported by this engine; use adamw_torch",
    "adamw_torch_npu_fused": "Ascend NPUs are not supported by this engine; use adamw_torch or adamw_torch_fused",
    "adamw_apex_fused": "NVIDIA apex is not supported (torch has the same fused kernel); use adamw_torch_fused",
    "adamw_anyprecision": "torchdistx's AnyPrecisionAdamW is not supported; use adamw_torch with train.bf16 = true, "
                          "or adamw_8bit (engine[bnb]) for smaller optimizer state",
}


# train.resume_from_checkpoint names a first-party plugin fetches -> that plugin
CHECKPOINT_SOURCES = {"hub": "hub"}
# Run(model=<a peft model>): its checkpoints hold the adapter only, so the plugin that saves and loads them
# comes with it
ADAPTER_PLUGIN = "peft"


def provider_of(kind: str, name: str) -> str | None:
    """The first-party plugin that registers ``name`` in registry ``kind``, if any."""
    for plugin, info in FIRST_PARTY.items():
        if name in info.provides.get(kind, ()):
            return plugin
    return None
