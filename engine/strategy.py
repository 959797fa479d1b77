"""The strategy: where the model runs and how gradients are made, reduced and applied.

:class:`Strategy` is the builtin single-process strategy (CPU or one GPU). Distributed
strategies (DDP, FSDP, DeepSpeed plugins) subclass it and override what differs; the loop only
talks to this interface. Register one with the ``register_strategies`` hook.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError

if TYPE_CHECKING:
    from .run import Run


class Strategy:
    """One process, one device. Owns precision (autocast, fp16 loss scaling) too."""

    name = "single"
    rank = 0
    local_rank = 0
    world_size = 1

    def __init__(self, run: Run):
        self.run = run
        train = run.config.train
        use_cuda = torch.cuda.is_available() and not train.use_cpu
        self.device = torch.device("cuda", self.local_rank) if use_cuda else torch.device("cpu")
        self.scaler: torch.amp.GradScaler | None = None
        self._autocast_dtype: torch.dtype | None = None
        if train.fp16:
            if self.device.type != "cuda":
                raise ConfigError("train.fp16 needs a CUDA device; on CPU use train.bf16 = true")
            self._autocast_dtype = torch.float16
            self.scaler = torch.amp.GradScaler("cuda")
        elif train.bf16:
            if self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
                raise ConfigError("train.bf16: this GPU does not support bfloat16; use train.fp16")
            self._autocast_dtype = torch.bfloat16

    # ------------------------------------------------------------------ process topology

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def setup(self) -> None:
        """Initialise the process group, if any. Called once, before the model is built."""

    def teardown(self) -> None:
        """Release the process group, if any. Called once after training."""

    def barrier(self) -> None:
        """Wait for all processes."""

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` over processes (``mean`` or ``sum``); identity here."""
        return tensor

    # ------------------------------------------------------------------ model and optimizer

    def model_init_context(self) -> contextlib.AbstractContextManager:
        """Context in which the model is constructed (DeepSpeed ZeRO-3 partitions here)."""
        return contextlib.nullcontext()

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move (and wrap or shard) the patched model; returns the module to call forward on."""
        return model.to(self.device)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Wrap the optimizer if the strategy needs to."""
        return optimizer

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.device.type == "cpu":
            return batch
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    # ------------------------------------------------------------------ one step

    @property
    def scales_loss(self) -> bool:
        """fp16 loss scaling is on: non-finite gradients are then expected, and the scaler skips them."""
        return self.scaler is not None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Context for micro-batches whose gradients must not be synchronised yet."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm of ``optimizer``'s parameters; returns the norm before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    # ------------------------------------------------------------------ checkpoint I/O

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights of ``model``, for saving on the main process."""
        return model.state_dict()

    def load_model_weights(self, model: torch.nn.Module, folder: Any) -> None:
        """Load the full weights saved in ``folder`` (a checkpoint or a final model) into ``model``."""
        from .checkpoint import load_weights

        load_weights(model, folder, self.device)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Strategy state for checkpoints (the fp16 loss scale)."""
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def strategy_name(run: Run) -> str:
    """``train.strategy``, with "auto" resolved: an enabled plugin's strategy, else "single"."""
    from .plugins import BUILTIN_PREFIX

    registry = run.registries["strategy"]
    name = run.config.train.strategy
    if name != "auto":
        registry.get(name)
        return name
    offered = {n: e.plugin for n, e in registry.entries.items() if not e.plugin.startswith(BUILTIN_PREFIX)}
    if len(offered) > 1:
        listed = ", ".join(f"{n} (plugin {p})" for n, p in sorted(offered.items()))
        raise ConfigError(f"train.strategy: enabled plugins offer several strategies ({listed}); "
                          "set train.strategy to one or disable the others")
    return next(iter(offered), "single")
