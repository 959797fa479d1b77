"""Checkpoints: ``output_dir/checkpoint-<step>/``, written atomically, loaded without unpickling.

Layout (Hugging Face compatible)::

    checkpoint-<step>/
        config.json, model.safetensors    save_pretrained layout for HF models (sharded with
                                          model.safetensors.index.json when large); the
                                          safetensors file alone for other modules
        optimizer.pt, scheduler.pt        state dicts (loaded with weights_only=True)
        rng_state.pt                      python, numpy, torch, cuda RNG (rng_state_<rank>.pt
                                          for rank > 0); the data order is a function of
                                          (seed, epoch, step), recorded in trainer_state.json
        engine_state.pt                   strategy state + each plugin's checkpoint_state
        trainer_state.json                TrainState (step, epoch, log history, best metric
                                          and checkpoint), enabled plugins, data order
        tokenizer files                   when the run has a tokenizer
        checkpoint_complete               written last

Crash safety: everything is written into ``.tmp-checkpoint-<step>`` and renamed into place,
so a folder named ``checkpoint-<step>`` is always complete (the marker guards against copies).
A folder is deleted (rotation, overwrite) by first renaming it to ``.deleting-<name>``, so a
kill in the middle of a deletion never leaves a half-deleted ``checkpoint-<step>``. Leftover
``.tmp-`` / ``.deleting-`` folders of a killed run are removed when the next run starts.

Resume validates the checkpoint before the model is built (files present, plugin set, data
order, no truncated weights or state files) and restores it after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from .run import Run

logger = logging.getLogger("engine")

PREFIX = "checkpoint-"
TMP = ".tmp-"
DELETING = ".deleting-"
MARKER = "checkpoint_complete"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PROGRESS_FIELDS = ("global_step", "epoch", "num_input_tokens_seen", "log_history", "best_metric",
                   "best_global_step", "best_model_checkpoint")
REQUIRED = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "engine_state.pt")
# [train] keys that fix which sample comes at which step: a resume with other values would
# not continue the same run, so it is refused
DATA_ORDER_KEYS = ("seed", "per_device_train_batch_size", "gradient_accumulation_steps")


def _rng_file(rank: int) -> str:
    return "rng_state.pt" if rank == 0 else f"rng_state_{rank}.pt"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = re.fullmatch(PREFIX + r"(\d+)", path.name)
        if match and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def remove_partial(output_dir: Path) -> None:
    """Delete what a killed run left half written or half deleted."""
    if output_dir.is_dir():
        for path in output_dir.iterdir():
            if path.name.startswith((TMP + PREFIX, DELETING + PREFIX)):
                shutil.rmtree(path, ignore_errors=True)


def _delete(path: Path) -> None:
    """Remove a checkpoint folder so that no kill can leave it half deleted under its name."""
    trash = path.with_name(DELETING + path.name)
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash)


# ---------------------------------------------------------------------------- RNG


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:
        return state
    _, keys, pos, has_gauss, gauss = numpy.random.get_state()
    state["numpy"] = {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        np_state = state["numpy"]
        numpy.random.set_state(("MT19937", np_state["keys"].numpy().astype("uint32"), np_state["pos"],
                                np_state["has_gauss"], np_state["gauss"]))


# ---------------------------------------------------------------------------- model files


def _unique_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names that alias a tensor already kept (tied weights): safetensors refuses them."""
    seen, out = set(), {}
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tensor.shape, tensor.stride())
        if key not in seen:
            seen.add(key)
            out[name] = tensor.contiguous()
    return out


@contextlib.contextmanager
def _quiet_transformers():
    """No "Writing model shards" progress bar in the middle of training output."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def write_model(run: Run, folder: Path, model_state: dict[str, torch.Tensor]) -> None:
    """Weights (HF ``save_pretrained`` layout when the model has it) and tokenizer into ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(run.model, "save_pretrained"):
        with _quiet_transformers():
            run.model.save_pretrained(folder, state_dict=model_state, safe_serialization=True)
    else:
        save_file(_unique_tensors(model_state), str(folder / WEIGHTS))
    if hasattr(run.tokenizer, "save_pretrained"):
        run.tokenizer.save_pretrained(folder)


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (one file, or the shards an index names)."""
    if (folder / WEIGHTS_INDEX).is_file():
        index = json.loads((folder / WEIGHTS_INDEX).read_text())
        return [folder / name for name in sorted(set(index["weight_map"].values()))]
    return [folder / WEIGHTS]


def _check_safetensors(path: Path) -> None:
    """Refuse a missing or truncated safetensors file from its header, without loading it."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is missing")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else size
        if 8 + header_len > size:
            raise CheckpointError(f"checkpoint {path.parent}: {path.name} is truncated ({size} bytes)")
        try:
            header = json.loads(handle.read(header_len))
        except ValueError:
            raise CheckpointError(f"checkpoint {path.parent}: {path.name} is not a safetensors file") from None
    data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + header_len + data_end != size:
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is truncated or padded "
                              f"({size} bytes, header says {8 + header_len + data_end})")


def load_weights(model: torch.nn.Module, folder: str | Path, device: Any = "cpu") -> None:
    """Load a checkpoint's or a final model's safetensors weights into ``model`` (strict)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    files = _weight_files(folder)
    state: dict[str, torch.Tensor] = {}
    for path in files:
        _check_safetensors(path)
        try:
            state.update(load_file(str(path), device=str(device)))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"checkpoint {folder}: cannot load {path.name}: {exc}") from None
    expected = model.state_dict()
    # tied weights are stored once: any name missing from the file must alias a stored tensor
    aliases = {}
    for name, tensor in expected.items():
        aliases.setdefault((tensor.data_ptr(), tensor.shape), []).append(name)
    missing = [name for name in expected if name not in state and not any(
        alias in state for alias in aliases[(expected[name].data_ptr(), expected[name].shape)])]
    unexpected = [name for name in state if name not in expected]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {folder}: weights do not match the model (missing "
                              f"{missing[:5] or 'none'}, unexpected {unexpected[:5] or 'none'})")
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatch: a different model config
        raise CheckpointError(f"checkpoint {folder}: weights do not fit the model: {exc}") from None


# ---------------------------------------------------------------------------- best model


def best_metric_name(run: Run) -> str | None:
    """``train.metric_for_best_model`` as an evaluation key (``loss`` -> ``eval_loss``)."""
    name = run.config.train.metric_for_best_model
    if name is None:
        return None
    return name if name.startswith("eval_") else f"eval_{name}"


def metric_value(run: Run, metrics: dict[str, float]) -> float:
    """The value of ``metric_for_best_model`` in ``metrics``; a clear error when absent."""
    name = best_metric_name(run)
    if name not in metrics:
        raise ConfigError(f"train.metric_for_best_model: {name!r} is not among the evaluation metrics "
                          f"({', '.join(sorted(metrics))})")
    return float(metrics[name])


def improves(run: Run, value: float, reference: float | None, threshold: float = 0.0) -> bool:
    """Whether ``value`` beats ``reference`` by more than ``threshold`` in the configured direction."""
    if reference is None:
        return True
    gain = value - reference if run.config.train.greater_is_better else reference - value
    return gain > threshold


def note_evaluation(run: Run, metrics: dict[str, float]) -> None:
    """Track the best metric (Trainer's rule); the next save at this step becomes the best checkpoint."""
    if best_metric_name(run) is None:
        return
    value = metric_value(run, metrics)
    state = run.state
    if improves(run, value, state.best_metric):
        state.best_metric, state.best_global_step = value, state.global_step


def _rotate(run: Run) -> None:
    """Delete the oldest checkpoints beyond ``save_total_limit``, never the best one.

    As in Trainer: the best checkpoint is kept in the second-newest slot, so with a limit of 1
    and a best that is not the newest, two are kept.
    """
    limit = run.config.train.save_total_limit
    if not limit:
        return
    ordered = list_checkpoints(run.output_dir)
    best = run.state.best_model_checkpoint
    best_path = next((p for p in ordered if str(p) == best), None)
    if best_path is not None and best_path != ordered[-1]:
        ordered.remove(best_path)
        ordered.insert(len(ordered) - 1, best_path)
        limit = max(limit, 2)
    for path in ordered[: max(0, len(ordered) - limit)]:
        _delete(path)


# ---------------------------------------------------------------------------- save


def save(run: Run) -> Path:
    """Write a checkpoint for the current step, rotate old ones; returns its path."""
    strategy, state = run.strategy, run.state
    run.hook.on_eval_mode(run=run)
    final = run.output_dir / f"{PREFIX}{state.global_step}"
    tmp = run.output_dir / f"{TMP}{final.name}"
    if state.best_global_step == state.global_step:
        state.best_model_checkpoint = str(final)
    plugin_states = run.plugin_manager.per_plugin("checkpoint_state", run=run)
    model_state = strategy.model_state_dict(run.model)
    optimizer_state = strategy.optimizer_state_dict(run.optimizer)
    if strategy.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    strategy.barrier()
    torch.save(_rng_state(), tmp / _rng_file(strategy.rank))
    strategy.barrier()
    if strategy.is_main_process:
        write_model(run, tmp, model_state)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(run.scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save({"strategy": strategy.state_dict(), "plugins": plugin_states}, tmp / "engine_state.pt")
        train = run.config.train
        trainer_state = {**dataclasses.asdict(state), "plugins": list(run.config.plugins),
                         "world_size": strategy.world_size,
                         "data_order": {key: getattr(train, key) for key in DATA_ORDER_KEYS}}
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        (tmp / MARKER).write_text("")
        if final.exists():
            _delete(final)
        os.replace(tmp, final)
        _rotate(run)
    strategy.barrier()
    if strategy.is_main_process:
        logger.debug("saved %s", final)
        run.hook.on_checkpoint_saved(run=run, path=str(final))
    return final


def save_final_model(run: Run) -> None:
    """The trained model (and tokenizer) in ``output_dir``, loadable with ``from_pretrained``."""
    model_state = run.strategy.model_state_dict(run.model)
    if run.strategy.is_main_process:
        write_model(run, run.output_dir, model_state)
        logger.info("saved the final model to %s", run.output_dir)
    run.strategy.barrier()


def load_best_model(run: Run) -> None:
    """Load the best checkpoint's weights into the model (``load_best_model_at_end``)."""
    best = run.state.best_model_checkpoint
    if best is None:
        logger.warning("load_best_model_at_end: no checkpoint was saved after an evaluation; "
                       "keeping the last weights")
        return
    run.strategy.load_model_weights(run.model, Path(best))
    logger.info("loaded the best model from %s (%s = %s)", best, best_metric_name(run), run.state.best_metric)


# ---------------------------------------------------------------------------- resume


def find_resume_checkpoint(run: Run) -> Path | None:
    """The checkpoint ``train.resume_from_checkpoint`` names, validated; None to start fresh.

    Runs before the model is built, so a bad checkpoint stops the run before anything loads.
    """
    spec = run.config.train.resume_from_checkpoint
    if spec is None or spec is False:
        return None
    if spec is True:
        found = list_checkpoints(run.output_dir)
        if not found:
            logger.info("resume_from_checkpoint = true but %s holds no checkpoint; starting from scratch",
                        run.output_dir)
            return None
        path = found[-1]
    else:
        path = Path(spec)
    validate(run, path)
    return path


def validate(run: Run, path: Path) -> None:
    """Refuse a folder that is not a complete checkpoint of this run, naming what is wrong."""
    if not path.is_dir():
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a folder")
    weights = [WEIGHTS_INDEX] if (path / WEIGHTS_INDEX).is_file() else [WEIGHTS]
    missing = [name for name in (MARKER, *REQUIRED, *weights) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a complete checkpoint "
                              f"(missing {', '.join(missing)})")
    try:
        trainer_state = json.loads((path / "trainer_state.json").read_text())
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path}: trainer_state.json is not valid JSON: {exc}") from None
    if trainer_state.get("plugins") != list(run.config.plugins):
        saved, now = set(trainer_state.get("plugins", [])), set(run.config.plugins)
        raise CheckpointError(
            f"resume_from_checkpoint: {path} was made with plugins {sorted(saved)}, this run enables "
            f"{sorted(now)} (only in checkpoint: {sorted(saved - now) or 'none'}; only in run: "
            f"{sorted(now - saved) or 'none'})")
    train = run.config.train
    changed = [f"train.{key} = {getattr(train, key)!r} (checkpoint: {value!r})"
               for key, value in trainer_state.get("data_order", {}).items() if getattr(train, key) != value]
    if changed:
        raise CheckpointError(f"resume_from_checkpoint: {path} was trained with a different data order: "
                              f"{'; '.join(changed)}. Resume with the checkpoint's values, or start a "
                              "fresh output_dir")
    for weights_file in _weight_files(path):
        _check_safetensors(weights_file)
    for name in [*REQUIRED[1:], *(p.name for p in path.glob("rng_state*.pt"))]:
        try:  # torch.save files are zip archives: a truncated one has no central directory
            zipfile.ZipFile(path / name).close()
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointError(f"checkpoint {path}: {name} is truncated or corrupt ({exc})") from None


def _load(path: Path, name: str, device: Any = "cpu") -> Any:
    try:
        return torch.load(path / name, map_location=device, weights_only=True)
    except Exception as exc:  # foreign or damaged files: say which one
        raise CheckpointError(f"checkpoint {path}: cannot load {name}: {exc}") from None


def load(run: Run, path: str | Path) -> None:
    """Restore weights, optimizer, scheduler, RNG, state and plugin states from ``path``.

    ``path`` has passed :func:`validate`; the run is set up.
    """
    path = Path(path)
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    strategy = run.strategy
    if trainer_state["world_size"] != strategy.world_size:
        raise CheckpointError(f"resume_from_checkpoint: {path} was made by {trainer_state['world_size']} "
                              f"processes, this run has {strategy.world_size}")
    if trainer_state["steps_per_epoch"] != run.state.steps_per_epoch:
        raise CheckpointError(f"resume_from_checkpoint: {path} had {trainer_state['steps_per_epoch']} steps "
                              f"per epoch, this run has {run.state.steps_per_epoch}: the train data changed")
    strategy.load_model_weights(run.model, path)
    strategy.load_optimizer_state_dict(run.optimizer, _load(path, "optimizer.pt", strategy.device))
    run.scheduler.load_state_dict(_load(path, "scheduler.pt"))
    engine_state = _load(path, "engine_state.pt")
    strategy.load_state_dict(engine_state["strategy"])
    rng_file = _rng_file(strategy.rank)
    if (path / rng_file).is_file():
        _set_rng_state(_load(path, rng_file))
    for key in PROGRESS_FIELDS:  # max_steps and steps_per_epoch belong to the resumed run's config
        setattr(run.state, key, trainer_state.get(key))
    saved = engine_state["plugins"]
    for plugin in run.plugin_manager.call_order("load_checkpoint_state"):
        run.plugin_manager.call_plugin("load_checkpoint_state", plugin, run=run, state=saved.get(plugin, {}))
    logger.info("resumed from %s (step %d)", path, run.state.global_step)
