"""Deprecated: the data layer moved to :mod:`engine.builtin.data` (the data builtin, a package).

Importing ``engine.data`` still works for one release and re-exports its public names.
"""

import warnings

from engine.builtin.data.build import build_datasets, needs_tokenizer, prepare_given, tokenized_max_length
from engine.builtin.data.chat import render_chat
from engine.builtin.data.checks import ModelLimits, check_token_rows, input_limits, token_row_problem
from engine.builtin.data.collators import DataCollator, FlatteningCollator, collator_for, enable_document_packing
from engine.builtin.data.prepare import prepare
from engine.builtin.data.sources import BadRow, column_names, embedded_corpus, load_source, source_files
from engine.builtin.data.streaming import ResumableStream
from engine.builtin.data.tokenizer import (
    EOS_TOKEN, PAD_TOKEN, build_tokenizer, has_tokenizer, load_tokenizer, train_tokenizer,
)
from engine.kit.loaders import example_lengths, forward_columns, without_unused_columns
from engine.loss import IGNORE_INDEX
from engine.state import Datasets
from engine.util import is_datasets_object

warnings.warn("engine.data moved to engine.builtin.data (Datasets: engine.Datasets); the old path goes away "
              "in the next release", DeprecationWarning, stacklevel=2)
