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
from pathlib import Path
from typing import Any, Callable

import torch

from . import config as cfg
from .checkpoint import ModelWeights, check_resume_spec
from .errors import ConfigError
from .logs import quiet_known_noise, setup_logging
from .plugins import PLUGINS_ENV, EnvironmentPlugins, IsolatedHooks, PluginManager
from .rundir import env_rank
from .state import Control, EpochSampler, PredictionOutput, TrainState
from .trainer_args import check_train_keys
from .util import is_peft_model

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
    from .builtin.callbacks import is_callback

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
        quiet_known_noise()  # before the plugins (and the libraries they import) load
        if isinstance(config, (str, Path)):
            raw = cfg.read_run_file(config)
        else:
            raw = dict(config or {})
        environment = EnvironmentPlugins.read()
        in_config = cfg.enabled_plugins(raw)
        raw, left_out = environment.exclude(cfg.apply_overrides(raw, overrides, [*environment.edits(), *plugin_edits]))
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
        _register_trainer_arguments(self.plugin_manager, [*(callbacks or ()), *given_callbacks], compute_loss_func)
        if optimizers is not None or optimizer_cls_and_kwargs is not None:
            from .builtin.optimizers import GIVEN, GivenOptimizer

            optim_named = "optim" in (raw.get("train") or {})
            self.plugin_manager.pm.register(GivenOptimizer(optimizers, optimizer_cls_and_kwargs, optim_named),
                                            name=GIVEN)
        self.hook = self.plugin_manager.hook
        self.isolated_hooks = IsolatedHooks(self)  # the logging hooks and on_checkpoint_saved
        self.registries = self.plugin_manager.registries
        check_train_keys(raw.get("train"))
        self.config = cfg.compose(raw, self.plugin_manager.option_schemas())
        _resolve_defaults(self.config.train)
        _check_values(self.config.train)
        check_resume_spec(self.config)
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
        # which weights checkpoints and the final model hold (a plugin may narrow it in configure)
        self.weights = ModelWeights()
        # from_pretrained keywords for a train.model folder, set by plugins in configure
        # (peft's quantization_config: the base loads quantized, never at full size first)
        self.model_load_kwargs: dict[str, Any] = {}
        # lines a plugin adds in configure for `engine plan` (what it will do to the model)
        self.plan_notes: list[str] = []
        self.run_id: str | None = None  # set when training claims output_dir (engine.rundir)
        self.is_setup = False
        self._task: str | None = None
        self._model_given = model is not None
        if self.config.train.task or model is not None:  # else the model's config says it, read in setup
            from .tasks import configure

            configure(self.config.train, self.task)
        self.hook.configure(run=self)

    # ------------------------------------------------------------------ setup

    @property
    def task(self) -> str:
        """What the model learns (engine/tasks.py): ``train.task``, else what the given model or the
        model config's ``architectures`` say, else ``"causal-lm"``."""
        if self._task is None:
            from .models import model_config
            from .tasks import resolve_task

            train = self.config.train
            config = model_config(train) if self.model is None and not train.task else None
            self._task = resolve_task(train, self.model, config)
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
        """Build everything the loop needs, through the hooks. Idempotent."""
        if self.is_setup:
            return
        from . import data as data_mod
        from . import tasks
        from .loss import shifts_labels
        from .models import build_model, check_model, input_limits

        train, data = self.config.train, self.config.data
        self.setup_strategy()
        set_seed(train.seed)
        _set_determinism(train)
        if self.model is None and self.model_init is not None:
            self.model = _call_model_init(self.model_init)
        task = self.task
        tasks.configure(train, task)
        max_length = data_mod.tokenized_max_length(data, self.train_dataset, task)  # None: rows of token ids
        if self.model is None:
            check_model(train, max_length, task)  # its config, before the tokenizer, data and weights load
        else:
            self._check_model("model", max_length)
        given = self.train_dataset
        if given is None or data_mod.is_datasets_object(given):
            data_mod.show_progress(not train.disable_tqdm)
        if self.tokenizer is None and (given is None or self.model is None or
                                       data_mod.needs_tokenizer(given, data, task)):
            rows = given if data_mod.is_datasets_object(given) else None
            with data_mod.named_rows(data.train if given is None else None, "data.train", data):  # rows learnt from
                self.tokenizer = data_mod.build_tokenizer(data, train.model, rows, task)
        label2id = tasks.label_ids_by_name(train)
        if given is None:
            data_mod.check_config(data)
            built = self.hook.create_datasets(run=self)
            if not isinstance(built, data_mod.Datasets):
                raise ConfigError(f"create_datasets returned a {type(built).__name__}, expected engine.data.Datasets")
            self.train_dataset = data_mod.prepare_given(built.train, data, self.tokenizer, "train dataset", task,
                                                        label2id)
            self.eval_dataset = self.eval_dataset if self.eval_dataset is not None else built.eval
            self.data_collator = self.data_collator or built.collator
        else:
            self.train_dataset = data_mod.prepare_given(given, data, self.tokenizer, "train_dataset", task, label2id)
        self.eval_dataset = data_mod.prepare_given(self.eval_dataset, data, self.tokenizer, "eval_dataset", task,
                                                   label2id)
        if self.compute_metrics is None and train.compute_metrics:
            from .util import load_callable

            self.compute_metrics = load_callable(train.compute_metrics, "train.compute_metrics")
            self.compute_metrics_key = "train.compute_metrics"
        if self.model is None:
            labels = tasks.label_settings(train, task, tasks.label_names(self.train_dataset, task),
                                          self.train_dataset)
            with self.strategy.model_init_context():
                self.model = build_model(train, self.tokenizer, labels, self.model_load_kwargs)
            self._check_model("train.model", max_length)
        self._check_task_data(task)
        model_config = getattr(self.model, "config", None)
        if model_config is not None and hasattr(model_config, "use_cache"):  # as Trainer sets it
            model_config.use_cache = train.use_cache
        if self.data_collator is None:
            self.data_collator = tasks.collator(task, self.tokenizer, self.model) or \
                data_mod.collator_for(data, self.tokenizer)
        if data.packing == "document":
            data_mod.enable_document_packing(self.model)
        self.label_shift = shifts_labels(self.model)
        if train.label_names is not None:
            self.label_names = list(train.label_names)
            self._check_label_names()
        else:  # Trainer's default; a module without label arguments: 'labels', which the engine's loss reads
            from transformers.utils import find_labels

            self.label_names = find_labels(type(self.model)) or ["labels"]
        vocab_size = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab_size is not None and self.tokenizer is not None and len(self.tokenizer) > vocab_size:
            raise ConfigError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is "
                              f"{vocab_size}; set data.tokenizer to the model's tokenizer or pass tokenizer=")
        limits = input_limits(self.model)  # rows of token ids given, or made by a data plugin, fit the model
        data_mod.check_examples(self.train_dataset, task, "train_dataset", limits)
        data_mod.check_examples(self.eval_dataset, task, "eval_dataset", limits)

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
        self.train_loader = self._train_loader()
        self.num_training_steps = self._count_training_steps()
        optimizer = self.hook.create_optimizer(run=self)
        self.optimizer = self.strategy.prepare_optimizer(optimizer)
        self.scheduler = self.hook.create_scheduler(run=self, optimizer=self.optimizer)

    def remove_patches(self) -> None:
        """Undo what ``patch_model`` did, newest first (idempotent): the model is left as it was built."""
        while self.undo_patches:
            self.undo_patches.pop()()

    def _check_task_data(self, task: str) -> None:
        """Class ids within the model's classes; a model that can generate for predict_with_generate; a
        sequence classifier's pad token id."""
        from . import tasks
        from .models import fill_pad_token_id

        fill_pad_token_id(self.model, self.tokenizer, task)
        if self.config.train.predict_with_generate:
            tasks.check_can_generate(self.model, "the model given" if self._model_given else "train.model")
            tasks.generation(self.config.train, self.model)  # its settings refused now, not at the first evaluation
        num_labels = getattr(getattr(self.model, "config", None), "num_labels", None)
        if task not in tasks.CLASSIFICATION or not isinstance(num_labels, int):
            return
        tasks.check_labels(self.train_dataset, num_labels, "data.train")
        evaluation = self.eval_dataset if isinstance(self.eval_dataset, dict) else {None: self.eval_dataset}
        for name, dataset in evaluation.items():
            tasks.check_labels(dataset, num_labels, "data.eval" if name is None else f"eval_dataset[{name!r}]")

    def _check_label_names(self) -> None:
        """``train.label_names`` are keys of the batches evaluation sees (one example collated to find out)."""
        evaluation = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
        dataset = next((d for d in evaluation.values() if d is not None), self.train_dataset)
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
            return  # a stream: its first batch is not read ahead
        dataset, collator = self.loader_data(dataset, "eval dataset")
        if len(dataset) == 0:
            return
        example = dataset[0]
        keys = collator([example]) if collator is not None else example
        if not hasattr(keys, "keys"):
            return  # not a mapping: the model takes no keyword batch
        missing = [name for name in self.label_names if name not in keys]
        if missing:
            raise ConfigError(f"train.label_names: {', '.join(map(repr, missing))} is not a key of the batches, "
                              f"which hold {', '.join(map(repr, keys))}; name the label keys, or leave "
                              "train.label_names unset (the model's label arguments)")

    def _check_model(self, key: str, max_length: int | None) -> None:
        """The model fits the data (positions of data.max_length, None for rows of token ids) and, with the
        default loss, takes ``model(**batch)``."""
        from .models import check_forward, check_positions

        config = getattr(self.model, "config", None)
        if config is not None:
            check_positions(config, max_length, "the model")
        if self.uses_builtin_loss:
            check_forward(self.model, key)

    @property
    def uses_builtin_loss(self) -> bool:
        """No enabled plugin answers ``compute_loss`` (wrappers around the builtin aside)."""
        return all(impl.plugin_name.startswith("builtin.") or impl.wrapper or impl.hookwrapper
                   for impl in self.hook.compute_loss.get_hookimpls())

    def _train_loader(self) -> torch.utils.data.DataLoader:
        train = self.config.train
        dataset = self.train_dataset
        sampler = None
        lengths = None
        if train.train_sampling_strategy == "group_by_length":
            if isinstance(dataset, torch.utils.data.IterableDataset):
                logger.warning("train.train_sampling_strategy = 'group_by_length': the train dataset is an "
                               "IterableDataset, so its examples are not grouped by length (as Trainer)")
            else:  # the lengths are read before remove_unused_columns drops a length column
                from .data import example_lengths

                input_name = (getattr(self.tokenizer, "model_input_names", None) or ["input_ids"])[0]
                lengths = example_lengths(dataset, train.length_column_name, input_name)
        dataset, collator = self.loader_data(dataset, "train dataset")
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            try:
                length = len(dataset)
            except TypeError:
                raise ConfigError("train dataset has no len(); use an IterableDataset with train.max_steps") from None
            if length == 0:
                raise ConfigError("the train dataset is empty")
            batch = train.per_device_train_batch_size * self.strategy.world_size
            if batch > length:  # every step would silently be the whole dataset
                raise ConfigError(f"train.per_device_train_batch_size: {train.per_device_train_batch_size} per device "
                                  f"x {self.strategy.world_size} process(es) is more than the {length} train examples; "
                                  "lower it, or give more data")
            data_seed = train.data_seed if train.data_seed is not None else train.seed
            sampler = EpochSampler(length, data_seed, train.train_sampling_strategy == "random",
                                   self.strategy.rank, self.strategy.world_size, lengths,
                                   train.per_device_train_batch_size * train.gradient_accumulation_steps)
        elif train.max_steps <= 0:
            raise ConfigError("train.max_steps: an IterableDataset has no length; set train.max_steps > 0")
        return torch.utils.data.DataLoader(
            dataset, batch_size=train.per_device_train_batch_size, sampler=sampler,
            collate_fn=collator, drop_last=train.dataloader_drop_last, **self.loader_options(),
            # its own generator: starting an iterator must not draw from the global RNG, or a
            # resumed run (which starts one mid-epoch) would see different dropout masks
            generator=torch.Generator().manual_seed(train.seed),
        )

    def loader_data(self, dataset: Any, key: str) -> tuple[Any, Callable[[list[Any]], Any]]:
        """The dataset and collator a loader of ``dataset`` uses: the examples' keys that the model's forward
        does not take left out (``train.remove_unused_columns``, as Trainer)."""
        if not self.config.train.remove_unused_columns:
            return dataset, self.data_collator
        from .data import forward_columns, without_unused_columns

        return without_unused_columns(dataset, self.data_collator, forward_columns(self.model, self.label_names),
                                      self.model, key)

    def loader_options(self) -> dict[str, Any]:
        """The DataLoader arguments ``[train] dataloader_*`` set, for the train and evaluation loaders."""
        train = self.config.train
        options = {"num_workers": train.dataloader_num_workers,
                   "pin_memory": train.dataloader_pin_memory and self.strategy.device.type == "cuda",
                   "in_order": train.dataloader_in_order}
        if train.dataloader_num_workers:
            options.update(persistent_workers=train.dataloader_persistent_workers,
                           prefetch_factor=train.dataloader_prefetch_factor,
                           multiprocessing_context=train.dataloader_multiprocessing_context)
        return options

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
        from .loop import cast_for_full_eval, evaluate

        self.setup()
        cast_for_full_eval(self)
        return evaluate(self, self._prepared(eval_dataset, "eval_dataset"), metric_key_prefix)

    def predict(self, dataset: Any, metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (logits), label ids and metrics over ``dataset``, like ``Trainer.predict``."""
        from .loop import cast_for_full_eval, predict

        self.setup()
        cast_for_full_eval(self)
        return predict(self, self._prepared(dataset, "dataset"), metric_key_prefix)

    def _prepared(self, dataset: Any, key: str) -> Any:
        """Rows of a datasets object tokenized as the run's data is (others as they are)."""
        from .data import prepare_given
        from .tasks import label_ids_by_name

        if dataset is None:
            return None
        return prepare_given(dataset, self.config.data, self.tokenizer, key, self.task,
                             label_ids_by_name(self.config.train))

    def plan(self) -> str:
        """The composed run as text: plugins, hook call order, the full config."""
        from .plan import render_plan

        return render_plan(self)


def _register_trainer_arguments(plugin_manager: PluginManager, callbacks: list[Any], compute_loss_func: Any) -> None:
    """The builtins that only some runs need, registered only then (no cost per step otherwise)."""
    if callbacks:
        from .builtin.callbacks import PLUGIN, TrainerCallbacks

        plugin_manager.pm.register(TrainerCallbacks(callbacks), name=PLUGIN)
    if compute_loss_func is not None:
        from .builtin.loss import PLUGIN_LOSS_FUNC, ComputeLossFunc

        plugin_manager.pm.register(ComputeLossFunc(compute_loss_func), name=PLUGIN_LOSS_FUNC)


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


ADAPTER_PLUGIN = "peft"


def _resolve_defaults(train: cfg.TrainConfig) -> None:
    """Defaults that depend on other keys, as TrainingArguments resolves them."""
    if train.load_best_model_at_end and train.metric_for_best_model is None:
        train.metric_for_best_model = "loss"
    if train.metric_for_best_model is not None and train.greater_is_better is None:
        train.greater_is_better = not train.metric_for_best_model.endswith("loss")
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        value, current = getattr(train, old), getattr(train, new)
        if value is None:
            continue
        if current not in (None, False) and current != value:
            raise ConfigError(f"train.{old} = {value!r} and train.{new} = {current!r} disagree; "
                              f"{old} is TrainingArguments' older name of {new}: set one")
        setattr(train, new, value)
        setattr(train, old, None)
    if train.torch_compile_backend or train.torch_compile_mode:
        train.torch_compile = True
    if isinstance(train.include_num_input_tokens_seen, bool):  # as TrainingArguments reads a bool
        train.include_num_input_tokens_seen = "all" if train.include_num_input_tokens_seen else "no"


def _check_values(train: cfg.TrainConfig) -> None:
    """Checks across keys (each key's own range is declared with its option)."""
    if train.max_steps <= 0 and train.num_train_epochs <= 0:
        raise ConfigError("train.max_steps / train.num_train_epochs: set max_steps > 0 or num_train_epochs > 0")
    if train.save_strategy == "best" and (train.metric_for_best_model is None or train.eval_strategy == "no"):
        raise ConfigError("train.save_strategy = 'best' saves after evaluations that improve a metric: set "
                          "train.metric_for_best_model and train.eval_strategy")
    if train.load_best_model_at_end:
        if train.eval_strategy == "no":
            raise ConfigError("train.load_best_model_at_end needs evaluations: set train.eval_strategy")
        if train.save_strategy not in (train.eval_strategy, "best"):
            raise ConfigError(f"train.load_best_model_at_end: save_strategy ({train.save_strategy!r}) must "
                              f"equal eval_strategy ({train.eval_strategy!r}) so each evaluation has a checkpoint")
        eval_steps = train.eval_steps or train.logging_steps
        if train.save_strategy == "steps" and train.save_steps % eval_steps:
            raise ConfigError(f"train.load_best_model_at_end: save_steps ({train.save_steps}) must be a "
                              f"multiple of eval_steps ({eval_steps})")
    if train.bf16 and train.fp16:
        raise ConfigError("train.bf16 and train.fp16 are both true; pick one")
    unknown = [name for name in train.include_for_metrics if name not in ("inputs", "loss")]
    if unknown:
        raise ConfigError(f"train.include_for_metrics: {', '.join(map(repr, unknown))} is not one of 'inputs', 'loss'")
    if train.bf16_full_eval and train.fp16_full_eval:
        raise ConfigError("train.bf16_full_eval and train.fp16_full_eval are both true; pick one")
    if isinstance(train.generation_config, dict):
        from .tasks import check_generation_values

        check_generation_values(train.generation_config, "train.generation_config")
    for key in ("dataloader_persistent_workers", "dataloader_prefetch_factor"):
        if getattr(train, key) not in (None, False) and train.dataloader_num_workers == 0:
            raise ConfigError(f"train.{key} needs worker processes: set train.dataloader_num_workers > 0")
