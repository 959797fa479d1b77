"""The strategy: where the model runs and how gradients are made, reduced and applied.

:class:`Strategy` is the builtin single-process strategy (CPU or one GPU).
:class:`engine.kit.distributed.DistributedStrategy` adds what every multi-process strategy
shares: the ranks from the launcher's environment (torchrun, the deepspeed launcher), the
``torch.distributed`` process group (gloo on CPU, nccl on GPU, with a timeout), reductions,
barriers and broadcasts. The DDP, FSDP and DeepSpeed plugins subclass it and override what
differs (wrapping, backward, checkpoint I/O); the loop only talks to this interface. Register
one with the ``register_strategies`` hook.

Gradients are averaged over processes by every distributed strategy: a loss normalized by the
item count of the whole global batch is therefore scaled by ``world_size`` before backward (the
builtin step does it), which makes N processes equal one process with N times the batch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError

if TYPE_CHECKING:
    from .state import RunView


class Strategy:
    """One process, one device. Owns precision (autocast, fp16 loss scaling) too."""

    name = "single"
    rank = 0
    local_rank = 0
    world_size = 1
    # a checkpoint of full weights and a full optimizer state resumes under any world size
    resumes_other_world_sizes = True
    # what save_checkpoint_files writes: strategies that write the same files can resume each
    # other's checkpoints ("torch": full weights in the HF layout and torch's optimizer.pt)
    checkpoint_format = "torch"

    def __init__(self, run: RunView):
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
        """``tensor`` reduced over processes (``mean``, ``sum``, ``min`` or ``max``); identity here."""
        return tensor

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        """``value`` of process ``src``, on every process (picklable objects)."""
        return value

    def gather_object(self, value: Any) -> list[Any]:
        """Every process's ``value``, in rank order, on every process."""
        return [value]

    # ------------------------------------------------------------------ model and optimizer

    def model_init_context(self) -> contextlib.AbstractContextManager:
        """Context in which the model is constructed (DeepSpeed ZeRO-3 partitions here)."""
        return contextlib.nullcontext()

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move (and wrap or shard) the patched model; returns the module to call forward on."""
        return model.to(self.device)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Wrap the optimizer if the strategy needs to; returns the optimizer the scheduler drives.

        Called after :meth:`prepare_model`, with the registry's optimizer over the model's
        parameters. A strategy that wraps model and optimizer together (DeepSpeed) does it here and
        sets ``run.wrapped_model`` to the module the loop then calls forward on.
        """
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

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor | None:
        """Clip the global gradient norm of ``optimizer``'s parameters; returns the norm before clipping
        (None from a strategy that clips inside :meth:`optimizer_step`, which then returns it)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | float | None:
        """Apply the update. A strategy that clips inside its step (DeepSpeed: its
        :meth:`clip_grad_norm` returns None) returns the norm before clipping; None otherwise."""
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
        """Load the weights saved in ``folder`` (a checkpoint or a final model) into ``model``: all of them, or
        the part ``run.weights`` selects (an adapter)."""
        self.run.weights.load(self.run, model, Path(folder), self.device)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state, for saving on the main process."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def save_checkpoint_files(self, run: RunView, folder: Path, what: str) -> None:
        """Write the model's weights and the optimizer state into checkpoint ``folder``.

        Called on every process (gathering sharded state is collective). Non-finite weights are
        refused (:class:`~engine.errors.TrainingDiverged`, naming ``what``) before anything is
        written. Here the main process writes the full weights in the HF layout and optimizer.pt,
        so the checkpoint resumes under any number of processes; sharded strategies write shards.
        """
        from .checkpoint import check_finite_weights

        model_state = self.model_state_dict(run.model)
        if self.is_main_process:
            model_state = run.weights.select(run, model_state)
            check_finite_weights(run, model_state, what)
        optimizer_state = self.optimizer_state_dict(run.optimizer)
        if self.is_main_process:
            run.weights.write(run, folder, model_state)
            torch.save(optimizer_state, folder / "optimizer.pt")

    def checkpoint_files(self, folder: Path) -> tuple[str, ...]:
        """The files and folders :meth:`save_checkpoint_files` wrote into ``folder`` (checked before resuming)."""
        return (*self.run.weights.files(folder), "optimizer.pt")

    def load_optimizer(self, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        """Restore the optimizer state a checkpoint holds; a file that does not fit is a CheckpointError naming it."""
        from .checkpoint import load_state_file, restoring

        expected = tuple(self.optimizer_state_dict(optimizer))  # its own shape (layerwise ones differ)
        state = load_state_file(folder, "optimizer.pt", self.device, expect=expected)
        with restoring(folder, "optimizer.pt"):
            self.load_optimizer_state_dict(optimizer, state)

    def state_dict(self) -> dict[str, Any]:
        """Strategy state for checkpoints (the fp16 loss scale)."""
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def strategy_name(run: RunView) -> str:
    """``train.strategy``, with "auto" resolved: an enabled plugin's strategy, else "single"."""
    registry = run.registries["strategy"]
    name = run.config.train.strategy
    if name != "auto":
        registry.get(name)
        return name
    offered = {n: e.plugin for n, e in registry.entries.items() if not e.builtin}
    if len(offered) > 1:
        listed = ", ".join(f"{n} (plugin {p})" for n, p in sorted(offered.items()))
        raise ConfigError(f"train.strategy: enabled plugins offer several strategies ({listed}); "
                          "set train.strategy to one or disable the others")
    return next(iter(offered), "single")
