"""``ddp``: PyTorch DistributedDataParallel, one model copy per process, gradients all-reduced.

Enable it and launch the processes with torchrun (gloo on CPU, nccl on GPU)::

    plugins = ["ddp"]          # train.strategy = "auto" then takes "ddp"

    torchrun --nproc-per-node 2 -m engine train run.toml
    torchrun --nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint host:29500 -m engine train run.toml

Each process trains on its share of every global batch (``per_device_train_batch_size`` rows);
the loss is normalized by the item count of the whole global batch, so N processes make the same
update as one process with N times the batch. During gradient accumulation only the window's
last micro-batch synchronises gradients (``no_sync``). Only the main process logs, writes metrics
and checkpoints and holds the output_dir lock; checkpoints hold the full weights and optimizer
state, so a run resumes under any number of processes with the same global batch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch.nn.parallel import DistributedDataParallel

from engine import hookimpl, option
from engine.kit.distributed import DistributedStrategy


# torch 2.13 renamed broadcast_buffers (kept for older torch)
_SYNC_BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in \
    inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers"


@dataclass
class DDPOptions:
    """``[ddp]``: DistributedDataParallel's own arguments, and the collectives' timeout."""

    find_unused_parameters: bool = option(False, help=(
        "look for parameters that got no gradient each step (needed when some forward paths skip modules)"))
    bucket_cap_mb: float = option(25.0, min=1e-3, help="gradient bucket size for all-reduce, in MiB")
    broadcast_buffers: bool = option(True, help="send rank 0's buffers to every process at each forward")
    static_graph: bool = option(False, help="the graph is the same every step (lets DDP optimise its hooks)")
    gradient_as_bucket_view: bool = option(False, help="gradients as views into the buckets (saves memory)")
    timeout: float = option(1800.0, min=1, help=(
        "seconds a collective may wait for the other processes (TrainingArguments.ddp_timeout)"))


class DDPStrategy(DistributedStrategy):
    name = "ddp"

    def __init__(self, run):
        self.options = run.config.section("ddp")
        super().__init__(run, timeout_s=self.options.timeout)

    def prepare_model(self, model):
        options = self.options
        model = model.to(self.device)
        return DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=options.find_unused_parameters, bucket_cap_mb=options.bucket_cap_mb,
            static_graph=options.static_graph, gradient_as_bucket_view=options.gradient_as_bucket_view,
            **{_SYNC_BUFFERS: options.broadcast_buffers})

    def no_sync(self, model):
        return model.no_sync()


@hookimpl
def plugin_options():
    return DDPOptions


@hookimpl
def register_strategies(register):
    register("ddp", DDPStrategy)


@hookimpl
def trainer_argument_mappings():
    from .mappings import TRAINER_ARGUMENTS  # for engine migrate only: runs do not load it

    return TRAINER_ARGUMENTS
