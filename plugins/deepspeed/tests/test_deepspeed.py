"""DeepSpeed in real processes (gloo, CPU, torchrun): ZeRO 0-3 equal to one process with the whole
batch, checkpoints and exact resume, the final and the best model under ZeRO-3, config refusals."""

import json
import sys
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from engine.testing import launch_cases, max_parameter_difference, run_steps, tiny_dataset, tiny_model, torchrun

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


# ---------------------------------------------------------------------------- the command line under torchrun


CORPUS = "\n".join(f"record {i}: the quick brown fox {i % 7} jumps over {i % 13} lazy dogs" for i in range(1500))


def _run_file(folder, stage, deepspeed=None, **train):
    from engine.config import to_toml

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(CORPUS)
    path = folder / "run.toml"
    path.write_text(to_toml({
        "plugins": ["deepspeed"],
        "train": {"model": "tiny-llama", "output_dir": str(folder / "out"), "max_steps": 8,
                  "per_device_train_batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1, "save_steps": 4,
                  "disable_tqdm": True, "model_config": {"hidden_size": 32, "intermediate_size": 64}, **train},
        "data": {"train": str(folder / "corpus.txt"), "max_length": 32, "tokenizer": "train",
                 "tokenizer_vocab_size": 300, "eval_split": 0.05},
        "deepspeed": {"zero_stage": stage, **(deepspeed or {})}}))
    return path


def _train(run_file, *sets, nproc=2):
    result = torchrun(["-m", "engine", "train", str(run_file), *(f"--set={s}" for s in sets)], nproc=nproc, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _weights(folder):
    return load_file(folder / "model.safetensors")


def _losses(out):
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path, stage):
    straight = _run_file(tmp_path / "straight", stage)
    _train(straight)
    out = tmp_path / "straight" / "out"
    written = {p.name for p in (out / "checkpoint-4" / "deepspeed").iterdir()}
    partitions = {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)}  # one per process
    assert partitions <= written, written
    resumed = _run_file(tmp_path / "resumed", stage)
    result = _train(resumed, f'train.resume_from_checkpoint="{out / "checkpoint-4"}"')
    assert result.stderr.count("engine: resumed from") == 1
    expected = _weights(out)
    for name, tensor in _weights(tmp_path / "resumed" / "out").items():
        assert torch.equal(tensor, expected[name]), name
    assert _losses(tmp_path / "resumed" / "out") == _losses(out)[4:]
