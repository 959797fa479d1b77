"""``engine migrate``: TrainingArguments dumps of realistic Trainer runs become run files that
``engine plan`` accepts, with the values read back from the file and from the plan's composed
config; and the table behind it answers every field of the installed transformers. The commands
run in this process (``engine.cli.main``), except two in real processes (the command line itself;
a plan that reaches a local Hub)."""

import contextlib
import dataclasses
import io
import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from transformers import Seq2SeqTrainingArguments, TrainingArguments

import engine
from engine.cli import main
from engine.config import TrainConfig
from engine.plugins import PluginManager, installed_plugins
from engine.testing import assert_one_line_error
from engine.builtin.trainer_args import FIELDS, LEGACY, SEQ2SEQ_FIELDS, answer_for
from engine.kit.mappings import ACCEPTED, KINDS, PLUGIN, show
from engine.tooling.accelerate_config import map_config
from engine_fsdp.mappings import _TRAINER_FSDP, FSDP_CONFIG

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED_ZERO2 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "allgather_bucket_size": 5e8},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}


def engine_command(*args, cwd, env=None):
    """``engine ARGS`` run in ``cwd``, as a finished process: in this process, or with ``env`` (variables
    added to this environment) in a process of its own (huggingface_hub reads its endpoint at import)."""
    if env is not None:
        return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, cwd=cwd,
                              env={**os.environ, **env}, timeout=300)
    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main([str(arg) for arg in args])
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["engine", *args], status, out.getvalue(), err.getvalue())


def convert(folder, name, arguments, command=False):
    """``arguments`` dumped to NAME.json and converted to NAME.toml, by ``engine migrate`` in a process of
    its own or by ``engine.migrate`` here: (the run file parsed, the report)."""
    (folder / f"{name}.json").write_text(arguments.to_json_string())
    if command:
        result = engine_command("migrate", f"{name}.json", "-o", f"{name}.toml", cwd=folder)
        assert result.returncode == 0, result.stderr
        report = result.stderr
    else:
        migration = engine.migrate(json.loads((folder / f"{name}.json").read_text()), source=f"{name}.json")
        (folder / f"{name}.toml").write_text(migration.toml())
        report = migration.report()
    return tomllib.loads((folder / f"{name}.toml").read_text()), report


def plan(folder, name, *sets, env=None):
    """``engine plan NAME.toml --set SET ...``: (its text, its composed config parsed)."""
    result = engine_command("plan", f"{name}.toml", *(arg for item in sets for arg in ("--set", item)), cwd=folder,
                            env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout, tomllib.loads(result.stdout.split("config (defaults filled in):", 1)[1])


def requires(*plugins):
    missing = [name for name in plugins if name not in installed_plugins()]
    return pytest.mark.skipif(bool(missing), reason=f"plugins not installed: {missing}")


# ---------------------------------------------------------------------------- the table


def test_every_field_of_the_installed_transformers_has_an_answer():
    names = [f.name for f in dataclasses.fields(TrainingArguments)]
    unanswered = [name for name in names if name not in FIELDS]
    assert not unanswered, f"TrainingArguments fields without an answer in engine/builtin/trainer_args.py: {unanswered}"
    gone = [name for name in FIELDS if name not in names]
    assert not gone, f"no longer TrainingArguments fields (move them to LEGACY): {gone}"
    assert not set(LEGACY) & set(names), "LEGACY holds current fields"
    assert list(FIELDS) == names  # the table reads in the dataclass's order
    seq2seq = [f.name for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.name not in names]
    assert list(SEQ2SEQ_FIELDS) == seq2seq, "Seq2SeqTrainingArguments' own fields and SEQ2SEQ_FIELDS differ"
    for name, answer in {**FIELDS, **SEQ2SEQ_FIELDS, **LEGACY}.items():
        assert answer.kind in KINDS, name
        if answer.kind in (ACCEPTED, PLUGIN):
            assert answer.keys or answer.convert, name
        else:
            assert answer.note and not answer.keys and not answer.convert, name
        assert (name in LEGACY) == bool(answer.legacy_defaults), name


def test_every_answer_names_a_real_train_key_or_plugin_option():
    plugins = sorted({p for answer in {**FIELDS, **SEQ2SEQ_FIELDS, **LEGACY}.values() for p in answer.plugins})
    missing = [p for p in plugins if p not in installed_plugins()]
    if missing:
        pytest.skip(f"plugins not installed: {missing}")
    schemas = {"train": TrainConfig, **PluginManager(enabled=plugins).option_schemas()}
    for name in [*FIELDS, *SEQ2SEQ_FIELDS, *LEGACY]:
        answer = answer_for(name)  # a field a plugin answers (fsdp, deepspeed): the plugin's answer
        if answer.kind == ACCEPTED:
            assert any(key.startswith("train.") for key in answer.keys), name
        if answer.kind == PLUGIN:
            assert answer.plugins, name
        for key in answer.keys:
            section, option = key.split(".", 1)
            assert section == "train" or section in answer.plugins, (name, key)
            assert option in {f.name for f in dataclasses.fields(schemas[section])}, (name, key)


def test_a_field_or_key_its_plugin_answers_is_lost_with_why_when_the_plugin_does_not_load(monkeypatch):
    """migrate and --accelerate-config ask the plugin itself (hooks trainer_argument_mappings and
    accelerate_mappings); a plugin that cannot answer leaves the value unconverted, saying why."""
    monkeypatch.setenv("ENGINE_DISABLE_PLUGIN_AUTOLOAD", "1")
    migration = engine.migrate({"output_dir": "out", "fsdp": "full_shard", "neftune_noise_alpha": 5.0})
    assert migration.plugins == []
    assert dict(migration.lost)['fsdp = "full_shard"'] == \
        "mapped by plugin fsdp, which ENGINE_DISABLE_PLUGIN_AUTOLOAD keeps from loading here"
    assert "neftune_noise_alpha = 5.0" in dict(migration.lost)
    with pytest.raises(engine.ConfigError, match=r"fsdp_config: '\{\.\.\.\}': mapped by plugin fsdp, which "):
        map_config({"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": True}}, "x.yaml")
    assert map_config({"distributed_type": "MULTI_GPU", "fsdp_config": {}}, "x.yaml").plugins == ["ddp"]
    monkeypatch.delenv("ENGINE_DISABLE_PLUGIN_AUTOLOAD")
    assert engine.migrate({"output_dir": "out", "fsdp": "full_shard"}).plugins == ["fsdp"]


def test_trainer_arguments_doc_is_up_to_date():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "docs" / "generate_trainer_arguments.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "trainer-arguments.md").read_text() == module.render(), \
        "docs/trainer-arguments.md is stale: run python docs/generate_trainer_arguments.py"


def test_seq2seq_training_arguments_convert_their_generation_fields():
    arguments = Seq2SeqTrainingArguments(output_dir="out/t5", predict_with_generate=True, generation_max_length=64,
                                         generation_num_beams=4, sortish_sampler=True, report_to="none")
    migration = engine.migrate(arguments)
    train = tomllib.loads(migration.toml())["train"]
    assert (train["predict_with_generate"], train["generation_max_length"], train["generation_num_beams"]) == \
        (True, 64, 4)
    assert "sortish_sampler = true" in migration.report() and "generation_config" not in train


def test_sampling_and_column_fields_convert():
    arguments = TrainingArguments(output_dir="out/s", train_sampling_strategy="group_by_length", length_column_name="n",
                                  remove_unused_columns=False, eval_accumulation_steps=4, report_to="none")
    train = tomllib.loads(engine.migrate(arguments).toml())["train"]
    assert {key: train[key] for key in ("train_sampling_strategy", "length_column_name", "remove_unused_columns",
                                        "eval_accumulation_steps")} == {
        "train_sampling_strategy": "group_by_length", "length_column_name": "n", "remove_unused_columns": False,
        "eval_accumulation_steps": 4}
    rebalance = engine.migrate(TrainingArguments(output_dir="out/r", train_sampling_strategy="batch_rebalance",
                                                 report_to="none"))
    assert "train_sampling_strategy" not in tomllib.loads(rebalance.toml())["train"]
    assert 'train_sampling_strategy = "batch_rebalance": \'batch_rebalance\' is refused' in rebalance.report()
    older = engine.migrate({"output_dir": "out/o", "group_by_length": True})
    assert tomllib.loads(older.toml())["train"]["train_sampling_strategy"] == "group_by_length"


# ---------------------------------------------------------------------------- realistic runs


def test_defaults_write_only_where_the_engines_default_differs(tmp_path):
    run, report = convert(tmp_path, "defaults", TrainingArguments(output_dir="out/defaults"), command=True)
    # Trainer's adamw_torch_fused and logging every 500 steps, not the engine's adamw_torch and 10
    assert run == {"plugins": [], "train": {"output_dir": "out/defaults", "optim": "adamw_torch_fused",
                                            "logging_steps": 500}, "data": {}}
    assert 'train.logging_steps = 500 (engine default: 10)' in report
    assert 'train.optim = "adamw_torch_fused" (engine default: "adamw_torch")' in report
    assert "not converted" not in report  # nothing set away from Trainer's default
    idle = report.split("no counterpart, at Trainer's default (docs/trainer-arguments.md): ", 1)[1].splitlines()[0]
    assert {"do_train", "local_rank", "do_eval"} <= set(idle.split(", "))
    text = (tmp_path / "defaults.toml").read_text()
    assert '# model = "path/to/model"' in text and '# train = "data/train.jsonl"' in text

    stdout, config = plan(tmp_path, "defaults")
    assert "optimizer  selected 'adamw_torch_fused' from builtin.optimizers" in stdout
    assert config["train"]["logging_steps"] == 500 and config["train"]["model"] == "tiny-llama"


def test_lora_style_finetune_with_galore(tmp_path):
    arguments = TrainingArguments(
        output_dir="out/galore", optim="galore_adamw", optim_target_modules=["self_attn", "mlp"],
        optim_args="rank=64,update_proj_gap=100,scale=0.25", learning_rate=2e-4, weight_decay=0.01,
        lr_scheduler_type="cosine", warmup_steps=0.1, per_device_train_batch_size=4, gradient_accumulation_steps=4,
        max_steps=200, logging_steps=0.05, eval_strategy="steps", eval_steps=50, save_strategy="steps",
        save_steps=100, save_total_limit=2, load_best_model_at_end=True, seed=7, bf16=False,
        gradient_checkpointing=True, report_to="none", eval_on_start=True, use_cache=True,
        do_train=True)
    run, report = convert(tmp_path, "galore", arguments)
    assert run["plugins"] == ["galore"]
    assert run["train"] == {
        "output_dir": "out/galore", "seed": 7, "max_steps": 200, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4, "learning_rate": 2e-4, "weight_decay": 0.01, "optim": "galore_adamw",
        "optim_args": "rank=64,update_proj_gap=100,scale=0.25", "optim_target_modules": ["self_attn", "mlp"],
        "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "activation_checkpointing": True,
        "logging_steps": 10, "eval_strategy": "steps", "eval_steps": 50, "save_steps": 100, "save_total_limit": 2,
        "load_best_model_at_end": True, "metric_for_best_model": "loss", "greater_is_better": False,
        "eval_on_start": True, "use_cache": True}
    assert "optim -> plugins += ['galore']" in report
    assert "logging_steps -> train.logging_steps = 10 (0.05 x max_steps 200, rounded up as Trainer does)" in report
    assert "warmup_steps -> train.warmup_ratio = 0.1" in report
    assert "do_train = true: refused: a flag for training scripts" in report
    text = (tmp_path / "galore.toml").read_text()
    assert "#   do_train = true: refused" in text
    assert "# eval_split = 0.1  # Trainer evaluated the eval_dataset it was given" in text  # plan refuses without

    stdout, config = plan(tmp_path, "galore", "data.eval_split=0.1")
    assert "optimizer  selected 'galore_adamw' from galore" in stdout
    assert "scheduler  selected 'cosine' from builtin.schedulers" in stdout
    assert {key: config["train"][key] for key in run["train"]} == run["train"]


@requires("fsdp")
def test_fsdp_run(tmp_path):
    arguments = TrainingArguments(
        output_dir="out/fsdp", fsdp="full_shard auto_wrap", ddp_timeout=3600, bf16=False, fsdp_config={
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "backward_prefetch": "backward_pre",
            "forward_prefetch": False, "use_orig_params": True, "cpu_ram_efficient_loading": True,
            "sync_module_states": True, "state_dict_type": "SHARDED_STATE_DICT", "activation_checkpointing": True})
    run, report = convert(tmp_path, "fsdp", arguments)
    assert run["plugins"] == ["fsdp"]
    assert run["fsdp"] == {"wrap_modules": ["LlamaDecoderLayer"], "reshard_after_forward": True,
                           "state_dict_type": "sharded", "timeout": 3600.0}
    assert run["train"]["activation_checkpointing"] is True  # FSDP's activation checkpointing of each block
    assert "fsdp_config.backward_prefetch -> FSDP2's own backward prefetch" in report
    assert "ddp_timeout -> fsdp.timeout = 3600.0" in report

    stdout, config = plan(tmp_path, "fsdp")
    assert "strategy   selected 'fsdp' from fsdp" in stdout
    assert {key: config["fsdp"][key] for key in run["fsdp"]} == run["fsdp"]
    assert config["fsdp"]["cpu_offload"] is False


@requires("deepspeed")
def test_deepspeed_zero2_as_a_table_and_as_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # TrainingArguments reads a DeepSpeed path from the working folder
    run, report = convert(tmp_path, "zero2", TrainingArguments(output_dir="out/ds", deepspeed=DEEPSPEED_ZERO2,
                                                               per_device_train_batch_size=2))
    expected = json.loads(json.dumps(DEEPSPEED_ZERO2))
    del expected["scheduler"], expected["zero_optimization"]["reduce_bucket_size"]
    assert run["plugins"] == ["deepspeed"] and run["deepspeed"] == {"config": expected}
    assert "deepspeed.scheduler = " in report and "the engine's scheduler drives the learning rate" in report
    assert 'deepspeed.zero_optimization.reduce_bucket_size = "auto": Trainer sizes it from the model' in report
    stdout, config = plan(tmp_path, "zero2")
    assert "strategy   selected 'deepspeed' from deepspeed" in stdout
    assert config["deepspeed"]["config"] == expected and config["train"]["per_device_train_batch_size"] == 2

    plain = {key: value for key, value in expected.items() if key != "optimizer"}
    (tmp_path / "ds_plain.json").write_text(json.dumps(plain))
    (tmp_path / "ds_trainer.json").write_text(json.dumps(DEEPSPEED_ZERO2))
    run, _ = convert(tmp_path, "plain", TrainingArguments(output_dir="out/plain", deepspeed="ds_plain.json"))
    assert run["deepspeed"] == {"config": "ds_plain.json"}  # the file as it is
    stdout, _ = plan(tmp_path, "plain")
    assert "strategy   selected 'deepspeed' from deepspeed" in stdout
    run, report = convert(tmp_path, "trainer", TrainingArguments(output_dir="out/t", deepspeed="ds_trainer.json"))
    assert run["deepspeed"] == {"config": expected}  # its content, without what the engine would refuse
    assert "deepspeed -> deepspeed.config = " in report and "(the content of ds_trainer.json)" in report


@requires("tensorboard", "mlflow", "neftune", "liger", "hub")
def test_trackers_neftune_liger_and_the_hub(tmp_path):
    sys.path.insert(0, str(ROOT / "plugins" / "hub" / "tests"))  # the fake Hub server of the hub plugin's tests
    from fake_hub import serve

    arguments = TrainingArguments(
        output_dir="out/misc", report_to=["tensorboard", "mlflow", "my_tracker"], run_name="exp-1",
        neftune_noise_alpha=5.0, use_liger_kernel=True,
        liger_kernel_config={"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": True},
        push_to_hub=True, hub_model_id="user/my-model", hub_strategy="checkpoint", hub_revision="dev",
        project="not-trackio")
    run, report = convert(tmp_path, "misc", arguments)
    assert run["plugins"] == ["liger", "neftune", "tensorboard", "mlflow", "hub"]
    assert run["neftune"] == {"noise_alpha": 5.0}
    assert run["liger"] == {"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": True}
    assert run["hub"] == {"repo": "user/my-model", "strategy": "checkpoint", "revision": "dev"}
    assert run["train"]["run_name"] == "exp-1" and "hub_token" not in json.dumps(run)
    assert "report_to 'my_tracker': no engine plugin reports to my_tracker" in report
    assert 'project = "not-trackio": used by plugin trackio only, which no argument enables' in report

    hub, server = serve()
    try:
        env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
               "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "hf_fakeToken", "HF_HUB_DISABLE_TELEMETRY": "1"}
        stdout, config = plan(tmp_path, "misc", env=env)
    finally:
        server.shutdown()
    assert list(hub.repos) == ["user/my-model"]  # the hub plugin checked the repo at configure
    for name in run["plugins"]:
        assert f"\n  {name} " in stdout
    for section in ("neftune", "liger", "hub"):
        assert {key: config[section][key] for key in run[section]} == run[section]


def test_every_report_to_integration_enables_its_tracker_plugin_and_all_the_installed_ones(monkeypatch):
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    from engine.builtin.trainer_args import REPORT_TO, TRACKERS, installed_trackers

    assert set(REPORT_TO) == set(INTEGRATION_TO_CALLBACK)  # transformers' 14 names, each answered
    named = engine.migrate({"output_dir": "out", "report_to": list(INTEGRATION_TO_CALLBACK)}).mapping
    assert sorted(named["plugins"]) == sorted(TRACKERS)
    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)
    everything = engine.migrate({"output_dir": "out", "report_to": "all"})
    assert everything.mapping.get("plugins", []) == installed_trackers()
    assert "kubeflow" not in installed_trackers()  # as Trainer: only inside a Kubeflow TrainJob
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", "https://127.0.0.1:1")
    assert ("kubeflow" in installed_trackers()) == ("kubeflow" in installed_plugins())
    monkeypatch.setenv("DISABLE_KUBEFLOW_INTEGRATION", "true")
    assert "kubeflow" not in installed_trackers()


def test_python_entry_point_takes_training_arguments(tmp_path):
    arguments = TrainingArguments(output_dir="out/api", optim="adamw_torch", learning_rate=1e-4,
                                  lr_scheduler_type="cosine", lr_scheduler_kwargs={"num_cycles": 0.25},
                                  eval_strategy="epoch", logging_steps=25, neftune_noise_alpha=10.0)
    migration = engine.migrate(arguments)
    text = migration.toml()
    assert tomllib.loads(text) == migration.mapping
    assert migration.mapping["train"]["lr_scheduler_kwargs"] == {"num_cycles": 0.25}
    (tmp_path / "api.json").write_text(arguments.to_json_string())
    result = engine_command("migrate", "api.json", cwd=tmp_path, env={})  # the real command line, once
    assert result.returncode == 0, result.stderr
    assert result.stdout == text.replace("from TrainingArguments", "from api.json")


def test_an_older_dump_and_fields_of_subclasses(tmp_path):
    older = {"output_dir": "out/old", "evaluation_strategy": "steps", "eval_steps": 20, "warmup_ratio": 0.05,
             "per_gpu_train_batch_size": 4, "logging_dir": "out/old/runs/Jan01_10-00-00_host",
             "fsdp": [], "sharded_ddp": [], "overwrite_output_dir": True, "no_cuda": True,
             "include_inputs_for_metrics": True,
             "my_script_flag": 1}  # not a field (TRL's SFTConfig fields are answered: tests/test_migrate_sft.py)
    (tmp_path / "old.json").write_text(json.dumps(older))
    result = engine_command("migrate", "old.json", "-o", "old.toml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run = tomllib.loads((tmp_path / "old.toml").read_text())
    assert run["train"] == {"output_dir": "out/old", "per_device_train_batch_size": 4, "warmup_ratio": 0.05,
                            "use_cpu": True, "eval_strategy": "steps", "eval_steps": 20,
                            "include_for_metrics": ["inputs"]}
    assert "overwrite_output_dir = true: refused: a flag of the example scripts" in result.stderr
    assert "not fields of transformers" in result.stderr and "not converted: my_script_flag" in result.stderr
    assert "logging_dir" not in result.stderr  # Trainer's own default folder


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("content, fragment", [
    ("output_dir: out\n", "args.json is not JSON (Expecting value: line 1 column 1 (char 0)); expected "
                          "TrainingArguments.to_json_string() output"),
    ('["output_dir"]', "args.json holds a JSON list, expected an object of TrainingArguments fields"),
    (None, "args.json: no such file; name the JSON file TrainingArguments.to_json_file() wrote"),
])
def test_bad_arguments_file(tmp_path, content, fragment):
    if content is not None:
        (tmp_path / "args.json").write_text(content)
    assert_one_line_error(engine_command("migrate", "args.json", cwd=tmp_path), fragment)


@pytest.mark.parametrize("path, make, fragment", [
    ("args", Path.mkdir, "args is a folder; name the JSON file TrainingArguments.to_json_file() wrote"),
    ("/dev/zero", None, "/dev/zero is not a regular file; name the JSON file"),  # would never end
    ("args.json", lambda p: p.write_bytes(b'{"output_dir": "\xff"}'), "args.json is not UTF-8 text (byte 0xff on "
                                                                     "line 1)"),
    ("args.json", lambda p: p.write_text(" " * (1 << 20) + "{}"), "args.json is larger than 1,048,576 bytes"),
    ("args.json", lambda p: p.write_text('{"lr_scheduler_kwargs": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     "args.json nests tables or arrays more than 32 levels deep; expected TrainingArguments.to_json_string() output"),
    ("args.json", lambda p: p.write_text('{"deepspeed": ' + '{"a": ' * 40 + "1" + "}" * 41),
     "args.json nests tables or arrays more than 32 levels deep"),  # parses, but too deep to walk
])
def test_special_large_binary_and_deep_arguments_files(tmp_path, path, make, fragment):
    if make is not None:
        make(tmp_path / path)
    assert_one_line_error(engine_command("migrate", path, cwd=tmp_path), fragment)


def test_an_existing_output_is_kept_unless_forced(tmp_path):
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": "out", "learning_rate": 1e-3}))
    (tmp_path / "run.toml").write_text("# mine\n")
    assert_one_line_error(engine_command("migrate", "args.json", "-o", "run.toml", cwd=tmp_path),
                           "-o run.toml: the file exists; pass --force to overwrite it")
    assert (tmp_path / "run.toml").read_text() == "# mine\n"
    result = engine_command("migrate", "args.json", "-o", "run.toml", "--force", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert tomllib.loads((tmp_path / "run.toml").read_text())["train"]["learning_rate"] == 1e-3


# ---------------------------------------------------------------------------- credentials

SECRETS = {"hub_token": "hf_SECRETa1hub", "push_to_hub_token": "hf_SECRETb2push",  # the field, and older releases'
           "wandb_api_key": "SECRETc3wandb", "db_password": "SECRETd4pw"}  # fields of a subclass (TRL, a user's own)
NESTED_SECRETS = {  # credentials inside tables
    "lr_scheduler_kwargs": {"num_cycles": 0.5, "api_key": "SECRETe5kwargs"},
    "accelerator_config": {"split_batches": True, "token": "SECRETf6accelerator"},
    "fsdp_config": {"hf_token": "SECRETg7fsdp"},  # without fsdp: listed as not converted
}
COMET = {"enabled": True, "api_key": "SECRETh8comet"}  # DeepSpeed's Comet monitor takes an API key


def _secrets_in(text):
    return [secret for secret in [*SECRETS.values(), "SECRETe5", "SECRETf6", "SECRETg7", "SECRETh8"] if secret in text]


@requires("deepspeed")
def test_no_credential_reaches_the_run_file_the_report_or_the_plan(tmp_path, monkeypatch, capfd):
    """Everything migrate writes (the run file, stdout, stderr) and everything `engine plan` prints of
    the converted run (file descriptors captured: logging too), with a distinctive credential in every
    place a dump can hold one."""
    (tmp_path / "ds.json").write_text(json.dumps({**DEEPSPEED_ZERO2, "comet": COMET}))
    # a path to a file whose content is written (its scheduler is dropped), and an inline table
    for deepspeed in ("ds.json", {**DEEPSPEED_ZERO2, "comet": COMET}):
        migration = engine.migrate({"output_dir": "out", **SECRETS, **NESTED_SECRETS, "deepspeed": deepspeed})
        assert _secrets_in(migration.toml() + migration.report()) == []
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": "out", **SECRETS, **NESTED_SECRETS,
                                                    "deepspeed": "ds.json"}))
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    assert main(["migrate", "args.json", "-o", "run.toml"]) == 0
    stdout, stderr = capfd.readouterr()
    run_file = (tmp_path / "run.toml").read_text()
    assert _secrets_in(stdout + stderr + run_file) == []
    for line in ('hub_token = "***": a token is never written to a run file: set HF_TOKEN',
                 'push_to_hub_token = "***": refused: set HF_TOKEN',
                 'deepspeed.comet.api_key = "***": a credential is never written to a run file',
                 'lr_scheduler_kwargs = {"num_cycles": 0.5, "api_key": "***"}: train.lr_scheduler_kwargs.api_key is a '
                 'credential, never written to a run file',
                 'accelerator_config = {"split_batches": true, "token": "***"}: refused',
                 'fsdp_config = {"hf_token": "***"}: used only with fsdp'):
        assert f"\n  {line}" in stderr and f"\n#   {line}" in run_file
    assert "wandb_api_key, db_password" in stderr  # named as unknown fields, never their values
    run = tomllib.loads(run_file)
    assert run["deepspeed"]["config"]["comet"] == {"enabled": True}  # the rest of the table is kept
    assert "lr_scheduler_kwargs" not in run["train"]

    assert main(["plan", "run.toml"]) == 0
    stdout, stderr = capfd.readouterr()
    assert "strategy   selected 'deepspeed' from deepspeed" in stdout
    assert _secrets_in(stdout + stderr) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["args.json", "ds.json", "run.toml"]


# ---------------------------------------------------------------------------- values of the wrong type

WRONG = [None, "false", "yes", [1, 2], [[1]], {"a": 1}, {"a": None}, 2.5, -1, float("inf"), float("nan"), True,
         10**30]


@pytest.mark.parametrize("wrong", WRONG, ids=repr)
def test_every_field_of_a_wrong_type_is_listed_never_a_crash(wrong):
    """Every field (and every fsdp_config key) at once at a value of a type it may not take: a run file
    that parses, whose values its sections' schemas accept (migrate checks them); a key with a line
    break ends no comment of it."""
    fsdp_keys = [*_TRAINER_FSDP, *FSDP_CONFIG, 'x\nplugins = ["evil"]']
    for arguments in ({name: wrong for name in [*FIELDS, *SEQ2SEQ_FIELDS, *LEGACY]},
                      {"output_dir": "out", "fsdp": True, "fsdp_config": {key: wrong for key in fsdp_keys}}):
        migration = engine.migrate(arguments)
        assert tomllib.loads(migration.toml()) == migration.mapping
        assert migration.report()


def test_values_of_the_wrong_type_are_listed_with_what_the_field_takes():
    deep = '{"power": ' + "[" * 40 + "]" * 40 + "}"  # a JSON string Trainer would parse
    migration = engine.migrate({
        "output_dir": "out", "use_liger_kernel": "false", "push_to_hub": "false", "group_by_length": "true",
        "logging_steps": float("inf"), "warmup_steps": float("nan"), "optim": ["adamw_torch"], "deepspeed": True,
        "fsdp": 3, "learning_rate": "1e-3", "activation_checkpointing_kwargs": {"every_n_layers": None},
        "lr_scheduler_kwargs": deep})
    assert migration.plugins == []  # "false" enabled liger and the hub, true DeepSpeed without a config
    lost = dict(migration.lost)
    assert lost == {
        'use_liger_kernel = "false"': "expected true or false",
        'push_to_hub = "false"': "expected true or false",
        'group_by_length = "true"': "expected true or false",
        "logging_steps = Infinity": "expected a whole number of steps, or a ratio in (0, 1)",
        "warmup_steps = NaN": "expected a step count or a ratio in [0, 1)",
        'optim = ["adamw_torch"]': "expected an optimizer name, e.g. 'adamw_torch'",
        "deepspeed = true": "expected the path of a DeepSpeed JSON file or a table",
        "fsdp = 3": "expected true, or FSDP options such as 'full_shard auto_wrap'",
        'learning_rate = "1e-3"': "train.learning_rate: expected float, got str '1e-3'",
        'activation_checkpointing_kwargs = {"every_n_layers": null}': "train.activation_checkpointing_kwargs."
                                                                 "every_n_layers would be null, which a run file "
                                                                 "(TOML) cannot hold",
        f"lr_scheduler_kwargs = {show(deep)}":
            "expected a table or a JSON object, got a string that nests tables or arrays more than 32 levels deep"}


def test_fsdp_config_values_of_the_wrong_type_are_listed(tmp_path):
    (tmp_path / "deep.json").write_text('{"a": ' * 40 + "1" + "}" * 40)
    migration = engine.migrate({"output_dir": "out", "fsdp": True, "fsdp_config": {
        "sharding_strategy": [1], "state_dict_type": {"FULL_STATE_DICT": 1}, "fsdp_version": True,
        "transformer_layer_cls_to_wrap": [3], "cpu_offload": "maybe", "backward_prefetch": 1}})
    assert migration.plugins == ["fsdp"] and migration.sections["fsdp"] == {}
    assert dict(migration.lost) == {
        "fsdp_config.sharding_strategy = [1]": "the engine maps FULL_SHARD (1), SHARD_GRAD_OP (2) and HYBRID_SHARD (4)",
        'fsdp_config.state_dict_type = {"FULL_STATE_DICT": 1}': "the engine saves FULL_STATE_DICT or "
                                                                "SHARDED_STATE_DICT",
        "fsdp_config.version = true": "expected 1 or 2",
        "fsdp_config.transformer_layer_cls_to_wrap = [3]": "expected class names, e.g. 'LlamaDecoderLayer' or "
                                                           "'BertLayer,BertEmbeddings'",
        'fsdp_config.cpu_offload = "maybe"': "expected true or false",
        "fsdp_config.backward_prefetch = 1": "FSDP2 prefetches the next block before each block's backward "
                                             "(BACKWARD_PRE) and has no other policy"}
    for path, problem in (("/dev/zero", "is not a regular file"), (str(tmp_path), "is a folder"),
                          (str(tmp_path / "deep.json"), "nests tables or arrays more than 32 levels deep")):
        migration = engine.migrate({"output_dir": "out", "fsdp": True, "fsdp_config": path})
        assert dict(migration.lost) == {f"fsdp_config = {show(path)}": f"fsdp_config {path} {problem}" + (
            "; name the fsdp_config JSON file" if "nests" not in problem else "")}


def test_migrate_prints_nothing_libraries_say_while_they_load(tmp_path):
    """transformers brings in torchao, bitsandbytes and torch's pytree registrations; their import-time lines
    (on this machine: torchao's CPU build, the kernels package, torch's Enum deprecation) are filtered as in a run."""
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": "out", "learning_rate": 2e-5}))
    done = engine_command("migrate", "args.json", "-o", "run.toml", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    said = (done.stdout + done.stderr).splitlines()
    assert said[0] == "engine migrate: args.json -> plugins = []"
    noise = ("Failed to load", "is an Enum subclass", "kernels-community", "Setting accelerator to CPU")
    assert [line for line in said if any(text in line for text in noise)] == []
