"""DeepSpeed in real processes (gloo, CPU, torchrun): ZeRO 0-3 equal to one process with the whole
batch, checkpoints and exact resume, the final and the best model under ZeRO-3, config refusals."""

import json
import sys
from pathlib import Path

import pytest
import torch

from engine.testing import launch_cases, max_parameter_difference, run_steps, tiny_dataset, tiny_model

HERE = Path(__file__).parent
# SGD with momentum in fp32: the paths agree to ~1e-8 (the only difference is the order of the sums)
SGD = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "lr_scheduler_type": "linear"}
TOLERANCE = 1e-6
STEPS = 6
# DeepSpeed JIT-compiles a small communication op on first use (~1 min): compiled once, kept in the venv
ENV = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"),
       "PYTHONPATH": f"{HERE}:{HERE.parents[1] / 'ddp' / 'tests'}"}


def _reference(train):
    """One process with the whole global batch."""
    return run_steps(STEPS, model=tiny_model(seed=0), dataset=tiny_dataset(size=64), train={**SGD, **train}).model


def _case(name, stage, train, **extra):
    return {"name": name, "steps": STEPS, "plugins": ["deepspeed"], "train": {**SGD, **train},
            "sections": {"deepspeed": {"zero_stage": stage}}, **extra}


def test_zero_stages_in_two_processes_make_the_updates_of_one_with_twice_the_batch(tmp_path):
    whole = {"per_device_train_batch_size": 4, "max_grad_norm": 1.0}
    accumulated = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_grad_norm": 1.0}
    cases = [_case(f"zero{stage}", stage, whole) for stage in (0, 1, 2, 3)]
    cases += [_case("zero2_accumulation", 2, accumulated), _case("zero3_accumulation", 3, accumulated),
              # negative controls: gradients never synchronised (DDP's control), divided by the window twice
              {**_case("unsynced", 0, {**whole, "strategy": "unsynced"}), "plugins": ["ddp"], "sections": {},
               "objects": ["unsynced:plugin"]},
              {**_case("divided_twice", 2, {**accumulated, "strategy": "divided_twice"}),
               "objects": ["controls:plugin"]}]
    trained = launch_cases(cases, tmp_path, env=ENV)
    whole_reference = _reference({"per_device_train_batch_size": 8, "max_grad_norm": 1.0})
    accumulated_reference = _reference({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                        "max_grad_norm": 1.0})
    differences = {case["name"]: max_parameter_difference(trained[case["name"]], accumulated_reference if
                                                          "gradient_accumulation_steps" in case["train"] else
                                                          whole_reference) for case in cases}
    print("max |parameter difference| against one process:", differences)
    controls = {"unsynced", "divided_twice"}
    assert all(value < TOLERANCE for name, value in differences.items() if name not in controls), differences
    assert all(differences[name] > 100 * TOLERANCE for name in controls), differences
