"""Log levels per process, with ``TrainingArguments``' meanings.

The engine logs through the ``engine`` logger (plugins: ``logging.getLogger("engine.<name>")``),
which prints ``engine: <message>`` to stderr. Metrics are not log records: trackers and the
console plugin get them through ``log_metrics`` on the main process.

* ``log_level``: the main process's level for the engine and transformers loggers;
  ``passive`` keeps engine at info and leaves transformers at its own default.
* ``log_level_replica``: the level of every other process (default: warning).
* ``log_on_each_node``: which process counts as main: each node's local rank 0 (true,
  default) or only global rank 0 (false).

Known messages that libraries print while being imported (:data:`KNOWN_NOISE`) are filtered at
their loggers, so the console shows the run; ``log_level = "debug"`` shows them again.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig  # assembled from the builtins' options: not at import

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (which tests and notebooks may replace)."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


# Messages libraries log while the engine imports them that say nothing about the run:
# logger -> how their message formats start. Shown again at log_level = "debug".
KNOWN_NOISE = {
    # torchao (which transformers imports when it is installed) on a build without its CUDA kernels
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
    # bitsandbytes' optional `kernels` package for a faster CPU 4-bit matmul
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    # ... and the `kernels` package itself when it is asked for that kernel with the Hub offline (transformers 5.25)
    "kernels._internals.hf_hub": ("Skipping publisher trust check for ",),
    # DeepSpeed (which transformers imports when it is installed) on a machine without a GPU
    "DeepSpeed": ("Setting accelerator to CPU",),
    # datasets on a JSON file it cannot parse, before it raises: the engine's error names the line
    "datasets.packaged_modules.json.json": ("Failed to load JSON from file ", "Failed to convert pandas DataFrame"),
    # transformers at log_level "info" on each file of the loads and saves the engine drives and reports itself
    # (a saved-model load, each checkpoint, the final model): the whole model config, again at every save
    "transformers.configuration_utils": ("loading configuration file ", "Model config ", "Configuration saved in "),
    "transformers.generation.configuration_utils": ("loading configuration file ", "Generate config ",
                                                    "Configuration saved in "),
    "transformers.modeling_utils": ("loading weights file ", "Model weights saved in ", "Will use dtype="),
    "transformers.tokenization_utils_base": ("tokenizer config file saved in ", "chat template saved in "),
}


class _KnownNoise(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger("engine").isEnabledFor(logging.DEBUG):
            return True
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


def quiet_known_noise() -> None:
    """Filter :data:`KNOWN_NOISE` at its loggers (only those messages; idempotent)."""
    for name, prefixes in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownNoise) for f in logger.filters):
            logger.addFilter(_KnownNoise(prefixes))


def process_log_level(train: TrainConfig, rank: int, local_rank: int) -> str:
    """The configured level name for the process with these ranks."""
    main = local_rank == 0 if train.log_on_each_node else rank == 0
    return train.log_level if main else train.log_level_replica


def setup_logging(train: TrainConfig, rank: int, local_rank: int) -> None:
    """Set the engine (and, unless passive, transformers) log level of this process."""
    level = process_log_level(train, rank, local_rank)
    logger = logging.getLogger("engine")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("engine: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if level == "passive" else LEVELS[level])
    if level != "passive":
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(LEVELS[level])
