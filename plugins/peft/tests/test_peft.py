"""peft adapters: from a run file, complete resumable checkpoints, deliverables that load in a fresh
process, parity with transformers' Trainer on a PeftModel, QLoRA on the CPU, refusals."""

import json
import subprocess
import sys
import types
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file

import engine
from engine import CheckpointError, hookimpl
from engine.cli import main
from engine.builtin.data.collators import DataCollator
from engine.testing import (
    assert_one_line_error,
    assert_resume_is_exact,
    assert_same_state,
    launch_cases,
    max_difference,
    run_steps,
    tiny_dataset,
    tiny_model,
    write_run_file,
)

LORA = {"r": 4, "lora_alpha": 8.0, "target_modules": "all-linear"}


def _cli(capfd, *argv):
    """``engine <argv>`` in this process: (exit status, stdout, stderr) as a CompletedProcess-like object."""
    capfd.readouterr()
    status = main(list(argv))
    out, err = capfd.readouterr()
    return types.SimpleNamespace(returncode=status, stdout=out, stderr=err)


def test_plan_shows_the_adapter_and_bad_options_are_one_line_errors(tmp_path, capfd):
    run_file = write_run_file(tmp_path, ["peft"], {"peft": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
    plan = _cli(capfd, "plan", str(run_file))
    assert plan.returncode == 0, plan.stderr
    assert "peft: LORA adapter on 4 modules: model.layers.0.self_attn.q_proj, model.layers.0.self_attn.v_proj" \
        in plan.stdout
    # hidden 32: q_proj 4 x (32 + 32), v_proj (k/v heads 2 of 4: 16 wide) 4 x (32 + 16), two layers
    assert "trainable parameters 896 of " in plan.stdout, plan.stdout
    for edits, kind in ((["peft.method=dora"], "LORA (DoRA) adapter on 4 modules"),
                        (["peft.use_dora=true"], "LORA (DoRA) adapter on 4 modules"),
                        (["peft.method=ia3", "peft.r=8", 'peft.feedforward_modules=["v_proj"]'],
                         "IA3 adapter on 4 modules"),
                        # lm_head trained in full besides the adapter: 896 + its 1024 x 32 weights (the plan's
                        # model has tiny-llama's vocabulary; the tokenizer is trained later)
                        (['peft.modules_to_save=["lm_head"]'], "LORA adapter on 4 modules: "
                         "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.v_proj, model.layers.1.self_attn."
                         "q_proj, model.layers.1.self_attn.v_proj; trained in full: lm_head\n  peft: trainable "
                         "parameters 33,664 of ")):
        plan = _cli(capfd, "plan", str(run_file), *[arg for edit in edits for arg in ("--set", edit)])
        assert plan.returncode == 0 and f"peft: {kind}" in plan.stdout, plan.stderr
    saved = tmp_path / "saved"
    tiny_model().save_pretrained(saved)
    galore = ["--plugins", "+galore", "--set", "train.optim=galore_adamw", "--set", 'train.optim_target_modules=["q_proj"]']
    for edits, fragment in [
        (["peft.rank=4"], "peft.rank: unknown key; known keys: method, r, lora_alpha, "),
        (['peft.target_modules=["qproj"]'], "peft.target_modules: 'qproj' matches no module of LlamaForCausalLM "
                                           "(did you mean 'q_proj'?); its linear and embedding modules are down_proj, "
                                           "embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
        # every option that names modules or layers: a name that matches nothing was dropped by peft
        (['peft.target_modules=["q_proj", "vproj"]'], "peft.target_modules: 'vproj' matches no module of "
                                                     "LlamaForCausalLM (did you mean 'v_proj'?)"),
        (['peft.modules_to_save=["lm_heads"]'], "peft.modules_to_save: 'lm_heads' matches no module of "
                                               "LlamaForCausalLM (did you mean 'lm_head'?); its modules are act_fn, "
                                               "down_proj, embed_tokens, gate_proj, input_layernorm, k_proj, layers, "
                                               "lm_head, mlp, model, norm, o_proj, "),
        (['peft.exclude_modules=["vproj"]'], "peft.exclude_modules: 'vproj' matches no module of LlamaForCausalLM "
                                            "(did you mean 'v_proj'?)"),
        (['peft.exclude_modules="model.layers.0.q_proj"'], "peft.exclude_modules: the regex 'model.layers.0.q_proj' "
                                                          "matches no module path of LlamaForCausalLM"),
        (["peft.layers_to_transform=[0, 5]"], "peft.layers_to_transform: no module of layer 5 is adapted; "
                                              "LlamaForCausalLM has layers 0-1"),
        (["peft.method=ia3", "peft.r=8", "peft.feedforward_modules=up_proj"],
         "peft.feedforward_modules: 'up_proj' matches none of the adapted modules (q_proj, v_proj: "
         "peft.target_modules)"),
        # contradictions, naming both keys
        (["peft.method=dora", "peft.use_dora=false"], "peft.use_dora = false contradicts peft.method = 'dora'"),
        (["peft.target_modules=all-linear", "peft.layers_to_transform=[0]"],
         "peft.layers_to_transform picks layers of the modules a list of names selects, but peft.target_modules = "
         "'all-linear' is a string (a regex, or 'all-linear')"),
        (['peft.modules_to_save=["v_proj"]'], "peft.modules_to_save and peft.target_modules both name 'v_proj'"),
        (['peft.exclude_modules=["q_proj"]'], "peft.exclude_modules excludes every module peft.target_modules = "
                                             "'q_proj' selects"),
        (["peft.bnb_4bit_quant_type=fp4"], "peft.bnb_4bit_quant_type: an option of the 4-bit base, but peft.quantize "
                                           "is None; set quantize = '4bit'"),
        (["peft.quantize=4bit"], "peft.quantize: train.model = 'tiny-llama' is built from a config with random "
                                 "weights, so there are no weights to quantize"),
        (["peft.quantize=4bit", "peft.merge=true", f"train.model={saved}"], "peft.merge: a quantized base cannot"),
        (["peft.method=ia3", "peft.r=16"], "peft.r: a LoRA option; method = 'ia3' takes"),
        (["peft.lora_dropout=1.5"], "peft.lora_dropout: expected float in [0, 1), got 1.5"),
        (galore, "train.optim: 'galore_adamw' cannot train adapters: GaLore and APOLLO project the gradients"),
    ]:
        argv = ["train", str(run_file), *(edits if edits[0].startswith("--") else
                                          [arg for edit in edits for arg in ("--set", edit)])]
        assert_one_line_error(_cli(capfd, *argv), fragment)
        assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before training


def test_adapter_checkpoints_resume_exactly_and_refuse_another_base(tmp_path):
    check = assert_resume_is_exact(4, 2, tmp_path, plugins=["peft"], sections={"peft": LORA}, resumed_model_seed=0,
                                   train={"lr_scheduler_type": "cosine", "warmup_steps": 1})
    saved = check.checkpoint
    names = sorted(p.name for p in saved.iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors", "base_fingerprint.json",
                     "checkpoint_complete", "engine_state.pt", "optimizer.pt", "rng_state.pt", "scheduler.pt",
                     "trainer_state.json"]
    manifest = json.loads((saved / "checkpoint_complete").read_text())["files"]
    assert {"adapter_model.safetensors", "adapter_config.json", "base_fingerprint.json"} <= set(manifest)
    adapter = load_file(saved / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    # the optimizer holds state for the adapter only: two LoRA matrices per linear module (7 x 2 layers)
    assert len(torch.load(saved / "optimizer.pt", weights_only=True)["state"]) == 28
    # the adapter changed from its start and the base did not
    base = tiny_model(seed=0).state_dict()
    trained = check.straight.model.get_base_model().state_dict()
    assert torch.equal(trained["model.layers.0.self_attn.q_proj.base_layer.weight"],
                       base["model.layers.0.self_attn.q_proj.weight"])

    plain = tmp_path / "plain"  # a checkpoint of a run with no other plugin
    run_steps(2, ["peft"], output_dir=plain, sections={"peft": LORA}, model=tiny_model(seed=0),
              train={"save_strategy": "steps", "save_steps": 2})
    with pytest.raises(CheckpointError) as refused:  # resumed onto another base
        run_steps(4, ["peft"], output_dir=tmp_path / "other", sections={"peft": LORA}, model=tiny_model(seed=1),
                  train={"resume_from_checkpoint": str(plain / "checkpoint-2")})
    message = str(refused.value)
    assert refused.value.exit_status == 2
    assert "its adapter was trained on base 'tiny-llama' (config " in message and "the weights differ" in message
    assert message.count("weights ") >= 2  # both fingerprints named
    assert not (tmp_path / "other" / "metrics.jsonl").exists()


def test_an_adapter_checkpoint_without_peft_and_a_whole_model_with_it_are_refused_saying_so(tmp_path, capfd):
    run_files = []
    for name, plugins in (("lora", ["peft"]), ("plain", [])):
        (tmp_path / name).mkdir()
        run_files.append(write_run_file(tmp_path / name, plugins, {"peft": LORA} if plugins else None,
                                        max_steps=2, save_steps=2))
        trained = _cli(capfd, "train", str(run_files[-1]))
        assert trained.returncode == 0, trained.stderr
    lora, plain = run_files
    adapter, whole = (run_file.parent / "out" / "checkpoint-2" for run_file in run_files)
    enable = ("is an adapter checkpoint (adapter_config.json, adapter_model.safetensors: the adapter alone, not the "
              'whole model), which only the peft plugin loads; enable it with plugins = ["peft"] in the run file, '
              "or --plugins +peft")
    # it used to be "not a complete checkpoint (missing model.safetensors)", and evaluate said so after loading
    resumed = _cli(capfd, "train", str(lora), "--plugins", "-peft", "--set", "train.max_steps=4", "--set",
                   "train.resume_from_checkpoint=true")
    assert_one_line_error(resumed, f"resume_from_checkpoint: {adapter} {enable}")
    assert_one_line_error(_cli(capfd, "evaluate", str(lora), "--plugins", "-peft", "--checkpoint", str(adapter)),
                          f"--checkpoint: {adapter} {enable}")
    assert_one_line_error(_cli(capfd, "evaluate", str(plain), "--plugins", "+peft", "--checkpoint", str(whole)),
                          f"--checkpoint: {whole} holds a whole model (model.safetensors), and this run's plugins load "
                          "adapter files (adapter_model.safetensors, adapter_config.json, base_fingerprint.json)")
    assert not any(path.name == "eval_results.json" for path in tmp_path.rglob("*"))


FRESH_PROCESS = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
out = sys.argv[1]
prompt = torch.tensor([[5, 9, 14, 20]])
def greedy(model):
    return model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
auto = AutoPeftModelForCausalLM.from_pretrained(out)
base = AutoModelForCausalLM.from_pretrained(json.load(open(out + "/adapter_config.json"))["base_model_name_or_path"])
explicit = PeftModel.from_pretrained(base, out)
merged = AutoModelForCausalLM.from_pretrained(out + "/merged")
print(json.dumps({"auto": greedy(auto), "explicit": greedy(explicit), "merged": greedy(merged),
                  "logits": [m(prompt).logits[0, -1].tolist() for m in (auto, merged)],
                  "vocab": [len(AutoTokenizer.from_pretrained(path)) for path in (out, out + "/base", out + "/merged")]}))
"""


def test_the_best_adapter_ships_and_loads_in_a_fresh_process(tmp_path, capfd):
    run_file = write_run_file(tmp_path, ["peft"], {"peft": {**LORA, "merge": True}}, max_steps=6, save_steps=2,
                              eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, learning_rate=0.3)
    (tmp_path / "eval.txt").write_text("abc " * 200)
    result = _cli(capfd, "train", str(run_file), "--set", f"data.eval={tmp_path / 'eval.txt'}")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    best = Path(state["best_model_checkpoint"])
    assert best.name != "checkpoint-6", "the best checkpoint is the last one: the test shows nothing"
    final = load_file(out / "adapter_model.safetensors")
    assert_same_state(final, load_file(best / "adapter_model.safetensors"), path="final adapter vs best")
    assert not torch.equal(next(iter(final.values())),
                           next(iter(load_file(out / "checkpoint-6" / "adapter_model.safetensors").values())))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((out / "base").resolve())
    card = (out / "README.md").read_text()
    assert f"base_model: {out.resolve() / 'base'}" in card and '"r": 4' in card and "eval_loss" in card
    manifest = json.loads((out / "model_complete").read_text())["files"]  # checksummed with the adapter
    assert {"adapter_model.safetensors", "base/model.safetensors", "merged/model.safetensors"} <= set(manifest)

    loaded = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(out)], capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    found = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert found["auto"] == found["explicit"] == found["merged"], found
    assert found["vocab"][0] == found["vocab"][1] == found["vocab"][2] == 300
    auto_logits, merged_logits = map(torch.tensor, found["logits"])
    assert torch.allclose(auto_logits, merged_logits, atol=1e-5)


class LossRecorder:
    """The training losses as computed (not as logged, which rounds)."""

    name = "loss_recorder"

    def __init__(self):
        self.losses = []

    @hookimpl(wrapper=True)
    def compute_loss(self, run, model, batch, num_items_in_batch):
        loss = yield
        if model.training:
            self.losses.append(loss.item())
        return loss


def test_per_step_losses_and_adapter_weights_equal_transformers_trainer_on_a_peft_model(tmp_path):
    from transformers import Trainer, TrainingArguments

    steps, config = 5, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    data = tiny_dataset(size=4 * steps)

    class Recorded(Trainer):
        losses = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(loss.item())
            return loss

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    torch.manual_seed(0)
    theirs = peft.get_peft_model(tiny_model(seed=0), config)
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1, optim="adamw_torch",
                             weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    Recorded(model=theirs, args=args, train_dataset=data, data_collator=DataCollator(0)).train()

    torch.manual_seed(0)
    ours = peft.get_peft_model(tiny_model(seed=0), config)  # the same initial adapter
    recorder = LossRecorder()
    run = run_steps(steps, objects=[recorder], model=ours, dataset=data, output_dir=tmp_path / "engine",
                    train={"lr_scheduler_type": "linear", "warmup_steps": 1, "optim": "adamw_torch",
                           "weight_decay": 0.01, "train_sampling_strategy": "sequential"})
    assert "peft" in run.config.plugins  # a PeftModel given to Run brings the plugin that saves it
    assert len(recorder.losses) == len(Recorded.losses) == steps
    # the same operations in the same order: equal to the last bit (tolerance 0)
    assert recorder.losses == Recorded.losses
    their_adapter = peft.get_peft_model_state_dict(theirs)
    our_adapter = load_file(tmp_path / "engine" / "adapter_model.safetensors")
    assert set(our_adapter) == set(their_adapter)
    for name, tensor in their_adapter.items():
        assert_same_state(our_adapter[name], tensor.detach(), path=name)


def _word_tokenizer(vocab_size=128):
    """A word-level tokenizer over the tiny model's vocabulary (built, not trained: no time spent)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0")


def _quantized_run(base, output_dir, quantize, steps, **train):
    four_bit = {"bnb_4bit_compute_dtype": "float32"} if quantize == "4bit" else {}
    run = engine.Run({"plugins": ["peft"], "peft": {**LORA, "quantize": quantize, **four_bit},
                      "train": {"model": str(base), "max_steps": steps, "per_device_train_batch_size": 4,
                                "learning_rate": 1e-2, "logging_steps": 1, "disable_tqdm": True,
                                "output_dir": str(output_dir), "save_strategy": "steps", "save_steps": 2, **train}},
                     tokenizer=_word_tokenizer(), train_dataset=tiny_dataset(), data_collator=DataCollator(0))
    run.train()
    return run


def test_qlora_4bit_resumes_bit_exactly_on_the_cpu_and_8bit_trains(tmp_path):
    import bitsandbytes

    base = tmp_path / "base"
    tiny_model(seed=0).save_pretrained(base)
    straight = _quantized_run(base, tmp_path / "straight", "4bit", 4)
    layer = straight.model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, bitsandbytes.nn.Linear4bit) and layer.base_layer.weight.quant_type == "nf4"
    resumed = _quantized_run(base, tmp_path / "resumed", "4bit", 4,
                             resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    losses = [[entry["loss"] for entry in run.state.log_history if "loss" in entry] for run in (straight, resumed)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    assert_same_state(peft.get_peft_model_state_dict(resumed.model), peft.get_peft_model_state_dict(straight.model))
    assert_same_state(resumed.optimizer.state_dict(), straight.optimizer.state_dict())
    # the final adapter names its base folder (nothing copied: the base has weights of its own)
    config = json.loads((tmp_path / "straight" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert not (tmp_path / "straight" / "base").exists()

    eight = _quantized_run(base, tmp_path / "eight", "8bit", 2)
    layer = eight.model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, bitsandbytes.nn.Linear8bitLt)
    assert layer.lora_B.default.weight.abs().sum() > 0  # B starts at zero: it trained


def test_neftune_activation_checkpointing_and_lomo_compose_with_adapters(tmp_path):
    runs = {}
    for name, plugins, train in [("plain", ["peft", "neftune"], {}),
                                 ("checkpointed", ["peft", "neftune"], {"activation_checkpointing": True}),
                                 ("lomo", ["peft", "lomo"], {"optim": "lomo", "max_grad_norm": 0})]:
        runs[name] = run_steps(3, plugins, output_dir=tmp_path / name, sections={"peft": LORA}, train=train,
                               model=tiny_model(seed=0))
    plain, checkpointed = runs["plain"], runs["checkpointed"]
    # NEFTune noised the PEFT model's embeddings (a different loss than without it is NEFTune's own test)
    # and recomputing the checkpointed blocks gives the frozen-embedding adapter the same gradients
    losses = [[entry["loss"] for entry in run.state.log_history if "loss" in entry] for run in (plain, checkpointed)]
    assert losses[0] == losses[1]
    assert_same_state(peft.get_peft_model_state_dict(checkpointed.model), peft.get_peft_model_state_dict(plain.model),
                      atol=1e-6)
    # LOMO's fused update touches the adapter only
    lomo = runs["lomo"].model.get_base_model().model.layers[0].self_attn.q_proj
    assert torch.equal(lomo.base_layer.weight, tiny_model(seed=0).model.layers[0].self_attn.q_proj.weight)
    assert lomo.lora_B.default.weight.abs().sum() > 0


def test_under_ddp_two_processes_train_the_adapter_of_one_with_twice_the_batch(tmp_path):
    """Only the adapter trains (the base has no gradients to reduce): two processes with 4 rows
    each update it as one process with 8, and leave the base as it was."""
    sgd = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "lr_scheduler_type": "linear"}
    trained = launch_cases([{"name": "lora", "steps": 4, "plugins": ["ddp", "peft"], "sections": {"peft": LORA},
                             "train": {**sgd, "per_device_train_batch_size": 4}}], tmp_path)["lora"]
    one = run_steps(4, plugins=["peft"], sections={"peft": LORA}, model=tiny_model(seed=0),
                    dataset=tiny_dataset(size=64), train={**sgd, "per_device_train_batch_size": 8}).model
    adapter = {name: value for name, value in one.named_parameters() if value.requires_grad}
    assert adapter and all("lora_" in name for name in adapter)
    assert max_difference(trained, one) < 1e-6
    base = tiny_model(seed=0).state_dict()
    for name, value in trained.items():
        if "lora_" not in name:
            assert torch.equal(value, base[name.replace("base_model.model.", "").replace(".base_layer", "")]), name
