"""What a run carries and hands out: its progress, the loop's requests, a step's and a prediction's
results. Plain records with no engine imports, so the loop, the
strategies and plugins use them without importing :mod:`engine.run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch


class StepOutput(NamedTuple):
    """What a ``training_step`` returns: the window's mean loss, the pre-clip grad norm, and
    whether the update was skipped (``train.on_nonfinite = "skip"``: a nan/inf loss or norm)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor | float | None = None
    skipped: bool = False


@dataclass
class TrainState:
    """Progress of the run; saved in checkpoints as trainer_state.json."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0
    steps_per_epoch: int = 0
    num_input_tokens_seen: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    num_skipped_steps: int = 0  # updates skipped for a non-finite loss (train.on_nonfinite = "skip")


@dataclass
class Control:
    """Requests plugins make from lifecycle hooks; the loop acts on them after the current step."""

    should_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False
    should_epoch_stop: bool = False  # end the current epoch after this step (cleared when the next begins)
    stop_reason: str | None = None
    abort: BaseException | None = None  # raised once this step's log, evaluation and save are done

    def request_stop(self, reason: str) -> None:
        self.should_stop = True
        self.stop_reason = reason

    def request_abort(self, error: BaseException) -> None:
        """End the run with ``error`` after this step's checkpoint (the SIGTERM checkpoint: save, then exit)."""
        self.should_save = True
        self.abort = error


class PredictionOutput(NamedTuple):
    """What :meth:`Run.predict` returns: numpy arrays (label_ids None without labels) and metrics."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


class Datasets(NamedTuple):
    """What the ``create_datasets`` hook returns: train data, eval data (None, a dataset or a dict of
    them) and the collator (None: the one ``create_collator`` makes)."""

    train: Any
    eval: Any = None
    collator: Any = None


class RunView(Protocol):
    """What hooks, strategies and builtins may use of a run: the concrete :class:`engine.Run`
    satisfies it. Annotate ``run: RunView`` instead of importing ``engine.run.Run``, so that no module
    depends on the class that composes every module (the kernel has no import cycle)."""

    config: Any  # engine.config.RunConfig: .train, .data and plugin sections by name
    hook: Any  # the plugin manager's hook relay: run.hook.<name>(run=run, ...)
    isolated_hooks: Any  # logging hooks and on_checkpoint_saved, called per plugin
    plugin_manager: Any
    registries: Any  # optimizers, schedulers, strategies by name
    state: TrainState
    control: Control
    strategy: Any
    model: torch.nn.Module | None
    wrapped_model: torch.nn.Module | None
    tokenizer: Any
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    train_dataset: Any
    eval_dataset: Any
    data_collator: Any
    train_loader: Any
    num_training_steps: int
    label_names: list[str]
    label_shift: bool
    compute_metrics: Any
    preprocess_logits_for_metrics: Any
    run_id: str | None
    is_setup: bool
    weights: Any  # engine.ModelWeights: what checkpoints hold (the checkpoint_weights answer)

    @property
    def output_dir(self) -> Path: ...

    @property
    def task(self) -> str: ...

    def setup(self) -> None: ...
