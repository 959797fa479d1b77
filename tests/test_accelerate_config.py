"""--accelerate-config: the four shapes of Accelerate's documentation map onto the strategy
plugins and their options; keys the engine cannot honour are refused by name; values of the wrong
type, files that are not small UTF-8 YAML, and YAML that nests or expands too far are one line each;
a credential is never shown."""

import json
import math
import subprocess
import sys

import pytest

from engine import ConfigError
from engine.tooling.accelerate_config import _TOP_LEVEL, ACCELERATE_KEYS, apply, map_config
from engine_deepspeed.mappings import DEEPSPEED_CONFIG
from engine_fsdp.mappings import FSDP_CONFIG
from engine.cli import main

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
    assert result.stderr.strip() == f"engine: error: --accelerate-config {tmp_path / 'bad.yaml'} is not valid YAML " \
                                    "at line 2, column 1"


@pytest.fixture
def cli(tmp_path, capfd, monkeypatch):
    """``cli(*argv)`` runs ``engine`` in ``tmp_path``: (exit status, stdout, stderr), file descriptors captured."""
    monkeypatch.chdir(tmp_path)

    def run(*argv):
        capfd.readouterr()
        status = main([str(a) for a in argv])
        out, err = capfd.readouterr()
        return status, out, err

    return run


def _refused(cli, tmp_path, yaml_text, fragment):
    (tmp_path / "acc.yaml").write_text(yaml_text)
    status, _, err = cli("plan", "--accelerate-config", "acc.yaml")
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("engine: error: "), err
    assert fragment in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------- values of the wrong type

# what each key the mapping reads takes (a bool is not an int); a new key needs its line here
TAKES = {
    "distributed_type": (str,), "num_processes": (int,), "num_machines": (int,), "machine_rank": (int,),
    "main_process_ip": (str, type(None)), "main_process_port": (int, type(None)), "rdzv_backend": (str,),
    "same_network": (bool,), "gpu_ids": (str, int), "main_training_function": (str,), "enable_cpu_affinity": (bool,),
    "compute_environment": (str,), "debug": (bool,), "downcast_bf16": (str, bool), "tpu_env": (list,),
    "tpu_use_cluster": (bool,), "tpu_use_sudo": (bool,), "dynamo_config": (dict, type(None)),
    "mixed_precision": (str, bool),  # YAML reads an unquoted `no` as false
    "use_cpu": (bool, str), "fsdp_config": (dict, type(None)), "deepspeed_config": (dict, type(None)),
    "fsdp_config.fsdp_auto_wrap_policy": (str,), "fsdp_config.fsdp_transformer_layer_cls_to_wrap": (str, list),
    "fsdp_config.fsdp_sharding_strategy": (str, int), "fsdp_config.fsdp_reshard_after_forward": (bool, str),
    "fsdp_config.fsdp_offload_params": (bool, str), "fsdp_config.fsdp_state_dict_type": (str,),
    "fsdp_config.fsdp_backward_prefetch_policy": (str, type(None)),
    "fsdp_config.fsdp_backward_prefetch": (str, type(None)), "fsdp_config.fsdp_forward_prefetch": (bool,),
    "fsdp_config.fsdp_use_orig_params": (bool,), "fsdp_config.fsdp_sync_module_states": (bool,),
    "fsdp_config.fsdp_cpu_ram_efficient_loading": (bool,), "fsdp_config.fsdp_version": (int,),
    "fsdp_config.fsdp_activation_checkpointing": (bool,),
    "deepspeed_config.deepspeed_config_file": (str,), "deepspeed_config.zero_stage": (int,),
    "deepspeed_config.offload_optimizer_device": (str, type(None)),
    "deepspeed_config.offload_param_device": (str, type(None)), "deepspeed_config.zero3_init_flag": (bool, str),
    "deepspeed_config.zero3_save_16bit_model": (bool, str), "deepspeed_config.gradient_accumulation_steps": (int,),
    "deepspeed_config.gradient_clipping": (int, float), "deepspeed_config.deepspeed_multinode_launcher": (str,),
}
CANDIDATES = [None, True, False, 0, 1, 2, 2.5, -1, math.nan, math.inf, "", "no", "bogus", "true", "1", "FULL_SHARD",
              "BACKWARD_PRE", "TRANSFORMER_BASED_WRAP", "SHARDED_STATE_DICT", "LOCAL_MACHINE", "FSDP", "cpu", [], [1],
              ["BertLayer"], [[[]]], {}, {"a": 1}, {"fsdp_version": 2}]


def _config_reading(path, value):
    """The smallest config in which the mapping reads key ``path`` (``table.key`` for a nested one)."""
    table, _, key = path.rpartition(".")
    distributed = {"fsdp_config": "FSDP", "deepspeed_config": "DEEPSPEED"}.get(table or key, "NO")
    config = {"distributed_type": distributed}
    if table:
        config[table] = {key: value}
    else:
        config[key] = value
    return config


def test_every_key_read_is_typed_here():
    read = {"distributed_type", *_TOP_LEVEL, *ACCELERATE_KEYS, *(f"fsdp_config.{key}" for key in FSDP_CONFIG),
            *(f"deepspeed_config.{key}" for key in DEEPSPEED_CONFIG)}
    assert read == set(TAKES)


@pytest.mark.parametrize("path", sorted(TAKES))
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key(path):
    """Every candidate value either maps (and is of a type the key takes) or is refused with one line
    naming the key path: never another exception."""
    for value in CANDIDATES:
        try:
            map_config(_config_reading(path, value), "x.yaml")
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message and message.startswith(f"--accelerate-config x.yaml: {path}"), message
        else:
            assert type(value) in TAKES[path], f"{path}: {value!r} was accepted"


@pytest.mark.parametrize("yaml_text, fragment", [
    ("distributed_type: [FSDP]\n", "distributed_type: ['FSDP']: the engine runs MULTI_GPU, MULTI_CPU, FSDP"),
    ("distributed_type: FSDP\nfsdp_config: [fsdp_offload_params]\n",
     "fsdp_config: ['fsdp_offload_params']: expected a table of settings"),
    ("distributed_type: FSDP\nfsdp_config: FULL_SHARD\n", "fsdp_config: 'FULL_SHARD': expected a table of settings"),
    ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: [1]\n",
     "fsdp_config.fsdp_sharding_strategy: [1]: the engine maps FULL_SHARD (1)"),
    ("distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: {FULL_STATE_DICT: 1}\n",
     "fsdp_config.fsdp_state_dict_type: {'FULL_STATE_DICT': 1}: the engine saves FULL_STATE_DICT or"),
    ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: '3'\n",
     "deepspeed_config.zero_stage: '3': expected 0, 1, 2 or 3"),
    ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_clipping: .nan\n",
     "deepspeed_config.gradient_clipping: nan: sets train.max_grad_norm: expected a finite float"),
    ("num_processes: two\n", "num_processes: 'two': expected a whole number"),
    ("use_cpu: 'no'\n", "use_cpu: 'no': expected true or false"),  # bool('no') was true: the CPU was used
    ('"a\\nb": 1\n', "'a\\nb': 1: not an Accelerate key the engine can map"),  # a line break in a key
    ("3: 1\n", "3: 1: not an Accelerate key the engine can map"),
])
def test_wrong_types_through_engine_plan(cli, tmp_path, yaml_text, fragment):
    _refused(cli, tmp_path, yaml_text, f"--accelerate-config acc.yaml: {fragment}")


def test_an_unquoted_no_is_no_mixed_precision():
    assert map_config({**DDP, "mixed_precision": False}, "x.yaml").settings["train.bf16"] is False


# ---------------------------------------------------------------------------- bounded reading

LEVELS = "abcdefghij"
BOMB = "tpu_env: [&a [" + ",".join("x" * 9) + "], " + ", ".join(  # "billion laughs": 9^10 values in 331 bytes
    f"&{name} [{','.join([f'*{below}'] * 9)}]" for below, name in zip(LEVELS, LEVELS[1:])) + "]\n"


@pytest.mark.parametrize("name, content, fragment", [
    ("bomb.yaml", BOMB, "bomb.yaml holds more than 10,000 values once its aliases (*name) are expanded; "
                   "write the settings out"),
    ("/dev/zero", None, "/dev/zero is not a regular file; name the YAML file `accelerate config` wrote"),
])
def test_files_that_would_never_end_are_one_line(tmp_path, name, content, fragment):
    """In a process of its own, with a timeout: both hung `engine plan`."""
    assert len(BOMB) < 400
    if content is not None:
        (tmp_path / name).write_text(content)
    result = subprocess.run([sys.executable, "-m", "engine", "plan", "--accelerate-config", name], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == f"engine: error: --accelerate-config {fragment}"


@pytest.mark.parametrize("content, fragment", [
    ("[" * 100_000 + "]" * 100_000, "nests mappings or lists more than 32 levels deep"),
    ("a: " + "{b: " * 33 + "1" + "}" * 33, "nests mappings or lists more than 32 levels deep"),
    ("a: &a [1, *a]\n", "alias *a refers to a mapping or list that holds it"),
    (b"distributed_type: FSDP\n\xff\n", "is not UTF-8 text (byte 0xff on line 2)"),
    (bytes(range(256)), "is not UTF-8 text (byte 0x80 on line 2)"),
    ("# " + "x" * (1 << 20), "is larger than 1,048,576 bytes"),
    ("distributed_type: FSDP\n\0\n", "is not valid YAML"),
    ("", "holds a NoneType, expected a mapping of Accelerate settings"),
])
def test_deep_recursive_binary_and_huge_files_are_one_line(cli, tmp_path, content, fragment):
    path = tmp_path / "acc.yaml"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    status, _, err = cli("plan", "--accelerate-config", "acc.yaml")
    assert status == 2 and err.strip().splitlines() == [err.strip()] and "Traceback" not in err, err
    assert err.startswith("engine: error: --accelerate-config acc.yaml") and fragment in err, err


def test_a_folder_and_a_missing_file(cli, tmp_path):
    (tmp_path / "configs").mkdir()
    for name, fragment in (("configs", "configs is a folder"), ("none.yaml", "none.yaml: no such file")):
        status, _, err = cli("plan", "--accelerate-config", name)
        assert status == 2 and err.strip() == f"engine: error: --accelerate-config {fragment}; name the YAML file " \
                                              "`accelerate config` wrote"


def test_aliases_within_bounds_are_read(tmp_path):
    (tmp_path / "acc.yaml").write_text("distributed_type: FSDP\nnum_machines: &one 1\nfsdp_config:\n"
                                       "  fsdp_sharding_strategy: *one\n  fsdp_version: 2\n")
    raw, mapping = apply({}, tmp_path / "acc.yaml")
    assert mapping.plugins == ["fsdp"] and raw["fsdp"] == {"reshard_after_forward": True}


# ---------------------------------------------------------------------------- credentials


def test_a_credential_is_never_shown(cli, tmp_path):
    for text in ("hf_token: SECRETa1\n", "wandb: {project: p, api_key: SECRETa1}\n",
                 "distributed_type: DEEPSPEED\ndeepspeed_config: {comet_api_key: SECRETa1}\n"):
        line = _refused(cli, tmp_path, text, "not ")
        assert "SECRETa1" not in line and "***" in line
    # a DeepSpeed file holding one: the plan shows its path, never its content
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2},
                                                  "comet": {"enabled": False, "api_key": "SECRETa1"}}))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: ds.json\n")
    status, out, err = cli("plan", "--accelerate-config", "acc.yaml")
    assert status == 0, err
    assert "deepspeed_config.deepspeed_config_file: 'ds.json' -> deepspeed.config = 'ds.json'" in out
    assert "SECRETa1" not in out + err
