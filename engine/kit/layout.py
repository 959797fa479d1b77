"""The names of the files and folders a run writes into ``output_dir`` (see :mod:`engine.layout` for the tree),
importable without torch: for a process that only moves a run's files, such as engine-hub's upload process,
whose start would otherwise import torch (~3 s of CPU taken from training)."""

from __future__ import annotations

from ..layout import (FINAL_MARKER, FINAL_TMP, MARKER, METRICS, MODEL_FILES, PREFIX, RECORD, RUN_FILES, TMP, WEIGHTS,
                      WEIGHTS_INDEX)

__all__ = ["FINAL_MARKER", "FINAL_TMP", "MARKER", "METRICS", "MODEL_FILES", "PREFIX", "RECORD", "RUN_FILES", "TMP",
           "WEIGHTS", "WEIGHTS_INDEX"]
