"""Deprecated: the model building moved to :mod:`engine.builtin.models` (the model builtin); the model
config to :mod:`engine.kit.models`. Importing ``engine.models`` still works for one release."""

import warnings

from engine.builtin.data.checks import input_limits
from engine.builtin.models import build_model, check_forward, check_model, check_positions
from engine.builtin.tasks import fill_pad_token_id
from engine.kit.models import BUILTIN_CONFIGS, POSITION_ATTRIBUTES, max_positions, model_config

warnings.warn("engine.models moved to engine.builtin.models (model_config, max_positions: engine.kit.models); the "
              "old path goes away in the next release", DeprecationWarning, stacklevel=2)
