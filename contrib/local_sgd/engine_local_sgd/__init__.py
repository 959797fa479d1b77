"""``local_sgd``: local SGD (Lin et al. 2018, *Don't Use Large Mini-Batches, Use Local SGD*).

Each process steps its own optimizer on its own share of every global batch, without
synchronising gradients; every ``sync_every`` optimizer steps the processes' parameters are
replaced by their mean (one all-reduce). With ``sync_every = 1`` and SGD (with or without
momentum, no gradient clipping) the updates equal synchronous data parallel training: averaging
after each linear update is averaging the gradients. ``warmup_steps`` averages after every step
first (post-local SGD, from the same paper).

Evaluation, checkpoints and the final model see the processes' mean parameters (the
evaluation weights, as Schedule-Free's); training continues from each process's own, which
checkpoints keep too (``local_parameters[_<rank>].pt`` and ``optimizer_<rank>.pt`` beside rank
0's ``optimizer.pt``), so a resume under the same number of processes is exact.

Launch with torchrun (gloo on CPU, nccl on GPU)::

    plugins = ["local_sgd"]    # train.strategy = "auto" then takes "local_sgd"

    [local_sgd]
    sync_every = 4

    torchrun --nproc-per-node 2 -m engine train run.toml
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import ConfigError, hookimpl, option
from engine.kit.checkpoint import load_state_file, restoring
from engine.kit.distributed import DistributedStrategy, strategy_name

NAME = "local_sgd"
LOCAL_PARAMETERS = "local_parameters"


def rank_file(stem: str, rank: int) -> str:
    """A process's own checkpoint file, named as the engine names its RNG files (rank 0 unsuffixed)."""
    return f"{stem}.pt" if rank == 0 else f"{stem}_{rank}.pt"


@dataclass
class LocalSGDOptions:
    """``[local_sgd]``: how often the processes' parameters are averaged."""

    sync_every: int = option(4, min=1, help=(
        "average the parameters over the processes every this many optimizer steps (1: synchronous "
        "data parallel for SGD)"))
    warmup_steps: int = option(0, min=0, help=(
        "post-local SGD: average after every step up to this step, then every sync_every steps"))
    timeout: float = option(1800.0, min=1, help="seconds a collective may wait for the other processes")


class LocalSGDStrategy(DistributedStrategy):
    name = NAME
    # each process's own parameters and optimizer state: resumed by as many processes only
    resumes_other_world_sizes = False

    def __init__(self, run):
        self.options = run.config.section(NAME)
        super().__init__(run, timeout_s=self.options.timeout)
        self._own: list[torch.Tensor] | None = None  # this process's parameters while the mean is in place

    def prepare_model(self, model):
        model = model.to(self.device)
        with torch.no_grad():  # every process starts from rank 0's parameters, as DDP does
            for parameter in model.parameters():
                dist.broadcast(parameter, src=0)
        return model

    # ------------------------------------------------------------------ averaging

    def is_sync_step(self, step: int) -> bool:
        return step <= self.options.warmup_steps or step % self.options.sync_every == 0

    @torch.no_grad()
    def average_parameters(self, model: torch.nn.Module) -> None:
        """Replace every process's trainable parameters by their mean: one all-reduce per dtype."""
        parameters = _trainable(model)
        for dtype in dict.fromkeys(p.dtype for p in parameters):  # the same order on every process
            group = [p for p in parameters if p.dtype == dtype]
            flat = torch.cat([p.reshape(-1) for p in group])
            dist.all_reduce(flat)
            flat /= self.world_size
            for parameter, mean in zip(group, flat.split([p.numel() for p in group])):
                parameter.copy_(mean.view_as(parameter))

    def use_mean(self, model: torch.nn.Module) -> None:
        """Evaluation mode: the processes' mean parameters; each keeps its own aside."""
        if self._own is None:
            self._own = [p.detach().clone() for p in _trainable(model)]
            self.average_parameters(model)

    @torch.no_grad()
    def use_own(self, model: torch.nn.Module) -> None:
        """Training mode: each process's own parameters again."""
        if self._own is not None:
            for parameter, own in zip(_trainable(model), self._own):
                parameter.copy_(own)
            self._own = None

    def own_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        names = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
        return dict(zip(names, self._own if self._own is not None else _trainable(model)))

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint_files(self, run, folder, what):
        super().save_checkpoint_files(run, folder, what)  # the mean weights, rank 0's optimizer.pt
        if self.rank:
            torch.save(self.optimizer_state_dict(run.optimizer), folder / rank_file("optimizer", self.rank))
        torch.save(self.own_parameters(run.model), folder / rank_file(LOCAL_PARAMETERS, self.rank))

    def checkpoint_files(self, folder):
        ranks = range(self.world_size)
        return (*super().checkpoint_files(folder), *(rank_file("optimizer", r) for r in ranks if r),
                *(rank_file(LOCAL_PARAMETERS, r) for r in ranks))

    def load_optimizer(self, optimizer, folder):
        name = rank_file("optimizer", self.rank)
        expected = tuple(self.optimizer_state_dict(optimizer))
        state = load_state_file(folder, name, self.device, expect=expected)
        with restoring(folder, name):
            self.load_optimizer_state_dict(optimizer, state)

    @torch.no_grad()
    def load_model_weights(self, model, folder):
        """The folder's (mean) weights; while training (a resume), then this process's own parameters."""
        super().load_model_weights(model, folder)
        name = rank_file(LOCAL_PARAMETERS, self.rank)
        if self._own is not None or not (folder / name).is_file():
            return
        own = load_state_file(folder, name, self.device)
        with restoring(folder, name):
            for parameter_name, parameter in self.own_parameters(model).items():
                parameter.copy_(own[parameter_name])


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def _local_sgd(run) -> LocalSGDStrategy | None:
    return run.strategy if isinstance(run.strategy, LocalSGDStrategy) else None


@hookimpl
def plugin_options():
    return LocalSGDOptions


@hookimpl
def register_strategies(register):
    register(NAME, LocalSGDStrategy)


@hookimpl
def configure(run):
    options, max_steps = run.config.section(NAME), run.config.train.max_steps
    if 0 < max_steps < options.sync_every and options.warmup_steps < max_steps:
        raise ConfigError(f"local_sgd.sync_every = {options.sync_every} is more than train.max_steps = {max_steps}: "
                          "the processes would train apart and be averaged only at the end; lower "
                          "local_sgd.sync_every (1 averages after every step)")


@hookimpl
def plan_lines(run):
    strategy = strategy_name(run)
    if strategy != NAME:
        return [f"inactive: the run's strategy is {strategy!r}"]
    options = run.config.section(NAME)
    warmup = f", after every step up to step {options.warmup_steps}" if options.warmup_steps else ""
    return [f"each process steps its own optimizer; parameters averaged over the processes every "
            f"{options.sync_every} steps{warmup}; evaluation and checkpoints see their mean"]


@hookimpl(tryfirst=True)  # the average is part of the step: every other plugin sees the step's parameters
def on_step_end(run):
    strategy = _local_sgd(run)
    if strategy is not None and strategy.is_sync_step(run.state.global_step):
        strategy.average_parameters(run.model)


@hookimpl
def on_eval_mode(run):
    strategy = _local_sgd(run)
    if strategy is not None:
        strategy.use_mean(run.model)


@hookimpl
def on_train_mode(run):
    strategy = _local_sgd(run)
    if strategy is not None:
        strategy.use_own(run.model)
