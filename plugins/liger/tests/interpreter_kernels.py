"""Liger's kernels that Triton's CPU interpreter can run, against the stock model.

Run by test_liger.py in a process of its own with TRITON_INTERPRET=1: the variable must be set
before any Triton kernel is defined, and it would turn every other library's Triton kernels
(torch-optimi's) into interpreted ones in a shared test process.
"""

import pytest
import torch
from transformers.models.llama import modeling_llama

from engine import hookimpl
from engine.testing import max_difference, run_steps, tiny_model

# the kernels the interpreter cannot run (rms_norm, swiglu) stay off where a forward runs
RUNNABLE = {"rms_norm": False, "swiglu": False}
SGD = {"optim": "sgd", "learning_rate": 0.1, "use_cpu": True}


class Probe:
    """Records, at every step, which patched names are in place."""

    name = "probe"

    def __init__(self):
        self.seen = []

    @hookimpl
    def on_step_end(self, run):
        self.seen.append({"cross_entropy": torch.nn.functional.cross_entropy.__module__,
                          "forward": "forward" in vars(run.model),
                          "rope": modeling_llama.apply_rotary_pos_emb.__module__})


class Losses:
    """The window losses as computed (the logged ones are rounded to 6 decimals: two losses within
    1e-7 of each other can log 1e-6 apart)."""

    name = "losses"

    def __init__(self):
        self.values = []

    @hookimpl(wrapper=True)
    def training_step(self, run, batches, num_items_in_batch):
        out = yield
        self.values.append(out.loss.item())
        return out


@pytest.mark.parametrize("kernels", [
    {"cross_entropy": True, "fused_linear_cross_entropy": False, "rope": False},
    {"fused_linear_cross_entropy": True, "rope": False},
    {"rope": True, "fused_linear_cross_entropy": False},
])
def test_kernels_that_run_on_the_interpreter_match_the_stock_model(tmp_path, kernels):
    probe, patched_losses, stock_losses = Probe(), Losses(), Losses()
    patched = run_steps(2, plugins=["liger"], objects=[probe, patched_losses],
                        sections={"liger": {**RUNNABLE, **kernels}}, output_dir=tmp_path / "liger",
                        model=tiny_model(seed=0), train=SGD)
    stock = run_steps(2, objects=[stock_losses], output_dir=tmp_path / "stock", model=tiny_model(seed=0), train=SGD)
    seen = probe.seen[0]
    if kernels.get("cross_entropy"):
        assert seen["cross_entropy"].startswith("liger_kernel")
    if kernels.get("fused_linear_cross_entropy"):
        assert seen["forward"]  # the model's forward is liger's fused one
    if kernels.get("rope"):
        assert seen["rope"].startswith("liger_kernel")
    losses = (patched_losses.values, stock_losses.values)
    assert len(losses[0]) == len(losses[1]) == 2
    assert max(abs(a - b) for a, b in zip(*losses)) < 5e-7, losses
    # two SGD steps at lr 0.1: weights agree as closely as the gradients do
    assert max_difference(patched.model.state_dict(), stock.model) < 1e-6
