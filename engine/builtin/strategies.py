"""The single-device strategy and the choice of strategy (``train.strategy``)."""

from __future__ import annotations

from engine import hookimpl
from engine.errors import ConfigError
from engine.rundir import env_rank
from engine.strategy import Strategy, strategy_name


@hookimpl
def register_strategies(register):
    register("single", Strategy)


@hookimpl
def configure(run):
    check_launcher(strategy_name(run))


def check_launcher(name: str) -> None:
    """A launcher's WORLD_SIZE > 1 needs a distributed strategy, and a distributed strategy a launcher:
    otherwise each process would train alone, with no word."""
    import os

    import torch.distributed

    world = env_rank("WORLD_SIZE") if "WORLD_SIZE" in os.environ else 1
    if world <= 1:
        return
    if name == "single":
        raise ConfigError(f"WORLD_SIZE={world}: a launcher started {world} processes, but train.strategy 'single' "
                          "trains in one; enable a distributed strategy (plugins ddp, fsdp or deepspeed) or start "
                          "one process")
    if "MASTER_ADDR" not in os.environ and not torch.distributed.is_initialized():
        raise ConfigError(f"WORLD_SIZE={world} is set but no launcher started this process (MASTER_ADDR is not set): "
                          f"start it with torchrun --nproc-per-node {world} (or deepspeed), or unset WORLD_SIZE")


@hookimpl(trylast=True)
def create_strategy(run):
    return run.registries["strategy"].get(strategy_name(run)).factory(run)
