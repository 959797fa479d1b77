"""Liger on the CPU through Triton's interpreter: the kernels that run there match the unpatched
model; every kernel is patched onto the instance and every name liger-kernel rebinds is put back.

TRITON_INTERPRET must be set before liger-kernel's kernels are defined (at its import), so this
module sets it at collection time; it only affects Triton kernels, which nothing else here uses.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from engine import ConfigError, Run, hookimpl  # noqa: E402
from engine.testing import max_difference, run_steps, tiny_dataset, tiny_model  # noqa: E402

# the kernels the interpreter cannot run (rms_norm, swiglu) stay off where a forward runs
RUNNABLE = {"rms_norm": False, "swiglu": False}
SGD = {"optim": "sgd", "learning_rate": 0.1, "use_cpu": True}


def _stock_names():
    return {"LlamaRMSNorm": modeling_llama.LlamaRMSNorm, "LlamaMLP": modeling_llama.LlamaMLP,
            "apply_rotary_pos_emb": modeling_llama.apply_rotary_pos_emb,
            "cross_entropy": torch.nn.functional.cross_entropy,
            "LlamaForCausalLM.forward": modeling_llama.LlamaForCausalLM.forward}


@pytest.fixture(autouse=True)
def stock_transformers():
    """Each test starts and must end with the stock names (a failed undo would leak into others)."""
    before = _stock_names()
    yield
    after = _stock_names()
    leaked = [name for name in before if after[name] is not before[name]]
    modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP = before["LlamaRMSNorm"], before["LlamaMLP"]
    modeling_llama.apply_rotary_pos_emb = before["apply_rotary_pos_emb"]
    torch.nn.functional.cross_entropy = before["cross_entropy"]
    modeling_llama.LlamaForCausalLM.forward = before["LlamaForCausalLM.forward"]
    assert not leaked, f"liger left {leaked} patched"


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


@pytest.mark.parametrize("kernels", [
    {"cross_entropy": True, "fused_linear_cross_entropy": False, "rope": False},
    {"fused_linear_cross_entropy": True, "rope": False},
    {"rope": True, "fused_linear_cross_entropy": False},
])
def test_kernels_that_run_on_the_interpreter_match_the_stock_model(tmp_path, kernels):
    probe = Probe()
    patched = run_steps(2, plugins=["liger"], objects=[probe], sections={"liger": {**RUNNABLE, **kernels}},
                        output_dir=tmp_path / "liger", model=tiny_model(seed=0), train=SGD)
    stock = run_steps(2, output_dir=tmp_path / "stock", model=tiny_model(seed=0), train=SGD)
    seen = probe.seen[0]
    if kernels.get("cross_entropy"):
        assert seen["cross_entropy"].startswith("liger_kernel")
    if kernels.get("fused_linear_cross_entropy"):
        assert seen["forward"]  # the model's forward is liger's fused one
    if kernels.get("rope"):
        assert seen["rope"].startswith("liger_kernel")
    losses = [[r["loss"] for r in run.state.log_history if "loss" in r] for run in (patched, stock)]
    assert max(abs(a - b) for a, b in zip(*losses)) < 5e-7, losses
    # two SGD steps at lr 0.1: weights agree as closely as the gradients do
    assert max_difference(patched.model.state_dict(), stock.model) < 1e-6


def test_every_kernel_patches_the_instance_and_the_undo_restores_every_name(tmp_path):
    stock = _stock_names()
    model = tiny_model(seed=0)
    run = Run({"plugins": ["liger"], "train": {"output_dir": str(tmp_path), "max_steps": 1, "use_cpu": True},
               "liger": {"rms_norm": True, "swiglu": True, "rope": True, "fused_linear_cross_entropy": True}},
              model=model, train_dataset=tiny_dataset())
    run.setup()
    assert modeling_llama.LlamaRMSNorm.__module__.startswith("liger_kernel")
    assert modeling_llama.apply_rotary_pos_emb is not stock["apply_rotary_pos_emb"]
    assert "forward" in vars(model.model.norm) and "forward" in vars(model.model.layers[0].mlp)
    run.remove_patches()
    assert all(_stock_names()[name] is value for name, value in stock.items())
    assert "forward" not in vars(model.model.norm) and "forward" not in vars(model.model.layers[0].mlp)
    assert "forward" not in vars(model)
    fresh = tiny_model(seed=1)  # a model built later in the same process is the stock one
    assert type(fresh.model.norm) is stock["LlamaRMSNorm"] and "forward" not in vars(fresh.model.norm)


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128))
    with pytest.raises(ConfigError, match=r"liger-kernel 0\.\S+ has no kernels for model_type 'gpt2'; it "
                                          r"supports .*llama.*qwen2"):
        Run({"plugins": ["liger"], "train": {"output_dir": str(tmp_path)}}, model=gpt2)


@pytest.mark.parametrize("liger, train, message", [
    ({"cross_entropy": True}, {}, "liger.cross_entropy and liger.fused_linear_cross_entropy are both on"),
    ({}, {"label_smoothing_factor": 0.1}, "computes the loss inside the model, without label smoothing"),
    ({"geglu": True}, {}, "liger.geglu: liger-kernel has no such kernel for llama models; it patches rope"),
])
def test_conflicts_are_refused_at_configure(tmp_path, liger, train, message):
    with pytest.raises(ConfigError, match=message):
        Run({"plugins": ["liger"], "train": {"output_dir": str(tmp_path), **train}, "liger": liger})


def test_another_loss_plugin_is_refused_with_the_fused_kernel(tmp_path):
    class Loss:
        name = "my_loss"

        @hookimpl
        def compute_loss(self, run, model, batch, num_items_in_batch):
            return model(**batch).logits.float().mean()

    with pytest.raises(ConfigError, match="plugin 'my_loss' computes the loss from the logits"):
        Run({"plugins": ["liger"], "train": {"output_dir": str(tmp_path)}}, plugins=[Loss()])
    Run({"plugins": ["liger"], "train": {"output_dir": str(tmp_path)}, "liger": {"fused_linear_cross_entropy": False}},
        plugins=[Loss()])


def test_a_cpu_run_is_refused_without_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="liger-kernel's Triton kernels need a CUDA GPU and this run is on the CPU"):
        run_steps(1, plugins=["liger"], output_dir=tmp_path, model=tiny_model(), train={"use_cpu": True})


def test_plan_lists_both_patches_in_order(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "engine", "plan", "--plugins", "+neftune,+liger"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith("patch_model"))
    assert line.split()[2:] == ["neftune,", "liger,", "builtin.patches"], line
