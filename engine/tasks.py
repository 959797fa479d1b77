"""Deprecated: tasks moved to :mod:`engine.builtin.tasks` (the task builtin), the generation behind
``predict_with_generate`` to :mod:`engine.builtin.generation`. Importing ``engine.tasks`` still works
for one release."""

import warnings

from engine.builtin.data.task_rows import label_ids_by_name
from engine.builtin.generation import Generation, check_generation_values, generate, generation
from engine.builtin.tasks import (
    AUTO_CLASSES, CAUSAL_LM, CLASS_SUFFIXES, CLASSIFICATION, SEQ2SEQ, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION,
    auto_class, check_can_generate, check_labels, collator, label_names, label_settings, task_of_class,
)
from engine.builtin.tasks import check_task_keys as configure
from engine.builtin.tasks import task_of as resolve_task

warnings.warn("engine.tasks moved to engine.builtin.tasks (generation: engine.builtin.generation); the old path "
              "goes away in the next release", DeprecationWarning, stacklevel=2)
