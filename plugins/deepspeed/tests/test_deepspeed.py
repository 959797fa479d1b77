"""DeepSpeed in real processes (gloo, CPU, torchrun): ZeRO 0-3 equal to one process with the whole
batch, checkpoints and exact resume, the final and the best model under ZeRO-3, config refusals."""

import json
import sys
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from engine.testing import (TEST_CORPUS, free_port, launch_cases, max_difference, run_steps, tiny_dataset,
                            tiny_model, tiny_tokenizer, torchrun, write_run_file)

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
              {**_case("zero3_offload", 3, whole), "sections": {"deepspeed": {
                  "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}}},
              # the DeepSpeed config names the optimizer: DeepSpeed builds it, the engine's scheduler drives it
              {**_case("ds_optimizer", 2, whole), "sections": {"deepspeed": {"zero_stage": 2, "config": {
                  "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.9}}}}}},
              # negative controls: gradients never synchronised (DDP's control), divided by the window twice
              {**_case("unsynced", 0, {**whole, "strategy": "unsynced"}), "plugins": ["ddp"], "sections": {},
               "objects": ["unsynced:plugin"]},
              {**_case("divided_twice", 2, {**accumulated, "strategy": "divided_twice"}),
               "objects": ["controls:plugin"]}]
    # DeepSpeed's bf16 mode: bf16 weights, fp32 master copy in the optimizer
    bf16_cases = [_case(f"bf16_zero{stage}", stage, {**whole, "bf16": True}) for stage in (2, 3)]
    trained = launch_cases(cases + bf16_cases, tmp_path, env=ENV)
    whole_reference = _reference({"per_device_train_batch_size": 8, "max_grad_norm": 1.0})
    accumulated_reference = _reference({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                        "max_grad_norm": 1.0})
    differences = {case["name"]: max_difference(trained[case["name"]], accumulated_reference if
                                                          "gradient_accumulation_steps" in case["train"] else
                                                          whole_reference) for case in cases}
    print("max |parameter difference| against one process:", differences)
    controls = {"unsynced", "divided_twice"}
    for case in bf16_cases:  # within bf16's rounding of the weights (8 bits of mantissa) of the fp32 run
        bf16 = trained[case["name"]]
        assert all(tensor.dtype == torch.bfloat16 for tensor in bf16.values())
        relative = max(((bf16[name].float() - value).abs().max() / value.abs().max()).item()
                       for name, value in whole_reference.state_dict().items())
        print(f"{case['name']}: max |difference| / max |weight| against fp32 = {relative:.2e}")  # 5.6e-3 measured
        assert relative < 2 ** -6
    assert all(value < TOLERANCE for name, value in differences.items() if name not in controls), differences
    assert all(differences[name] > 100 * TOLERANCE for name in controls), differences


# ---------------------------------------------------------------------------- the command line under torchrun


def _run_file(folder, stage, deepspeed=None, **train):
    from engine.config import to_toml

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(TEST_CORPUS)
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


def _train_alone(run_file):
    """``python -m engine train RUN_FILE``: one process, no launcher."""
    import os
    import subprocess

    env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, "-m", "engine", "train", str(run_file)], env={**env, **ENV},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _weights(folder):
    return load_file(folder / "model.safetensors")


def _losses(out):
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _deepspeed_launcher(run_file, *sets):
    """``deepspeed --module engine train`` (the DeepSpeed launcher, 2 processes on this machine)."""
    import os
    import subprocess

    command = [str(Path(sys.prefix) / "bin" / "deepspeed"), "--no_local_rank", "--num_gpus", "2", "--master_port",
               str(free_port()), "--module", "engine", "train", str(run_file), *(f"--set={s}" for s in sets)]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", **ENV}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _resume_from_step_4(tmp_path, stage, launcher):
    """An uninterrupted 8-step run, then a run resumed from its checkpoint-4: both end with the same
    weights (bit for bit) and losses. Returns the uninterrupted run's output folder and resumed run file."""
    straight = _run_file(tmp_path / "straight", stage)
    _train(straight)
    out = tmp_path / "straight" / "out"
    logged = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert logged == list(range(1, 9))  # by the main process only
    written = {p.name for p in (out / "checkpoint-4" / "deepspeed").iterdir()}
    partitions = {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)}  # one per process
    assert partitions <= written, written
    resumed = _run_file(tmp_path / "resumed", stage)
    result = launcher(resumed, f'train.resume_from_checkpoint="{out / "checkpoint-4"}"')
    assert result.stderr.count("engine: resumed from") == 1
    expected = _weights(out)
    for name, tensor in _weights(tmp_path / "resumed" / "out").items():
        assert torch.equal(tensor, expected[name]), name
    assert _losses(tmp_path / "resumed" / "out") == _losses(out)[4:]
    return out, resumed


def test_zero1_resumes_exactly_under_the_deepspeed_launcher_and_only_with_as_many_processes(tmp_path):
    out, resumed = _resume_from_step_4(tmp_path, 1, _deepspeed_launcher)
    # one optimizer partition per process: another number of processes cannot resume it
    other = torchrun(["-m", "engine", "train", str(resumed), f'--set=train.resume_from_checkpoint="{out}/checkpoint-4"',
                      f'--set=train.output_dir="{tmp_path / "single"}"', "--set=train.per_device_train_batch_size=8"],
                     nproc=1, env=ENV)
    assert other.returncode != 0
    assert ("was made by 2 processes (deepspeed), this run has 1 (deepspeed), which cannot resume it; "
            "launch 2 processes") in other.stderr


def test_zero3_resumes_exactly_and_a_damaged_partition_is_refused(tmp_path):
    out, _ = _resume_from_step_4(tmp_path, 3, _train)
    # DeepSpeed's files are in the checkpoint's manifest: a changed byte is refused before anything loads
    partition = out / "checkpoint-8" / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(partition.read_bytes())
    data[len(data) // 2] ^= 0xFF
    partition.write_bytes(bytes(data))
    damaged = torchrun(["-m", "engine", "train", str(tmp_path / "straight" / "run.toml"),
                        "--set=train.resume_from_checkpoint=true", "--set=train.max_steps=10"], env=ENV)
    assert damaged.returncode != 0
    assert damaged.stderr.count("deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt does not match its "
                                "checksum") == 1


def test_zero3_best_and_final_models_are_whole_and_load_with_from_pretrained(tmp_path):
    import transformers

    # greater_is_better on a loss: the first evaluation is the best, far from the last weights
    run_file = _run_file(tmp_path, 3, eval_strategy="steps", eval_steps=2, save_steps=2, load_best_model_at_end=True,
                         metric_for_best_model="eval_loss", greater_is_better=True)
    result = _train(run_file)
    out = tmp_path / "out"
    assert "loaded the best model from" in result.stderr
    best = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())["best_model_checkpoint"]
    assert Path(best).name == "checkpoint-2"
    final, best_weights, last = _weights(out), _weights(Path(best)), _weights(out / "checkpoint-8")
    assert all(torch.equal(final[name], best_weights[name]) for name in final)
    assert not all(torch.equal(final[name], last[name]) for name in final)  # the best really was loaded

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    config = model.config
    assert (config.hidden_size, config.intermediate_size) == (32, 64)
    for name, tensor in model.state_dict().items():  # whole tensors, not ZeRO-3's empty partitions
        assert tensor.numel() > 0 and torch.equal(tensor, final[name]), name
    ids = torch.arange(10).unsqueeze(0)
    assert torch.isfinite(model(input_ids=ids).logits).all()

    # and a ZeRO-3 run starts from it: from_pretrained under zero.Init loads into the partitions
    again = _run_file(tmp_path / "again", 3, model=str(out), max_steps=1, learning_rate=1e-12, save_steps=100)
    _train(again, f'data.tokenizer="{out}"')
    for name, tensor in _weights(tmp_path / "again" / "out").items():
        assert torch.allclose(tensor, final[name], rtol=0, atol=1e-9), name


# ---------------------------------------------------------------------------- ZeRO-3 construction (zero.Init)


def test_zero3_run_of_a_model_built_from_config_equals_one_process_with_twice_the_batch(tmp_path):
    # the builtin tiny-llama's random weights are drawn under zero.Init: they used to be other draws
    # than one process's (loss at step 1: 5.699 vs 5.728; weights 0.12 apart after 4 steps)
    train = {**SGD, "max_steps": 4, "save_strategy": "no"}
    (tmp_path / "zero3").mkdir()
    (tmp_path / "one").mkdir()
    zero3 = write_run_file(tmp_path / "zero3", ["deepspeed"], {"deepspeed": {"zero_stage": 3}}, **train)
    one = write_run_file(tmp_path / "one", [], **{**train, "per_device_train_batch_size": 8})
    _train(zero3)
    _train_alone(one)
    zero3_out, one_out = tmp_path / "zero3" / "out", tmp_path / "one" / "out"
    assert _losses(zero3_out)[0] == pytest.approx(_losses(one_out)[0], abs=2e-6)  # logged with 6 decimals
    difference = max_difference(_weights(zero3_out), _weights(one_out))
    print(f"max |weight difference| against one process: {difference:.1e}")
    assert difference < TOLERANCE


def test_zero3_starts_from_the_weights_one_process_draws_for_a_class_called_directly_and_from_pretrained(
        tmp_path, monkeypatch):
    # the builtin model (AutoModelForCausalLM.from_config, as a from_config factory) is the test above
    monkeypatch.syspath_prepend(str(HERE))  # the factories, also for the reference built in this process
    import transformers
    from initial_weights import SIZES, initial_weights

    (tmp_path / "corpus.txt").write_text(TEST_CORPUS)
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                     **SIZES}))
    base, tokenizer = tmp_path / "base", tiny_tokenizer()
    transformers.LlamaModel(transformers.LlamaConfig(**SIZES, vocab_size=len(tokenizer))).save_pretrained(base)
    tokenizer.save_pretrained(base)
    monkeypatch.setenv("BASE_MODEL", str(base))
    models = {"json_architectures": str(tmp_path / "llama.json"),  # used to crash: init on empty partitions
              "factory_class": "initial_weights:llama_from_class",  # used to keep torch's default init (4.2 away)
              "factory_base": "initial_weights:llama_from_base"}  # transformers' ZeRO-3 path initialises the head

    def config(name, **run):
        return {"train": {"model": models[name], "output_dir": str(tmp_path / name), "disable_tqdm": True,
                          "save_strategy": "no", "seed": 7},
                "data": {"train": str(tmp_path / "corpus.txt"), "max_length": 32, "tokenizer_vocab_size": 300,
                         "tokenizer": str(base) if name == "factory_base" else "train"}, **run}

    cases = {name: config(name, plugins=["deepspeed"], deepspeed={"zero_stage": 3}) for name in models}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = torchrun([str(HERE / "initial_weights.py"), str(tmp_path / "cases.json"), str(tmp_path)], env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in models:
        zero3, one = torch.load(tmp_path / f"{name}.pt", weights_only=True), initial_weights(config(name))
        assert sorted(zero3) == sorted(one), name
        unequal = [key for key in one if not torch.equal(zero3[key], one[key])]
        assert not unequal, (name, unequal, max_difference(zero3, one))


# ---------------------------------------------------------------------------- refused at configure


def _configure(tmp_path, deepspeed=None, plugins=("deepspeed",), **train):
    from engine import Run

    return Run({"plugins": list(plugins), "train": {"output_dir": str(tmp_path), **train},
                "deepspeed": deepspeed or {}})


@pytest.mark.parametrize("deepspeed, train, message", [
    ({"config": {"train_batch_size": 16}}, {"per_device_train_batch_size": 4},
     'deepspeed.config: train_batch_size = 16 contradicts the run\'s global batch (per_device_train_batch_size x '
     'gradient_accumulation_steps x 1 processes) = 4; set it to "auto"'),
    ({"config": {"gradient_clipping": 1.0}}, {"max_grad_norm": 0.0},
     "gradient_clipping = 1.0 contradicts the run's train.max_grad_norm = 0.0"),
    ({"config": {"zero_optimization": {"stage": 3}}, "zero_stage": 2}, {},
     "zero_optimization.stage = 3 contradicts the run's deepspeed.zero_stage = 2"),
    ({"config": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}}, {"learning_rate": 1e-4},
     "optimizer.params.lr = 0.001 contradicts the run's train.learning_rate = 0.0001"),
    ({"config": {"scheduler": {"type": "WarmupLR"}}}, {},
     "deepspeed.config: scheduler: the engine's scheduler drives the learning rate"),
    ({"zero_stage": 2, "offload_param": "cpu"}, {},
     "deepspeed.offload_param: offloading params needs ZeRO stage 3 (zero_optimization.stage = 2)"),
    ({"config": "missing.json"}, {}, "deepspeed.config: missing.json is not a file"),
    ({}, {"on_nonfinite": "skip"}, "train.on_nonfinite = 'skip': DeepSpeed measures the gradient norm inside"),
])
def test_contradictions_between_the_deepspeed_config_and_the_run_are_refused_by_key(tmp_path, deepspeed, train,
                                                                                     message):
    from engine import ConfigError

    with pytest.raises(ConfigError) as refused:
        _configure(tmp_path, deepspeed, **train)
    assert message in str(refused.value)


def test_auto_values_are_filled_from_the_run(tmp_path, monkeypatch):
    from engine_deepspeed import dsconfig

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # as a launcher sets it (the run is configured, never set up)
    run = _configure(tmp_path, {"config": {"train_batch_size": "auto", "gradient_clipping": "auto",
                                           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}},
                                "offload_optimizer": "cpu"},
                     per_device_train_batch_size=3, gradient_accumulation_steps=2, max_grad_norm=0.5,
                     learning_rate=3e-4, adam_beta2=0.95)
    config = dsconfig.resolve(run, 4)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"], config["gradient_clipping"]) == (24, 3, 2, 0.5)
    assert config["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95]}
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def test_zero3_in_one_process_without_a_launcher_trains_with_auto_bucket_sizes(tmp_path):
    auto = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto"}
    _train_alone(_run_file(tmp_path, 3, {"config": {"zero_optimization": auto}}, max_steps=2, save_steps=2))
    assert len(_losses(tmp_path / "out")) == 2 and (tmp_path / "out" / "model.safetensors").is_file()


def test_auto_bucket_sizes_come_from_the_hidden_size_as_in_trainer(tmp_path):
    from engine import ConfigError
    from engine_deepspeed import dsconfig

    sized = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
             "stage3_param_persistence_threshold": "auto"}
    run = _configure(tmp_path, {"config": {"zero_optimization": sized}}, model="tiny-llama",
                     model_config={"hidden_size": 48})
    zero = dsconfig.resolve(run, 1)["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (48 * 48, int(0.9 * 48 * 48), 480)
    with pytest.raises(ConfigError, match=r'zero_optimization.reduce_bucket_size = "auto" comes from the model\'s '
                                          r"hidden_size \(as in Trainer\), which this model's config does not give"):
        _configure(tmp_path, {"config": {"zero_optimization": sized}}, model="engine.testing:tiny_model")


@pytest.mark.parametrize("plugins, train", [
    (("deepspeed", "galore"), {"optim": "galore_adamw_layerwise", "optim_target_modules": "all-linear",
                               "max_grad_norm": 0.0}),
    (("deepspeed", "lomo"), {"optim": "lomo"}),
])
def test_layerwise_optimizers_and_lomo_are_refused_with_deepspeed(tmp_path, plugins, train):
    from engine import ConfigError

    with pytest.raises(ConfigError, match=r"train\.strategy: .*(single process only|one device only).*deepspeed"):
        _configure(tmp_path, plugins=plugins, **train)


def test_bad_deepspeed_config_is_reported_once_before_anything_loads(tmp_path):
    run_file = _run_file(tmp_path, 2, deepspeed={"config": {"train_micro_batch_size_per_gpu": 2}})
    result = torchrun(["-m", "engine", "train", str(run_file)], env=ENV)
    assert result.returncode != 0
    assert result.stderr.count("engine: error: deepspeed.config: train_micro_batch_size_per_gpu = 2 contradicts "
                               "the run's train.per_device_train_batch_size = 4") == 1
    assert not (tmp_path / "out").exists()


def test_a_missing_deepspeed_package_is_named_with_its_install_line(tmp_path, monkeypatch):
    from engine import MissingDependencyError

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an absent package looks like to import
    with pytest.raises(MissingDependencyError, match="DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"):
        _configure(tmp_path)
