"""FSDP2 in real processes (gloo, CPU, torchrun): equal to one process with the whole batch,
full and sharded (DCP) checkpoints, resume under another number of processes, two nodes."""

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file

from engine import ConfigError, Run
from engine.testing import (
    launch_cases,
    max_difference,
    run_steps,
    tiny_dataset,
    tiny_model,
    torchrun,
    write_run_file,
)

# SGD with momentum in fp32: the paths agree to ~1e-8 (the only difference is the order of the sums)
SGD = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "lr_scheduler_type": "linear"}
TOLERANCE = 1e-6
STEPS = 6


def _reference(**train):
    """One process with the whole global batch."""
    return run_steps(STEPS, model=tiny_model(seed=0), dataset=tiny_dataset(size=64), train={**SGD, **train}).model


def test_two_processes_make_the_updates_of_one_with_twice_the_batch(tmp_path):
    cases = [
        {"name": "full_shard", "steps": STEPS, "plugins": ["fsdp"], "train": {**SGD, "per_device_train_batch_size": 4}},
        {"name": "accumulation_and_clipping", "steps": STEPS, "plugins": ["fsdp"],
         "train": {**SGD, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_grad_norm": 0.5}},
        {"name": "offload_no_reshard", "steps": STEPS, "plugins": ["fsdp"],
         "sections": {"fsdp": {"cpu_offload": True, "reshard_after_forward": False}},
         "train": {**SGD, "per_device_train_batch_size": 4}},
        {"name": "bf16_compute", "steps": STEPS, "plugins": ["fsdp"],
         "sections": {"fsdp": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}},
         "train": {**SGD, "per_device_train_batch_size": 4}},
    ]
    trained = launch_cases(cases, tmp_path)
    whole_batch = _reference(per_device_train_batch_size=8)
    references = {"full_shard": whole_batch, "offload_no_reshard": whole_batch,
                  "accumulation_and_clipping": _reference(per_device_train_batch_size=4,
                                                          gradient_accumulation_steps=2, max_grad_norm=0.5)}
    differences = {name: max_difference(trained[name], model) for name, model in references.items()}
    print("max |parameter difference| against one process:", differences)
    assert all(difference < TOLERANCE for difference in differences.values()), differences
    # MixedPrecisionPolicy: blocks compute in bf16, the sharded weights stay fp32 (measured: 8e-5 off)
    assert all(tensor.dtype == torch.float32 for tensor in trained["bf16_compute"].values())
    assert 1e-6 < max_difference(trained["bf16_compute"], whole_batch) < 1e-3
    # the negative control of this check (unsynchronised gradients fail it) is in plugins/ddp/tests
    assert max_difference(trained["full_shard"], tiny_model(seed=0)) > 1e-3  # it trained


def test_two_nodes_on_one_machine_train_like_one_process(tmp_path):
    cases = [{"name": "fsdp", "steps": STEPS, "plugins": ["fsdp"], "train": {**SGD, "per_device_train_batch_size": 4}}]
    weights = launch_cases(cases, tmp_path, nproc=1, nnodes=2)["fsdp"]
    assert max_difference(weights, _reference(per_device_train_batch_size=8)) < TOLERANCE


# ---------------------------------------------------------------------------- checkpoints under torchrun


def _train(run_file, *sets, nproc=2):
    result = torchrun(["-m", "engine", "train", str(run_file), *[arg for key in sets for arg in ("--set", key)]],
                      nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def _straight_and_stopped_at_step_4(tmp_path, sections):
    """Two folders of the same run: trained 8 steps straight, and stopped at step 4 (a checkpoint)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for folder in (straight, resumed):
        folder.mkdir()
        write_run_file(folder, ["fsdp"], sections, lr_scheduler_type="constant")
    _train(straight / "run.toml")
    _train(resumed / "run.toml", "train.max_steps=4")
    return straight, resumed


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_checkpoint_then_resume_ends_like_an_uninterrupted_run(tmp_path, state_dict_type):
    sections = {"fsdp": {"state_dict_type": state_dict_type}}
    straight, resumed = _straight_and_stopped_at_step_4(tmp_path, sections)
    checkpoint = resumed / "out" / "checkpoint-4"
    sharded = {p.name for p in checkpoint.iterdir() if p.is_dir()}
    assert sharded == ({"pytorch_model_fsdp_0", "optimizer_0"} if state_dict_type == "sharded" else set())
    if state_dict_type == "sharded":  # each process wrote its own shard
        assert sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp")) == \
            ["__0_0.distcp", "__1_0.distcp"]
    again = _train(resumed / "run.toml", "train.resume_from_checkpoint=true")
    assert again.stderr.count("engine: resumed from") == 1
    expected = load_file(straight / "out" / "model.safetensors")
    for name, tensor in load_file(resumed / "out" / "model.safetensors").items():
        assert torch.equal(tensor, expected[name]), name
    assert _losses(resumed / "out") == _losses(straight / "out")
    # the final model is the full weights, in the HF layout
    model = transformers.AutoModelForCausalLM.from_pretrained(resumed / "out")
    assert max_difference({k: v for k, v in model.state_dict().items() if k in expected}, expected) == 0


def test_a_sharded_checkpoint_of_two_processes_resumes_in_one(tmp_path):
    sections = {"fsdp": {"state_dict_type": "sharded"}}
    straight, resumed = _straight_and_stopped_at_step_4(tmp_path, sections)
    # one process with the same global batch reads both shards (DCP reshards on load)
    single = _train(resumed / "run.toml", "train.resume_from_checkpoint=true", "train.per_device_train_batch_size=8",
                    nproc=1)
    assert re.search(r"engine: resumed from \S+checkpoint-4 \(step 4\)", single.stderr)
    expected = load_file(straight / "out" / "model.safetensors")
    got = load_file(resumed / "out" / "model.safetensors")
    assert max_difference(got, expected) < TOLERANCE  # one process sums in another order


def test_best_model_at_end_under_fsdp(tmp_path):
    run_file = write_run_file(tmp_path, ["fsdp"], eval_strategy="steps", eval_steps=4, save_steps=4,
                              load_best_model_at_end=True, learning_rate=0.05)
    text = run_file.read_text().replace("[data]\n", "[data]\neval_split = 0.1\n")
    run_file.write_text(text)
    _train(run_file)
    out = tmp_path / "out"
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    best = state["best_model_checkpoint"]
    assert best is not None
    best_weights = transformers.AutoModelForCausalLM.from_pretrained(best).state_dict()
    final = load_file(out / "model.safetensors")
    assert max_difference({k: v for k, v in best_weights.items() if k in final}, final) == 0


# ---------------------------------------------------------------------------- refused at configure


def test_hybrid_sharding_is_refused_on_cpu(tmp_path):
    with pytest.raises(ConfigError, match="fsdp.sharding = 'hybrid' needs CUDA devices"):
        run_steps(1, plugins=["fsdp"], sections={"fsdp": {"sharding": "hybrid"}}, output_dir=tmp_path)


def test_unknown_wrap_module_names_the_model_classes(tmp_path):
    with pytest.raises(ConfigError, match=r"fsdp.wrap_modules: \['LlamaBlock'\] are not module classes of "
                                          r"LlamaForCausalLM; it has \[.*'LlamaDecoderLayer'"):
        run_steps(1, plugins=["fsdp"], sections={"fsdp": {"wrap_modules": ["LlamaBlock"]}}, output_dir=tmp_path)


def test_fsdp_refuses_layerwise_optimizers_at_configure(tmp_path):
    with pytest.raises(ConfigError, match="runs in a single process only"):
        Run({"plugins": ["fsdp", "galore"], "train": {"optim": "galore_adamw_layerwise",
                                                    "optim_target_modules": "all-linear", "max_grad_norm": 0.0,
                                                    "output_dir": str(tmp_path)}})


def test_an_accelerate_fsdp_config_file_runs_under_torchrun(tmp_path):
    # the shape of Accelerate's FSDP guide (transformer-based wrap, sharded state dict)
    (tmp_path / "fsdp.yaml").write_text("""\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: true
""")
    run_file = write_run_file(tmp_path, [], max_steps=4)
    result = torchrun(["-m", "engine", "train", str(run_file), "--accelerate-config", str(tmp_path / "fsdp.yaml")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint-4" / "pytorch_model_fsdp_0").is_dir()
    trainer_state = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    assert trainer_state["strategy"] == "fsdp" and trainer_state["world_size"] == 2
    assert trainer_state["config"]["fsdp"]["wrap_modules"] == ["LlamaDecoderLayer"]
    wrong = torchrun(["-m", "engine", "train", str(run_file), "--accelerate-config", str(tmp_path / "fsdp.yaml")],
                     nproc=1)
    assert wrong.returncode != 0  # torchrun's own status for a failed worker
    assert wrong.stderr.count("num_processes: 2: the launcher started 1 processes") == 1
