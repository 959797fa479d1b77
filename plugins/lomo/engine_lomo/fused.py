"""LOMO and AdaLomo from ``lomo_optim`` with three fixes the engine needs.

* The update runs only inside :meth:`fused_backward` / :meth:`grad_norm`. ``lomo_optim`` hooks
  every parameter for good, so any later ``loss.backward()`` on the model (another
  optimizer, a probe, a second run) would silently update the weights; here such a backward
  just accumulates ``.grad`` as usual.
* :meth:`step` is a no-op (the update already happened during backward), so a torch LR
  scheduler sees a step and does not warn; :meth:`grad_norm` returns the norm it computed.
* :class:`AdaLomo` builds its state on each parameter's device: ``lomo_optim`` 0.1.1 calls
  ``.cuda()`` in the constructor, which fails on CPU. The update itself is the library's
  (``fuse_update``), unchanged. Its second-moment state and step counter live outside
  ``optimizer.state``, so :meth:`AdaLomo.state_dict` adds them (key ``"adalomo"``) and
  :meth:`AdaLomo.load_state_dict` restores them.
"""

from __future__ import annotations

from typing import Any

import lomo_optim
import torch

_ADALOMO_STATE = ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col")


class _FusedStep:
    _updating = False  # True only inside fused_backward / grad_norm

    def fuse_update(self) -> Any:
        update = super().fuse_update()

        def hook(grad: Any) -> Any:
            return update(grad) if self._updating else grad

        return hook

    def fused_backward(self, loss: torch.Tensor, lr: float) -> None:
        """Backward of ``loss`` with each parameter updated (learning rate ``lr``) as its gradient lands."""
        self._updating = True
        try:
            super().fused_backward(loss, lr)
        finally:
            self._updating = False

    def grad_norm(self, loss: torch.Tensor) -> torch.Tensor:
        """A first backward (graph kept) that only measures the global gradient norm, returned.

        Sets the clipping coefficient ``min(1, clip_grad_norm / (norm + 1e-6))`` that the next
        :meth:`fused_backward` applies, as ``torch.nn.utils.clip_grad_norm_`` would.
        """
        self._updating = True
        try:
            super().grad_norm(loss)
        finally:
            self._updating = False
        return torch.linalg.vector_norm(self.grad_norms)

    def step(self, closure: Any = None) -> None:
        """Nothing to do: the update happened in :meth:`fused_backward`."""


class Lomo(_FusedStep, lomo_optim.Lomo):
    """``lomo_optim.Lomo``: SGD applied inside backward, no optimizer state."""


class AdaLomo(_FusedStep, lomo_optim.AdaLomo):
    """``lomo_optim.AdaLomo`` whose state lives on the parameters' device (CPU included)."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3, loss_scale: float = 2**10,
                 eps: tuple[float, float] = (1e-30, 1e-3), clip_threshold: float = 1.0,
                 decay_rate: float = -0.8, clip_grad_norm: float | None = None,
                 clip_grad_value: float | None = None, weight_decay: float = 0.0):
        # lomo_optim.AdaLomo.__init__ (0.1.1) without the .cuda() calls and without the
        # DeepSpeed ZeRO-3 branch (the plugin refuses DeepSpeed).
        if clip_grad_norm is not None and clip_grad_norm <= 0:
            raise ValueError(f"clip_grad_norm should be positive, got {clip_grad_norm}.")
        self.model, self.lr, self.loss_scale, self.eps = model, lr, loss_scale, eps
        self.clip_grad_norm, self.clip_grad_value = clip_grad_norm, clip_grad_value
        self.weight_decay, self.do_weight_decay = weight_decay, weight_decay > 0.0
        self.step_num, self.decay_rate, self.clip_threshold = 0, decay_rate, clip_threshold
        self.gather_norm, self.grad_norms, self.clip_coef = False, [], None
        self.zero3_enabled = False
        self.grad_func = self.fuse_update()
        self.exp_avg_sq, self.exp_avg_sq_row, self.exp_avg_sq_col = {}, {}, {}
        for name, p in model.named_parameters():
            if p.dim() == 1:
                self.exp_avg_sq[name] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
            else:
                self.exp_avg_sq_row[name] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                self.exp_avg_sq_col[name] = torch.zeros(p.shape[1], dtype=torch.float32, device=p.device)
            if p.requires_grad:
                p.register_hook(self.grad_func)
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, clip_grad_norm=clip_grad_norm,
                        clip_grad_value=clip_grad_value)
        torch.optim.Optimizer.__init__(self, model.parameters(), defaults)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["adalomo"] = {"step_num": self.step_num,
                            **{key: dict(getattr(self, key)) for key in _ADALOMO_STATE}}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("adalomo", None)
        if saved is None:
            raise ValueError("AdaLomo.load_state_dict: no 'adalomo' entry (second moments and step "
                             "count); this state dict was not saved by engine_lomo.AdaLomo")
        super().load_state_dict(state_dict)
        self.step_num = int(saved["step_num"])
        for key in _ADALOMO_STATE:
            mine = getattr(self, key)
            if set(saved[key]) != set(mine):
                raise ValueError(f"AdaLomo.load_state_dict: {key} holds parameters "
                                 f"{sorted(saved[key])[:3]}..., this model has {sorted(mine)[:3]}...")
            for name, tensor in saved[key].items():
                mine[name].copy_(tensor)
