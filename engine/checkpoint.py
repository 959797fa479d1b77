"""Checkpoints: ``output_dir/checkpoint-<step>/``, written atomically, loaded without unpickling.

Layout (Hugging Face compatible)::

    checkpoint-<step>/
        config.json, model.safetensors    save_pretrained layout for HF models
                                          (model.safetensors alone for other modules)
        optimizer.pt, scheduler.pt        state dicts (loaded with weights_only=True)
        rng_state.pt                      python, numpy, torch, cuda RNG (rng_state_<rank>.pt
                                          for rank > 0)
        engine_state.pt                   strategy state + each plugin's checkpoint_state
        trainer_state.json                TrainState, enabled plugins
        tokenizer files                   when the run has a tokenizer
        checkpoint_complete               written last

Everything is written into ``.tmp-checkpoint-<step>`` and renamed into place, so a folder
named ``checkpoint-<step>`` is always complete; the marker guards against copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import CheckpointError

if TYPE_CHECKING:
    from .run import Run

PREFIX = "checkpoint-"
MARKER = "checkpoint_complete"
WEIGHTS = "model.safetensors"
PROGRESS_FIELDS = ("global_step", "epoch", "num_input_tokens_seen", "log_history", "best_metric",
                   "best_model_checkpoint")
REQUIRED = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "engine_state.pt")


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


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:
        return state
    kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
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
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def save(run: Run) -> Path:
    """Write a checkpoint for the current step; returns its path."""
    from safetensors.torch import save_file

    strategy, state = run.strategy, run.state
    run.hook.on_eval_mode(run=run)
    final = run.output_dir / f"{PREFIX}{state.global_step}"
    tmp = run.output_dir / f".tmp-{PREFIX}{state.global_step}"
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
        if hasattr(run.model, "save_pretrained"):
            with _quiet_transformers():
                run.model.save_pretrained(tmp, state_dict=model_state, safe_serialization=True)
        else:
            save_file(_unique_tensors(model_state), str(tmp / WEIGHTS))
        if hasattr(run.tokenizer, "save_pretrained"):
            run.tokenizer.save_pretrained(tmp)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(run.scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save({"strategy": strategy.state_dict(), "plugins": plugin_states}, tmp / "engine_state.pt")
        trainer_state = {**dataclasses.asdict(state), "plugins": list(run.config.plugins),
                         "world_size": strategy.world_size}
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        (tmp / MARKER).write_text("")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    strategy.barrier()
    if strategy.is_main_process:
        run.hook.on_checkpoint_saved(run=run, path=str(final))
    return final


def resume_if_requested(run: Run) -> Path | None:
    """Restore the checkpoint ``train.resume_from_checkpoint`` names, if any."""
    spec = run.config.train.resume_from_checkpoint
    if spec is None or spec is False:
        return None
    if spec is True:
        found = list_checkpoints(run.output_dir)
        if not found:
            if run.strategy.is_main_process:
                print(f"engine: resume_from_checkpoint = true but {run.output_dir} holds no checkpoint; "
                      "starting from scratch")
            return None
        path = found[-1]
    else:
        path = Path(spec)
    load(run, path)
    return path


def _load(path: Path, name: str, device: Any = "cpu") -> Any:
    try:
        return torch.load(path / name, map_location=device, weights_only=True)
    except Exception as exc:  # truncated or foreign files: say which one
        raise CheckpointError(f"checkpoint {path}: cannot load {name}: {exc}") from None


def load(run: Run, path: str | Path) -> None:
    """Restore weights, optimizer, scheduler, RNG, state and plugin states from ``path``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a folder")
    missing = [name for name in (MARKER, *REQUIRED, WEIGHTS) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a complete checkpoint "
                              f"(missing {', '.join(missing)})")
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    if trainer_state.get("plugins") != list(run.config.plugins):
        saved, now = set(trainer_state.get("plugins", [])), set(run.config.plugins)
        raise CheckpointError(
            f"resume_from_checkpoint: {path} was made with plugins {sorted(saved)}, this run enables "
            f"{sorted(now)} (only in checkpoint: {sorted(saved - now) or 'none'}; only in run: "
            f"{sorted(now - saved) or 'none'})")
    try:
        load_model(run.model, str(path / WEIGHTS), device=str(run.strategy.device))
    except (SafetensorError, RuntimeError, OSError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot load {WEIGHTS}: {exc}") from None
    device = run.strategy.device
    run.strategy.load_optimizer_state_dict(run.optimizer, _load(path, "optimizer.pt", device))
    run.scheduler.load_state_dict(_load(path, "scheduler.pt"))
    engine_state = _load(path, "engine_state.pt")
    run.strategy.load_state_dict(engine_state["strategy"])
    rng_file = _rng_file(run.strategy.rank)
    if (path / rng_file).is_file():
        _set_rng_state(_load(path, rng_file))
    for key in PROGRESS_FIELDS:  # max_steps and steps_per_epoch belong to the resumed run's config
        setattr(run.state, key, trainer_state[key])
    saved = engine_state["plugins"]
    for plugin in run.plugin_manager.call_order("load_checkpoint_state"):
        run.plugin_manager.call_plugin("load_checkpoint_state", plugin, run=run, state=saved.get(plugin, {}))
