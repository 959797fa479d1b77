"""``deepspeed``: DeepSpeed ZeRO 0/1/2/3 (optimizer states, gradients, parameters partitioned over
processes), with optional CPU offload of the optimizer and of the parameters.

Enable it and launch with torchrun or the ``deepspeed`` launcher (gloo on CPU, nccl on GPU)::

    plugins = ["deepspeed"]         # train.strategy = "auto" then takes "deepspeed"

    [deepspeed]
    zero_stage = 3
    config = "ds_config.json"       # optional: a DeepSpeed JSON file, or an inline table

The DeepSpeed config's ``"auto"`` (or missing) values come from the run: batch sizes, gradient
accumulation, ``gradient_clipping`` (= ``train.max_grad_norm``, always set: DeepSpeed's own
default would clip at 1.0), bf16/fp16, and an ``optimizer`` section's lr, betas, eps and weight
decay. A value that contradicts the run is refused naming its key. The engine's optimizer (from
the registry, ``train.optim``) is used unless the config names its own ``optimizer``; the
engine's scheduler drives the learning rate (a config ``scheduler`` is refused).

N processes make the update of one process with N times the batch (the loss is normalized over
the global batch; DeepSpeed averages gradients; ``backward`` does not divide by the accumulation
steps again). Checkpoints hold DeepSpeed's own files (``deepspeed/``, partitioned optimizer
states, written by ``save_checkpoint``, restored by ``load_checkpoint``: resume is bit-exact) and
the full weights in the HF layout (gathered under ZeRO-3), so ``from_pretrained`` and
``load_best_model_at_end`` read them; the final model is consolidated the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from engine import ConfigError, MissingDependencyError, hookimpl, option
from engine.kit.distributed import DistributedStrategy, strategy_name

from . import dsconfig

TAG = "deepspeed"  # the checkpoint subfolder DeepSpeed writes its files into


@dataclass
class DeepSpeedOptions:
    """``[deepspeed]``: the DeepSpeed config and shortcuts for its most used keys."""

    config: str | dict[str, Any] | None = option(None, help=(
        "a DeepSpeed JSON file or an inline table; its \"auto\" values are filled from the run"))
    zero_stage: int | None = option(None, min=0, max=3, help=(
        "ZeRO stage (zero_optimization.stage); unset: the config's, else 2"))
    offload_optimizer: Literal["none", "cpu"] | None = option(None, help=(
        "zero_optimization.offload_optimizer.device (ZeRO 1-3); unset: the config's, else none"))
    offload_param: Literal["none", "cpu"] | None = option(None, help=(
        "zero_optimization.offload_param.device (ZeRO-3 only); unset: the config's, else none"))
    timeout: float = option(1800.0, min=1, help="seconds a collective may wait for the other processes")


def _world_size() -> int:
    from engine.kit.distributed import env_rank

    return env_rank("WORLD_SIZE") if "WORLD_SIZE" in os.environ else 1


def _quiet_deepspeed() -> None:
    # DeepSpeed logs its whole config and per-step notes at INFO; the engine logs progress itself
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # torch's deprecation of the collectives DeepSpeed calls, once per call site and process
    warnings.filterwarnings("ignore", category=FutureWarning, message=(
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"))


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def _initialized_as_in_one_process():
    """Inside the strategy's ``zero.Init``: a transformers model built from a config starts from the
    weights one process draws with the same seed, and no module is whole longer than its initialisation.

    Left to itself, ``from_config`` opens its own ``zero.Init`` in which the layers' constructors do
    not initialise, then initialises each module on rank 0: other draws of the random generator than
    one process makes (2 processes started 0.12 away). A class called directly (a config naming its
    architecture, a factory) initialised the empty partitions: torch's default init stayed, or it crashed.
    Here the constructors initialise each module whole, as in one process (``zero.Init`` then
    broadcasts rank 0's values and partitions them), and ``post_init``'s weight initialisation sees
    each module's parameters gathered, in one process's order, rank 0's result broadcast.
    ``from_pretrained`` keeps its own ZeRO-3 path (it builds without initialising, so ``init_weights``
    is not called, then initialises the weights the folder lacks gathered), which draws as one process."""
    import deepspeed
    from transformers import PreTrainedModel
    from transformers.modeling_utils import set_zero3_state

    from_config = PreTrainedModel.__dict__["_from_config"].__func__
    init_weights, initialize = PreTrainedModel.init_weights, PreTrainedModel._initialize_weights

    def from_config_in_this_init(cls, config, **kwargs):
        with set_zero3_state():  # the strategy's zero.Init is open: transformers opens none of its own
            return from_config(cls, config, **kwargs)

    def init_weights_gathered(self):  # post_init: the modules are built, and partitioned
        with _replaced(PreTrainedModel, "_initialize_weights", initialize_gathered):
            init_weights(self)

    def initialize_gathered(self, module, *args, **kwargs):
        if getattr(module, "_is_hf_initialized", False):
            return  # by a sub-model's post_init: not gathered again
        # _init_weights may also set its children's parameters (e.g. module.q_proj.weight)
        params = [*module.parameters(recurse=False),
                  *(param for child in module.children() for param in child.parameters(recurse=False))]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            initialize(self, module, *args, **kwargs)

    with _replaced(PreTrainedModel, "_from_config", classmethod(from_config_in_this_init)), \
            _replaced(PreTrainedModel, "init_weights", init_weights_gathered):
        yield


class DeepSpeedStrategy(DistributedStrategy):
    name = "deepspeed"
    # checkpoint-N/deepspeed/ (DeepSpeed's own files) beside the full weights: only deepspeed reads it
    checkpoint_format = "deepspeed"

    def __init__(self, run):
        self.options = run.config.section("deepspeed")
        super().__init__(run, timeout_s=self.options.timeout)
        # DeepSpeed owns precision: bf16 / fp16 become its bf16 / fp16 modes (config), not autocast
        self.scaler = None
        self._autocast_dtype = None
        self.ds_config = dsconfig.resolve(run, self.world_size)
        self.stage = dsconfig.stage_of(self.ds_config)
        self.engine: Any = None
        self._boundary = True  # the micro-batch being run ends the accumulation window
        self._restored_from: Path | None = None  # a checkpoint whose weights load_checkpoint restored
        self._hf_config: Any = None

    @property
    def resumes_other_world_sizes(self) -> bool:
        return self.stage == 0  # ZeRO 1-3 checkpoints hold one optimizer partition per process

    def setup(self) -> None:
        super().setup()
        _quiet_deepspeed()
        import deepspeed

        # DeepSpeed's communication layer wraps the group that now exists (and its timeout);
        # zero.Init reads the world size from it before deepspeed.initialize runs, and the
        # device from LOCAL_RANK, which only a launcher sets: one process without one is rank 0
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                                   timeout=self.timeout, verbose=False)

    def teardown(self) -> None:
        if self._hf_config is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            self._hf_config = None
        super().teardown()

    # ------------------------------------------------------------------ model and optimizer

    def model_init_context(self):
        if self.stage != 3:
            return contextlib.nullcontext()
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        # transformers then builds and loads (from_pretrained) partitioned weights itself; it holds
        # this object weakly, so the strategy keeps it for the run
        self._hf_config = HfDeepSpeedConfig(self.ds_config)
        # torch._dynamo checks torch.Tensor.__new__'s signature when first imported and refuses zero.Init's
        # replacement; building the model (transformers' modeling code) may be its first import, so it comes now
        importlib.import_module("torch._dynamo")
        context = contextlib.ExitStack()
        context.enter_context(deepspeed.zero.Init(config_dict_or_path=self.ds_config))
        context.enter_context(_initialized_as_in_one_process())
        return context

    def prepare_model(self, model):
        return model.to(self.device)  # wrapped with the optimizer in prepare_optimizer

    def prepare_optimizer(self, optimizer):
        import deepspeed

        own_optimizer = "optimizer" in self.ds_config
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.run.model, optimizer=None if own_optimizer else optimizer,
            model_parameters=[p for p in self.run.model.parameters() if p.requires_grad] if own_optimizer else None,
            config=self.ds_config, dist_init_required=False)
        self.run.wrapped_model = self.engine
        # the torch optimizer DeepSpeed steps: its param_groups carry the lr the scheduler sets
        return self.engine.basic_optimizer

    # ------------------------------------------------------------------ one step

    @contextlib.contextmanager
    def no_sync(self, model):
        # DeepSpeed's own no_sync refuses ZeRO 2/3; marking the micro-batch as not the window's
        # last makes every stage defer its reduction and step
        self._boundary = False
        try:
            yield
        finally:
            self._boundary = True

    def backward(self, loss):
        self.engine.set_gradient_accumulation_boundary(self._boundary)
        # the builtin step has already divided the loss over the window
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(self, optimizer, max_norm):
        return None  # DeepSpeed clips inside step (gradient_clipping = train.max_grad_norm)

    def optimizer_step(self, optimizer):
        clips = self.ds_config["gradient_clipping"] > 0
        measured = None
        if clips and not hasattr(self.engine.optimizer, "_global_grad_norm"):
            # plain ZeRO-0 (fp32, no DeepSpeed optimizer wrapper) clips but keeps no norm: measure it
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            measured = torch.nn.utils.get_total_norm(grads)
        self.engine.step()
        if not clips:
            return None
        return measured if measured is not None else self.engine.get_global_grad_norm()

    # ------------------------------------------------------------------ checkpoint I/O

    def _gathered(self, model):
        """Context in which ZeRO-3's partitioned parameters are whole (rank 0's edits kept)."""
        if self.stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)

    def model_state_dict(self, model):
        if self.stage != 3:
            return model.state_dict()
        import deepspeed

        # one module's parameters at a time, so no process holds the whole model at once
        gathered: dict[int, torch.Tensor] = {}
        for module in model.modules():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            with deepspeed.zero.GatheredParameters(params):
                if self.is_main_process:
                    for param in params:
                        gathered[id(param)] = param.detach().cpu().clone()
        if not self.is_main_process:
            return {}
        return {name: gathered.get(id(value), value) if isinstance(value, torch.nn.Parameter) else value
                for name, value in model.state_dict(keep_vars=True).items()}

    def load_model_weights(self, model, folder):
        folder = Path(folder)
        if self._restored_from == folder:  # load_optimizer restored these weights with the optimizer
            self._restored_from = None
            return
        with self._gathered(model):
            super().load_model_weights(model, folder)
        if self.engine is not None and hasattr(self.engine.optimizer, "refresh_fp32_params"):
            self.engine.optimizer.refresh_fp32_params()  # the optimizer's fp32 copy follows the weights

    def save_checkpoint_files(self, run, folder, what):
        from engine.kit.checkpoint import check_finite_weights, write_model

        model_state = self.model_state_dict(run.model)  # full weights: from_pretrained, load_best_model_at_end
        if self.is_main_process:
            check_finite_weights(run, model_state, what)
        self.engine.save_checkpoint(str(folder), tag=TAG, save_latest=False)
        if self.is_main_process:
            write_model(run, folder, model_state)

    def checkpoint_files(self, folder):
        from engine.kit.checkpoint import WEIGHTS, WEIGHTS_INDEX

        return (WEIGHTS_INDEX if (folder / WEIGHTS_INDEX).is_file() else WEIGHTS, TAG)

    def load_optimizer(self, optimizer, folder):
        from engine.kit.checkpoint import CheckpointError, restoring

        folder = Path(folder)
        with restoring(folder, TAG):
            loaded, _ = self.engine.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                                    load_lr_scheduler_states=False)
        if loaded is None:
            raise CheckpointError(f"checkpoint {folder}: DeepSpeed could not load {TAG}/")
        self._restored_from = folder


@hookimpl
def plugin_options():
    return DeepSpeedOptions


@hookimpl
def configure(run):
    if strategy_name(run) != "deepspeed":
        return
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:  # looked up, not imported: that takes seconds
        raise MissingDependencyError("package 'deepspeed' is needed for the deepspeed strategy: install it after "
                                     "torch with DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed")
    train = run.config.train
    if train.on_nonfinite == "skip":
        raise ConfigError("train.on_nonfinite = 'skip': DeepSpeed measures the gradient norm inside its "
                          "step, too late to skip the update; use on_nonfinite = 'stop'")
    dsconfig.resolve(run, _world_size())  # contradictions refused now, before anything loads


@hookimpl
def register_strategies(register):
    register("deepspeed", DeepSpeedStrategy)


@hookimpl
def trainer_argument_mappings():
    from .mappings import TRAINER_ARGUMENTS  # for engine migrate only: runs do not load it

    return TRAINER_ARGUMENTS


@hookimpl
def accelerate_mappings():
    from .mappings import ACCELERATE

    return ACCELERATE
