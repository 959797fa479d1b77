"""Builtin model patches: activation checkpointing and torch.compile (``[train]`` keys, as
TrainingArguments names them). Each is applied through ``patch_model`` and undone at the end."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from engine import hookimpl
from engine.config import option
from engine.errors import ConfigError

logger = logging.getLogger("engine")
# activation_checkpointing_kwargs that choose the layers rather than go to torch.utils.checkpoint
LAYER_KEYS = ("every_n_layers", "offload")


@dataclass
class PatchOptions:
    """``[train]`` keys of builtin.patches: activation checkpointing and torch.compile."""

    activation_checkpointing: bool = option(False, shared=True, help=(
        "recompute each block's activations in backward instead of keeping them (less memory, ~30 % "
        "more compute): HF models through activation_checkpointing_enable, any other module on its blocks"))
    activation_checkpointing_kwargs: dict[str, Any] | None = option(None, shared=True, help=(
        "for activation checkpointing: every_n_layers, offload (HF models) and torch.utils.checkpoint "
        "arguments (default use_reentrant = false)"))
    gradient_checkpointing: bool | None = option(None, shared=True, help=(
        "TrainingArguments' older name of activation_checkpointing"))
    gradient_checkpointing_kwargs: dict[str, Any] | None = option(None, shared=True, help=(
        "TrainingArguments' older name of activation_checkpointing_kwargs"))
    torch_compile: bool = option(False, shared=True, help=(
        "compile the model with torch.compile (its forward; backward follows)"))
    torch_compile_backend: str | None = option(None, shared=True, nonempty=True, help=(
        "torch.compile backend (inductor, aot_eager, ...); setting it turns torch_compile on"))
    torch_compile_mode: str | None = option(None, shared=True, nonempty=True, help=(
        "torch.compile mode (default, reduce-overhead, max-autotune, ...); setting it turns torch_compile on"))


TRAIN_OPTIONS = PatchOptions  # the [train] keys it reads: engine.config.TrainConfig has them


@hookimpl(tryfirst=True)  # the older names resolved before other plugins read activation_checkpointing
def configure(run):
    train = run.config.train
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        value, current = getattr(train, old), getattr(train, new)
        if value is None:
            continue
        if current not in (None, False) and current != value:
            raise ConfigError(f"train.{old} = {value!r} and train.{new} = {current!r} disagree; "
                              f"{old} is TrainingArguments' older name of {new}: set one")
        setattr(train, new, value)
        setattr(train, old, None)
    if train.torch_compile_backend or train.torch_compile_mode:
        train.torch_compile = True
    if train.torch_compile:
        _check_compile_options(train.torch_compile_backend or "inductor", train.torch_compile_mode)
    kwargs = train.activation_checkpointing_kwargs or {}
    every = kwargs.get("every_n_layers", 1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"train.activation_checkpointing_kwargs.every_n_layers: expected int >= 1, got {every!r}")
    if "offload" in kwargs and not isinstance(kwargs["offload"], bool):
        raise ConfigError(f"train.activation_checkpointing_kwargs.offload: expected true or false, "
                          f"got {kwargs['offload']!r}")


@hookimpl
def patch_model(run, model):
    train = run.config.train
    undo = []
    if train.activation_checkpointing:
        undo.append(enable_activation_checkpointing(model, dict(train.activation_checkpointing_kwargs or {})))
    if train.torch_compile:
        undo.append(compile_model(model, train.torch_compile_backend or "inductor", train.torch_compile_mode))
    if not undo:
        return None
    return lambda: [step() for step in reversed(undo)] and None


def enable_activation_checkpointing(model: torch.nn.Module, kwargs: dict[str, Any]):
    """Checkpoint ``model``'s blocks; returns the undo.

    An HF model does it itself (``activation_checkpointing_enable``, as Trainer calls it); any
    other module gets its largest stack of repeated blocks (the ``nn.ModuleList`` holding most
    parameters) checkpointed through an instance-level ``forward``.
    """
    every = kwargs.get("every_n_layers", 1)
    if getattr(model, "supports_gradient_checkpointing", False):
        layer_kwargs = {key: kwargs.pop(key) for key in LAYER_KEYS if key in kwargs}
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable(kwargs or None, **layer_kwargs)
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        return disable
    if kwargs.get("offload"):
        raise ConfigError(f"train.activation_checkpointing_kwargs.offload: {type(model).__name__} is not a "
                          "transformers model; offloading activations needs activation_checkpointing_enable")
    blocks = _largest_block_stack(model)
    if blocks is None:
        raise ConfigError(f"train.activation_checkpointing: {type(model).__name__} has no stack of blocks "
                          "(an nn.ModuleList) to checkpoint and no activation_checkpointing_enable")
    kwargs = {key: value for key, value in kwargs.items() if key not in LAYER_KEYS}
    kwargs.setdefault("use_reentrant", False)
    patched = [block for index, block in enumerate(blocks) if index % every == 0]
    for block in patched:
        # the instance attribute shadows the class's forward; __call__'s hooks still run around it
        block.forward = functools.partial(_checkpointed, block, type(block).forward, kwargs)

    def undo():
        for block in patched:
            del block.forward

    return undo


def _checkpointed(block, forward, kwargs, *args, **call_kwargs):
    if not (block.training and torch.is_grad_enabled()):
        return forward(block, *args, **call_kwargs)
    return checkpoint(forward, block, *args, **kwargs, **call_kwargs)


def _largest_block_stack(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    return max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def _check_compile_options(backend: str, mode: str | None) -> None:
    """Refuse a backend torch does not have, and an inductor mode it does not know, before the model loads."""
    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise ConfigError(f"train.torch_compile_backend: unknown backend {backend!r}; torch has "
                          f"{', '.join(sorted(backends))}")
    if backend == "inductor" and mode is not None:
        import torch._inductor

        modes = list(torch._inductor.list_mode_options())
        if mode not in modes:
            raise ConfigError(f"train.torch_compile_mode: unknown mode {mode!r}; inductor has {', '.join(modes)}")


def compile_model(model: torch.nn.Module, backend: str, mode: str | None):
    """``model.compile(...)`` in place (the module object stays the same for the strategy and the
    checkpoints); returns the undo."""
    model.compile(backend=backend, mode=mode)
    logger.info("torch.compile: backend %s, mode %s (the first steps compile)", backend, mode or "default")

    def undo():
        model._compiled_call_impl = None  # what Module.compile set

    return undo
