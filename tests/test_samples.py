"""The samples plugin: generations at each evaluation into samples.jsonl and log_samples, without
touching the training RNG stream (a run trains the same with and without it, and a killed and
resumed run ends with the weights and samples of an uninterrupted one)."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Run, hookimpl
from engine.cli import main
from engine.config import to_toml
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


# ---------------------------------------------------------------------------- refused before training


CORPUS = "\n".join(f"line {i} of a corpus the samples are drawn from" for i in range(200))
CHAT_TEMPLATES = {"raising_template": "{{ raise_exception('this template takes no user turns') }}",
                  "empty_template": "{% if false %}x{% endif %}"}


@pytest.fixture
def engine_cli(tmp_path, capfd, monkeypatch):
    """``engine_cli(*argv, **samples)`` runs ``engine`` in-process in ``tmp_path`` on a tiny run with
    the samples plugin (``samples`` its section): (exit status, the lines on stderr)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(CORPUS)

    def run(*argv, tokenizer="train", **samples):
        (tmp_path / "run.toml").write_text(to_toml({
            "plugins": ["samples"],
            "train": {"max_steps": 2, "disable_tqdm": True, "save_strategy": "no", "output_dir": "out",
                      "model_config": {"hidden_size": 32, "intermediate_size": 64}},
            "data": {"train": "corpus.txt", "max_length": 16, "tokenizer": tokenizer, "tokenizer_vocab_size": 300},
            "samples": {"every": "end", "max_new_tokens": 4, **samples}}))
        capfd.readouterr()
        status = main([argv[0], "run.toml", *argv[1:]])
        return status, [line for line in capfd.readouterr().err.splitlines() if line.strip()]

    return run


LONG_PROMPT = "line 7 of a corpus " * 200  # ~1000 tokens: more than tiny-llama's 512 positions
# (case, [samples] options, files to write (or the chat template of the tokenizer), the start of the error
# line (a pattern: all of it), and where it is refused: "plan" (at configure, so `engine plan` too) or "train")
REFUSED = [
    ("generation beyond the positions", {"prompts": ["line"], "max_new_tokens": 100000}, {},
     "samples.max_new_tokens = 100000: a prompt and its completion need 100001 positions at least, but the model "
     "(tiny-llama) has 512 (max_position_embeddings); lower samples.max_new_tokens", "plan"),
    ("temperature 0 when sampling", {"prompts": ["line"], "do_sample": True, "temperature": 0.0}, {},
     "samples.temperature = 0 with samples.do_sample = true: sampling divides by the temperature; set "
     "samples.do_sample = false for greedy decoding, or samples.temperature > 0", "plan"),
    ("a temperature greedy decoding ignores", {"prompts": ["line"], "temperature": 0.7}, {},
     "samples.temperature = 0.7 applies only when sampling, and samples.do_sample = false (greedy decoding): set "
     "samples.do_sample = true, or leave samples.temperature out", "plan"),
    ("a top_p greedy decoding ignores", {"prompts": ["line"], "top_p": 0.9}, {},
     "samples.top_p = 0.9 applies only when sampling", "plan"),
    ("a prompt file that is not UTF-8", {"prompts": "prompts.txt"}, {"prompts.txt": b"line 1\n\xff\xfe line\n"},
     "samples.prompts: prompts.txt is not UTF-8 text (byte 0xff on line 2); save it as UTF-8", "plan"),
    ("a prompt file line that is not JSON", {"prompts": "prompts.txt"}, {"prompts.txt": b'line 1\n\n{"prompt": \n'},
     "samples.prompts (prompts.txt line 3): not valid JSON: ", "plan"),
    ("a chat turn without content", {"prompts": [{"messages": [{"role": "user"}]}]}, {},
     "samples.prompts[0]: a chat prompt is {messages = [{role = ..., content = ...}, ...]} with string roles and "
     "contents, got {'messages': [{'role': 'user'}]}", "plan"),
    ("a prompt longer than the positions", {"prompts": "prompts.txt"},
     {"prompts.txt": f"line 1\n\n{LONG_PROMPT}\n".encode()},
     re.compile(r"samples.prompts \(prompts.txt line 3\): \d{3,} tokens and samples.max_new_tokens = 4 need \d{3,} "
                r"positions, but the model has 512 \(max_position_embeddings\); shorten the prompt or lower "
                r"samples.max_new_tokens"), "train"),
    ("a chat template that raises", {"prompts": ["line", {"messages": [{"role": "user", "content": "hi"}]}]},
     {"tokenizer": "raising_template"}, "samples.prompts[1]: the tokenizer cannot encode it: TemplateError: this "
                                        "template takes no user turns", "train"),
    ("a prompt of no token", {"prompts": [{"messages": [{"role": "user", "content": "hi"}]}]},
     {"tokenizer": "empty_template"}, "samples.prompts[0]: {'messages': [{'role': 'user', 'content': 'hi'}]} "
                                      "encodes to no token; give a prompt with text", "train"),
]


@pytest.mark.parametrize("name, samples, files, message, where", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_generating_needs_is_refused_before_anything_is_written(engine_cli, tmp_path, name, samples, files,
                                                                     message, where):
    """Each used to fail (or generate for minutes) only after training and the final save."""
    files = dict(files)
    tokenizer = files.pop("tokenizer", "train")
    if tokenizer != "train":
        from engine.builtin.data.tokenizer import train_tokenizer

        built = train_tokenizer(CORPUS.splitlines(), 300)
        built.chat_template = CHAT_TEMPLATES[tokenizer]
        built.save_pretrained(tmp_path / tokenizer)
    for file_name, content in files.items():
        (tmp_path / file_name).write_bytes(content)
    commands = ["plan", "train"] if where == "plan" else ["train"]
    for command in commands:
        status, err = engine_cli(command, tokenizer=tokenizer, **samples)
        assert status == 2 and len(err) == 1, err
        line = err[0].removeprefix("engine: error: ")
        assert message.fullmatch(line) if isinstance(message, re.Pattern) else line.startswith(message), err[0]
        assert not (tmp_path / "out").exists()  # refused before the run wrote anything


def test_a_prompt_and_completion_that_just_fit_generate(engine_cli, tmp_path):
    status, err = engine_cli("train", prompts=["line"], max_new_tokens=511)
    assert status == 0, err
    (row,) = _rows(tmp_path / "out")
    assert row["prompt"] == "line" and row["completion"]
