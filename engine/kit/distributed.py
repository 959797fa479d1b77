"""What a strategy plugin builds on: the strategy interface and the launcher's ranks.

Subclass :class:`DistributedStrategy` (process group, reductions, barriers, broadcasts) and
override what differs (wrapping, backward, checkpoint I/O); register it with the
``register_strategies`` hook. :func:`strategy_name` is the run's strategy with ``"auto"``
resolved; :func:`env_rank` and :func:`is_main_process` read the launcher's environment before
the strategy is set up.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Any

import torch

from ..rundir import env_rank, is_main_process
from ..strategy import Strategy, strategy_name

if TYPE_CHECKING:
    from ..state import RunView

__all__ = ["DistributedStrategy", "Strategy", "strategy_name", "env_rank", "is_main_process"]


class DistributedStrategy(Strategy):
    """Processes started by a launcher (``torchrun``, ``deepspeed``), one ``torch.distributed`` group.

    Ranks come from the standard environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...);
    without a launcher it is one process (a group of one), so a run and its checkpoints also work
    there. The group is gloo on CPU, nccl on GPU, with ``timeout_s`` on every collective, so a
    process that died never leaves the others waiting forever. A group that already exists (a
    notebook, a test driver) is used and left as it was.
    """

    name = "distributed"

    def __init__(self, run: RunView, timeout_s: float = 1800.0):
        self.world_size = env_rank("WORLD_SIZE") if "WORLD_SIZE" in os.environ else 1
        self.rank = env_rank("RANK")
        self.local_rank = env_rank("LOCAL_RANK")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.owns_group = False
        super().__init__(run)

    def setup(self) -> None:
        import torch.distributed as dist

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=self.timeout, rank=self.rank, world_size=self.world_size)
        else:  # no launcher: a group of one, in memory
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout)
        self.owns_group = True

    def teardown(self) -> None:
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    _OPS = {"sum": "SUM", "mean": "SUM", "min": "MIN", "max": "MAX"}

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        import torch.distributed as dist

        reduced = tensor.detach().to(self.device, copy=True)  # nccl reduces device tensors only
        dist.all_reduce(reduced, op=getattr(dist.ReduceOp, self._OPS[op]))
        return (reduced / self.world_size if op == "mean" else reduced).to(tensor.device)

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather_object(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered
