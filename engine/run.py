"""A composed run: config + plugins + the objects the loop trains.

:class:`Run` is the Python API (like ``transformers.Trainer``) and the object every hook
receives. Constructing it composes and validates the run (cheap: no model, no data);
:meth:`Run.setup` builds strategy, tokenizer, data, model, optimizer and scheduler through the
hooks; :meth:`Run.train` / :meth:`Run.evaluate` run the loop in ``engine/loop.py``.
"""

from __future__ import annotations

import logging
import math
import random
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from . import config as cfg
from .catalogue import ADAPTER_PLUGIN
from .errors import ConfigError
from .logs import quiet_known_noise, setup_logging
from .discovery import command_hooks
from .plugins import PLUGINS_ENV, EnvironmentPlugins, IsolatedHooks, PluginManager, builtin_specs
from .rundir import env_rank
from .state import Control, Datasets, PredictionOutput, TrainState
from .util import is_callback, is_peft_model

logger = logging.getLogger("engine")


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def _plugin_objects(plugins: Any) -> tuple[dict[str, Any], list[Any]]:
    """The plugin objects by name, and the TrainerCallbacks among ``plugins`` (run by their adapter)."""
    if plugins is None:
        return {}, []
    items = plugins.items() if isinstance(plugins, dict) else [
        (getattr(p, "name", None) or getattr(p, "__name__", None) or type(p).__name__, p) for p in plugins]
    objects = {name: plugin for name, plugin in items if not is_callback(plugin)}
    return objects, [plugin for _, plugin in items if is_callback(plugin)]


class Run:
    """A training run composed from a config and plugins.

    ``config`` is a run-file path, a mapping shaped like a run file, or None (all defaults).
    ``overrides`` are ``"section.key=value"`` strings and ``plugin_edits`` ``"+name,-name"``
    strings, as on the command line. ``model``, ``tokenizer``, ``train_dataset``,
    ``eval_dataset`` (a dataset or a dict of them), ``data_collator`` and ``compute_metrics``
    replace what the config would build, as in ``transformers.Trainer``. ``plugins`` adds
    plugin objects (modules or instances with ``@hookimpl`` functions) without entry points:
    a list (named by their ``name`` / ``__name__``) or a {name: plugin} dict.

    Trainer's other constructor arguments: ``processing_class`` (the tokenizer's newer name),
    ``model_init`` (called for a fresh model when the run sets up), ``callbacks``
    (``transformers.TrainerCallback`` instances or classes, also accepted in ``plugins``; run by
    :mod:`engine.builtin.callbacks`), ``compute_loss_func(outputs, labels, num_items_in_batch)``
    and ``preprocess_logits_for_metrics(logits, labels)``, ``optimizers=(optimizer, scheduler)``
    and ``optimizer_cls_and_kwargs=(cls, kwargs)`` (instead of ``train.optim``; a scheduler of
    None is built from ``[train]``).
    """

    def __init__(
        self,
        config: str | Path | dict[str, Any] | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        compute_metrics: Callable[[Any], dict[str, float]] | None = None,
        plugins: Any = None,
        overrides: list[str] = (),
        plugin_edits: list[str] = (),
        callbacks: list[Any] | None = None,
        processing_class: Any = None,
        model_init: Callable[..., torch.nn.Module] | None = None,
        compute_loss_func: Callable[..., torch.Tensor] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        optimizers: tuple[Any, Any] | None = None,
        optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None,
    ):
        self.arguments = {name: value for name, value in locals().items() if name != "self"}  # a search's trials
        quiet_known_noise()  # before the plugins (and the libraries they import) load
        if isinstance(config, (str, Path)):
            raw = cfg.read_run_file(config)
        elif config is None or isinstance(config, dict):
            raw = dict(config or {})
        else:  # e.g. a TrainingArguments, converted as `engine migrate` converts it
            raw = command_hooks().convert_run_config(config=config)
            if raw is None:
                raise ConfigError(f"Run(config): expected a run file, a mapping or a TrainingArguments, got "
                                  f"{type(config).__name__}")
        environment = EnvironmentPlugins.read()
        in_config = cfg.enabled_plugins(raw)
        raw, left_out = environment.exclude(cfg.apply_overrides(raw, overrides, [*environment.edits(), *plugin_edits],
                                                                     builtin_specs()))
        objects, given_callbacks = _plugin_objects(plugins)
        enabled = cfg.enabled_plugins(raw)
        raw["plugins"] = enabled + [name for name in objects if name not in enabled]
        origins = {name: "Run(plugins=...)" if name in objects else "the run config" if name in in_config
                   else PLUGINS_ENV if name in environment.added else "--plugins" for name in raw["plugins"]}
        if is_peft_model(model) and ADAPTER_PLUGIN not in raw["plugins"]:
            # its checkpoints hold the adapter only: the plugin that saves and loads them comes with it
            raw["plugins"].append(ADAPTER_PLUGIN)
            origins[ADAPTER_PLUGIN] = "Run(model=<a peft model>)"
        self.plugin_manager = PluginManager(raw["plugins"], objects, origins=origins, excluded=environment.excluded,
                                            required=cfg.required_plugins(raw))
        self.plugin_manager.add_argument_plugins({
            "callbacks": [*(callbacks or ()), *given_callbacks], "compute_loss_func": compute_loss_func,
            "optimizers": optimizers, "optimizer_cls_and_kwargs": optimizer_cls_and_kwargs,
            "optim_named": "optim" in (raw.get("train") or {})})
        self.hook = self.plugin_manager.hook
        self.isolated_hooks = IsolatedHooks(self)  # the logging hooks and on_checkpoint_saved
        self.registries = self.plugin_manager.registries
        self.hook.check_raw_config(raw=raw)  # e.g. a TrainingArguments name in [train]: where it goes
        self.plugin_manager.check_blocked_keys(raw.get("train") or {})
        self.config = cfg.compose(raw, self.plugin_manager.option_schemas())
        _resolve_defaults(self.config.train)
        _check_values(self.config.train)
        _check_resumable(self)
        # levels for what configure logs; setup() sets them again from the strategy's ranks
        setup_logging(self.config.train, env_rank("RANK"), env_rank("LOCAL_RANK"))
        if left_out:
            logger.info("%s excludes %s: not loaded in this run", PLUGINS_ENV, ", ".join(map(repr, left_out)))

        self.state = TrainState()
        self.control = Control()
        if model is not None and model_init is not None:
            raise ConfigError("Run: pass model or model_init, not both")
        if tokenizer is not None and processing_class is not None and tokenizer is not processing_class:
            raise ConfigError("Run: tokenizer and processing_class are the same argument (processing_class is "
                              "Trainer's newer name); pass one")
        self.model = model  # the module as built and patched (saved, inspected)
        self.model_init = model_init
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.wrapped_model: torch.nn.Module | None = None  # what the strategy returned (forward)
        self.tokenizer = tokenizer if tokenizer is not None else processing_class
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.data_collator = data_collator
        self.compute_metrics = compute_metrics
        self.compute_metrics_key = "compute_metrics"  # where it came from, for errors it raises
        self.strategy: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.train_loader: torch.utils.data.DataLoader | None = None
        self.num_training_steps = 0
        self.label_shift = False
        self.label_names: list[str] = []  # the batch keys evaluation returns as label_ids
        self.undo_patches: list[Callable[[], None]] = []
        self.run_id: str | None = None  # set when training claims output_dir (engine.rundir)
        self.is_setup = False
        self._task: str | None = None
        # attributes plugins set in configure before 0.2, now hooks; honoured with a warning for one release
        self.weights: Any = None  # -> checkpoint_weights
        self.model_load_kwargs: dict[str, Any] = {}  # -> model_load_kwargs
        self.plan_notes: list[str] = []  # -> plan_lines
        self.hook.configure(run=self)
        answered = self.hook.checkpoint_weights(run=self)  # which weights checkpoints and the final model hold
        _warn_set_attributes(self)
        self.weights = self.weights if self.weights is not None else answered

    # ------------------------------------------------------------------ setup

    @property
    def task(self) -> str:
        """What the model learns, as the ``resolve_task`` hook says (the task builtin: ``train.task``, else
        what the given model or the model config's ``architectures`` say, else ``"causal-lm"``)."""
        if self._task is None:
            self._task = self.hook.resolve_task(run=self)
        return self._task

    @property
    def output_dir(self) -> Path:
        return Path(self.config.train.output_dir)

    def setup_strategy(self) -> None:
        """Create the strategy and set it up (the process group, if any). Idempotent; cheap."""
        if self.strategy is None:
            self.strategy = self.hook.create_strategy(run=self)
            self.strategy.setup()
            setup_logging(self.config.train, self.strategy.rank, self.strategy.local_rank)

    def setup(self) -> None:
        """Build everything the loop needs, as a sequence of hook calls (engine/hookspecs.py). Idempotent."""
        if self.is_setup:
            return
        from .loss import shifts_labels

        train = self.config.train
        self.setup_strategy()
        set_seed(train.seed)
        _set_determinism(train)
        if self.model is None and self.model_init is not None:
            self.model = _call_model_init(self.model_init)
        self.hook.on_build_start(run=self)  # refusals the configs show, before the tokenizer, data or weights load
        if self.tokenizer is None:
            self.tokenizer = self.hook.create_tokenizer(run=self, checkpoint=None)
        self._build_datasets()
        if self.compute_metrics is None and train.compute_metrics:
            from .util import load_callable

            self.compute_metrics = load_callable(train.compute_metrics, "train.compute_metrics")
            self.compute_metrics_key = "train.compute_metrics"
        if self.model is None:
            with self.strategy.model_init_context():
                self.model = self.hook.create_model(run=self)
        self.hook.on_model_built(run=self)
        model_config = getattr(self.model, "config", None)
        if model_config is not None and hasattr(model_config, "use_cache"):  # as Trainer sets it
            model_config.use_cache = train.use_cache
        if self.data_collator is None:
            self.data_collator = self.hook.create_collator(run=self)
        self.label_shift = shifts_labels(self.model)
        if train.label_names is not None:
            self.label_names = list(train.label_names)
        else:  # Trainer's default; a module without label arguments: 'labels', which the engine's loss reads
            from transformers.utils import find_labels

            self.label_names = find_labels(type(self.model)) or ["labels"]
        self.hook.on_build_end(run=self)  # tokenizer, data, model and collator fit together

        self.undo_patches = [undo for undo in self.hook.patch_model(run=self, model=self.model) if undo]
        try:
            self._prepare()
        except BaseException:
            self.remove_patches()
            raise
        self.is_setup = True

    def _prepare(self) -> None:
        """Wrap the patched model, make the train loader, optimizer and scheduler."""
        self.wrapped_model = self.strategy.prepare_model(self.model)
        self.prepare_training()

    def prepare_training(self) -> None:
        """The train loader, the step count, the optimizer and the scheduler, from the config as it is now
        (made again when train.auto_find_batch_size changed the batch size)."""
        self.train_loader = self.hook.create_train_loader(run=self)
        self.num_training_steps = self._count_training_steps()
        optimizer = self.hook.create_optimizer(run=self)
        self.optimizer = self.strategy.prepare_optimizer(optimizer)
        self.scheduler = self.hook.create_scheduler(run=self, optimizer=self.optimizer)

    def remove_patches(self) -> None:
        """Undo what ``patch_model`` did, newest first (idempotent): the model is left as it was built."""
        while self.undo_patches:
            self.undo_patches.pop()()

    def _build_datasets(self) -> None:
        """The train and eval data: as given to Run, else from ``create_datasets``; made examples by
        ``prepare_dataset``."""
        if self.train_dataset is None:
            built = self.hook.create_datasets(run=self)
            if not isinstance(built, Datasets):
                raise ConfigError(f"create_datasets returned a {type(built).__name__}, expected engine.Datasets")
            self.train_dataset = self._prepared(built.train, "train dataset")
            self.eval_dataset = self.eval_dataset if self.eval_dataset is not None else built.eval
            self.data_collator = self.data_collator or built.collator
        else:
            self.train_dataset = self._prepared(self.train_dataset, "train_dataset")
        self.eval_dataset = self._prepared(self.eval_dataset, "eval_dataset")

    @property
    def uses_builtin_loss(self) -> bool:
        """No enabled plugin answers ``compute_loss`` (wrappers around the builtin aside)."""
        return not self.plugin_manager.plugins_answering("compute_loss")

    def _count_training_steps(self) -> int:
        train = self.config.train
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            self.state.steps_per_epoch = 0
            return train.max_steps
        if len(self.train_loader) == 0:
            raise ConfigError("train.per_device_train_batch_size: larger than the dataset with "
                              "dataloader_drop_last = true; no batch left")
        self.state.steps_per_epoch = math.ceil(len(self.train_loader) / train.gradient_accumulation_steps)
        if train.max_steps > 0:
            return train.max_steps
        steps = train.num_train_epochs * self.state.steps_per_epoch
        if steps >= 2**53:  # beyond a float's exact integers (1e308 epochs: inf)
            raise ConfigError(f"train.num_train_epochs: {train.num_train_epochs:g} epochs of {self.state.steps_per_epoch} "
                              "steps are more steps than any run takes; lower it, or set train.max_steps")
        return math.ceil(steps)

    @property
    def num_warmup_steps(self) -> int:
        train = self.config.train
        if train.warmup_steps > 0:
            return train.warmup_steps
        return math.ceil(train.warmup_ratio * self.num_training_steps)

    # ------------------------------------------------------------------ running

    def train(self) -> dict[str, float]:
        """Set up (if needed), train, and return the final metrics."""
        from .loop import train

        return train(self)

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate on ``eval_dataset`` (default: the run's eval data) and return the metrics."""
        self.setup()
        return self.hook.evaluate(run=self, dataset=self._prepared(eval_dataset, "eval_dataset"),
                                  prefix=metric_key_prefix, report=True, in_training=False)

    def predict(self, dataset: Any, metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (logits), label ids and metrics over ``dataset``, like ``Trainer.predict``."""
        self.setup()
        return self.hook.predict(run=self, dataset=self._prepared(dataset, "dataset"), prefix=metric_key_prefix)

    def _prepared(self, dataset: Any, key: str) -> Any:
        """``dataset`` made examples as the run's data is (``prepare_dataset``; as it is where none answers)."""
        if dataset is None:
            return None
        prepared = self.hook.prepare_dataset(run=self, dataset=dataset, key=key)
        return dataset if prepared is None else prepared

    def hyperparameter_search(self, hp_space: Callable[[Any], dict[str, Any]] | None = None,
                              compute_objective: Callable[[dict[str, float]], Any] | None = None, n_trials: int = 20,
                              direction: str | list[str] = "minimize", backend: str | None = None,
                              hp_name: Callable[[Any], str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.hyperparameter_search``: each trial a run in ``output_dir/run-<n>``; returns ``BestRun`` (a list
        for several directions), through the tooling's ``hyperparameter_search`` hook (engine/tooling/search.py)."""
        return command_hooks().hyperparameter_search(
            run=self, hp_space=hp_space, compute_objective=compute_objective, n_trials=n_trials, direction=direction,
            backend=backend, hp_name=hp_name, kwargs=kwargs)

    def plan(self) -> str:
        """The composed run as text: plugins, hook call order, the full config."""
        from .plan import render_plan

        return render_plan(self)


def _call_model_init(model_init: Callable[..., Any]) -> torch.nn.Module:
    """``model_init()`` (or ``model_init(None)`` for one that takes a trial, as Trainer calls it)."""
    import inspect

    from .util import call_user

    name = getattr(model_init, "__qualname__", type(model_init).__name__)
    takes_trial = len(inspect.signature(model_init).parameters) == 1
    model = call_user("model_init", name, model_init, *([None] if takes_trial else []))
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model_init: {name} returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def _set_determinism(train: cfg.TrainConfig) -> None:
    """``full_determinism`` and ``tf32``, process-wide as Trainer sets them."""
    if train.full_determinism:
        import os

        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"  # deterministic cuBLAS needs it
        os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if train.tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = train.tf32
        torch.backends.cudnn.allow_tf32 = train.tf32


def _warn_set_attributes(run: Run) -> None:
    hooks = {"weights": "checkpoint_weights", "model_load_kwargs": "model_load_kwargs", "plan_notes": "plan_lines"}
    for attribute, hook in hooks.items():
        if getattr(run, attribute):
            warnings.warn(f"a plugin set run.{attribute} in configure: answer the {hook} hook instead (engine/hookspecs.py); "
                          "the attribute is honoured until the next release", DeprecationWarning, stacklevel=2)


def _resolve_defaults(train: cfg.TrainConfig) -> None:
    """Defaults of the kernel's keys that depend on their values, as TrainingArguments resolves them (the
    builtins resolve their own keys in ``configure``)."""
    if isinstance(train.include_num_input_tokens_seen, bool):  # as TrainingArguments reads a bool
        train.include_num_input_tokens_seen = "all" if train.include_num_input_tokens_seen else "no"


def _check_values(train: cfg.TrainConfig) -> None:
    """Checks across the kernel's keys (each key's own range is declared with its option; the builtins check
    theirs in ``configure``)."""
    if train.max_steps <= 0 and train.num_train_epochs <= 0:
        raise ConfigError("train.max_steps / train.num_train_epochs: set max_steps > 0 or num_train_epochs > 0")
    if train.bf16 and train.fp16:
        raise ConfigError("train.bf16 and train.fp16 are both true; pick one")


def _check_resumable(run: Run) -> None:
    """A run that resumes needs a plugin that restores checkpoints: without one (its plugins block the
    builtin that does) nothing would, and training would silently start over."""
    spec = run.config.train.resume_from_checkpoint
    if spec is not None and spec is not False and not run.hook.restore_checkpoint.get_hookimpls():
        raise ConfigError(f"train.resume_from_checkpoint = {spec!r}: no plugin of this run restores checkpoints (the "
                          "restore_checkpoint hook: its plugins block the builtin that does); remove the block, or "
                          "leave train.resume_from_checkpoint unset")
