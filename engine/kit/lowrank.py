"""Helpers for low-rank projection optimizer plugins (GaLore, APOLLO): target groups, layerwise
stepping, projector checkpoints, and the configure-time checks they share.

Imports no optimizer library and implements no hook: a plugin passes its optimizer class and
projector factory, and calls these from its own hookimpls.

* :func:`check` (from the family's ``check``) validates the target modules and the layerwise
  conflicts; ``train.optim_args`` are the family's (:class:`engine.optim.OptimizerFamily`).
* :func:`build` makes transformers' two parameter groups (every other parameter; the selected
  ``nn.Linear`` weights with the projection options) and the optimizer, or for a
  ``*_layerwise`` name one optimizer per parameter behind a :class:`LayerwiseOptimizer`.
* Projectors live in the optimizer state as Python objects, which ``torch.load(weights_only=True)``
  refuses: :func:`build` registers state-dict hooks that store them as tensors and numbers,
  and :func:`restore_projectors` turns them back into objects after a load.
* For the plugin's hooks: :func:`attach` (``on_train_start``), :func:`detach` (``on_train_end``),
  :func:`restore` (``load_checkpoint_state``) and :func:`without_grad_norm` (a ``training_step``
  wrapper)::

      @hookimpl(wrapper=True)
      def training_step(run, batches, num_items_in_batch):
          return lowrank.without_grad_norm(run, (yield))

      @hookimpl
      def on_train_start(run):
          lowrank.attach(run)
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable

import torch

from ..errors import CheckpointError, ConfigError
from ..optim import target_linear_parameters
from ..strategy import strategy_name

__all__ = ["LAYERWISE", "is_layerwise", "check", "check_layerwise", "warn_unused_train_keys", "build",
           "LayerwiseOptimizer", "keep_projectors_loadable", "restore_projectors", "without_grad_norm", "attach",
           "detach", "restore"]

LAYERWISE = "_layerwise"


def is_layerwise(name: str) -> bool:
    return name.endswith(LAYERWISE)


def check(run: Any, logger: logging.Logger) -> None:
    """The configure-time checks both families make besides optim_args.

    ``train.optim_target_modules`` (unset: refused now; matched against the model when one was
    given to the run, else when the optimizer is made); the layerwise conflicts
    (:func:`check_layerwise`).
    """
    train = run.config.train
    if train.optim_target_modules is None or run.model is not None:  # None is refused without a model
        target_linear_parameters(run.model, train.optim_target_modules, user=train.optim)
    if is_layerwise(train.optim):
        check_layerwise(run, logger)


def check_layerwise(run: Any, logger: logging.Logger) -> None:
    """Refuse what per-parameter stepping inside backward cannot do; warn that it does not clip."""
    train = run.config.train
    name, base = train.optim, train.optim.removesuffix(LAYERWISE)
    if train.gradient_accumulation_steps > 1:
        raise ConfigError(f"train.gradient_accumulation_steps: {name} updates each parameter as soon as "
                          f"its gradient is ready, so it cannot accumulate; set it to 1 (raise "
                          f"per_device_train_batch_size instead) or use {base}")
    strategy = strategy_name(run)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy != "single" or world > 1:
        where = f"train.strategy = {strategy!r}" if strategy != "single" else f"WORLD_SIZE={world}"
        raise ConfigError(f"train.strategy: {name} runs in a single process only ({where}): it updates "
                          f"parameters inside backward, before DDP/FSDP/DeepSpeed reduce gradients; "
                          f"use {base}, or train on one device")
    if train.fp16:
        raise ConfigError(f"train.fp16: {name} cannot unscale fp16 gradients before its per-parameter "
                          f"updates; use train.bf16 = true or {base}")
    if train.max_grad_norm > 0:
        logger.warning("%s: train.max_grad_norm = %s is not applied: each parameter is updated during "
                       "backward, before a global gradient norm exists (Trainer does the same and logs "
                       "0); grad_norm is not logged. Set train.max_grad_norm = 0 to silence this.",
                       name, train.max_grad_norm)


def warn_unused_train_keys(run: Any, keys: tuple[str, ...], logger: logging.Logger, note: str) -> None:
    """Warn about [train] keys set away from their defaults that this optimizer (partly) ignores.

    Logs "<optim>: train.<key> = <value>, ... <note>".
    """
    from ..config import TrainConfig  # assembled from the builtins' options: not at import

    train, defaults = run.config.train, TrainConfig()  # a [train] value that differs from these was set by the user
    changed = [f"{key} = {getattr(train, key)}" for key in keys
               if getattr(train, key) != getattr(defaults, key)]
    if changed:
        logger.warning("%s: train.%s %s", train.optim, ", train.".join(changed), note)


def build(run: Any, cls: type, target_kwargs: dict[str, Any], optimizer_kwargs: dict[str, Any],
          make_projector: Callable[[Any, dict[str, Any], dict[str, Any]], Any],
          per_param: Callable[[torch.optim.Optimizer, torch.nn.Parameter, int], None] | None = None,
          ) -> torch.optim.Optimizer:
    """The optimizer for ``run.model`` as transformers' Trainer builds it for GaLore / APOLLO.

    Groups: ``[{"params": others}, {"params": targets, **target_kwargs}]`` where targets are
    the selected ``nn.Linear`` weights (:func:`engine.optim.target_linear_parameters`), both
    in ``named_parameters`` order; ``cls(groups, **optimizer_kwargs)``. For a layerwise name,
    ``cls([{"params": [p], ...}], **optimizer_kwargs)`` per trainable parameter (``per_param``
    is called with each and its 1-based position in the groups above) behind a
    :class:`LayerwiseOptimizer`. ``make_projector(optimizer, group, state)`` builds an empty
    projector of the kind the optimizer would create (used when loading a state dict).
    """
    name = run.config.train.optim
    weights = target_linear_parameters(run.model, run.config.train.optim_target_modules, user=name)
    target_ids = {id(p) for p in weights.values()}
    named = list(run.model.named_parameters())
    targets = [p for _, p in named if id(p) in target_ids]
    others = [p for _, p in named if id(p) not in target_ids]
    groups = [{"params": others}, {"params": targets, **target_kwargs}]

    def new(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        with warnings.catch_warnings():  # galore's AdamW: "deprecated, use torch.optim.AdamW"
            warnings.filterwarnings("ignore", message="This implementation of AdamW is deprecated")
            optimizer = cls(param_groups, **optimizer_kwargs)
        keep_projectors_loadable(optimizer, make_projector)
        return optimizer

    if not is_layerwise(name):
        return new(groups)
    optimizers = {}
    for position, param in enumerate(others + targets, start=1):
        if param.requires_grad:
            extra = target_kwargs if id(param) in target_ids else {}
            optimizers[param] = new([{"params": [param], **extra}])
            if per_param is not None:
                per_param(optimizers[param], param, position)
    return LayerwiseOptimizer(optimizers, lr=optimizer_kwargs["lr"])


# ---------------------------------------------------------------------------- layerwise


class LayerwiseOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, each stepped by the parameter's post-accumulate-grad hook.

    As transformers' ``LayerWiseDummyOptimizer``: the update happens inside ``backward`` and
    ``step()`` / ``zero_grad()`` do nothing, so only one parameter's gradient is alive at a time.
    Unlike it, ``param_groups`` is the list of every per-parameter optimizer's groups, so any
    lr scheduler made for this optimizer schedules them all, and ``state_dict()`` holds every
    per-parameter optimizer's state dict (``{"layerwise": [...]}``), so checkpoints keep them.
    """

    def __init__(self, optimizers: dict[torch.nn.Parameter, torch.optim.Optimizer], lr: float):
        self.optimizers = optimizers
        super().__init__(self._inner_groups(), {"lr": lr})
        self._handles: list[Any] = []
        self.attach()

    def _inner_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def attach(self) -> None:
        """Register the per-parameter step hooks (idempotent)."""
        if not self._handles:
            self._handles = [p.register_post_accumulate_grad_hook(self._step_param) for p in self.optimizers]

    def detach(self) -> None:
        """Remove the hooks: backward no longer updates the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _step_param(self, param: torch.nn.Parameter) -> None:
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()  # its backward runs the per-parameter steps

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # each hook already cleared its parameter's gradient

    def state_dict(self) -> dict[str, Any]:
        return {"layerwise": [optimizer.state_dict() for optimizer in self.optimizers.values()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("layerwise")
        if saved is None or len(saved) != len(self.optimizers):
            count = "no layerwise state" if saved is None else f"{len(saved)} per-parameter optimizers"
            raise CheckpointError(f"optimizer state: expected {len(self.optimizers)} per-parameter optimizers "
                                  f"(train.optim = a *_layerwise name), the checkpoint has {count}")
        for optimizer, state in zip(self.optimizers.values(), saved):
            optimizer.load_state_dict(state)
            restore_projectors(optimizer)  # a no-op after torch's hook; bitsandbytes' load has none
        self.param_groups = self._inner_groups()  # load_state_dict replaced the group dicts


# ---------------------------------------------------------------------------- projectors


def keep_projectors_loadable(optimizer: torch.optim.Optimizer,
                             make_projector: Callable[[Any, dict[str, Any], dict[str, Any]], Any]) -> None:
    """Store ``state["projector"]`` as plain data in ``state_dict()``; rebuild it on load.

    Saved: the projector's attributes except strings (``proj_type`` comes back from the param
    group): tensors, numbers and None, which ``weights_only`` loading accepts and
    ``load_state_dict`` casts to the parameter's device. bitsandbytes optimizers (galore 8-bit)
    load without torch's hooks: call :func:`restore_projectors` after their load.
    """
    optimizer.register_state_dict_post_hook(_encode_projectors)
    optimizer.register_load_state_dict_post_hook(lambda opt: restore_projectors(opt, make_projector))
    optimizer._engine_make_projector = make_projector


def _encode_projectors(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    state = {}
    for index, param_state in state_dict["state"].items():
        projector = param_state.get("projector")
        if projector is not None and not isinstance(projector, dict):
            kept = {key: value for key, value in vars(projector).items() if not isinstance(value, str)}
            param_state = {**param_state, "projector": kept}  # a copy: the live state keeps the object
        state[index] = param_state
    return {**state_dict, "state": state}


def restore_projectors(optimizer: torch.optim.Optimizer, make_projector: Callable[..., Any] | None = None) -> None:
    """Turn projectors loaded as plain data back into projector objects (idempotent).

    A :class:`LayerwiseOptimizer` restores each per-parameter optimizer.
    """
    if isinstance(optimizer, LayerwiseOptimizer):
        for inner in optimizer.optimizers.values():
            restore_projectors(inner)
        return
    make_projector = make_projector or getattr(optimizer, "_engine_make_projector", None)
    if make_projector is None:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and isinstance(state.get("projector"), dict):
                projector = make_projector(optimizer, group, state)
                vars(projector).update(state["projector"])
                state["projector"] = projector


# ---------------------------------------------------------------------------- for the plugins' hooks


def without_grad_norm(run: Any, out: Any) -> Any:
    """A ``training_step`` result without its grad_norm when the optimizer steps per parameter:
    the norm of gradients already cleared inside backward (0) means nothing."""
    if isinstance(run.optimizer, LayerwiseOptimizer) and out is not None and out.grad_norm is not None:
        return out._replace(grad_norm=None)
    return out


def attach(run: Any) -> None:
    """At train start: a layerwise optimizer's per-parameter step hooks are on (idempotent)."""
    if isinstance(run.optimizer, LayerwiseOptimizer):
        run.optimizer.attach()


def detach(run: Any) -> None:
    """At train end: the model is left as it was built, so backward no longer steps."""
    if isinstance(run.optimizer, LayerwiseOptimizer):
        run.optimizer.detach()


def restore(run: Any) -> None:
    """After a checkpoint loaded: projectors back to objects (bitsandbytes' load_state_dict runs no torch hooks)."""
    if run.optimizer is not None:
        restore_projectors(run.optimizer)
