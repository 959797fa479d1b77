"""The samples plugin: generations at each evaluation into samples.jsonl and log_samples, without
touching the training RNG stream (a run trains the same with and without it, and a killed and
resumed run ends with the weights and samples of an uninterrupted one)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Run, hookimpl
from engine.errors import ConfigError
from engine.testing import run_steps, same_weights, tiny_dataset, tiny_model, tiny_tokenizer

STEPS = 8
PROMPTS = ["record 3: the quick", {"messages": [{"role": "user", "content": "jumps over"}]}]
TESTS = Path(__file__).resolve().parent


def samples_run(out, *, samples=True, objects=(), train=None):
    """8 steps of a tiny Llama with dropout (so training draws from the RNG), evaluating every 2
    steps, a checkpoint every 4, and samples drawn with do_sample at each evaluation."""
    sections = {"samples": {"prompts": PROMPTS, "max_new_tokens": 6, "do_sample": True, "seed": 7}} if samples else {}
    return run_steps(STEPS, ["samples"] if samples else [], objects=list(objects), output_dir=out,
                     model=tiny_model(vocab_size=300, attention_dropout=0.2), tokenizer=tiny_tokenizer(),
                     eval_dataset=tiny_dataset(8, seed=1), sections=sections,
                     train={"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 4,
                            **(train or {})})


class KillAt:
    """SIGKILLs its own process after optimizer step ``step``: a real kill at a known moment."""

    name = "kill_at"

    def __init__(self, step):
        self.step = step

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class SampleRecorder:
    name = "sample_recorder"

    def __init__(self):
        self.calls = []

    @hookimpl
    def log_samples(self, run, samples, step):
        self.calls.append((step, samples))


def _rows(out):
    return [json.loads(line) for line in (Path(out) / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    recorder = SampleRecorder()
    return samples_run(out, objects=[recorder]), out, recorder


def test_samples_at_each_evaluation_go_to_the_file_and_log_samples(reference):
    _, out, recorder = reference
    rows = _rows(out)
    assert [row["step"] for row in rows] == [2, 2, 4, 4, 6, 6, 8, 8]  # the end is step 8's evaluation
    assert [row["prompt"] for row in rows[:2]] == [PROMPTS[0], PROMPTS[1]["messages"]]
    assert all(isinstance(row["completion"], str) and row["completion"] for row in rows)
    assert [(step, samples) for step, samples in recorder.calls] == [
        (step, rows[i:i + 2]) for i, step in zip(range(0, 8, 2), (2, 4, 6, 8))]
    assert len({row["completion"] for row in rows}) > 2  # the model changes what it says


def test_two_identical_runs_write_identical_samples_and_train_as_without_samples(reference, tmp_path):
    run, out, _ = reference
    twin = samples_run(tmp_path / "twin")
    assert (tmp_path / "twin" / "samples.jsonl").read_bytes() == (out / "samples.jsonl").read_bytes()
    # dropout draws from the RNG at every step: sampling drew from it only in its own fork
    plain = samples_run(tmp_path / "plain", samples=False)
    assert same_weights(plain.model, run.model) == [] and same_weights(twin.model, run.model) == []
    assert not (tmp_path / "plain" / "samples.jsonl").exists()


def test_killed_and_resumed_run_ends_with_the_weights_and_samples_of_an_uninterrupted_one(reference, tmp_path):
    run, out, _ = reference
    killed = tmp_path / "killed"
    script = (f"import sys, torch; sys.path.insert(0, {str(TESTS)!r}); torch.set_num_threads(1)\n"
              f"from test_samples import KillAt, samples_run\n"
              f"samples_run({str(killed)!r}, objects=[KillAt(7)])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert [row["step"] for row in _rows(killed)] == [2, 2, 4, 4, 6, 6]  # checkpoint-4 is the newest
    # a resume enables the plugins its checkpoint was made with: KillAt, here never firing
    resumed = samples_run(killed, objects=[KillAt(None)], train={"resume_from_checkpoint": True})
    assert resumed.state.global_step == STEPS
    assert same_weights(resumed.model, run.model) == []
    assert (killed / "samples.jsonl").read_bytes() == (out / "samples.jsonl").read_bytes()


def test_prompts_from_a_file_greedy_at_the_end_only(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('record 5: the\n\n{"messages": [{"role": "user", "content": "fox"}]}\n{"prompt": "lazy"}\n')
    run = run_steps(2, ["samples"], output_dir=tmp_path / "out", model=tiny_model(vocab_size=300),
                    tokenizer=tiny_tokenizer(), sections={"samples": {"prompts": str(prompts), "every": "end",
                                                                       "max_new_tokens": 3}})
    rows = _rows(tmp_path / "out")
    assert [(r["step"], r["prompt"]) for r in rows] == [
        (2, "record 5: the"), (2, [{"role": "user", "content": "fox"}]), (2, "lazy")]
    # greedy: what the final model says, token for token
    tokenizer = run.tokenizer
    ids = tokenizer("lazy", add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected = run.model.generate(input_ids=ids, max_new_tokens=3, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
    assert rows[2]["completion"] == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("sections, train, message", [
    ({}, {}, "samples.prompts: no prompts"),
    ({"prompts": ["a"]}, {}, "samples.every = 'evaluation' but train.eval_strategy = 'no'"),
    ({"prompts": "missing.txt", "every": "end"}, {}, "samples.prompts: 'missing.txt' is not a file"),
    ({"prompts": [{"content": "x"}], "every": "end"}, {}, "a chat prompt is {messages = "),
    ({"prompts": ["a"], "every": "sometimes"}, {}, "samples.every: expected 'evaluation' | 'end'"),
])
def test_bad_options_are_refused_by_name(tmp_path, sections, train, message):
    with pytest.raises(ConfigError, match=None) as error:
        Run({"plugins": ["samples"], "train": {"output_dir": str(tmp_path), **train}, "samples": sections})
    assert message in str(error.value)


def test_a_run_without_a_tokenizer_is_refused_before_the_first_step(tmp_path):
    with pytest.raises(ConfigError, match="plugin samples needs a tokenizer"):
        run_steps(2, ["samples"], output_dir=tmp_path, sections={"samples": {"prompts": ["a"], "every": "end"}})


def test_samples_of_an_adapter_model_come_from_the_adapted_model(tmp_path):
    peft = pytest.importorskip("peft")
    # random LoRA weights (B not zero): the adapted model says something else than its base
    model = peft.get_peft_model(tiny_model(vocab_size=300), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    prompts = ["record 7: the", "brown fox"]
    run = run_steps(2, ["samples"], output_dir=tmp_path, model=model, tokenizer=tiny_tokenizer(),
                    sections={"samples": {"prompts": prompts, "every": "end", "max_new_tokens": 6}})
    tokenizer = run.tokenizer

    def greedy():
        said = []
        for prompt in prompts:
            ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            out = run.model.generate(input_ids=ids, max_new_tokens=6, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
            said.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        return said

    completions = [row["completion"] for row in _rows(tmp_path)]
    assert completions == greedy()
    with run.model.disable_adapter():
        assert greedy() != completions
