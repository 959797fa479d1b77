"""``liger``: liger-kernel's Triton kernels (RoPE, RMSNorm, SwiGLU/GeGLU, LayerNorm, cross-entropy,
fused linear cross-entropy) patched into the model, by its ``model_type``.

    plugins = ["liger"]

    [liger]                  # unset: liger-kernel's default for the model type
    fused_linear_cross_entropy = true
    rms_norm = true

The kernels need a GPU: a CPU run is refused, unless ``TRITON_INTERPRET=1`` runs Triton's CPU
interpreter (slow; there only the cross-entropy kernels and RoPE work). liger-kernel patches the
model instance and also rebinds names in transformers' modules (``LlamaRMSNorm``,
``apply_rotary_pos_emb``, ``torch.nn.functional.cross_entropy``, ...): the undo puts back every
name it changed, in modules, their classes and the model's submodules, so a model built later in
the same process is the stock one.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from dataclasses import dataclass, fields
from typing import Any

import torch

import engine
from engine import ConfigError, hookimpl, option

logger = logging.getLogger("engine")
KERNELS = ("rope", "rms_norm", "swiglu", "geglu", "layer_norm", "cross_entropy", "fused_linear_cross_entropy")


@dataclass
class LigerOptions:
    """``[liger]``: each kernel on, off, or (unset) liger-kernel's default for the model type."""

    rope: bool | None = option(None, help="rotary position embeddings")
    rms_norm: bool | None = option(None, help="RMSNorm")
    swiglu: bool | None = option(None, help="SwiGLU MLP (Llama, Mistral, Qwen, ...)")
    geglu: bool | None = option(None, help="GeGLU MLP (Gemma)")
    layer_norm: bool | None = option(None, help="LayerNorm")
    cross_entropy: bool | None = option(None, help="cross-entropy on the logits")
    fused_linear_cross_entropy: bool | None = option(None, help=(
        "the head and the cross-entropy fused, chunk by chunk: the logits are never materialised in training"))


def _patch_functions() -> dict[str, Any]:
    engine.require("liger_kernel", "liger-kernel", feature="plugin liger", extra="liger")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def _model_type(run) -> str | None:
    from engine.kit.models import model_config

    config = getattr(run.model, "config", None) if run.model is not None else model_config(run.config.train)
    return getattr(config, "model_type", None)


def kernel_arguments(run, model_type: str) -> dict[str, bool]:
    """The apply function's arguments for this run: the options set, checked against what it takes."""
    apply = _patch_functions()[model_type]
    takes = [name for name in inspect.signature(apply).parameters if name in KERNELS]
    options = run.config.section("liger")
    chosen = {f.name: getattr(options, f.name) for f in fields(options) if getattr(options, f.name) is not None}
    unknown = sorted(set(chosen) - set(takes))
    if unknown:
        raise ConfigError(f"liger.{unknown[0]}: liger-kernel has no such kernel for {model_type} models; "
                          f"it patches {', '.join(takes)}")
    defaults = {name: inspect.signature(apply).parameters[name].default for name in takes}
    return {**defaults, **chosen}


@hookimpl
def plugin_options():
    return LigerOptions


@hookimpl
def configure(run):
    supported = _patch_functions()
    model_type = _model_type(run)
    if model_type is None:
        return  # a model factory: checked when the model is built
    _check(run, model_type, supported)


def _check(run, model_type: str, supported: dict[str, Any]) -> None:
    if model_type not in supported:
        raise ConfigError(f"plugin liger: liger-kernel {_version()} has no kernels for model_type "
                          f"{model_type!r}; it supports {', '.join(sorted(supported))}")
    kernels = kernel_arguments(run, model_type)
    if kernels.get("cross_entropy") and kernels.get("fused_linear_cross_entropy"):
        raise ConfigError("liger.cross_entropy and liger.fused_linear_cross_entropy are both on; the fused one "
                          f"already computes the cross-entropy (it is on by default for {model_type}): turn one off")
    if kernels.get("fused_linear_cross_entropy"):
        # the model then returns its loss without logits
        if run.config.train.label_smoothing_factor > 0:
            raise ConfigError("liger.fused_linear_cross_entropy computes the loss inside the model, without label "
                              "smoothing; set train.label_smoothing_factor = 0 or fused_linear_cross_entropy = false")
        owners = run.plugin_manager.plugins_answering("compute_loss")
        if owners:
            raise ConfigError(f"liger.fused_linear_cross_entropy: plugin {owners[0]!r} computes the loss from the "
                              "logits, which the fused kernel never materialises; set "
                              "fused_linear_cross_entropy = false in [liger] to use that loss")


def _check_device(run) -> None:
    """Checked when the model is patched (``engine plan`` shows a GPU run's plan on any machine)."""
    if run.strategy.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("plugin liger: liger-kernel's Triton kernels need a CUDA GPU and this run is on the CPU; "
                          "disable the plugin (or set TRITON_INTERPRET=1 to run Triton's slow CPU interpreter, "
                          "for tests)")


def _version() -> str:
    from importlib.metadata import version

    return version("liger-kernel")


class Snapshot:
    """What liger-kernel rebinds: names in transformers' modules and their classes,
    ``torch.nn.functional`` and the model's submodules, compared before and after it patches."""

    def __init__(self, model: torch.nn.Module):
        self.namespaces: list[Any] = [torch.nn.functional]
        for name, module in list(sys.modules.items()):
            if module is not None and (name == "transformers" or name.startswith("transformers.")):
                self.namespaces.append(module)
                self.namespaces += [value for value in vars(module).values()
                                    if isinstance(value, type) and value.__module__ == name]
        self.namespaces += list(model.modules())
        self.before = [dict(vars(space)) for space in self.namespaces]
        self.changes: list[tuple[Any, str, Any]] = []

    def record_changes(self) -> None:
        """After patching: remember each name that was changed or added, with its old value."""
        for space, before in zip(self.namespaces, self.before):
            for key, value in vars(space).items():
                if before.get(key, _MISSING) is not value:
                    self.changes.append((space, key, before.get(key, _MISSING)))
        self.before = []

    def restore(self) -> int:
        """Put back only what the patch changed (what others added since, e.g. a strategy's state,
        stays); returns how many names."""
        for space, key, value in self.changes:
            if value is _MISSING:
                vars(space).pop(key, None) if isinstance(space, torch.nn.Module) else delattr(space, key)
            else:
                setattr(space, key, value)
        return len(self.changes)


_MISSING = object()


@hookimpl
def patch_model(run, model):
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    supported = _patch_functions()
    if model_type is None:
        raise ConfigError(f"plugin liger: {type(model).__name__} has no config.model_type; liger-kernel patches "
                          "transformers models by type")
    _check(run, model_type, supported)
    _check_device(run)
    kernels = kernel_arguments(run, model_type)
    snapshot = Snapshot(model)
    supported[model_type](model=model, **kernels)
    snapshot.record_changes()
    logger.info("liger: %s kernels on (%s)", model_type, ", ".join(name for name, on in kernels.items() if on))

    def undo():
        restored = snapshot.restore()
        logger.debug("liger: %d names put back", restored)

    return undo


@hookimpl
def trainer_argument_mappings():
    from .mappings import TRAINER_ARGUMENTS  # for engine migrate only: runs do not load it

    return TRAINER_ARGUMENTS
