"""The plugin contract: every hook the engine calls, when, with what, and how results combine.

A plugin is a module (or object) with functions marked ``@engine.hookimpl`` whose names and
argument names match the specs below; a plugin may take any subset of a hook's arguments.
Plugins are found through the entry-point group ``engine.plugins`` (entry name = plugin
name) and loaded only when a run enables them::

    # pyproject.toml of engine-myplugin
    [project.entry-points."engine.plugins"]
    myplugin = "engine_myplugin"

An entry point may also name a class (``"engine_myplugin:MyPlugin"``): it is instantiated
once per run, so state kept on ``self`` (counters, open files) belongs to that run.

How results combine (pluggy semantics):

* **broadcast**: every implementation is called; return values are collected or ignored.
* **firstresult**: implementations are called until one returns something other than None;
  that value is the result. Enabled plugins are called before the builtins, in the order of
  the run's ``plugins`` list (``tryfirst`` / ``trylast`` move an implementation).
* **per plugin**: the engine calls each plugin's implementation separately and files the
  result under that plugin's name (its options section, its checkpoint state).
* **isolated** (the logging hooks and ``on_checkpoint_saved``): called plugin by plugin; an
  implementation that raises is reported once by name, that plugin is switched off for these
  hooks for the rest of the run, and training goes on (the end of the run lists it). A plugin
  whose options have ``strict: bool = option(False, ...)`` set to true makes such a failure end
  the run. Wrappers are refused on these hooks.
* **wrappers**: any hook also accepts ``@hookimpl(wrapper=True)`` implementations, generator
  functions that run around the others and may replace the result::

      @hookimpl(wrapper=True)
      def compute_loss(run, model, batch, num_items_in_batch):
          loss = yield
          return loss * 0.5

Every hook gets ``run`` (:class:`engine.run.Run`): the composed config (``run.config``), the
model, optimizer, scheduler, strategy, datasets, ``run.state`` (step, epoch, log history) and
``run.control`` (set ``should_stop`` / ``should_save`` / ``should_evaluate`` to ask the loop to
stop, save or evaluate after the current step, ``should_epoch_stop`` to end the epoch). Hooks are grouped below by the phase in which
they fire; ``engine/loop.py`` shows them in place as pseudocode. The hooks that only a builtin calls are declared
beside it (engine/builtin/hookspecs.py) and join these through the entry-point group ``engine.hookspecs``, as a
plugin's own hooks for other plugins may.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:  # only for annotations: importing the specs must stay cheap
    from pathlib import Path

    import torch

    from .state import PredictionOutput, RunView, StepOutput

hookspec = pluggy.HookspecMarker("engine")

# Hooks the engine calls once per plugin, filing each result under the plugin's name.
PER_PLUGIN_HOOKS = ("plugin_options", "checkpoint_state", "load_checkpoint_state", "plan_lines")
# Hooks the engine calls per plugin in isolation: a plugin whose implementation raises is
# reported once by name and switched off for these hooks for the rest of the run (training goes
# on; the end of the run lists it), unless its options section sets ``strict = true``. Trackers
# and uploads must never end a run.
ISOLATED_HOOKS = ("log_hyperparams", "log_metrics", "log_samples", "log_finish", "on_checkpoint_saved")
# Hooks of the engine's tooling, not of a run: the command line's (called on the plugins of the
# entry-point group ``engine.commands`` while a command line is read) and the mappings that
# ``engine migrate`` and ``--accelerate-config`` ask of an installed plugin, enabled or not.
TOOLING_HOOKS = ("register_commands", "add_run_arguments", "edit_run_config", "convert_run_config", "trainer_argument_mappings",
                 "accelerate_mappings", "hyperparameter_search")
# Hooks every run needs answered: blocking the builtin that answers one ("-builtin.steps" in
# ``plugins``) without enabling another plugin that does is refused while the run is composed.
REQUIRED_HOOKS = ("create_strategy", "create_datasets", "create_train_loader", "create_optimizer", "create_scheduler",
                  "training_step", "compute_loss", "checkpoint_weights", "evaluate", "predict", "prediction_step")
# firstresult hooks that one enabled plugin at most answers besides the builtin default: two are
# refused while the run is composed, naming both (neither could silently win).
SINGLE_ANSWER_HOOKS = ("checkpoint_weights",)


def combine_kind(name: str) -> str:
    """How the results of hook ``name`` combine: per plugin, isolated, firstresult or broadcast."""
    if name in PER_PLUGIN_HOOKS:
        return "per plugin"
    if name in ISOLATED_HOOKS:
        return "isolated"
    return "firstresult" if globals()[name].engine_spec.get("firstresult") else "broadcast"

# ---------------------------------------------------------------------------- composition


@hookspec
def plugin_options() -> type | None:
    """Declare the schema of this plugin's section in the run file.

    **When**: once per enabled plugin while the run is composed, before anything loads.
    **Combine**: per plugin: the returned dataclass validates the section named after the
    plugin (``[neftune]`` for plugin ``neftune``); unknown keys and wrong types are refused
    with the key path. A plugin returning None takes no options; a section given for it is
    an error. The validated instance is ``run.config.section("<plugin>")``.

    Example::

        @dataclass
        class NEFTuneOptions:
            noise_alpha: float = option(5.0, help="noise scale")

        @hookimpl
        def plugin_options():
            return NEFTuneOptions
    """


@hookspec
def register_optimizers(register: Callable[..., None]) -> None:
    """Register optimizer factories by name (the names of ``TrainingArguments.optim``).

    **When**: once while the run is composed (and by ``engine plugins`` / ``engine plan``).
    **Combine**: broadcast. ``register(name, factory)`` where ``factory(run, params)``
    returns a ``torch.optim.Optimizer``; ``params`` are the parameter groups from
    :func:`engine.optim.param_groups` (weight decay split). A name registered by two enabled
    plugins is an error naming both; an enabled plugin's name replaces a builtin one.
    ``register(name, factory, takes_target_modules=True)`` marks an optimizer that uses
    ``train.optim_target_modules`` (GaLore, APOLLO); for any other the engine refuses it.

    Example::

        @hookimpl
        def register_optimizers(register):
            register("sgd_nesterov", lambda run, params: torch.optim.SGD(
                params, lr=run.config.train.learning_rate, momentum=0.9, nesterov=True))
    """


@hookspec
def register_schedulers(register: Callable[..., None]) -> None:
    """Register learning-rate scheduler factories by name (``train.lr_scheduler_type``).

    **When**: with :func:`register_optimizers`. **Combine**: broadcast, same rules.
    ``register(name, factory)`` where ``factory(optimizer, num_warmup_steps,
    num_training_steps, **train.lr_scheduler_kwargs)`` returns a scheduler stepped once per
    optimizer step.

    Example::

        @hookimpl
        def register_schedulers(register):
            register("step_decay", lambda optimizer, num_warmup_steps, num_training_steps:
                     torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5))
    """


@hookspec
def register_strategies(register: Callable[..., None]) -> None:
    """Register distributed strategies by name (``train.strategy``).

    **When**: with :func:`register_optimizers`. **Combine**: broadcast, same rules.
    ``register(name, factory)`` where ``factory(run)`` returns an
    :class:`engine.strategy.Strategy` (device placement, model/optimizer preparation,
    backward, clipping, reduction, barrier). With ``train.strategy = "auto"`` the engine takes
    the one strategy an enabled plugin registers, else the builtin ``single``; two candidates
    are refused.

    Example::

        @hookimpl
        def register_strategies(register):
            register("ddp", DDPStrategy)
    """


@hookspec
def register_argument_plugins(register: Callable[[str, Any], None], arguments: dict[str, Any]) -> None:
    """Register the plugin objects that ``Run``'s Trainer-style arguments need.

    **When**: once while the run is composed, before its config is (so before ``configure``).
    **Combine**: broadcast. ``arguments`` holds what ``Run`` was given: ``callbacks`` (the
    ``TrainerCallback``s), ``compute_loss_func``, ``optimizers``, ``optimizer_cls_and_kwargs``, and
    ``optim_named`` (whether the run file names ``train.optim``). ``register(name, plugin)`` adds a
    plugin object for this run only, so that a run without the argument pays nothing per step; the
    engine registers them in the order of their names. The builtins callbacks, loss and optimizers
    answer for the arguments above.

    Example::

        @hookimpl
        def register_argument_plugins(register, arguments):
            if arguments["compute_loss_func"] is not None:
                register("builtin.compute_loss_func", ComputeLossFunc(arguments["compute_loss_func"]))
    """


@hookspec
def configure(run: RunView) -> None:
    """Validate the composed run and refuse conflicts, before anything heavy loads.

    **When**: once, after the config is composed and the registries are filled, before the
    strategy, tokenizer, model or data are built. ``run.config`` is final; ``run.model`` is
    None. **Combine**: broadcast; raise :class:`engine.errors.ConfigError` (or PluginError)
    with a message that says what to change to refuse the run.

    Example::

        @hookimpl
        def configure(run):
            if run.config.train.gradient_accumulation_steps > 1:
                raise ConfigError("lomo: gradient_accumulation_steps must be 1 "
                                  "(the update is fused into backward)")
    """


# ---------------------------------------------------------------------------- setup


@hookspec(firstresult=True)
def create_strategy(run: RunView) -> Any:
    """Create the distributed strategy for this run.

    **When**: once after :func:`configure`, before the model is built (the strategy picks
    the device and may initialise a process group). **Combine**: firstresult. The builtin
    looks up ``train.strategy`` in the strategy registry.
    """


@hookspec(firstresult=True)
def create_datasets(run: RunView) -> Any:
    """Supply the train and eval data: a streaming format, a database, a generator.

    **When**: once in ``run.setup()``, after the tokenizer (``run.tokenizer``) and before the
    model is built, unless ``Run(train_dataset=...)`` was given. **Combine**: firstresult. The
    builtin reads ``[data]`` (files, globs, folders, saved datasets, dataset names; tokenized,
    packed and cached with 🤗 Datasets). Return :class:`engine.Datasets` ``(train, eval=None,
    collator=None)``; a collator of None: :func:`create_collator` makes one. The datasets may be torch
    datasets (map-style or ``IterableDataset``, which needs ``train.max_steps``) or 🤗
    ``datasets.Dataset`` / ``IterableDataset``: rows with ``input_ids`` are used as is, rows of
    text, ``messages`` or ``prompt``/``completion`` are tokenized and packed per ``[data]``.

    Example::

        @hookimpl
        def create_datasets(run):
            import datasets
            rows = datasets.Dataset.from_generator(read_my_database)   # rows with a "text" column
            return Datasets(train=rows)
    """


# ---------------------------------------------------------------------------- setup: tokenizer, data, model


@hookspec(firstresult=True)
def resolve_task(run: RunView) -> str | None:
    """Say what the model learns: ``"causal-lm"``, ``"sequence-classification"``, ...

    **When**: the first time ``run.task`` is read (the task builtin's :func:`configure` reads it
    when ``train.task`` is set or a model was given; else ``run.setup()`` does), then cached.
    **Combine**: firstresult. The task builtin answers ``train.task``, else what the given model's
    class or the ``architectures`` of the model config say, else ``"causal-lm"``.

    Example::

        @hookimpl(tryfirst=True)
        def resolve_task(run):
            return "causal-lm" if run.config.train.model.startswith("my-lm:") else None
    """


@hookspec
def on_build_start(run: RunView) -> None:
    """Refuse what the configs already show, before the tokenizer, the data or the weights load.

    **When**: once in ``run.setup()``, after the strategy is set up and the seed set (and
    ``model_init`` called), before :func:`create_tokenizer`. ``run.model`` is the model given (or
    None); ``run.train_dataset`` the dataset given (or None). **Combine**: broadcast; raise
    :class:`engine.errors.ConfigError` to refuse. The builtins check the task's keys, ``[data]``'s
    values and the model's config against ``data.max_length`` (a config-built model runs one
    forward pass on the meta device).

    Example::

        @hookimpl
        def on_build_start(run):
            if run.config.data.max_length > 4096:
                raise ConfigError("data.max_length: mykernel supports at most 4096 tokens")
    """


@hookspec(firstresult=True)
def create_tokenizer(run: RunView, checkpoint: Any) -> Any:
    """Create the tokenizer (a ``transformers`` tokenizer), or None when the run needs none.

    **When**: in ``run.setup()`` after :func:`on_build_start`, unless the run has one
    (``Run(tokenizer=...)``); also by ``engine evaluate --checkpoint``, with ``checkpoint`` the
    folder it loads weights from (None otherwise): the tokenizer saved there is the one they were
    trained with. **Combine**: firstresult. The data builtin loads ``data.tokenizer``, the model
    folder's, or trains one on ``data.train``; with a ``checkpoint`` it loads that folder's (None
    when it holds none).

    Example::

        @hookimpl
        def create_tokenizer(run, checkpoint):
            return AutoTokenizer.from_pretrained(run.config["mytok"].path)
    """


@hookspec(firstresult=True)
def prepare_dataset(run: RunView, dataset: Any, key: str) -> Any:
    """Make ``dataset`` (or a dict of them) examples the model trains on, or return it as it is.

    **When**: in ``run.setup()`` for the train and eval data (after :func:`create_datasets`, or as
    given to Run), and by :meth:`Run.evaluate` / :meth:`Run.predict` for the dataset they get;
    ``key`` names it in errors (``"train_dataset"``). Not called for None. **Combine**:
    firstresult. The data builtin tokenizes and packs 🤗 ``datasets`` rows per ``[data]`` (rows
    with ``input_ids`` are checked and used as they are) and returns other datasets unchanged.

    Example::

        @hookimpl(tryfirst=True)
        def prepare_dataset(run, dataset, key):
            if isinstance(dataset, MyRecords):
                return dataset.to_torch(run.tokenizer)
    """


@hookspec(firstresult=True)
def create_model(run: RunView) -> torch.nn.Module | None:
    """Create the model (with its weights) the run trains.

    **When**: once in ``run.setup()`` after the data, inside the strategy's
    ``model_init_context()``, unless a model was given (``Run(model=...)`` or ``model_init``).
    **Combine**: firstresult. The model builtin builds ``train.model`` (a factory, a saved folder
    through ``from_pretrained`` with the :func:`model_load_kwargs`, a config, a builtin name), for
    the task, with the class count the data shows, and checks it fits the data.

    Example::

        @hookimpl
        def create_model(run):
            return MyModel(vocab_size=len(run.tokenizer))
    """


@hookspec
def on_model_built(run: RunView) -> None:
    """Fit the model to the task and data, and refuse what does not fit, before the collator is made.

    **When**: once in ``run.setup()``, after :func:`create_model` (or with the model given), before
    :func:`create_collator` and :func:`patch_model`. **Combine**: broadcast; raise
    :class:`engine.errors.ConfigError` to refuse. The task builtin sets a sequence classifier's
    pad token id, checks that a model can generate for ``predict_with_generate`` and that class ids
    are within the model's classes.

    Example::

        @hookimpl
        def on_model_built(run):
            if run.model.config.model_type not in SUPPORTED:
                raise ConfigError(f"mykernel: {run.model.config.model_type} is not supported")
    """


@hookspec(firstresult=True)
def create_collator(run: RunView) -> Callable[[list[Any]], Any] | None:
    """Create the collator that makes batches of examples.

    **When**: once in ``run.setup()`` after :func:`on_model_built`, unless the run has one
    (``Run(data_collator=...)`` or the collator :func:`create_datasets` returned). **Combine**:
    firstresult. The task builtin answers transformers' padding collator of the task (none for
    causal-lm); the data builtin, last, the engine's collator for ``[data]``.

    Example::

        @hookimpl
        def create_collator(run):
            return MyCollator(run.tokenizer, pad_to_multiple_of=64)
    """


@hookspec
def on_build_end(run: RunView) -> None:
    """Last checks that tokenizer, data, model and collator fit together, before the model is patched.

    **When**: once in ``run.setup()``, after :func:`create_collator`, with ``run.label_names`` set;
    before :func:`patch_model`. **Combine**: broadcast; raise :class:`engine.errors.ConfigError` to
    refuse. The data builtin enables document packing on the model (``data.packing =
    "document"``), checks ``train.label_names`` against a collated batch, the tokenizer against the
    model's vocabulary, rows of token ids against the model's vocabulary and positions, and that a
    schedule that evaluates has eval data (a data plugin may have supplied none).

    Example::

        @hookimpl
        def on_build_end(run):
            if len(run.tokenizer) != run.model.get_input_embeddings().num_embeddings:
                logger.warning("the embeddings have rows no token uses")
    """


# ---------------------------------------------------------------- setup: patching, the train loader, the optimizer


@hookspec
def patch_model(run: RunView, model: torch.nn.Module) -> Callable[[], None] | None:
    """Patch the freshly built model (kernels, noise, compile, activation checkpointing).

    **When**: once, after the model is built and moved to the device, before the strategy
    wraps it and before the optimizer is created. **Combine**: broadcast, in plugin order;
    each implementation may return an *undo* callable, called in reverse order when training
    ends so the model is left as it was built.

    Example::

        @hookimpl
        def patch_model(run, model):
            handle = model.get_input_embeddings().register_forward_hook(add_noise)
            return handle.remove
    """


@hookspec(firstresult=True)
def create_train_loader(run: RunView) -> torch.utils.data.DataLoader | None:
    """Make the loader of the train data (``run.train_dataset``, ``run.data_collator``): a sampler of your
    own, a streaming loader.

    **When**: in ``run.setup()`` after the strategy wrapped the model, before
    :func:`create_optimizer` (``run.num_training_steps`` is counted from its length), and again when
    ``auto_find_batch_size`` changed the batch size. **Combine**: firstresult. ``builtin.loaders``
    answers a DataLoader of ``per_device_train_batch_size`` examples in the order of an
    ``EpochSampler`` (``train_sampling_strategy``, ``data_seed``; this process's share) with the
    ``[train] dataloader_*`` arguments; :mod:`engine.kit.loaders` has the sampler and its helpers. Give the loader a
    ``generator``: the loop seeds it each epoch (and calls ``sampler.set_epoch(epoch, rows_done)``
    where the sampler has one, for a resume).

    Example::

        @hookimpl
        def create_train_loader(run):
            dataset, collator = loader_data(run, run.train_dataset, "train dataset")
            return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=collator,
                                               generator=torch.Generator())
    """


@hookspec(firstresult=True)
def create_optimizer(run: RunView) -> torch.optim.Optimizer | None:
    """Create the optimizer.

    **When**: once, after :func:`patch_model`, before the strategy prepares model and
    optimizer. **Combine**: firstresult. The builtin looks ``train.optim`` up in the
    optimizer registry and calls the factory; implement this hook only to bypass names.
    """


@hookspec(firstresult=True)
def create_scheduler(run: RunView, optimizer: torch.optim.Optimizer) -> Any:
    """Create the learning-rate scheduler for ``optimizer``.

    **When**: once, right after :func:`create_optimizer`; ``run.num_training_steps`` is
    known. **Combine**: firstresult. The builtin looks ``train.lr_scheduler_type`` up in the
    scheduler registry, with warmup from ``warmup_steps`` / ``warmup_ratio``.
    """


# ---------------------------------------------------------------------------- training


@hookspec
def on_train_start(run: RunView) -> None:
    """Training is about to start (after a resume, if any).

    **When**: once, after setup and checkpoint restore, before the first step.
    **Combine**: broadcast.
    """


@hookspec
def on_epoch_start(run: RunView) -> None:
    """An epoch starts; ``run.state.epoch`` is its index as a float.

    **When**: at the start of each epoch. **Combine**: broadcast.
    """


@hookspec
def on_train_mode(run: RunView) -> None:
    """Switch to training mode.

    **When**: before the first training step and after every evaluation or checkpoint that
    switched to eval mode. **Combine**: broadcast. The builtin calls ``model.train()``;
    Schedule-Free optimizers call ``optimizer.train()`` here.
    """


@hookspec
def on_eval_mode(run: RunView) -> None:
    """Switch to evaluation mode.

    **When**: before evaluation, before a checkpoint is written (so saved weights are the
    evaluation weights) and at the end of training. **Combine**: broadcast. The builtin calls
    ``model.eval()``; Schedule-Free optimizers call ``optimizer.eval()`` here.
    """


@hookspec(firstresult=True)
def training_step(run: RunView, batches: list[dict[str, Any]], num_items_in_batch: Any) -> StepOutput | None:
    """Run one optimizer step over ``batches`` (the micro-batches of one accumulation window).

    **When**: once per optimizer step, in train mode. ``num_items_in_batch`` is the number
    of label tokens in the whole window (a tensor), or None when batches carry no labels or
    the window is a single micro-batch (whose mean loss is then the window's mean).
    **Combine**: firstresult; wrappers allowed. The builtin does, per micro-batch,
    ``compute_loss`` + ``run.strategy.backward``, then clipping, ``optimizer.step()`` and
    ``zero_grad``; the scheduler is stepped by the loop afterwards. A plugin that fuses
    backward and update (LOMO) returns its own ``StepOutput(loss, grad_norm)``; ``loss`` is
    the window's mean loss as a detached tensor.

    Keep ``loss`` and ``grad_norm`` as tensors (reading them is a host sync): the loop checks
    them for nan/inf where it syncs anyway, and stops a diverged run (``TrainingDiverged``,
    exit status 3). With ``train.on_nonfinite = "skip"`` the builtin reads them before the
    update and, when one is not finite, zeroes the gradients instead and returns
    ``StepOutput(loss, grad_norm, skipped=True)``; the run refuses that policy when a plugin
    owns the step.
    """


@hookspec(firstresult=True)
def compute_loss(run: RunView, model: torch.nn.Module, batch: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor | None:
    """Compute the loss of one micro-batch.

    **When**: by the builtin :func:`training_step` for every micro-batch, and for every
    evaluation batch (under ``torch.no_grad``). **Combine**: firstresult; wrappers may
    adjust the loss. Return a scalar tensor: the sum of per-token (per-item) losses divided by
    ``num_items_in_batch`` when it is given (so accumulated micro-batches add up to the mean of
    the window), else the mean over this batch. The builtin uses the model's own loss, or
    token cross-entropy with ``label_smoothing_factor``.

    Helpers: ``run.label_shift`` says whether labels are unshifted (HF causal LMs: position i
    predicts label i+1); ``engine.loss`` has ``IGNORE_INDEX``, ``count_items(labels, shift)``
    and ``logits_of(outputs)``. ``model.training`` tells a training batch from an evaluation
    one.

    Example::

        @hookimpl
        def compute_loss(run, model, batch, num_items_in_batch):
            logits = model(batch["input_ids"]).logits
            return focal_loss(logits, batch["labels"], num_items_in_batch)
    """


@hookspec
def on_step_end(run: RunView) -> None:
    """An optimizer step finished; ``run.state.global_step`` counts it.

    **When**: after every optimizer step and scheduler step, before logging, evaluation and
    saving for that step. **Combine**: broadcast. Set ``run.control.should_stop`` /
    ``should_save`` / ``should_evaluate`` / ``should_log`` to act after this step (the builtin
    flow, called first, turns on what the logging/eval/save schedule asks for; a plugin may turn
    on more), or ``run.control.request_abort(error)`` to end the run with ``error`` after this
    step's save (the builtin SIGTERM checkpoint does).
    """


@hookspec
def on_epoch_end(run: RunView) -> None:
    """An epoch finished.

    **When**: after the last step of each epoch, before epoch-based evaluation and saving.
    **Combine**: broadcast; may set ``run.control`` flags like :func:`on_step_end`.
    """


@hookspec
def on_evaluate(run: RunView, metrics: dict[str, float]) -> None:
    """Evaluation finished with ``metrics`` (keys prefixed ``eval_``).

    **When**: after every evaluation, on every process, after the metrics were logged.
    **Combine**: broadcast; early stopping sets ``run.control.should_stop`` here.
    """


@hookspec
def on_train_end(run: RunView) -> None:
    """Training finished (normally or by a stop request).

    **When**: once after the last step and the final save, before patches are undone and
    trackers are finished. **Combine**: broadcast.
    """


# ---------------------------------------------------------------------------- restart and the end of training


@hookspec
def on_restart(run: RunView) -> None:
    """Training starts again from where it started: put this plugin's own state back as it was then.

    **When**: when a training step raised :class:`engine.errors.RestartTraining` (the builtin
    ``auto_find_batch_size`` does, on an out-of-memory error, with a smaller batch size set), on
    every process, after ``run.state`` and ``run.control`` were reset to fresh records and the train
    loader, optimizer and scheduler made again (``run.state.max_steps`` counted again), before a
    resumed checkpoint is loaded again (which then calls :func:`load_checkpoint_state`).
    :func:`on_train_start` does not fire again. **Combine**: broadcast. Every plugin with state of
    its own (counters, a best value, steps seen) resets it here, so the run then equals one started
    with the new settings; the builtin ``auto_find_batch_size`` puts the weights and RNG back.

    Example::

        @hookimpl
        def on_restart(run):
            self.evaluations_without_improvement = 0
    """


@hookspec
def on_train_summary(run: RunView, metrics: dict[str, float]) -> None:
    """Add figures to the end-of-training summary (``train_runtime``, ``train_loss``, ...).

    **When**: once after the last step, on every process, before the summary goes to
    :func:`log_metrics` and is returned by :meth:`Run.train`. **Combine**: broadcast;
    implementations add keys to ``metrics`` in place. The builtin memory plugin adds
    ``train_mem_*`` (``train.skip_memory_metrics = false``).

    Example::

        @hookimpl
        def on_train_summary(run, metrics):
            metrics["train_batches_dropped"] = self.dropped
    """


@hookspec
def on_before_final_save(run: RunView) -> None:
    """Training is over and the model in eval mode: decide the weights the run ends with.

    **When**: once after the summary was logged, before the final model is written
    (``train.save_final_model``; also when it is off) and before :func:`on_train_end`.
    **Combine**: broadcast. The builtin best model plugin loads the best checkpoint's weights
    here (``train.load_best_model_at_end``).

    Example::

        @hookimpl
        def on_before_final_save(run):
            average_weights_into(run.model)  # e.g. an EMA of the weights
    """


@hookspec
def on_train_exit(run: RunView, status: str) -> None:
    """Training is over, finished or not: release what a plugin took for it.

    **When**: once at the end of :meth:`Run.train`, on every process, also when training raised
    (``status`` is "success" or "failed", as for :func:`log_finish`), before the patches are
    undone and :func:`log_finish`. **Combine**: broadcast. The builtins restore the SIGTERM
    handler and stop the memory watcher here.

    Example::

        @hookimpl
        def on_train_exit(run, status):
            self.profiler.stop()
    """


# ---------------------------------------------------------------------------- evaluation and prediction


@hookspec(firstresult=True)
def evaluate(run: RunView, dataset: Any, prefix: str, report: bool, in_training: bool) -> dict[str, float] | None:
    """Evaluate ``dataset`` and return its metrics (keys prefixed ``prefix + "_"``).

    **When**: at each evaluation the schedule asks for during training (``in_training`` true), by
    :meth:`Run.evaluate` and by ``engine evaluate`` (``in_training`` false: the model is first cast
    for ``bf16_full_eval`` / ``fp16_full_eval``, as Trainer does outside training). ``dataset``
    None means the run's eval data; a dict evaluates each part, prefixed ``{prefix}_{name}``.
    With ``report`` the metrics go to :func:`log_metrics` and :func:`on_evaluate`; ``engine
    evaluate``, a job of its own, passes false. **Combine**: firstresult; the builtin
    (engine/builtin/evaluation.py) runs :func:`on_eval_mode`, then :func:`prediction_step` and
    :func:`on_prediction_step` per batch, and ``compute_metrics``.

    Example (a plugin that evaluates elsewhere, e.g. on a remote service)::

        @hookimpl(tryfirst=True)
        def evaluate(run, dataset, prefix, report, in_training):
            return {f"{prefix}_score": remote_score(run.model)}
    """


@hookspec(firstresult=True)
def predict(run: RunView, dataset: Any, prefix: str) -> PredictionOutput | None:
    """Predictions, label ids and metrics over ``dataset``: what :meth:`Run.predict` returns.

    **When**: by :meth:`Run.predict`, after setup. **Combine**: firstresult; the builtin
    (engine/builtin/evaluation.py) casts for ``bf16_full_eval`` / ``fp16_full_eval``, runs the
    pass :func:`evaluate` runs and fires :func:`on_predict`; it returns an
    ``engine.PredictionOutput(predictions, label_ids, metrics)`` of numpy arrays.

    Example::

        @hookimpl(wrapper=True)
        def predict(run, dataset, prefix):
            output = yield
            print(f"{prefix}: {len(output.predictions)} predictions")
            return output
    """


# ---------------------------------------------------------------------------- logging


@hookspec
def collect_metrics(run: RunView, prefix: str) -> dict[str, float] | None:
    """Return your figures gathered since your last answer (e.g. ``{"rewards/margins": 0.4}``) for the row
    being logged. **When**: on every process (reduce with ``run.strategy.reduce``), at each training log step
    (``prefix`` ``""``) and after each evaluation (``"eval"``, ``"eval_<name>"``), before :func:`log_metrics`.
    **Combine**: broadcast; merged under the prefix (``eval_rewards/margins``); a key twice is an error."""


@hookspec
def log_hyperparams(run: RunView, params: dict[str, Any]) -> None:
    """Record the run's configuration (``params`` is the composed config as plain data).

    **When**: once before :func:`on_train_start`, on the main process only.
    **Combine**: isolated.
    """


@hookspec
def log_metrics(run: RunView, metrics: dict[str, float], step: int) -> None:
    """Record metrics for optimizer step ``step``.

    **When**: every ``logging_steps`` steps (loss, learning_rate, grad_norm, tokens_per_second,
    step_time, epoch), after each evaluation (eval_* metrics) and at the end of training
    (train_runtime, ...). On the main process only. **Combine**: isolated. The builtins write
    the console line and ``output_dir/metrics.jsonl``.

    Outside training, ``Run.evaluate()`` and ``Run.predict()`` send their metrics here too, at the
    run's current step (as Trainer's ``evaluate()``): a tracker appends, never starts anew. The
    ``engine evaluate`` command does not (its job writes ``eval_results.json`` only).
    """


@hookspec
def log_samples(run: RunView, samples: list[dict[str, Any]], step: int) -> None:
    """Record text the model generated at optimizer step ``step`` (the ``samples`` plugin).

    ``samples`` is one row per prompt: ``{"step": int, "prompt": str | list[dict], "completion":
    str}``; ``prompt`` is the text given, or the chat's ``messages`` list for a chat prompt, and
    ``completion`` the decoded new tokens only (special tokens skipped).

    **When**: each time a plugin generates samples (the builtin ``samples`` plugin: after each
    evaluation, or only at the end of training, per ``[samples] every``), after that step's
    ``log_metrics`` and on the main process only. **Combine**: isolated. The builtin writes
    ``output_dir/samples.jsonl`` (a resume drops rows after its checkpoint's step); trackers show a table.

    Example::

        @hookimpl
        def log_samples(run, samples, step):
            table = "| prompt | completion |\n| --- | --- |\n" + "\n".join(
                f"| {row['prompt']} | {row['completion']} |" for row in samples)
            my_tracker.log_text("samples", table, step=step)
    """


@hookspec
def log_finish(run: RunView, status: str) -> None:
    """The run is over: flush and close trackers. ``status`` is "success" or "failed".

    **When**: once at the very end, also when training raised (a diverged run, a failed save,
    an interrupt), on the main process only; also for a plugin switched off after a failure (so
    it can close what it opened; a second failure is only logged). **Combine**: isolated.
    """


# ---------------------------------------------------------------------------- checkpoints


@hookspec
def checkpoint_state(run: RunView) -> dict[str, Any] | None:
    """Return this plugin's state to store in a checkpoint.

    **When**: each time a checkpoint is written. **Combine**: per plugin: the returned
    mapping is saved under the plugin's name and handed back to :func:`load_checkpoint_state`
    on resume. Values must be tensors, numbers, strings, lists or dicts (checkpoints are loaded
    with ``weights_only=True``).
    """


@hookspec
def load_checkpoint_state(run: RunView, state: dict[str, Any]) -> None:
    """Restore this plugin's state from a checkpoint on resume.

    **When**: once, when resuming, after model, optimizer and scheduler are restored.
    **Combine**: per plugin: ``state`` is what this plugin's :func:`checkpoint_state`
    returned ({} if it returned None).
    """


@hookspec
def on_checkpoint_saved(run: RunView, path: str) -> None:
    """A complete checkpoint now exists at ``path``.

    **When**: after the checkpoint folder was written and renamed into place, on the main
    process. **Combine**: isolated: a failed upload never ends the run. Hub uploads hang off
    this hook.
    """


@hookspec(firstresult=True)
def resolve_checkpoint(run: RunView, run_id: str | None) -> Any:
    """Return the checkpoint folder this run resumes from (``train.resume_from_checkpoint``
    resolved), or None to start fresh.

    **When**: once, while the main process claims ``output_dir`` (before anything loads);
    ``run_id`` is the run recorded in ``output_dir`` (None when it holds no record).
    **Combine**: firstresult. The builtin ``builtin.resume`` answers None when
    ``resume_from_checkpoint`` is unset or false; for ``true``, the newest complete checkpoint of
    the run ``run_id`` (any run's when None; None when there is none: the run starts fresh); for a
    string, the folder a plugin's :func:`locate_checkpoint` fetches, else the string as a path. The
    folder is then checked (:func:`check_checkpoint`) and, once the run is set up, restored
    (:func:`restore_checkpoint`).

    Example::

        @hookimpl
        def resolve_checkpoint(run, run_id):
            if run.config.train.resume_from_checkpoint is True:  # the newest checkpoint that evaluated well
                return my_registry.best_checkpoint(run.output_dir)
    """


@hookspec
def check_checkpoint(run: RunView, path: Path) -> None:
    """Refuse a checkpoint folder this run cannot resume from, saying what is wrong and the fix.

    **When**: once, while the main process claims ``output_dir``, right after
    :func:`resolve_checkpoint` answered ``path``: before the model is built, so a bad checkpoint
    stops the run before anything loads. **Combine**: broadcast; raise
    :class:`engine.errors.CheckpointError` (or ``ConfigError``) to refuse. The builtin
    ``builtin.resume`` requires a complete checkpoint of this run: its files present, the same
    plugins, data order, checkpoint format and (unless the strategy resumes others) world size, the
    same ``train.optim`` (unless ``train.reset_optimizer``), intact weights and every checksum of its
    manifest.

    Example::

        @hookimpl
        def check_checkpoint(run, path):
            if not (path / "ema.pt").is_file():
                raise CheckpointError(f"resume_from_checkpoint: {path} holds no ema.pt (saved without the ema plugin)")
    """


@hookspec(firstresult=True)
def restore_checkpoint(run: RunView, path: Path) -> Any:
    """Restore the run from the checkpoint folder ``path``; return True once done.

    **When**: after ``run.setup()`` when the run resumes (``path`` passed :func:`check_checkpoint`),
    and again after a restart (a step raised ``RestartTraining``, e.g. ``auto_find_batch_size``)
    built a new optimizer and scheduler. **Combine**: firstresult. The builtin ``builtin.resume``
    restores weights, optimizer, scheduler, RNG, progress (``run.state``) and each plugin's
    :func:`load_checkpoint_state`, and applies the hyper-parameters changed since the checkpoint
    (learning rate, schedule, weight decay, betas, epsilon), listing them in one line. A run that
    resumes needs an answer: one that sets ``resume_from_checkpoint`` and leaves no plugin
    answering (``"-builtin.resume"`` in ``plugins``) is refused when it is composed.

    Example::

        @hookimpl(wrapper=True)
        def restore_checkpoint(run, path):
            restored = yield
            run.model.ema.load_state_dict(torch.load(path / "ema.pt", weights_only=True))
            return restored
    """


# ---------------------------------------------------------------------------- what plugins tell the engine
# Answers that were attributes of ``run`` once (two plugins setting one silently overwrote each
# other, and ``engine plan`` could not say who answers).


@hookspec(firstresult=True)
def checkpoint_weights(run: RunView) -> Any:
    """Return the :class:`engine.ModelWeights` that says which weights checkpoints and the final
    model hold, in which files, and how they load back.

    **When**: once, right after ``configure``; the run keeps the answer as ``run.weights``
    (``engine evaluate --checkpoint`` and resume checks read it before the model is built; a
    plugin may fill in its answer later, e.g. in ``patch_model``). **Combine**: firstresult; at
    most one enabled plugin may answer (two are refused while the run is composed, naming both).
    The builtin ``builtin.weights`` answers last with ``engine.ModelWeights()``: every weight of
    the model, in ``save_pretrained``'s layout. peft answers with its adapter's weights;
    ``engine plan`` names the plugin that answers.

    Example::

        @hookimpl
        def checkpoint_weights(run):
            return AdapterWeights(merge=run.config.section("myadapter").merge)
    """


@hookspec
def plan_lines(run: RunView) -> list[str] | None:
    """Return lines that ``engine plan`` shows about what this plugin will do in the run.

    **When**: when ``engine plan`` (or ``Run.plan()``) renders the composed run, after
    ``configure``; nothing is built yet. **Combine**: per plugin: each plugin's lines are
    printed under its name (``  peft: LORA adapter on 4 modules: ...``); None or [] shows nothing.

    Example::

        @hookimpl
        def plan_lines(run):
            return [f"noise alpha {run.config.section('neftune').noise_alpha} on the embeddings"]
    """


# ---------------------------------------------------------------------------- the run file and the command line


@hookspec
def check_raw_config(raw: dict[str, Any]) -> None:
    """Refuse what the run mapping holds, in your own words, before the sections are validated.

    **When**: once while the run is composed, after ``--set`` and ``--plugins`` were applied and
    before the sections are checked against their schemas (``plugin_options``), so before any
    "unknown key" error. ``raw`` is the run mapping (``{"plugins": [...], "train": {...}, ...}``),
    not validated: any value may have any type; do not change it. **Combine**: broadcast; raise
    :class:`engine.errors.ConfigError` to refuse the run. The builtin ``trainer_args`` refuses a
    ``[train]`` key that is a ``TrainingArguments`` field but no ``[train]`` key, saying where it goes.

    Example::

        @hookimpl
        def check_raw_config(raw):
            if "lr" in raw.get("train", {}):
                raise ConfigError("train.lr: write train.learning_rate")
    """


@hookspec
def register_commands(commands: Any) -> None:
    """Add commands to the ``engine`` command line (simonw/llm's ``register_commands``).

    **When**: once per ``engine`` command line, while its parser is built, after the core's
    commands (train, evaluate, plan, plugins). Only plugins of the entry-point group
    ``engine.commands`` are asked (they load for every command line; a run's plugins do not)::

        [project.entry-points."engine.commands"]
        mytool = "engine_mytool.commands"

    **Combine**: broadcast. ``commands`` is the parser's ``argparse`` sub-parsers action:
    ``commands.add_parser(name, help=...)`` adds a command, whose ``set_defaults(handler=f)``
    names the function that runs it: ``f(args)`` returns the exit status; an
    :class:`engine.errors.EngineError` it raises is the one-line error. ``commands.choices[name]``
    is an existing command's parser. The engine's tooling adds ``migrate`` and ``report``, and
    ``new`` / ``--check`` to ``engine plugins``.

    Example::

        @hookimpl
        def register_commands(commands):
            hello = commands.add_parser("hello", help="say hello")
            hello.add_argument("name")
            hello.set_defaults(handler=lambda args: print(f"hello {args.name}") or 0)
    """


@hookspec
def add_run_arguments(parser: Any) -> None:
    """Add options to the commands that compose a run (train, evaluate, plan, plugins).

    **When**: while the command line's parser is built, once per such command, on the plugins
    of the entry-point group ``engine.commands`` (see :func:`register_commands`).
    **Combine**: broadcast; ``parser`` is the command's ``argparse`` parser. What the options
    change, :func:`edit_run_config` does. The engine's tooling adds ``--accelerate-config``.

    Example::

        @hookimpl
        def add_run_arguments(parser):
            parser.add_argument("--team-defaults", metavar="FILE.toml")
    """


@hookspec
def edit_run_config(raw: dict[str, Any], args: Any) -> tuple[str, list[str]] | None:
    """Change the run mapping from the options :func:`add_run_arguments` added.

    **When**: once per command that composes a run, after the run file (or the embedded default
    run) was read and before ``--set`` and ``--plugins`` apply, so they override what this adds.
    **Combine**: broadcast; change ``raw`` (the run mapping) in place and return
    ``(title, lines)`` to show what was changed (``engine plan`` prints the lines under the
    title after the plan, ``engine train`` logs them), or None. Raise
    :class:`engine.errors.ConfigError` for an option's value that cannot be used.

    Example::

        @hookimpl
        def edit_run_config(raw, args):
            if args.team_defaults:
                raw.setdefault("train", {}).setdefault("seed", 1234)
                return f"team defaults {args.team_defaults}", ["train.seed = 1234"]
    """


@hookspec(firstresult=True)
def convert_run_config(config: Any) -> dict[str, Any] | None:
    """A run mapping from a config object that is neither a run file nor a mapping.

    **When**: by ``Run(config)`` given such an object (a ``TrainingArguments``, TRL's
    ``SFTConfig``), before any plugin loads, on the plugins of the entry-point group
    ``engine.commands``. **Combine**: firstresult: the run mapping (``{"plugins": [...],
    "train": {...}}``), having logged what did not carry over; None for an object the plugin does
    not know. The engine's tooling converts Trainer's arguments as ``engine migrate`` does.

    Example::

        @hookimpl
        def convert_run_config(config):
            if isinstance(config, argparse.Namespace):
                return {"train": {"learning_rate": config.lr, "max_steps": config.steps}}
    """


# ---------------------------------------------------------------------------- hooks declared beside their callers

# Entry points naming modules of hook specs that join these: a builtin's extension points beside it (engine's
# own, engine.builtin.hookspecs), or a plugin's hooks for other plugins (``[project.entry-points."engine.hookspecs"]``).
HOOKSPECS_GROUP = "engine.hookspecs"


def _declared_elsewhere() -> dict[str, Any]:
    """The hook specs the modules of :data:`HOOKSPECS_GROUP` declare, each name once."""
    import importlib.metadata

    from .errors import PluginError

    declared: dict[str, Any] = {}
    for entry in sorted(importlib.metadata.entry_points(group=HOOKSPECS_GROUP), key=lambda entry: entry.name):
        try:
            module = entry.load()
        except Exception as exc:
            raise PluginError(f"hook specs {entry.value!r} (entry point {entry.name!r} of group {HOOKSPECS_GROUP!r}) "
                              f"failed to import: {type(exc).__name__}: {exc}") from exc
        for name, spec in vars(module).items():
            if not hasattr(spec, "engine_spec"):
                continue
            known = globals().get(name) or declared.get(name)
            if known is not None and known is not spec:
                raise PluginError(f"hook {name!r} is declared by {known.__module__} and by {spec.__module__}; "
                                  "rename one")
            declared[name] = spec
    return declared


globals().update(_declared_elsewhere())

# Every hook of a run, in the order of this module, then of the modules that declare more (the order the
# reference and `engine plan` use).
HOOK_NAMES = tuple(name for name, value in list(globals().items())
                   if hasattr(value, "engine_spec") and name not in TOOLING_HOOKS)
SPEC_NAMES = (*HOOK_NAMES, *TOOLING_HOOKS)  # every hook a plugin may implement: a run's and the command line's
