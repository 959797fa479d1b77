"""Checkpoints, resume, rotation, best model, final model, evaluation and prediction."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

import engine.checkpoint as ckpt
from engine.kit.checkpoint import load_weights
from engine import CheckpointError, ConfigError, Run, hookimpl
from engine.cli import main
from engine.builtin.data.collators import DataCollator
from engine.logs import process_log_level
from engine.testing import tiny_dataset, tiny_model, write_run_file


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _losses(run):
    return [(h["step"], h["loss"]) for h in run.state.log_history if "loss" in h]


class StopAt:
    """Simulates an interruption: asks the loop to stop after step ``step``."""

    def __init__(self, step):
        self.step = step

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.step:
            run.control.request_stop("simulated interruption")


def _run(output_dir, train=None, objects=(), plugins=(), sections=None, stop_at=None, **kwargs):
    """A run of the tiny model on ragged data; ``stop_at`` interrupts it after that step."""
    config = {"plugins": list(plugins),
              "train": {"max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
                        "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True,
                        "output_dir": str(output_dir), **(train or {})},
              **(sections or {})}
    kwargs.setdefault("model", tiny_model())
    kwargs.setdefault("train_dataset", tiny_dataset(ragged=True))
    run = Run(config, data_collator=DataCollator(0), plugins=list(objects), **kwargs)
    if stop_at is not None:  # registered directly: not an enabled plugin, not in the checkpoint's plugin set
        run.plugin_manager.pm.register(StopAt(stop_at), name="stop_at")
    return run


# ---------------------------------------------------------------------------- bit-exact resume

# Accumulation over ragged batches, warmup + linear decay, AdamW state, dropout (torch RNG)
# and a resume point in the middle of an epoch whose data order must carry on (8 steps/epoch).
RESUME = {"max_steps": 12, "gradient_accumulation_steps": 2, "warmup_steps": 3, "weight_decay": 0.1,
          "lr_scheduler_type": "linear", "optim": "adamw_torch", "save_strategy": "steps", "save_steps": 3}


def _dropout_model():
    return tiny_model(attention_dropout=0.2)


def test_resume_is_bit_exact(tmp_path):
    straight = _run(tmp_path / "straight", RESUME, model=_dropout_model())
    straight.train()

    first = _run(tmp_path / "resumed", RESUME, stop_at=6, model=_dropout_model())
    first.train()
    assert first.state.global_step == 6
    resumed = _run(tmp_path / "resumed", {**RESUME, "resume_from_checkpoint": True}, model=_dropout_model())
    resumed.train()

    assert resumed.state.global_step == 12
    assert _losses(resumed) == _losses(straight)
    assert len(_losses(straight)) == 12
    for name, value in _params(straight.model).items():
        assert torch.equal(_params(resumed.model)[name], value), name
    for key, value in straight.optimizer.state_dict()["state"].items():
        for field, tensor in value.items():
            assert torch.equal(resumed.optimizer.state_dict()["state"][key][field], tensor), (key, field)
    records = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))


def test_resume_from_an_explicit_path_takes_that_checkpoint(tmp_path):
    _run(tmp_path, RESUME, stop_at=9).train()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]
    run = _run(tmp_path, {**RESUME, "max_steps": 12, "resume_from_checkpoint": str(tmp_path / "checkpoint-3")},
               stop_at=4)
    run.train()
    assert [s for s, _ in _losses(run)] == [1, 2, 3, 4]


class Fetcher:
    """A plugin that knows the checkpoint name "elsewhere": copies ``source`` into output_dir."""

    def __init__(self, source):
        self.source, self.asked = source, []

    @hookimpl
    def locate_checkpoint(self, run, spec):
        self.asked.append(spec)
        if spec == "elsewhere":
            local = run.output_dir / "fetched"
            shutil.copytree(self.source, local)
            return str(local)


def _fetching_run(output_dir, source, stop_at):
    run = _run(output_dir, {**RESUME, "resume_from_checkpoint": "elsewhere"}, stop_at=stop_at)
    fetcher = Fetcher(source)
    run.plugin_manager.pm.register(fetcher, name="fetcher")  # like stop_at: not in the checkpoint's plugin set
    return run, fetcher


def test_locate_checkpoint_fetches_a_named_checkpoint_which_is_validated_like_any(tmp_path):
    _run(tmp_path / "a", RESUME, stop_at=6).train()
    run, fetcher = _fetching_run(tmp_path / "b", tmp_path / "a" / "checkpoint-6", stop_at=7)
    run.train()
    assert fetcher.asked == ["elsewhere"]
    assert [s for s, _ in _losses(run)] == list(range(1, 8))  # steps 1-6 from the fetched checkpoint
    assert json.loads((tmp_path / "b" / "run.json").read_text())["starts"][0]["step"] == 6

    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "a" / "checkpoint-6", damaged)
    weights = bytearray((damaged / "model.safetensors").read_bytes())
    weights[len(weights) // 2] ^= 0xFF  # same size, one byte of tensor data changed
    (damaged / "model.safetensors").write_bytes(weights)
    run, _ = _fetching_run(tmp_path / "c", damaged, stop_at=7)
    with pytest.raises(CheckpointError, match="model.safetensors does not match its checksum"):
        run.train()


def test_a_large_state_file_loads_as_torch_load_reads_it(tmp_path):
    """Files of 64 MB and more are read through a memory map and copied out of it by threads: the same values,
    dtypes and views as torch.load gives, in memory of their own (the file can go); tensor subclasses the
    plain way."""
    weights = torch.randn(17_000_000)  # 68 MB
    state = {"state": {0: {"exp_avg": weights, "view": weights[10:20], "step": torch.tensor(3.0)}},
             "pairs": (torch.arange(4, dtype=torch.int64), [torch.ones(2, dtype=torch.bfloat16)], 7),
             "flags": torch.tensor([True, False]), "empty": torch.empty(0), "grad": torch.ones(2, requires_grad=True)}
    torch.save(state, tmp_path / "big.pt")
    loaded = ckpt.load_state_file(tmp_path, "big.pt")
    (tmp_path / "big.pt").unlink()
    assert torch.equal(loaded["state"][0]["exp_avg"], weights) and loaded["state"][0]["step"].item() == 3.0
    loaded["state"][0]["exp_avg"][15] = 42.0  # a view still shares its storage
    assert loaded["state"][0]["view"][5].item() == 42.0
    assert torch.equal(loaded["pairs"][0], torch.arange(4)) and loaded["pairs"][1][0].dtype == torch.bfloat16
    assert loaded["pairs"][2] == 7 and isinstance(loaded["pairs"], tuple)
    assert loaded["flags"].tolist() == [True, False] and loaded["empty"].numel() == 0 and loaded["grad"].requires_grad
    torch.save({"weight": torch.nn.Parameter(weights)}, tmp_path / "subclass.pt")
    assert isinstance(ckpt.load_state_file(tmp_path, "subclass.pt")["weight"], torch.nn.Parameter)


def test_checkpoint_layout_and_trainer_state(tmp_path):
    run = _run(tmp_path, {"max_steps": 2, "save_strategy": "steps", "save_steps": 2}, objects=[])
    run.train()
    folder = tmp_path / "checkpoint-2"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pt",
            "engine_state.pt", "trainer_state.json", "checkpoint_complete"} <= names
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["plugins"] == []
    assert state["data_order"] == {"seed": 42, "global_batch_size": 4, "gradient_accumulation_steps": 1}
    assert state["strategy"] == "single" and state["world_size"] == 1
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2]
    rng = torch.load(folder / "rng_state.pt", weights_only=True)
    assert {"python", "torch", "numpy"} <= set(rng)


def test_save_strategy_epoch_saves_at_each_epoch_end(tmp_path):
    run = _run(tmp_path, {"max_steps": -1, "num_train_epochs": 2, "save_strategy": "epoch"},
               train_dataset=tiny_dataset(size=16))
    run.train()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-8"]


def test_a_save_step_that_is_also_an_epoch_end_is_saved_once(tmp_path):
    saved = []

    class Saves:
        @hookimpl
        def on_checkpoint_saved(self, run, path):
            saved.append(path)

    _run(tmp_path, {"max_steps": -1, "num_train_epochs": 1, "save_strategy": "steps", "save_steps": 2},
         objects=[Saves()], train_dataset=tiny_dataset(size=16)).train()
    assert [p.rsplit("-", 1)[1] for p in saved] == ["2", "4"]


# ---------------------------------------------------------------------------- crash leftovers


def test_incomplete_folders_are_never_taken_and_leftovers_are_removed(tmp_path):
    _run(tmp_path, {"max_steps": 2, "save_strategy": "steps", "save_steps": 1}).train()
    # what a kill leaves: a half-written save, a half-deleted folder, a copy without the marker
    shutil.copytree(tmp_path / "checkpoint-2", tmp_path / ".tmp-checkpoint-3")
    shutil.copytree(tmp_path / "checkpoint-2", tmp_path / ".deleting-checkpoint-1")
    shutil.copytree(tmp_path / "checkpoint-2", tmp_path / "checkpoint-7")
    (tmp_path / "checkpoint-7" / ckpt.MARKER).unlink()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]
    run = _run(tmp_path, {"max_steps": 3, "resume_from_checkpoint": True})
    run.train()
    assert run.state.global_step == 3 and [s for s, _ in _losses(run)][-1] == 3
    assert not (tmp_path / ".tmp-checkpoint-3").exists()
    assert not (tmp_path / ".deleting-checkpoint-1").exists()


# ---------------------------------------------------------------------------- bad input


def test_resume_from_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("hello")
    run = _run(tmp_path, {"resume_from_checkpoint": str(tmp_path / "stuff")})
    with pytest.raises(CheckpointError, match=r"stuff is not a complete checkpoint \(missing checkpoint_complete, "
                                              r"trainer_state.json, scheduler.pt, engine_state.pt, model.safetensors, "
                                              r"optimizer.pt\)"):
        run.train()
    assert run.model is not None and run.optimizer is None  # refused before setup
    with pytest.raises(CheckpointError, match="nowhere is not a folder"):
        _run(tmp_path, {"resume_from_checkpoint": str(tmp_path / "nowhere")}).train()


@pytest.fixture
def saved(tmp_path):
    _run(tmp_path, {"max_steps": 2, "save_strategy": "steps", "save_steps": 2}).train()
    return tmp_path / "checkpoint-2"


def test_resume_with_a_different_plugin_set_says_which_differ(saved):
    run = _run(saved.parent, {"max_steps": 4, "resume_from_checkpoint": str(saved), "eval_strategy": "steps",
                              "metric_for_best_model": "loss"}, plugins=["early_stopping"],
               eval_dataset=tiny_dataset(size=8))
    with pytest.raises(CheckpointError, match=r"was made with plugins \[\], this run enables \['early_stopping'\] "
                                              r"\(only in checkpoint: none; only in run: \['early_stopping'\]\)"):
        run.train()
    assert run.optimizer is None


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng_state.pt"])
def test_a_truncated_file_is_refused_before_setup(saved, name):
    data = (saved / name).read_bytes()
    (saved / name).write_bytes(data[: len(data) // 2])
    run = _run(saved.parent, {"max_steps": 4, "resume_from_checkpoint": True})
    with pytest.raises(CheckpointError, match=f"checkpoint {saved}: {name} is truncated"):
        run.train()
    assert run.optimizer is None


def test_a_changed_data_order_is_refused(saved):
    run = _run(saved.parent, {"max_steps": 4, "resume_from_checkpoint": True, "seed": 7,
                              "gradient_accumulation_steps": 2})
    with pytest.raises(CheckpointError, match=r"different data order: train.seed = 7 \(checkpoint: 42\); "
                                              r"train.gradient_accumulation_steps = 2 \(checkpoint: 1\)"):
        run.train()


def test_a_changed_dataset_is_refused(saved):
    run = _run(saved.parent, {"max_steps": 4, "resume_from_checkpoint": True}, train_dataset=tiny_dataset(size=32))
    with pytest.raises(CheckpointError, match="had 16 steps per epoch, this run has 8: the train data changed"):
        run.train()


def _engine(capfd, *argv):
    """``engine <argv>`` in this process: its exit status and stderr lines."""
    capfd.readouterr()
    status = main([str(arg) for arg in argv])
    return status, [line for line in capfd.readouterr().err.splitlines() if line.strip()]


def test_a_resume_refused_for_other_data_names_the_keys_that_changed(tmp_path, capfd):
    run_file = write_run_file(tmp_path, [], max_steps=2, save_steps=2)
    assert _engine(capfd, "train", run_file)[0] == 0
    for edit, change in [("data.max_length=16", "data.max_length 32 -> 16"),
                         ("data.tokenizer_vocab_size=400", "data.tokenizer_vocab_size 300 -> 400")]:
        status, err = _engine(capfd, "train", run_file, "--set", "train.max_steps=4", "--set",
                              "train.resume_from_checkpoint=true", "--set", edit)
        assert status == 2 and len(err) == 1, err
        # it used to end in "...: the train data changed", naming no key
        assert re.fullmatch(rf"engine: error: resume_from_checkpoint: {re.escape(str(tmp_path / 'out'))}/checkpoint-2 "
                            rf"had \d+ steps per epoch, this run has \d+: changed since the checkpoint: "
                            rf"{re.escape(change)}; resume with the checkpoint's values, or start a fresh output_dir",
                            err[0]), err[0]


@pytest.mark.parametrize("spec, fragment", [
    ("true", "train.resume_from_checkpoint = 'true' is a string, read as a checkpoint folder, and there is no folder "
             "'true'; write true (the boolean, without quotes: the newest checkpoint in output_dir), e.g. --set "
             "train.resume_from_checkpoint=true"),
    ("False", "train.resume_from_checkpoint = 'False' is a string, read as a checkpoint folder, and there is no folder "
              "'False'; write false (the boolean, without quotes: start fresh), or leave it unset"),
    ("hub", "train.resume_from_checkpoint = 'hub': 'hub' is fetched by the hub plugin (engine-hub), which this run "
            'does not enable; enable it with plugins = ["hub"] and its [hub] section, or --plugins +hub'),
    ("", "train.resume_from_checkpoint = '': an empty string; name a checkpoint folder"),
])
def test_resume_strings_that_name_no_folder_are_refused_at_configure(tmp_path, capfd, monkeypatch, spec, fragment):
    monkeypatch.chdir(tmp_path)
    status, err = _engine(capfd, "plan", "--set", f'train.resume_from_checkpoint="{spec}"', "--set",
                          f'train.output_dir="{tmp_path / "out"}"')
    assert status == 2 and len(err) == 1 and err[0].startswith(f"engine: error: {fragment}"), err
    assert not (tmp_path / "out").exists()
    if spec:  # such a folder is a path, as in Trainer
        (tmp_path / spec).mkdir()
        assert _engine(capfd, "plan", "--set", f'train.resume_from_checkpoint="{spec}"')[0] == 0


def test_cli_resume_errors_are_one_line_and_nothing_runs(tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'[train]\nmax_steps = 2\noutput_dir = "{tmp_path / "out"}"\n'
                        f'resume_from_checkpoint = "{tmp_path}"\n[data]\ntrain = "{__file__}"\nmax_length = 16\n')
    result = subprocess.run([sys.executable, "-m", "engine", "train", str(run_file)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"engine: error: resume_from_checkpoint: {tmp_path} is not a complete checkpoint (missing "
        "checkpoint_complete, trainer_state.json, scheduler.pt, engine_state.pt, model.safetensors, optimizer.pt)"]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- rotation and best model


class Scores:
    """compute_metrics returning a fixed score per evaluation, so the best step is known."""

    def __init__(self, scores):
        self.scores = list(scores)
        self.calls = 0

    def __call__(self, prediction):
        self.calls += 1
        return {"score": self.scores[self.calls - 1]}


def _checkpoints(path):
    return [p.name for p in ckpt.list_checkpoints(path)]


def test_save_total_limit_keeps_the_newest(tmp_path):
    _run(tmp_path, {"max_steps": 5, "save_strategy": "steps", "save_steps": 1, "save_total_limit": 2}).train()
    assert _checkpoints(tmp_path) == ["checkpoint-4", "checkpoint-5"]


BEST = {"max_steps": 5, "eval_strategy": "steps", "eval_steps": 1, "save_strategy": "steps", "save_steps": 1,
        "metric_for_best_model": "score", "load_best_model_at_end": True}


@pytest.mark.parametrize("limit, kept", [(1, ["checkpoint-2", "checkpoint-5"]),
                                         (2, ["checkpoint-2", "checkpoint-5"]),
                                         (3, ["checkpoint-2", "checkpoint-4", "checkpoint-5"])])
def test_rotation_never_deletes_the_best_checkpoint(tmp_path, limit, kept):
    run = _run(tmp_path, {**BEST, "save_total_limit": limit}, eval_dataset=tiny_dataset(size=8),
               compute_metrics=Scores([1.0, 5.0, 2.0, 3.0, 4.0]))
    run.train()
    assert _checkpoints(tmp_path) == kept
    assert run.state.best_metric == 5.0 and run.state.best_global_step == 2
    assert run.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")


def test_load_best_model_at_end_loads_the_best_weights_and_saves_them(tmp_path):
    run = _run(tmp_path, {**BEST, "greater_is_better": False}, eval_dataset=tiny_dataset(size=8),
               compute_metrics=Scores([4.0, 5.0, 1.0, 3.0, 2.0]))
    run.train()
    assert run.state.best_model_checkpoint == str(tmp_path / "checkpoint-3")
    best = tiny_model()
    load_weights(best, tmp_path / "checkpoint-3")
    final = tiny_model(seed=1)
    load_weights(final, tmp_path)
    for name, value in _params(best).items():
        assert torch.equal(_params(run.model)[name], value), name
        assert torch.equal(_params(final)[name], value), name
    step_5 = tiny_model()
    load_weights(step_5, tmp_path / "checkpoint-5")
    assert not torch.equal(_params(step_5)["lm_head.weight"], _params(best)["lm_head.weight"])


def test_best_metric_defaults_follow_trainer(tmp_path):
    run = _run(tmp_path, {"eval_strategy": "steps", "save_strategy": "steps", "save_steps": 10,
                          "eval_steps": 5, "load_best_model_at_end": True}, eval_dataset=tiny_dataset(8, seed=1))
    assert run.config.train.metric_for_best_model == "loss" and run.config.train.greater_is_better is False
    run = _run(tmp_path, {"metric_for_best_model": "accuracy"})
    assert run.config.train.greater_is_better is True


@pytest.mark.parametrize("train, message", [
    ({"load_best_model_at_end": True}, "load_best_model_at_end needs evaluations"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "epoch"},
     r"save_strategy \('epoch'\) must equal eval_strategy \('steps'\)"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_strategy": "steps",
      "save_steps": 4},
     r"save_steps \(4\) must be a multiple of eval_steps \(3\)"),
    ({"save_total_limit": 0}, "train.save_total_limit: expected int >= 1"),
])
def test_best_model_settings_are_checked_before_anything_loads(tmp_path, train, message):
    with pytest.raises(ConfigError, match=message):
        _run(tmp_path, train)


def test_an_unknown_best_metric_lists_the_metrics(tmp_path):
    run = _run(tmp_path, {**BEST, "metric_for_best_model": "accuracy"}, eval_dataset=tiny_dataset(size=8))
    with pytest.raises(ConfigError, match=r"'eval_accuracy' is not among the evaluation metrics \(epoch, eval_loss"):
        run.train()


# ---------------------------------------------------------------------------- HF loading


def test_from_pretrained_loads_checkpoint_and_final_model_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    run = _run(tmp_path, {"max_steps": 3, "save_strategy": "steps", "save_steps": 3})
    run.train()
    batch = torch.stack([tiny_dataset()[i]["input_ids"] for i in range(4)])
    run.model.eval()
    with torch.no_grad():
        expected = run.model(batch).logits
        for folder in (tmp_path / "checkpoint-3", tmp_path):
            loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
            assert torch.equal(loaded(batch).logits, expected), folder


def test_final_model_includes_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"line {i} of a small corpus about checkpoints" for i in range(200)))
    run = Run({"train": {"max_steps": 2, "output_dir": str(tmp_path / "out"), "save_strategy": "no",
                         "disable_tqdm": True, "model_config": {"hidden_size": 32, "intermediate_size": 64}},
               "data": {"train": str(text), "max_length": 16, "tokenizer": "train", "tokenizer_vocab_size": 300}})
    run.train()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("line 3")["input_ids"] == run.tokenizer("line 3")["input_ids"]


def test_save_final_model_false_writes_no_model(tmp_path):
    _run(tmp_path, {"max_steps": 1, "save_final_model": False}).train()
    assert not (tmp_path / "model.safetensors").exists()


# ---------------------------------------------------------------------------- evaluation and prediction


def test_predict_returns_logits_labels_and_metrics(tmp_path):
    data = tiny_dataset(size=6)
    seen = []
    run = _run(tmp_path, {"per_device_eval_batch_size": 4}, compute_metrics=lambda p: seen.append(p) or {"n": 1.0})
    output = run.predict(data)
    assert output.predictions.shape == (6, 16, 128)
    rows = torch.stack([data[i]["input_ids"] for i in range(6)])
    assert (output.label_ids == rows.numpy()).all()
    with torch.no_grad():
        expected = run.model(rows).logits
    torch.testing.assert_close(torch.from_numpy(output.predictions), expected, rtol=1e-5, atol=1e-5)
    assert set(output.metrics) == {"test_loss", "test_runtime", "test_samples_per_second", "test_n", "epoch"}
    assert len(seen) == 1 and seen[0].predictions is output.predictions


def test_prediction_loss_only_skips_predictions_and_metrics(tmp_path):
    calls = []
    run = _run(tmp_path, {"prediction_loss_only": True}, compute_metrics=lambda p: calls.append(p) or {})
    output = run.predict(tiny_dataset(size=4))
    assert output.predictions is None and output.label_ids is None and calls == []
    assert set(run.evaluate(tiny_dataset(size=4))) == {"eval_loss", "eval_runtime", "eval_samples_per_second", "epoch"}


def test_compute_metrics_costs_no_second_forward(tmp_path):
    forwards = []
    model = tiny_model()
    model.register_forward_hook(lambda *args: forwards.append(1))
    run = _run(tmp_path, model=model, compute_metrics=lambda p: {"rows": float(len(p.predictions))})
    metrics = run.evaluate(tiny_dataset(size=8))
    assert metrics["eval_rows"] == 8.0 and len(forwards) == 1  # one batch of 8, one forward


def test_engine_evaluate_command_prints_metrics_of_a_checkpoint(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"sentence {i} about evaluation runs" for i in range(300)))
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'[train]\nmax_steps = 4\noutput_dir = "{tmp_path / "out"}"\nsave_steps = 4\n'
                        'disable_tqdm = true\nlearning_rate = 1e-2\n'
                        '[train.model_config]\nhidden_size = 32\nintermediate_size = 64\n'
                        f'[data]\ntrain = "{text}"\neval_split = 0.1\nmax_length = 16\ntokenizer_vocab_size = 300\n')
    run = Run(str(run_file))
    run.train()
    expected = run.evaluate()["eval_loss"]
    for folder in (tmp_path / "out" / "checkpoint-4", tmp_path / "out"):
        result = subprocess.run([sys.executable, "-m", "engine", "evaluate", str(run_file), "--checkpoint",
                                 str(folder), "--set", "train.disable_tqdm=true"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        metrics = json.loads(result.stdout.strip().splitlines()[-1])
        assert metrics["eval_loss"] == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------------------- early stopping


ES = {"max_steps": 10, "eval_strategy": "steps", "eval_steps": 1, "metric_for_best_model": "score"}


def test_early_stopping_stops_after_patience_evaluations_without_improvement(tmp_path):
    run = _run(tmp_path, ES, plugins=["early_stopping"], sections={"early_stopping": {"patience": 2, "threshold": 0.5}},
               eval_dataset=tiny_dataset(size=4), compute_metrics=Scores([1.0, 2.0, 2.4, 3.0, 3.2, 3.4, 9, 9, 9, 9]))
    run.train()
    # 2.4 and 3.2 are within the threshold of the best (2.0, 3.0): stop after 3.4 (steps 5, 6)
    assert run.state.global_step == 6
    assert run.control.stop_reason == "score did not improve on 3.0 for 2 evaluations"


def test_early_stopping_state_survives_a_resume(tmp_path):
    scores = [1.0, 2.0, 1.5, 1.5, 1.5, 1.5]
    config = {**ES, "save_strategy": "steps", "save_steps": 1}
    options = {"early_stopping": {"patience": 3}}
    _run(tmp_path, config, plugins=["early_stopping"], sections=options, stop_at=3,
         eval_dataset=tiny_dataset(size=4), compute_metrics=Scores(scores)).train()
    resumed = _run(tmp_path, {**config, "resume_from_checkpoint": True}, plugins=["early_stopping"], sections=options,
                   eval_dataset=tiny_dataset(size=4), compute_metrics=Scores(scores[3:]))
    resumed.train()
    assert resumed.state.global_step == 5  # steps 3, 4, 5 did not improve on 2.0


@pytest.mark.parametrize("train, message", [
    ({"eval_strategy": "steps"}, "plugin early_stopping needs train.metric_for_best_model"),
    ({"metric_for_best_model": "loss"}, "plugin early_stopping needs evaluations"),
])
def test_early_stopping_refuses_a_run_without_its_inputs(tmp_path, train, message):
    with pytest.raises(ConfigError, match=message):
        _run(tmp_path, train, plugins=["early_stopping"])


# ---------------------------------------------------------------------------- log levels


@pytest.mark.parametrize("on_each_node, rank, local_rank, expected", [
    (True, 0, 0, "error"), (True, 3, 0, "error"), (True, 3, 1, "info"),
    (False, 0, 0, "error"), (False, 3, 0, "info"), (False, 1, 1, "info")])
def test_log_level_per_process_follows_trainer(tmp_path, on_each_node, rank, local_rank, expected):
    run = _run(tmp_path, {"log_level": "error", "log_level_replica": "info", "log_on_each_node": on_each_node})
    assert process_log_level(run.config.train, rank, local_rank) == expected


def test_log_level_filters_engine_messages(tmp_path, capsys):
    import transformers

    _run(tmp_path, {"max_steps": 1, "save_strategy": "steps", "save_steps": 1, "log_level": "debug"}).train()
    err = capsys.readouterr().err
    assert f"engine: saved {tmp_path / 'checkpoint-1'}" in err
    assert transformers.logging.get_verbosity() == transformers.logging.DEBUG
    _run(tmp_path, {"max_steps": 2, "resume_from_checkpoint": True, "log_level": "error"}).train()
    assert "engine: " not in capsys.readouterr().err
    assert transformers.logging.get_verbosity() == transformers.logging.ERROR
    transformers.logging.set_verbosity_warning()
    _run(tmp_path, {"max_steps": 3, "resume_from_checkpoint": True}).train()
    assert "engine: resumed from" in capsys.readouterr().err  # passive: engine info
