"""--accelerate-config: the four shapes of Accelerate's documentation map onto the strategy
plugins and their options; keys the engine cannot honour are refused by name."""

import subprocess
import sys

import pytest

from engine import ConfigError
from engine.accelerate_config import apply, map_config

LAUNCHER = {"machine_rank": 0, "main_training_function": "main", "num_machines": 1, "num_processes": 2,
            "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False,
            "tpu_use_sudo": False, "use_cpu": False, "compute_environment": "LOCAL_MACHINE", "downcast_bf16": "no"}
DDP = {**LAUNCHER, "distributed_type": "MULTI_GPU", "gpu_ids": "all", "mixed_precision": "fp16"}
FSDP = {**LAUNCHER, "distributed_type": "FSDP", "debug": False, "mixed_precision": "bf16", "fsdp_config": {
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_backward_prefetch_policy": "BACKWARD_PRE",
    "fsdp_cpu_ram_efficient_loading": True, "fsdp_forward_prefetch": False, "fsdp_offload_params": False,
    "fsdp_sharding_strategy": 1, "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_sync_module_states": True,
    "fsdp_transformer_layer_cls_to_wrap": "BertLayer", "fsdp_use_orig_params": True}}
DEEPSPEED_FILE = {**LAUNCHER, "distributed_type": "DEEPSPEED", "fsdp_config": {}, "main_process_ip": None,
                  "main_process_port": None, "mixed_precision": "fp16",
                  "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero3_init_flag": True}}
DEEPSPEED_ZERO3 = {**LAUNCHER, "distributed_type": "DEEPSPEED", "mixed_precision": "fp16", "deepspeed_config": {
    "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "offload_optimizer_device": "cpu",
    "offload_param_device": "cpu", "zero3_init_flag": True, "zero3_save_16bit_model": True, "zero_stage": 3}}


def test_ddp_shape():
    mapping = map_config(DDP, "ddp.yaml")
    assert mapping.plugins == ["ddp"]
    assert mapping.settings == {"train.bf16": False, "train.fp16": True, "train.use_cpu": False}
    assert mapping.lines[-1] == "launch with: torchrun --nproc-per-node 2 -m engine train ..."


def test_fsdp_shape_with_transformer_based_wrap():
    mapping = map_config(FSDP, "fsdp.yaml")
    assert mapping.plugins == ["fsdp"]
    assert mapping.settings == {"train.bf16": True, "train.fp16": False, "train.use_cpu": False,
                                "fsdp.reshard_after_forward": True, "fsdp.state_dict_type": "sharded",
                                "fsdp.wrap_modules": ["BertLayer"], "fsdp.cpu_offload": False}
    assert "fsdp_config.fsdp_cpu_ram_efficient_loading: true -> every process loads the model itself " \
           "(not only rank 0): more host memory at start" in mapping.lines


def test_deepspeed_shape_with_a_config_file(tmp_path):
    (tmp_path / "ds.json").write_text("{}")
    config = {**DEEPSPEED_FILE, "deepspeed_config": {**DEEPSPEED_FILE["deepspeed_config"],
                                                      "deepspeed_config_file": str(tmp_path / "ds.json")}}
    mapping = map_config(config, "ds.yaml")
    assert mapping.plugins == ["deepspeed"]
    assert mapping.settings["deepspeed.config"] == str(tmp_path / "ds.json")
    assert "deepspeed_config.zero3_init_flag: true -> under ZeRO-3 the model is always built inside " \
           "deepspeed.zero.Init" in mapping.lines
    with pytest.raises(ConfigError, match=r"deepspeed_config.deepspeed_config_file: 'ds.json': expected the path "
                                          r"of a DeepSpeed JSON file that exists"):
        map_config(DEEPSPEED_FILE, "ds.yaml")


def test_deepspeed_inline_zero3_with_offload():
    mapping = map_config(DEEPSPEED_ZERO3, "zero3.yaml")
    assert mapping.plugins == ["deepspeed"]
    assert {k: v for k, v in mapping.settings.items() if not k.startswith("train.")} == {
        "deepspeed.offload_optimizer": "cpu", "deepspeed.offload_param": "cpu", "deepspeed.zero_stage": 3}
    assert mapping.settings["train.max_grad_norm"] == 1.0  # DeepSpeed's gradient_clipping, kept explicit
    assert mapping.settings["train.gradient_accumulation_steps"] == 1


@pytest.mark.parametrize("config, message", [
    ({"distributed_type": "XLA"}, "distributed_type: 'XLA': the engine runs MULTI_GPU, MULTI_CPU, FSDP, DEEPSPEED, NO"),
    ({**DDP, "mixed_precision": "fp8"}, "mixed_precision: 'fp8': the engine trains in 'no', 'bf16' or 'fp16'"),
    ({**DDP, "ipex_config": {}}, "ipex_config: {}: not an Accelerate key the engine can map"),
    ({**DDP, "compute_environment": "AMAZON_SAGEMAKER"}, "compute_environment: 'AMAZON_SAGEMAKER': not supported"),
    ({**FSDP, "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD"}}, "NO_SHARD is data parallelism"),
    ({**FSDP, "fsdp_config": {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}}, "the engine shards transformer blocks"),
    ({**FSDP, "fsdp_config": {"fsdp_activation_checkpointing": True}}, "fsdp_activation_checkpointing: true: not "
                                                                        "supported"),
    ({**FSDP, "fsdp_config": {"fsdp_min_num_params": 100}}, "fsdp_config.fsdp_min_num_params: 100: not an FSDP "
                                                             "setting the engine can map"),
    ({**DDP, "fsdp_config": {"fsdp_offload_params": True}}, "fsdp_config needs distributed_type: FSDP"),
    ({**DEEPSPEED_ZERO3, "deepspeed_config": {"offload_param_device": "nvme"}}, "nvme is not supported"),
    ({**DDP, "num_processes": 3, "num_machines": 2}, "expected a positive multiple of num_machines"),
])
def test_keys_that_cannot_be_honoured_are_refused_by_name(config, message):
    with pytest.raises(ConfigError, match="--accelerate-config x.yaml: .*" + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        map_config(config, "x.yaml")


def test_processes_started_must_match(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="num_processes: 2: the launcher started 4 processes"):
        map_config(DDP, "x.yaml")


def test_a_run_file_value_that_disagrees_is_refused(tmp_path):
    import yaml

    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(DDP))
    with pytest.raises(ConfigError, match="train.fp16 = false in the run file, but --accelerate-config"):
        apply({"train": {"fp16": False}}, tmp_path / "acc.yaml")
    raw, _ = apply({"plugins": ["galore"], "train": {"fp16": True}}, tmp_path / "acc.yaml")
    assert raw["plugins"] == ["galore", "ddp"] and raw["train"]["fp16"] is True


def test_plan_shows_the_mapping_and_bad_files_are_one_line(tmp_path):
    import yaml

    config = {**FSDP, "mixed_precision": "no", "fsdp_config": {**FSDP["fsdp_config"],
                                                               "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}}
    (tmp_path / "fsdp.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "engine", "plan", "--accelerate-config", str(tmp_path / "fsdp.yaml")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "fsdp_config.fsdp_transformer_layer_cls_to_wrap: 'LlamaDecoderLayer' -> fsdp.wrap_modules = " \
           "['LlamaDecoderLayer']" in result.stdout
    assert "strategy   selected 'fsdp'" in result.stdout
    (tmp_path / "bad.yaml").write_text("distributed_type: [FSDP\n")
    result = subprocess.run([sys.executable, "-m", "engine", "plan", "--accelerate-config", str(tmp_path / "bad.yaml")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"engine: error: --accelerate-config: {tmp_path / 'bad.yaml'} is not valid YAML " \
                                    "at line 2, column 1"
