"""The weights runs start from, and the model factories they name.

``torchrun ... initial_weights.py CASES.json OUT_DIR`` sets up each run of a JSON object
{name: run config} in one process group and saves the main process's full initial weights
to ``OUT_DIR/<name>.pt``; :func:`initial_weights` does the same for one run in this process.
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64}


def llama_from_class(tokenizer):
    """``train.model = "initial_weights:llama_from_class"``: transformers' class called directly."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, vocab_size=len(tokenizer)))


def llama_from_base(tokenizer):
    """``initial_weights:llama_from_base``: ``from_pretrained`` of a base model without the
    language-model head (the folder $BASE_MODEL), which transformers then initialises."""
    return transformers.AutoModelForCausalLM.from_pretrained(os.environ["BASE_MODEL"])


def initial_weights(config):
    """The full weights the run of ``config`` starts from (after setup, before any step); None on
    processes other than the main one."""
    from engine import Run

    run = Run(config)
    run.setup()
    weights = run.strategy.model_state_dict(run.model)
    if not run.strategy.is_main_process:
        return None
    return {name: tensor.detach().cpu().clone() for name, tensor in weights.items()}


if __name__ == "__main__":
    import torch.distributed as dist

    cases_file, out_dir = sys.argv[1:]
    dist.init_process_group("gloo")  # made once: each run's strategy uses it
    for name, config in json.loads(Path(cases_file).read_text()).items():
        weights = initial_weights(config)
        if weights is not None:
            torch.save(weights, Path(out_dir) / f"{name}.pt")
    dist.destroy_process_group()
