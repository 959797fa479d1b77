"""``fsdp``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and
optimizer state sharded over the processes.

Enable it and launch with torchrun (gloo on CPU, nccl on GPU)::

    plugins = ["fsdp"]         # train.strategy = "auto" then takes "fsdp"

    torchrun --nproc-per-node 2 -m engine train run.toml

Each transformer block (the model's ``_no_split_modules`` classes, e.g. ``LlamaDecoderLayer``,
or ``wrap_modules``) is sharded as one unit, then the root (embeddings, final norm, head). The
loss is normalized over the whole global batch, so N processes make the updates of one process
with N times the batch. Checkpoints hold either the full weights (HF layout) and a full
optimizer state (``state_dict_type = "full"``), or each process's shards written through
``torch.distributed.checkpoint`` (``"sharded"``: ``pytorch_model_fsdp_0/`` and ``optimizer_0/``,
as Trainer names them); both resume under another number of processes. The final model is
always the full weights, loadable with ``from_pretrained``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from engine import ConfigError, hookimpl, option
from engine.kit.distributed import DistributedStrategy

SHARDED_MODEL, SHARDED_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# full state dicts are gathered on the main process, in CPU memory
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class FSDPOptions:
    """``[fsdp]``: how the model is sharded and checkpointed."""

    wrap_modules: list[str] = option(default_factory=list, help=(
        "class names of the blocks sharded one by one (default: the model's _no_split_modules, "
        "e.g. LlamaDecoderLayer); the root is sharded last"))
    reshard_after_forward: bool = option(True, help=(
        "free each block's gathered parameters after its forward (ZeRO-3); false keeps them until "
        "backward (ZeRO-2 like: more memory, one all-gather less)"))
    cpu_offload: bool = option(False, help="keep parameter shards, gradients and optimizer state in CPU memory")
    param_dtype: Literal["", "float32", "bfloat16", "float16"] = option("", help=(
        "mixed precision: the dtype blocks compute in (MixedPrecisionPolicy.param_dtype); '' = the weights' dtype"))
    reduce_dtype: Literal["", "float32", "bfloat16", "float16"] = option("", help=(
        "mixed precision: the dtype gradients are reduced in; '' = param_dtype"))
    state_dict_type: Literal["full", "sharded"] = option("full", help=(
        "checkpoints: 'full' weights (HF layout) and optimizer state gathered on the main process, or "
        "'sharded' (torch.distributed.checkpoint, each process writes its shards)"))
    sharding: Literal["full", "hybrid"] = option("full", help=(
        "'full' shards over all processes; 'hybrid' shards within a node and replicates across nodes (GPU only)"))
    timeout: float = option(1800.0, min=1, help="seconds a collective may wait for the other processes")


class FSDPStrategy(DistributedStrategy):
    name = "fsdp"
    # full checkpoints key the optimizer state by parameter name, sharded ones are DCP folders;
    # either resumes under fsdp with any state_dict_type and any number of processes
    checkpoint_format = "fsdp"

    def __init__(self, run):
        self.options = run.config.section("fsdp")
        super().__init__(run, timeout_s=self.options.timeout)
        if self.options.sharding == "hybrid" and self.device.type != "cuda":
            # measured: on CPU the replicate dimension silently degenerates to full sharding
            raise ConfigError("fsdp.sharding = 'hybrid' needs CUDA devices (one node's GPUs shard, nodes "
                              "replicate); on CPU use sharding = 'full'")

    # ------------------------------------------------------------------ sharding

    def _mesh(self):
        if self.options.sharding == "full":
            return None
        from torch.distributed.device_mesh import init_device_mesh

        per_node = torch.cuda.device_count()
        if self.world_size % per_node:
            raise ConfigError(f"fsdp.sharding = 'hybrid': {self.world_size} processes are not whole nodes of "
                              f"{per_node} GPUs")
        return init_device_mesh("cuda", (self.world_size // per_node, per_node),
                                mesh_dim_names=("replicate", "shard"))

    def block_classes(self, model: torch.nn.Module) -> set[str]:
        """The class names sharded one by one: ``wrap_modules``, else the model's ``_no_split_modules``."""
        names = set(self.options.wrap_modules or getattr(model, "_no_split_modules", None) or ())
        present = {type(module).__name__ for module in model.modules()}
        unknown = names - present if self.options.wrap_modules else set()
        if unknown:
            raise ConfigError(f"fsdp.wrap_modules: {sorted(unknown)} are not module classes of "
                              f"{type(model).__name__}; it has {sorted(present)}")
        return names & present

    def prepare_model(self, model):
        options = self.options
        kwargs = {"reshard_after_forward": options.reshard_after_forward, "mesh": self._mesh(),
                  "offload_policy": CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if options.cpu_offload
                  else OffloadPolicy()}
        if options.param_dtype or options.reduce_dtype:
            param = DTYPES.get(options.param_dtype)
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param,
                                                       reduce_dtype=DTYPES.get(options.reduce_dtype, param))
        if not options.cpu_offload:
            model = model.to(self.device)
        blocks = self.block_classes(model)
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        return model

    @contextlib.contextmanager
    def _gradient_sync_off(self, model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(self, model):
        return self._gradient_sync_off(model)

    def clip_grad_norm(self, optimizer, max_norm):
        norm = super().clip_grad_norm(optimizer, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ------------------------------------------------------------------ checkpoints

    def model_state_dict(self, model):
        """Full weights on the main process (gathered shard by shard into CPU memory); {} on the others."""
        return get_model_state_dict(model, options=FULL)

    def optimizer_state_dict(self, optimizer):
        return get_optimizer_state_dict(self.run.model, optimizer, options=FULL)

    def save_checkpoint_files(self, run, folder, what):
        if self.options.state_dict_type == "full":
            return super().save_checkpoint_files(run, folder, what)
        from engine.kit.checkpoint import diverged

        model_state = get_model_state_dict(run.model)
        if not self._finite(model_state):
            raise diverged(run, f"weights hold nan or inf, so {what} was not saved")
        dcp.save(model_state, checkpoint_id=folder / SHARDED_MODEL)
        dcp.save(get_optimizer_state_dict(run.model, run.optimizer), checkpoint_id=folder / SHARDED_OPTIMIZER)

    def _finite(self, state) -> bool:
        """Every process's shards are finite (decided together: one host sync)."""
        local = [t.to_local() if isinstance(t, DTensor) else t for t in state.values()]
        floats = [t.detach() for t in local if t.is_floating_point() and t.numel()]
        finite = torch.stack([torch.stack(torch.aminmax(t)).float() for t in floats]).isfinite().all() \
            if floats else torch.tensor(True)
        return bool(self.reduce(finite.float(), "min"))

    def checkpoint_files(self, folder):
        if (folder / SHARDED_MODEL).is_dir():
            return (SHARDED_MODEL, SHARDED_OPTIMIZER)
        return super().checkpoint_files(folder)

    def load_model_weights(self, model, folder):
        from engine.kit.checkpoint import CheckpointError, read_weights, restoring

        if (folder / SHARDED_MODEL).is_dir():
            state = get_model_state_dict(model)
            with restoring(folder, SHARDED_MODEL):
                dcp.load(state, checkpoint_id=folder / SHARDED_MODEL)
            set_model_state_dict(model, state)
            return
        # every process reads the full weights and keeps its shards
        state = read_weights(model, folder)
        try:
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint {folder}: weights do not fit the model: {exc}") from None

    def load_optimizer(self, optimizer, folder):
        from engine.kit.checkpoint import load_state_file, restoring

        sharded = (folder / SHARDED_OPTIMIZER).is_dir()
        name = SHARDED_OPTIMIZER if sharded else "optimizer.pt"
        if sharded:
            state = get_optimizer_state_dict(self.run.model, optimizer)
            with restoring(folder, name):
                dcp.load(state, checkpoint_id=folder / name)
        else:
            state = load_state_file(folder, name, expect=("state", "param_groups"))
        with restoring(folder, name):
            set_optimizer_state_dict(self.run.model, optimizer, state,
                                     options=None if sharded else StateDictOptions(full_state_dict=True))


@hookimpl
def plugin_options():
    return FSDPOptions


@hookimpl
def register_strategies(register):
    register("fsdp", FSDPStrategy)


@hookimpl
def trainer_argument_mappings():
    from .mappings import TRAINER_ARGUMENTS  # for engine migrate only: runs do not load it

    return TRAINER_ARGUMENTS


@hookimpl
def accelerate_mappings():
    from .mappings import ACCELERATE

    return ACCELERATE
