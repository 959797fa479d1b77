"""Liger: every kernel is patched onto the instance and every name liger-kernel rebinds is put
back; conflicts and a CPU run are refused; the kernels that Triton's CPU interpreter runs match the
stock model (interpreter_kernels.py, in a process of its own: see there).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from transformers.models.llama import modeling_llama

from engine import ConfigError, Run, hookimpl
from engine.testing import run_steps, tiny_dataset, tiny_model

HERE = Path(__file__).parent
ROOT = HERE.parents[2]


def test_kernels_on_the_interpreter_match_the_stock_model():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-p",
                             "no:cacheprovider", str(HERE / "interpreter_kernels.py")],
                            capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "3 passed" in result.stdout


def test_every_kernel_patches_the_instance_and_the_undo_restores_every_name(tmp_path, monkeypatch, stock_names):
    stock = stock_names()
    model = tiny_model(seed=0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only for the CPU check: no kernel runs here
    run = Run({"plugins": ["liger"], "train": {"output_dir": str(tmp_path), "max_steps": 1, "use_cpu": True},
               "liger": {"rms_norm": True, "swiglu": True, "rope": True, "fused_linear_cross_entropy": True}},
              model=model, train_dataset=tiny_dataset())
    run.setup()
    assert modeling_llama.LlamaRMSNorm.__module__.startswith("liger_kernel")
    assert modeling_llama.apply_rotary_pos_emb is not stock["apply_rotary_pos_emb"]
    assert "forward" in vars(model.model.norm) and "forward" in vars(model.model.layers[0].mlp)
    run.remove_patches()
    assert all(stock_names()[name] is value for name, value in stock.items())
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
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="liger-kernel's Triton kernels need a CUDA GPU and this run is on the CPU"):
        run_steps(1, plugins=["liger"], output_dir=tmp_path, model=tiny_model(), train={"use_cpu": True})


def test_plan_lists_both_patches_in_order(tmp_path):
    result = subprocess.run([sys.executable, "-m", "engine", "plan", "--plugins", "+neftune,+liger"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith("patch_model"))
    assert line.split()[2:] == ["neftune,", "liger,", "builtin.patches"], line
