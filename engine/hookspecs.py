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
they fire; ``engine/loop.py`` shows them in place as pseudocode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:  # only for annotations: importing the specs must stay cheap
    import torch

    from .run import Run
    from .state import StepOutput

hookspec = pluggy.HookspecMarker("engine")

# Hooks the engine calls once per plugin, filing each result under the plugin's name.
PER_PLUGIN_HOOKS = ("plugin_options", "checkpoint_state", "load_checkpoint_state")
# Hooks the engine calls per plugin in isolation: a plugin whose implementation raises is
# reported once by name and switched off for these hooks for the rest of the run (training goes
# on; the end of the run lists it), unless its options section sets ``strict = true``. Trackers
# and uploads must never end a run.
ISOLATED_HOOKS = ("log_hyperparams", "log_metrics", "log_samples", "log_finish", "on_checkpoint_saved")


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
def configure(run: Run) -> None:
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
def create_strategy(run: Run) -> Any:
    """Create the distributed strategy for this run.

    **When**: once after :func:`configure`, before the model is built (the strategy picks
    the device and may initialise a process group). **Combine**: firstresult. The builtin
    looks up ``train.strategy`` in the strategy registry.
    """


@hookspec(firstresult=True)
def create_datasets(run: Run) -> Any:
    """Supply the train and eval data: a streaming format, a database, a generator.

    **When**: once in ``run.setup()``, after the tokenizer (``run.tokenizer``) and before the
    model is built, unless ``Run(train_dataset=...)`` was given. **Combine**: firstresult. The
    builtin reads ``[data]`` (files, globs, folders, saved datasets, dataset names; tokenized,
    packed and cached with 🤗 Datasets). Return :class:`engine.data.Datasets` ``(train, eval=None,
    collator=None)``; a collator of None is the engine's for ``[data]``. The datasets may be torch
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


@hookspec
def patch_model(run: Run, model: torch.nn.Module) -> Callable[[], None] | None:
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
def create_optimizer(run: Run) -> torch.optim.Optimizer | None:
    """Create the optimizer.

    **When**: once, after :func:`patch_model`, before the strategy prepares model and
    optimizer. **Combine**: firstresult. The builtin looks ``train.optim`` up in the
    optimizer registry and calls the factory; implement this hook only to bypass names.
    """


@hookspec(firstresult=True)
def create_scheduler(run: Run, optimizer: torch.optim.Optimizer) -> Any:
    """Create the learning-rate scheduler for ``optimizer``.

    **When**: once, right after :func:`create_optimizer`; ``run.num_training_steps`` is
    known. **Combine**: firstresult. The builtin looks ``train.lr_scheduler_type`` up in the
    scheduler registry, with warmup from ``warmup_steps`` / ``warmup_ratio``.
    """


# ---------------------------------------------------------------------------- training


@hookspec
def on_train_start(run: Run) -> None:
    """Training is about to start (after a resume, if any).

    **When**: once, after setup and checkpoint restore, before the first step.
    **Combine**: broadcast.
    """


@hookspec
def on_epoch_start(run: Run) -> None:
    """An epoch starts; ``run.state.epoch`` is its index as a float.

    **When**: at the start of each epoch. **Combine**: broadcast.
    """


@hookspec
def on_train_mode(run: Run) -> None:
    """Switch to training mode.

    **When**: before the first training step and after every evaluation or checkpoint that
    switched to eval mode. **Combine**: broadcast. The builtin calls ``model.train()``;
    Schedule-Free optimizers call ``optimizer.train()`` here.
    """


@hookspec
def on_eval_mode(run: Run) -> None:
    """Switch to evaluation mode.

    **When**: before evaluation, before a checkpoint is written (so saved weights are the
    evaluation weights) and at the end of training. **Combine**: broadcast. The builtin calls
    ``model.eval()``; Schedule-Free optimizers call ``optimizer.eval()`` here.
    """


@hookspec(firstresult=True)
def training_step(run: Run, batches: list[dict[str, Any]], num_items_in_batch: Any) -> StepOutput | None:
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
def compute_loss(run: Run, model: torch.nn.Module, batch: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor | None:
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
def on_step_end(run: Run) -> None:
    """An optimizer step finished; ``run.state.global_step`` counts it.

    **When**: after every optimizer step and scheduler step, before logging, evaluation and
    saving for that step. **Combine**: broadcast. Set ``run.control.should_stop`` /
    ``should_save`` / ``should_evaluate`` / ``should_log`` to act after this step.
    """


@hookspec
def on_epoch_end(run: Run) -> None:
    """An epoch finished.

    **When**: after the last step of each epoch, before epoch-based evaluation and saving.
    **Combine**: broadcast; may set ``run.control`` flags like :func:`on_step_end`.
    """


@hookspec
def on_prediction_step(run: Run, step: int, total: int | None) -> None:
    """One batch of an evaluation or prediction pass is done.

    **When**: after each eval/predict batch's forward, on every process; ``step`` counts this
    pass's batches from 1, ``total`` is its number of batches (None for an iterable dataset).
    **Combine**: broadcast. The console draws its evaluation bar from it.

    Example::

        @hookimpl
        def on_prediction_step(run, step, total):
            if step == total:
                print(f"evaluated {total} batches")
    """


@hookspec
def on_evaluate(run: Run, metrics: dict[str, float]) -> None:
    """Evaluation finished with ``metrics`` (keys prefixed ``eval_``).

    **When**: after every evaluation, on every process, after the metrics were logged.
    **Combine**: broadcast; early stopping sets ``run.control.should_stop`` here.
    """


@hookspec
def on_predict(run: Run, metrics: dict[str, float]) -> None:
    """A prediction pass (:meth:`Run.predict`) finished with ``metrics`` (keys prefixed ``test_``).

    **When**: at the end of every :meth:`Run.predict`, on every process. As under Trainer, the
    metrics are returned, not logged (no :func:`log_metrics`), and predictions are not evaluations:
    :func:`on_evaluate` does not fire for them (early stopping must not count them).
    **Combine**: broadcast.

    Example::

        @hookimpl
        def on_predict(run, metrics):
            print(f"predicted: {metrics}")
    """


@hookspec
def on_train_end(run: Run) -> None:
    """Training finished (normally or by a stop request).

    **When**: once after the last step and the final save, before patches are undone and
    trackers are finished. **Combine**: broadcast.
    """


# ---------------------------------------------------------------------------- logging


@hookspec
def log_hyperparams(run: Run, params: dict[str, Any]) -> None:
    """Record the run's configuration (``params`` is the composed config as plain data).

    **When**: once before :func:`on_train_start`, on the main process only.
    **Combine**: isolated.
    """


@hookspec
def log_metrics(run: Run, metrics: dict[str, float], step: int) -> None:
    """Record metrics for optimizer step ``step``.

    **When**: every ``logging_steps`` steps (loss, learning_rate, grad_norm, tokens_per_second,
    step_time, epoch), after each evaluation (eval_* metrics) and at the end of training
    (train_runtime, ...). On the main process only. **Combine**: isolated. The builtins write
    the console line and ``output_dir/metrics.jsonl``.

    Outside training, ``Run.evaluate()`` and ``Run.predict()`` called from Python send their
    metrics here too, at the run's current step (as Trainer's ``evaluate()`` logs them), so a
    tracker must append, never start its file anew here. The ``engine evaluate`` command does
    not call it: a job of its own writes ``eval_results.json`` and nothing into the training
    run's logs or trackers.
    """


@hookspec
def log_samples(run: Run, samples: list[dict[str, Any]], step: int) -> None:
    """Record text the model generated at optimizer step ``step`` (the ``samples`` plugin).

    ``samples`` is one row per prompt: ``{"step": int, "prompt": str | list[dict], "completion":
    str}``; ``prompt`` is the text given, or the chat's ``messages`` list for a chat prompt, and
    ``completion`` the decoded new tokens only (special tokens skipped).

    **When**: each time a plugin generates samples (the builtin ``samples`` plugin: after each
    evaluation, or only at the end of training, per ``[samples] every``), after that step's
    ``log_metrics`` and on the main process only. **Combine**: isolated. The builtin writes
    ``output_dir/samples.jsonl`` (a resumed run drops what was written after its checkpoint's
    step, as for ``metrics.jsonl``); a tracker shows them as a table (TensorBoard: a text
    summary ``samples`` at that step).

    Example::

        @hookimpl
        def log_samples(run, samples, step):
            table = "| prompt | completion |\n| --- | --- |\n" + "\n".join(
                f"| {row['prompt']} | {row['completion']} |" for row in samples)
            my_tracker.log_text("samples", table, step=step)
    """


@hookspec
def log_finish(run: Run, status: str) -> None:
    """The run is over: flush and close trackers. ``status`` is "success" or "failed".

    **When**: once at the very end, also when training raised (a diverged run, a failed save,
    an interrupt), on the main process only; also for a plugin switched off after a failure (so
    it can close what it opened; a second failure is only logged). **Combine**: isolated.
    """


# ---------------------------------------------------------------------------- checkpoints


@hookspec
def checkpoint_state(run: Run) -> dict[str, Any] | None:
    """Return this plugin's state to store in a checkpoint.

    **When**: each time a checkpoint is written. **Combine**: per plugin: the returned
    mapping is saved under the plugin's name and handed back to :func:`load_checkpoint_state`
    on resume. Values must be tensors, numbers, strings, lists or dicts (checkpoints are loaded
    with ``weights_only=True``).
    """


@hookspec
def load_checkpoint_state(run: Run, state: dict[str, Any]) -> None:
    """Restore this plugin's state from a checkpoint on resume.

    **When**: once, when resuming, after model, optimizer and scheduler are restored.
    **Combine**: per plugin: ``state`` is what this plugin's :func:`checkpoint_state`
    returned ({} if it returned None).
    """


@hookspec
def on_checkpoint_saved(run: Run, path: str) -> None:
    """A complete checkpoint now exists at ``path``.

    **When**: after the checkpoint folder was written and renamed into place, on the main
    process. **Combine**: isolated: a failed upload never ends the run. Hub uploads hang off
    this hook.
    """


@hookspec(firstresult=True)
def locate_checkpoint(run: Run, spec: str) -> str | None:
    """Turn ``train.resume_from_checkpoint = spec`` (a string) into a local checkpoint folder.

    **When**: once, while the main process claims ``output_dir`` (before anything loads), when
    ``resume_from_checkpoint`` is a string. **Combine**: firstresult: the first plugin that
    knows ``spec`` (a name such as ``"hub"``, a URL) fetches the checkpoint and returns the
    local folder; None from all means ``spec`` is a local path. The folder returned is validated
    like any other (files, plugins, data order, every checksum of its manifest) before it is
    resumed. Raise :class:`engine.errors.ConfigError` when ``spec`` is yours but holds no checkpoint.

    Example::

        @hookimpl
        def locate_checkpoint(run, spec):
            if spec.startswith("s3://"):
                local = run.output_dir / ".tmp-download"
                download(spec, local)
                return str(local)
    """


# Every hook, in the order of this module (the order the reference and `engine plan` use).
HOOK_NAMES = tuple(name for name, value in list(globals().items()) if hasattr(value, "engine_spec"))
