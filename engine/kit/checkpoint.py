"""Checkpoint and model files, for a strategy's checkpoint I/O or a checkpoint target (a hub push).

* :func:`write_model` writes a model's weights (and config) into a folder as the engine does;
  :func:`check_finite_weights` refuses non-finite weights first, :func:`diverged` is the error
  a strategy raises for them.
* :func:`read_weights` reads a folder's weights for a model; :func:`load_state_file` loads one
  checkpoint file with ``weights_only=True``; :func:`restoring` turns a failure while restoring
  ``name`` into a :class:`CheckpointError` naming the checkpoint.
* :func:`final_model_files` lists the final model's files (what a target uploads);
  :func:`versions` are the versions the run record holds (for a model card).
* :func:`quiet_transformers` silences transformers' warnings while loading a model.
* File names: :data:`MARKER` (a checkpoint's manifest, written last), :data:`FINAL_MARKER` (the
  final model's), :data:`TMP` (the prefix of folders being written), :data:`WEIGHTS` and
  :data:`WEIGHTS_INDEX` (safetensors weights, single or sharded).
"""

from ..checkpoint import (check_finite_weights, diverged, final_model_files, load_state_file, quiet_transformers,
                          read_weights, restoring, write_model)
from ..errors import CheckpointError
from ..layout import FINAL_MARKER, MARKER, TMP, WEIGHTS, WEIGHTS_INDEX
from ..rundir import versions

__all__ = ["write_model", "read_weights", "load_state_file", "restoring", "check_finite_weights", "diverged",
           "final_model_files", "quiet_transformers", "versions", "CheckpointError", "MARKER", "FINAL_MARKER", "TMP",
           "WEIGHTS", "WEIGHTS_INDEX"]
