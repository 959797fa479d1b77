"""Resume: which checkpoint a run continues from, what it accepts, and how training goes on, as a builtin plugin.

``train.resume_from_checkpoint`` names the checkpoint: ``true`` the newest one of the run recorded
in output_dir, a path, or a name a plugin's ``locate_checkpoint`` fetches (``"hub"``). The kernel
decides when (the run folder's claim, then the loop); this plugin answers

* ``configure``: a ``resume_from_checkpoint`` string that cannot mean what it says is refused;
* ``resolve_checkpoint``: the folder to resume from, None to start fresh;
* ``check_checkpoint``: before the model is built, a folder that is not a complete checkpoint of
  this run is refused (files present, plugin set, data order, optimizer name, every checksum);
* ``restore_checkpoint``: after setup, weights, optimizer, scheduler, RNG, progress and each
  plugin's state are restored, and the hyper-parameters that changed since the checkpoint are
  applied (learning rate, schedule, weight decay, betas, epsilon) and listed in one line.

Writing checkpoints and reading their files is the kernel's (:mod:`engine.checkpoint`); the
weights' safetensors headers are checked with :mod:`engine.kit.checkpoint`.

``[train]`` keys read: ``reset_optimizer`` (its own), ``resume_from_checkpoint`` (the kernel's),
and those a checkpoint must match.
"""

from __future__ import annotations

import json
import logging
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine import hookimpl
from engine.catalogue import CHECKPOINT_SOURCES
from engine.checkpoint import (PROGRESS_FIELDS, REQUIRED, data_order, list_checkpoints, load_state_file, restoring,
                               rng_file, set_rng_state)
from engine.config import START_KEYS, RunConfig, option
from engine.errors import CheckpointError, ConfigError
from engine.kit.checkpoint import check_safetensors, read_trainer_state, verify_manifest, weight_files
from engine.layout import MARKER, WEIGHTS, WEIGHTS_INDEX
from engine.optim import parse_optim_args
from engine.util import dumps_json

if TYPE_CHECKING:
    from engine.state import RunView

logger = logging.getLogger("engine")


@dataclass
class ResumeOptions:
    """``[train]`` keys of builtin.resume: how a resumed run goes on."""

    reset_optimizer: bool = option(False, help=(
        "on resume: restore weights, progress and RNG but build the optimizer and scheduler fresh, "
        "the schedule continuing at the resumed step (to change train.optim)"))


TRAIN_OPTIONS = ResumeOptions  # the [train] keys it reads: engine.config.TrainConfig has them

# config keys whose change on resume means the saved scheduler state is stale: a fresh
# scheduler from the current config is advanced to the resumed step instead
SCHEDULE_KEYS = ("train.learning_rate", "train.lr_scheduler_type", "train.lr_scheduler_kwargs",
                 "train.warmup_steps", "train.warmup_ratio", "train.max_steps", "train.num_train_epochs")
# config key -> optimizer param-group keys it sets; a change is copied from the freshly built
# optimizer into the restored one (the learning rate through initial_lr and the scheduler)
GROUP_KEYS = {"train.learning_rate": ("initial_lr",), "train.weight_decay": ("weight_decay",),
              "train.adam_beta1": ("betas",), "train.adam_beta2": ("betas",), "train.adam_epsilon": ("eps",)}
# [train] keys besides the data order's (data_order) that change the batches of an epoch, as the
# [data] keys and the plugins' sections may (a create_datasets plugin)
DATA_TRAIN_KEYS = ("train.model", "train.task", "train.dataloader_drop_last")


# tryfirst: the spec is refused before the enabled plugins' configure, as soon as the run is composed
@hookimpl(tryfirst=True)
def configure(run: RunView) -> None:
    check_resume_spec(run.config)


@hookimpl
def resolve_checkpoint(run: RunView, run_id: str | None) -> Path | None:
    """The checkpoint ``train.resume_from_checkpoint`` names; None to start fresh.

    ``true`` takes the newest complete checkpoint of the run recorded in output_dir
    (``run_id``; any run's when the folder has no record); a string is a path, or a name
    a plugin's ``locate_checkpoint`` fetches (``"hub"``). Runs before the model is
    built (the kernel then asks ``check_checkpoint``), so a bad checkpoint stops the run before
    anything loads.
    """
    spec = run.config.train.resume_from_checkpoint
    if spec is None or spec is False:
        return None
    if spec is True:
        found = list_checkpoints(run.output_dir, run_id)
        if not found:
            logger.info("resume_from_checkpoint = true but %s holds no checkpoint; starting from scratch",
                        run.output_dir)
            return None
        path = found[-1]
    else:  # a plugin may know the name (e.g. "hub") and fetch the checkpoint first
        path = Path(run.hook.locate_checkpoint(run=run, spec=spec) or spec)
    return path


# strings that read as a boolean in other formats (YAML, JSON from a shell): here they would be a path
_BOOLEAN_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False, "none": False,
                  "null": False}


def check_resume_spec(config: RunConfig) -> None:
    """Refuse a ``train.resume_from_checkpoint`` string that cannot mean what it says, at configure time.

    As in Trainer, a string is a path (Trainer too reads "true" as a folder named true): a word
    that reads as a boolean elsewhere, or a name only a plugin that is not enabled fetches, is
    refused with the fix unless such a folder exists.
    """
    spec = config.train.resume_from_checkpoint
    if not isinstance(spec, str):
        return
    key = f"train.resume_from_checkpoint = {spec!r}"
    if not spec.strip():
        raise ConfigError(f"{key}: an empty string; name a checkpoint folder, or write true (the newest "
                          "checkpoint in output_dir) or false")
    if Path(spec).is_dir():
        return
    word = _BOOLEAN_WORDS.get(spec.strip().lower())
    if word is not None:
        meaning = "true (the boolean, without quotes: the newest checkpoint in output_dir)" if word else \
            "false (the boolean, without quotes: start fresh), or leave it unset"
        raise ConfigError(f"{key} is a string, read as a checkpoint folder, and there is no folder {spec!r}; "
                          f"write {meaning}, e.g. --set train.resume_from_checkpoint={str(word).lower()}")
    plugin = CHECKPOINT_SOURCES.get(spec)
    if plugin is not None and plugin not in config.plugins:
        raise ConfigError(f"{key}: {spec!r} is fetched by the {plugin} plugin (engine-{plugin}), which this run "
                          f"does not enable; enable it with plugins = [\"{plugin}\"] and its [{plugin}] section, or "
                          f"--plugins +{plugin}")


@hookimpl
def check_checkpoint(run: RunView, path: Path) -> None:
    """Refuse a folder that is not a complete checkpoint of this run, naming what is wrong."""
    if not path.is_dir():
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a folder")
    if (path / "trainer_state.json").is_file() and \
            read_trainer_state(path)["config"].get("train", {}).get("save_only_model"):
        raise CheckpointError(f"resume_from_checkpoint: can't resume from a save_only_model checkpoint: {path} holds "
                              "the model but no optimizer, scheduler or RNG state (train.save_only_model = true); "
                              "start a fresh run from its weights with train.model = its path")
    run.weights.check_kind(path, "resume_from_checkpoint")
    strategy_files = run.strategy.checkpoint_files(path)
    required = (MARKER, *REQUIRED, *strategy_files)
    missing = [name for name in required if not (path / name).exists()]
    if missing:
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a complete checkpoint "
                              f"(missing {', '.join(missing)})")
    trainer_state = read_trainer_state(path)
    if trainer_state["plugins"] != list(run.config.plugins):
        saved, now = set(trainer_state["plugins"]), set(run.config.plugins)
        raise CheckpointError(
            f"resume_from_checkpoint: {path} was made with plugins {sorted(saved)}, this run enables "
            f"{sorted(now)} (only in checkpoint: {sorted(saved - now) or 'none'}; only in run: "
            f"{sorted(now - saved) or 'none'})")
    train, strategy = run.config.train, run.strategy
    saved_batch = trainer_state["config"]["train"].get("per_device_train_batch_size")
    if train.auto_find_batch_size and isinstance(saved_batch, int) and saved_batch != train.per_device_train_batch_size:
        # the batch size that run found, as Trainer restores state.train_batch_size
        logger.info("train.auto_find_batch_size: resuming with the checkpoint's per_device_train_batch_size %d "
                    "(configured: %d)", saved_batch, train.per_device_train_batch_size)
        train.per_device_train_batch_size = saved_batch
    now_order = data_order(run)
    changed = [f"{_ORDER_NAMES[key]} = {now_order[key]!r} (checkpoint: {value!r})"
               for key, value in trainer_state["data_order"].items() if now_order.get(key, value) != value]
    if changed:
        raise CheckpointError(f"resume_from_checkpoint: {path} was trained with a different data order: "
                              f"{'; '.join(changed)}. Resume with the checkpoint's values, or start a "
                              "fresh output_dir")
    saved_format = trainer_state.get("checkpoint_format", "torch")
    if saved_format != strategy.checkpoint_format:
        raise CheckpointError(f"resume_from_checkpoint: {path} holds {saved_format!r} checkpoint files (strategy "
                              f"{trainer_state.get('strategy')}), this run's strategy {strategy.name} reads "
                              f"{strategy.checkpoint_format!r}; resume with the checkpoint's strategy and options")
    saved_world = trainer_state["world_size"]
    if saved_world != strategy.world_size and not strategy.resumes_other_world_sizes:
        raise CheckpointError(f"resume_from_checkpoint: {path} was made by {saved_world} processes "
                              f"({trainer_state.get('strategy')}), this run has {strategy.world_size} "
                              f"({strategy.name}), which cannot resume it; launch {saved_world} processes")
    saved_optim = trainer_state["config"]["train"].get("optim")
    if saved_optim != train.optim and not train.reset_optimizer:
        raise CheckpointError(
            f"resume_from_checkpoint: {path} was trained with train.optim = {saved_optim!r}, this run asks for "
            f"{train.optim!r}, whose state cannot be restored from it; resume with train.optim = {saved_optim!r}, "
            f"or keep the weights and start {train.optim!r} fresh with train.reset_optimizer = true")
    try:
        if WEIGHTS in strategy_files or WEIGHTS_INDEX in strategy_files:
            for weights_file in weight_files(path):
                check_safetensors(weights_file)
        for name in strategy_files:
            if name.endswith(".safetensors") and name != WEIGHTS:
                check_safetensors(path / name)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {exc}") from None
    for name in [*REQUIRED[1:], *(n for n in strategy_files if n.endswith(".pt")),
                 *(p.name for p in path.glob("rng_state*.pt"))]:
        try:  # torch.save files are zip archives: a truncated one has no central directory
            zipfile.ZipFile(path / name).close()
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointError(f"checkpoint {path}: {name} is truncated or corrupt ({exc})") from None
    try:
        verify_manifest(path)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {exc}") from None


_ORDER_NAMES = {"seed": "train.seed", "global_batch_size": "the global batch (per_device_train_batch_size x "
                "processes)", "gradient_accumulation_steps": "train.gradient_accumulation_steps"}


def _flat(mapping: dict[str, Any]) -> dict[str, Any]:
    """A composed config as {"section.key": value}, in JSON's types (as saved in checkpoints)."""
    mapping = json.loads(dumps_json(mapping))
    return {f"{section}.{key}": value for section, values in mapping.items() if isinstance(values, dict)
            for key, value in values.items()}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint value, current value) for every config key that differs, start keys aside."""
    before, after = _flat(saved), _flat(current)
    skip = {f"train.{key}" for key in START_KEYS}
    return [(key, before.get(key), after.get(key)) for key in sorted(before.keys() | after.keys())
            if key not in skip and before.get(key) != after.get(key)]


def _apply_to_optimizer(optimizer: torch.optim.Optimizer, fresh: list[dict[str, Any]],
                        changes: list[tuple[str, Any, Any]]) -> dict[str, str]:
    """Copy the param-group values that changed config keys set from the fresh optimizer into the restored one.

    Returns a note for each changed optimizer key that this optimizer does not use.
    """
    notes = {}
    for key, old, new in changes:
        group_keys = GROUP_KEYS.get(key, ())
        if key == "train.optim_args":
            group_keys = tuple(parse_optim_args(old).keys() | parse_optim_args(new).keys())
        if not group_keys:
            continue
        used = False
        for group, fresh_group in zip(optimizer.param_groups, fresh):
            for name in group_keys:
                if name in fresh_group:
                    group[name] = fresh_group[name]
                    used = True
        if not used:
            notes[key] = f"not used by {type(optimizer).__name__}"
    return notes


def _advance(scheduler: Any, steps: int) -> None:
    """Step a freshly built scheduler to ``steps``: the schedule continues where the run is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": on purpose
        for _ in range(steps):
            scheduler.step()


@hookimpl
def restore_checkpoint(run: RunView, path: str | Path) -> bool:
    """Restore weights, optimizer, scheduler, RNG, state and plugin states from ``path``.

    ``path`` has passed :func:`check_checkpoint`; the run is set up. Hyper-parameters changed since the
    checkpoint are applied to the restored optimizer and scheduler and listed in one line.
    """
    path = Path(path)
    trainer_state = read_trainer_state(path)
    strategy, train = run.strategy, run.config.train
    changes = config_changes(trainer_state["config"], run.config.to_mapping())
    if trainer_state["steps_per_epoch"] != run.state.steps_per_epoch:
        # the data order's keys were compared in check_checkpoint: what is left is the data itself
        data_keys = [(key, old, new) for key, old, new in changes
                     if not key.startswith("train.") or key in DATA_TRAIN_KEYS]
        why = ("changed since the checkpoint: " + ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in data_keys)
               + "; resume with the checkpoint's values, or start a fresh output_dir") if data_keys else \
            "the train data changed (no key that selects it did: its contents differ); resume with the same data"
        raise CheckpointError(f"resume_from_checkpoint: {path} had {trainer_state['steps_per_epoch']} steps "
                              f"per epoch, this run has {run.state.steps_per_epoch}: {why}")
    # every file is read and checked against the run before the weights load, so a bad one
    # leaves the model as it was built
    engine_state = load_state_file(path, "engine_state.pt", expect=("strategy", "plugins"))
    with restoring(path, "engine_state.pt"):
        strategy.load_state_dict(engine_state["strategy"])
    rng_name = rng_file(strategy.rank)
    if (path / rng_name).is_file():
        saved_rng = load_state_file(path, rng_name, expect=("python", "python_pos", "torch"))
        with restoring(path, rng_name):
            set_rng_state(saved_rng)
    notes = {}
    if not train.reset_optimizer:
        fresh = [{k: v for k, v in group.items() if k != "params"} for group in run.optimizer.param_groups]
        strategy.load_optimizer(run.optimizer, path)
        notes = _apply_to_optimizer(run.optimizer, fresh, changes)
    if train.reset_optimizer or any(key in SCHEDULE_KEYS for key, _, _ in changes):
        _advance(run.scheduler, trainer_state["global_step"])
    else:
        scheduler_state = load_state_file(path, "scheduler.pt")
        with restoring(path, "scheduler.pt"):
            run.scheduler.load_state_dict(scheduler_state)
    strategy.load_model_weights(run.model, path)
    for key in PROGRESS_FIELDS:  # max_steps and steps_per_epoch belong to the resumed run's config
        setattr(run.state, key, trainer_state.get(key, getattr(run.state, key)))
    saved = engine_state["plugins"]
    for plugin in run.plugin_manager.call_order("load_checkpoint_state"):
        run.plugin_manager.call_plugin("load_checkpoint_state", plugin, run=run, state=saved.get(plugin, {}))
    line = f"resumed from {path} (step {run.state.global_step})"
    if changes:
        line += "; changed since the checkpoint: " + ", ".join(
            f"{key} {old!r} -> {new!r}" + (f" ({notes[key]})" if key in notes else "") for key, old, new in changes)
    if train.reset_optimizer:
        line += f"; optimizer {train.optim} and scheduler built fresh (train.reset_optimizer)"
    logger.info(line)
    return True
