"""Checkpoint and model files, for a strategy's checkpoint I/O or a checkpoint target (a hub push).

* :class:`ModelWeights` (``engine.ModelWeights``) says which of the model's weights a checkpoint
  and the final model hold, and writes and reads them: the answer to ``checkpoint_weights``
  (``builtin.weights``: every weight; peft subclasses it for its adapter).
* :func:`write_model` writes a model's weights (and config) into a folder as the engine does;
  :func:`check_finite_weights` refuses non-finite weights first, :func:`diverged` is the error
  a strategy raises for them.
* :func:`read_weights` reads a folder's weights for a model (:func:`load_weights` loads them into
  it); :func:`load_state_file` loads one checkpoint file with ``weights_only=True``;
  :func:`restoring` turns a failure while restoring ``name`` into a :class:`CheckpointError`
  naming the checkpoint; :func:`read_trainer_state` reads a checkpoint's trainer_state.json, its
  structure checked; :func:`verify_manifest` checks files against their manifest (sizes, checksums).
* :func:`check_model_folder` refuses a model folder (``train.model``, the best checkpoint, the
  one ``engine evaluate`` loads) whose weights are missing or damaged; :func:`weight_files` lists
  a folder's safetensors files and :func:`check_safetensors` checks one from its header (resume
  checks a checkpoint's weights with them).
* :func:`final_model_files` lists the final model's files (what a target uploads);
  :func:`list_checkpoints` the complete checkpoints of an output_dir, oldest first; :func:`snapshot_files`
  links a checkpoint's files into a folder an upload reads while rotation goes on;
  :func:`versions` are the versions the run record holds (for a model card).
* :func:`save_pretrained` writes a model in its ``save_pretrained`` layout, quietly, without importing DeepSpeed.
* File names: :data:`MARKER` (a checkpoint's manifest, written last), :data:`FINAL_MARKER` (the
  final model's), :data:`TMP` (the prefix of folders being written), :data:`WEIGHTS` and
  :data:`WEIGHTS_INDEX` (safetensors weights, single or sharded).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import (check_finite_weights, diverged, file_checksums, final_model_files, list_checkpoints,
                          load_state_file, read_manifest, restoring)
from ..errors import CheckpointError, ConfigError
from ..layout import FINAL_MARKER, FINAL_TMP, MARKER, RECORD, TMP, WEIGHTS, WEIGHTS_INDEX
from ..rundir import versions

if TYPE_CHECKING:
    from ..state import RunView

__all__ = ["ModelWeights", "write_model", "read_weights", "load_weights", "load_state_file", "restoring",
           "read_trainer_state", "verify_manifest",
           "check_finite_weights", "diverged", "check_model_folder", "weight_files", "check_safetensors",
           "final_model_files", "list_checkpoints", "snapshot_files", "save_pretrained",
           "versions", "CheckpointError", "MARKER", "FINAL_MARKER", "TMP", "WEIGHTS", "WEIGHTS_INDEX"]


def _unique_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names that alias a tensor already kept (tied weights): safetensors refuses them."""
    seen, out = set(), {}
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tensor.shape, tensor.stride())
        if key not in seen:
            seen.add(key)
            out[name] = tensor.contiguous()
    return out


_SAVING = threading.Lock()


def save_pretrained(model: Any, folder: Path, model_state: dict[str, torch.Tensor]) -> None:
    """``model.save_pretrained(folder)`` with ``model_state`` as safetensors, quietly and without DeepSpeed.

    Quiet: no "Writing model shards" progress bar in the middle of training output. Without DeepSpeed:
    ``save_pretrained`` unwraps the model through accelerate, which imports DeepSpeed (and MLflow through it),
    3-6 s, wherever it is installed, to test whether the model is a ``DeepSpeedEngine``; a model in a process
    that never imported DeepSpeed cannot be one, so then the test is skipped."""
    import sys

    import accelerate.utils.other as accelerate_other
    from transformers.utils import logging as hf_logging

    with _SAVING:  # one save at a time restores what it swapped
        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        deepspeed_test = accelerate_other.is_deepspeed_available
        if "deepspeed" not in sys.modules:
            accelerate_other.is_deepspeed_available = lambda: False
        try:
            model.save_pretrained(folder, state_dict=model_state, safe_serialization=True)
        finally:
            accelerate_other.is_deepspeed_available = deepspeed_test
            if was_enabled:
                hf_logging.enable_progress_bar()


def write_model(run: RunView, folder: Path, model_state: dict[str, torch.Tensor]) -> None:
    """Weights (HF ``save_pretrained`` layout when the model has it) and tokenizer into ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(run.model, "save_pretrained"):
        save_pretrained(run.model, folder, model_state)
    else:
        save_file(_unique_tensors(model_state), str(folder / WEIGHTS))
    if hasattr(run.tokenizer, "save_pretrained"):
        run.tokenizer.save_pretrained(folder)


# peft's adapter layout (a LoRA checkpoint holds these instead of the whole model)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ModelWeights:
    """Which of the model's weights a checkpoint and the final model hold, and how they are written and read.

    ``run.weights`` is one of these: the answer to the ``checkpoint_weights`` hook, asked once after
    ``configure``. The default (``builtin.weights``) holds every weight: ``save_pretrained``'s layout
    for HF models (``model.safetensors``), the safetensors file alone for other modules. A plugin
    that trains a part of a frozen model (peft adapters) answers with a subclass: its checkpoints
    are then complete with the files :meth:`files` names (checksummed like any other), and resume,
    ``load_best_model_at_end`` and ``engine evaluate --checkpoint`` read them back through
    :meth:`load` (:meth:`check_kind` first refuses a folder of the other kind). Strategies that
    write sharded or engine-specific files (FSDP, DeepSpeed) do not consult it.
    """

    def select(self, run: RunView, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The part of the full state dict that is saved (checked finite first)."""
        return model_state

    def files(self, folder: Path) -> tuple[str, ...]:
        """The weight files :meth:`write` put into ``folder`` (required to resume from it)."""
        return (WEIGHTS_INDEX if (folder / WEIGHTS_INDEX).is_file() else WEIGHTS,)

    def write(self, run: RunView, folder: Path, state: dict[str, torch.Tensor]) -> None:
        """Write the selected ``state`` (and the tokenizer) into a checkpoint ``folder``."""
        write_model(run, folder, state)

    def write_final(self, run: RunView, folder: Path, state: dict[str, torch.Tensor]) -> None:
        """Write the final model into ``folder`` (its files are then moved into output_dir)."""
        self.write(run, folder, state)

    def load(self, run: RunView, model: torch.nn.Module, folder: Path, device: Any) -> None:
        """Load what :meth:`write` saved in ``folder`` into ``model``; a mismatch is a CheckpointError."""
        load_weights(model, folder, device)

    def check_kind(self, folder: Path, key: str) -> None:
        """Refuse a folder whose weights are not the kind this run loads (an adapter without the plugin that
        loads adapters, a whole model with it), saying which it is and what to change."""
        wanted = self.files(folder)
        if all((folder / name).exists() for name in wanted):
            return
        loads_adapters = set(ADAPTER_FILES) <= set(wanted)
        if not loads_adapters and all((folder / name).is_file() for name in ADAPTER_FILES):
            kind = "an adapter checkpoint" if (folder / MARKER).is_file() else "an adapter"
            raise CheckpointError(f"{key}: {folder} is {kind} ({', '.join(ADAPTER_FILES)}: the adapter alone, not "
                                  "the whole model), which only the peft plugin loads; enable it with plugins = "
                                  "[\"peft\"] in the run file, or --plugins +peft")
        if loads_adapters and any((folder / name).is_file() for name in (WEIGHTS, WEIGHTS_INDEX)):
            raise CheckpointError(f"{key}: {folder} holds a whole model ({WEIGHTS}), and this run's plugins load "
                                  f"adapter files ({', '.join(wanted)}); use it without the adapter plugin (peft), "
                                  f"or train a new adapter on these weights with train.model = '{folder}'")

    def check_folder(self, folder: Path, key: str) -> None:
        """Refuse a model folder to load weights from (``engine evaluate --checkpoint``): damaged files
        (:func:`check_model_folder`), or weights of the other kind (:meth:`check_kind`)."""
        check_model_folder(folder, key)
        self.check_kind(folder, key)


_CHECKED_FOLDERS: set[tuple[Any, ...]] = set()  # model folders found intact, by the stat of their files


def _folder_stamp(folder: Path) -> tuple[Any, ...]:
    """The folder and the name, size and modification time of each file in it: changes when any file does."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    return (os.path.realpath(folder), *files)


def check_model_folder(folder: Path, key: str) -> None:
    """Refuse a model folder (``key`` names where it came from) whose weights are missing or damaged.

    A folder the engine wrote is checked against its manifest (sizes and checksums); any other
    must have config.json and weights, checked against their safetensors headers. A run folder
    whose final save did not finish is refused. A folder found intact is not read again while its
    files stay as they were (configure, the task and the model build each ask: checksums read
    every byte of the weights).
    """
    stamp = _folder_stamp(folder) if folder.is_dir() else None
    if stamp is not None and stamp in _CHECKED_FOLDERS:
        return
    _check_model_folder(folder, key)
    if stamp is not None:
        _CHECKED_FOLDERS.add(stamp)


def _check_model_folder(folder: Path, key: str) -> None:
    for marker in (FINAL_MARKER, MARKER):
        if (folder / marker).is_file():
            try:  # the model's files; a checkpoint's optimizer and other state files are not read
                files = read_manifest(folder, marker)["files"]
                verify_manifest(folder, marker, [name for name in files if not name.endswith(".pt")])
            except CheckpointError as exc:
                raise CheckpointError(f"{key}: {exc}") from None
            return
    if (folder / RECORD).is_file() or (folder / FINAL_TMP).exists():
        saved = list_checkpoints(folder)
        hint = f"; use one of its checkpoints, e.g. {saved[-1]}" if saved else ""
        raise ConfigError(f"{key}: {folder} holds no complete final model (the run's save did not finish){hint}")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{key}: folder {folder} has no config.json")
    names = ("model.safetensors", WEIGHTS_INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json")
    if not any((folder / name).is_file() for name in names):
        raise ConfigError(f"{key}: {folder} has config.json but no weights ({', '.join(names)}); to train from "
                          f"random weights, name the config file: train.model = '{folder / 'config.json'}'")
    if (folder / WEIGHTS).is_file() or (folder / WEIGHTS_INDEX).is_file():
        for path in weight_files(folder):
            try:
                check_safetensors(path)
            except CheckpointError as exc:
                raise CheckpointError(f"{key}: {exc}") from None


def snapshot_files(source: Path, target: Path, names: list[str] | None = None) -> Path:
    """``target`` holding hard links of ``source``'s files (or only ``names``; a copy where a link fails):
    checkpoint files are never rewritten in place, so a snapshot stays intact while rotation deletes
    ``source``, for an upload that outlives it (the hub and flyte plugins)."""
    target.mkdir(parents=True, exist_ok=True)
    files = [source / name for name in names] if names is not None else [p for p in source.rglob("*") if p.is_file()]
    for path in files:
        link = target / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, link)
        except OSError:
            shutil.copy2(path, link)
    return target


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (one file, or the shards an index names)."""
    index_path = folder / WEIGHTS_INDEX
    if not index_path.is_file():
        return [folder / WEIGHTS]
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{folder}: {WEIGHTS_INDEX} is not valid JSON") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(name, str) and name and "/" not in name and "\\" not in name for name in weight_map.values()):
        raise CheckpointError(f"{folder}: {WEIGHTS_INDEX} has no weight_map of tensor name -> file name in the folder")
    return [folder / name for name in sorted(set(weight_map.values()))]


# bytes per element of each safetensors dtype
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
                "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}


def check_safetensors(path: Path) -> None:
    """Refuse a missing, truncated or malformed safetensors file from its header, without loading it."""
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: {path.name} is missing")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else size
        if 8 + header_len > size:
            raise CheckpointError(f"{path.parent}: {path.name} is truncated ({size} bytes)")
        try:
            header = json.loads(handle.read(header_len))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{path.parent}: {path.name} is not a safetensors file") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.parent}: {path.name} has a malformed header (not a JSON object)")
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _tensor_entry_problem(entry)
        if problem:
            raise CheckpointError(f"{path.parent}: {path.name} has a malformed header: tensor {name!r} {problem}")
        data_end = max(data_end, entry["data_offsets"][1])
    if 8 + header_len + data_end != size:
        raise CheckpointError(f"{path.parent}: {path.name} is truncated or padded "
                              f"({size} bytes, header says {8 + header_len + data_end})")


def _tensor_entry_problem(entry: Any) -> str | None:
    """What is wrong with one tensor's entry of a safetensors header (None: nothing)."""
    if not isinstance(entry, dict):
        return "is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        return f"has dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        return f"has shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return f"has data_offsets {offsets!r}"
    if offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_BYTES[dtype]:
        return f"of shape {shape} {dtype} does not fill its {offsets[1] - offsets[0]} bytes"
    return None


def read_weights(model: torch.nn.Module, folder: str | Path, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """A model folder's safetensors weights, checked against ``model``: one tensor per name of its state dict.

    Tied weights are stored once: a name missing from the files is filled from the stored name
    it shares its tensor with. Names that are missing or unexpected are a CheckpointError.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        check_safetensors(path)
        try:
            state.update(load_file(str(path), device=str(device)))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"checkpoint {folder}: cannot load {path.name}: {exc}") from None
    tied: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        tied.setdefault(id(tensor), []).append(name)
    for names in tied.values():
        stored = next((name for name in names if name in state), None)
        for name in names:
            if stored is not None and name not in state:
                state[name] = state[stored]
    expected = model.state_dict().keys()
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {folder}: weights do not match the model (missing "
                              f"{missing[:5] or 'none'}, unexpected {unexpected[:5] or 'none'})")
    return state


def load_weights(model: torch.nn.Module, folder: str | Path, device: Any = "cpu") -> None:
    """Load a checkpoint's or a final model's safetensors weights into ``model`` (strict)."""
    state = read_weights(model, folder, device)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:  # shape mismatch: a different model config
        raise CheckpointError(f"checkpoint {folder}: weights do not fit the model: {exc}") from None


# ---------------------------------------------------------------------------- reading checkpoints


def verify_manifest(folder: Path, marker: str = MARKER, names: list[str] | None = None) -> None:
    """Check that the files a manifest lists (or ``names`` of them) are there with their size and checksum."""
    files = read_manifest(folder, marker)["files"]
    wanted = list(files) if names is None else names
    for name in wanted:
        entry = files.get(name)
        path = folder / name
        if entry is None:
            raise CheckpointError(f"{folder}: {name} is not in its manifest ({marker})")
        if not path.is_file():
            raise CheckpointError(f"{folder}: {name} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{folder}: {name} is truncated or padded ({size} bytes, saved with {entry['bytes']})")
    for name, digest in file_checksums(folder, wanted).items():
        if digest != files[name].get("xxh3_64"):
            raise CheckpointError(f"{folder}: {name} does not match its checksum (its bytes changed after the "
                                  "save); use another checkpoint")


# trainer_state.json: key -> the types its value may have (what a resume requires)
_TRAINER_STATE = {"global_step": (int,), "epoch": (int, float), "steps_per_epoch": (int,), "log_history": (list,),
                  "plugins": (list,), "world_size": (int,), "data_order": (dict,), "config": (dict,),
                  "strategy": (str,),
                  "num_input_tokens_seen": (int,), "num_skipped_steps": (int,), "best_metric": (int, float, type(None)),
                  "best_global_step": (int, type(None)), "best_model_checkpoint": (str, type(None))}


def read_trainer_state(path: Path) -> dict[str, Any]:
    """trainer_state.json, its structure checked: each failure names the key and what was found."""
    where = f"checkpoint {path}: trainer_state.json"
    try:
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} holds a JSON {type(state).__name__}, expected an object")
    for key, types in _TRAINER_STATE.items():
        value = state.get(key)
        if key not in state or not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            found = "missing" if key not in state else f"a {type(value).__name__} ({value!r:.40})"
            raise CheckpointError(f"{where}: {key} is {found}, expected {' or '.join(t.__name__ for t in types)}")
    if not all(isinstance(name, str) for name in state["plugins"]) or not isinstance(state["config"].get("train"), dict):
        raise CheckpointError(f"{where}: plugins must be a list of names and config a composed run config")
    return state
