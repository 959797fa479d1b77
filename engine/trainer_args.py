"""Deprecated: the TrainingArguments table moved to :mod:`engine.builtin.trainer_args`, its types to
:mod:`engine.kit.mappings`."""

import warnings

from engine.builtin.trainer_args import (ENABLED_BY, FIELDS, LEGACY, SEQ2SEQ_FIELDS, STRATEGIES,  # noqa: F401
                                         TRACKERS, TRANSFORMERS_VERSION, answer_for)
from engine.kit.mappings import (ACCEPTED, BUILTIN, KINDS, NOT_YET, PLUGIN, REFUSED, Answer, Conversion,  # noqa: F401
                                 accepted, builtin, load_json, plugin, read_json_file, refused, show)

warnings.warn("engine.trainer_args is deprecated: the table is engine.builtin.trainer_args, its types "
              "engine.kit.mappings",
              DeprecationWarning, stacklevel=2)
