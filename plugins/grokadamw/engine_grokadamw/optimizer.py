"""GrokAdamW (``grokadamw``) with a state dict that survives a checkpoint, and the loss-gap signal."""

from __future__ import annotations

from typing import Any

import grokadamw
import torch


class _StateView:
    """``group["state"]`` as the library reads and writes it, backed by ``optimizer.state``."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def get(self, param: torch.Tensor, default: Any = None) -> Any:
        return self.optimizer.state.get(param, default)

    def __setitem__(self, param: torch.Tensor, value: dict[str, Any]) -> None:
        self.optimizer.state[param] = value

    def __repr__(self) -> str:
        return "<optimizer.state>"


class GrokAdamW(grokadamw.GrokAdamW):
    """``grokadamw.GrokAdamW`` whose per-parameter state (step, exp_avg, exp_avg_sq, grok_ema)
    lives in ``optimizer.state``, where ``state_dict`` / ``load_state_dict`` carry it.

    The library keeps it in ``param_groups[i]["state"]``, a dict keyed by the parameter tensors:
    after a save and load those keys are other tensor objects, so every parameter silently
    starts again at step 1 with zero moments. The update itself is the library's, unchanged.
    Signal functions (``grokking_signal_fns``) are never saved: they come back from the
    constructor's arguments, as in the library.
    """

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self.param_groups[-1]["state"] = _StateView(self)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        for group in state["param_groups"]:
            group.pop("state", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["state"] = _StateView(self)


class LossGap:
    """Signal ``loss_gap``: the library's default formula, ``max(0, eval - train) / max(eval, train)``,
    on the latest ``loss`` and ``eval_loss`` in ``run.state.log_history`` (0 until both are logged).

    Reads only the entries added since the last call, so a call costs O(1); a resumed run's
    restored history is read from the start. With several processes the train loss (logged
    per process) is averaged over them when a new one arrives, so every process gets the same
    signal (the eval loss is already reduced).
    """

    def __init__(self, run: Any):
        self.run = run
        self.history: list[dict[str, Any]] | None = None
        self.seen = 0
        self.train_loss: float | None = None
        self.eval_loss: float | None = None

    def __call__(self) -> float:
        history = self.run.state.log_history
        if history is not self.history or len(history) < self.seen:
            self.history, self.seen, self.train_loss, self.eval_loss = history, 0, None, None
        train_loss = None
        for entry in history[self.seen:]:
            train_loss = entry.get("loss", train_loss)
            self.eval_loss = entry.get("eval_loss", self.eval_loss)
        self.seen = len(history)
        if train_loss is not None:
            strategy = self.run.strategy
            if getattr(strategy, "world_size", 1) > 1:
                local = torch.tensor(train_loss, dtype=torch.float64, device=strategy.device)
                train_loss = float(strategy.reduce(local, "mean"))
            self.train_loss = train_loss
        return grokadamw.GrokAdamW._default_grokking_signal(self.train_loss, self.eval_loss)
