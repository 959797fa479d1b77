"""Shared by the liger tests: every test starts and must end with transformers' stock names."""

import pytest
import torch
from transformers.models.llama import modeling_llama


def _stock_names():
    return {"LlamaRMSNorm": modeling_llama.LlamaRMSNorm, "LlamaMLP": modeling_llama.LlamaMLP,
            "apply_rotary_pos_emb": modeling_llama.apply_rotary_pos_emb,
            "cross_entropy": torch.nn.functional.cross_entropy,
            "LlamaForCausalLM.forward": modeling_llama.LlamaForCausalLM.forward}


@pytest.fixture
def stock_names():
    """A function returning the names liger-kernel rebinds for llama, as they are now."""
    return _stock_names


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
