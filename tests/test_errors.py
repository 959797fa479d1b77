"""Every mistake gets one clear line: ``engine: error: ...`` on stderr, exit status 2, no
traceback, and nothing written to output_dir when the mistake is found before training.

The table runs the CLI in-process (``engine.cli.main``) with file-descriptor capture, so
output printed by C code is seen too; the tests that need a fresh process start one.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import engine.checkpoint as ckpt
from engine.cli import main
from engine.config import to_toml
from engine.layout import MARKER

CORPUS = "\n".join(f"line {i} of a corpus about clear error messages" for i in range(300))


def _config(out, **train):
    return {"train": {"max_steps": 2, "disable_tqdm": True, "save_strategy": "no", "output_dir": str(out),
                      "model_config": {"hidden_size": 32, "intermediate_size": 64}, **train},
            "data": {"train": "corpus.txt", "max_length": 16, "tokenizer": "train", "tokenizer_vocab_size": 300}}


@pytest.fixture
def cli(tmp_path, capfd, monkeypatch):
    """``cli(*argv)`` runs ``engine`` in ``tmp_path``: (exit status, stdout, stderr lines)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # model factories in the test folder import
    (tmp_path / "corpus.txt").write_text(CORPUS)

    def run(*argv):
        capfd.readouterr()
        status = main([str(a) for a in argv])
        out, err = capfd.readouterr()
        return status, out, [line for line in err.splitlines() if line.strip()]

    return run


def _refused(cli, tmp_path, argv, fragment, status=2):
    code, _, err = cli(*argv)
    assert code == status, err
    assert len(err) == 1 and err[0].startswith("engine: error: "), err
    assert fragment in err[0], err[0]
    assert not (tmp_path / "out").exists()  # found before anything was written
    return err[0]


# (case, run-file content or None for the tiny run, --set overrides, files, fragment of the message)
MODEL_FACTORIES = {
    "factory_syntax.py": "def build(:\n",
    "factory_args.py": "def build():\n    pass\n",
    "factory_raises.py": "def build(tokenizer):\n    raise ValueError('no GPU here')\n",
    "factory_not_a_module.py": "def build(tokenizer):\n    return 3\n",
    "factory_no_input_ids.py": textwrap.dedent("""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(2, 2)

            def forward(self, x):
                return self.layer(x)

        def build(tokenizer):
            return Net()
        """),
    "factory_import_raises.py": "raise RuntimeError('set MY_TOKEN first')\n",
    "data_raises.py": "def rows(tokenizer):\n    raise KeyError('text')\n",
}
CASES = [
    # the run file
    ("not utf-8", b"[train]\nmax_steps = 2 # \xff\xfe\n", [], "run file run.toml is not UTF-8 text (byte 0xff on line 2)"),
    ("oversized", "# comment\n" * 200_000, [], "more than a run file's 1,048,576: is it the right file?"),
    ("plugins a string", 'plugins = "lion"\n', ["--plugins", "+early_stopping"],
     "plugins: expected list of str, got str 'lion'"),
    ("toml syntax", "[train\n", [], "run.toml: TOML syntax error"),
    # values that used to pass validation and crash later
    ("nan learning rate", None, ["--set", "train.learning_rate=nan"], "train.learning_rate: expected a finite float, got nan"),
    ("learning rate that overflows", None, ["--set", "train.learning_rate=1e38"],
     "train.learning_rate: expected float in [0, 1e+30], got 1e+38"),
    ("inf learning rate", None, ["--set", "train.learning_rate=inf"], "train.learning_rate: expected a finite float, got inf"),
    ("negative seed", None, ["--set", "train.seed=-5"], "train.seed: expected int in [0, 4294967295], got -5"),
    ("negative workers", None, ["--set", "train.dataloader_num_workers=-1"],
     "train.dataloader_num_workers: expected int >= 0, got -1"),
    ("beta of 1", None, ["--set", "train.adam_beta2=1.0"], "train.adam_beta2: expected float in [0, 1), got 1.0"),
    ("empty output_dir", None, ["--set", 'train.output_dir=""'], "train.output_dir: expected a non-empty string, got ''"),
    ("negative hidden size", None, ["--set", "train.model_config.hidden_size=-4"],
     "train.model_config: a llama model with this config fails on a test batch: RuntimeError: Trying to create "
     "tensor with negative dimension -4"),
    ("heads do not divide", None, ["--set", "train.model_config.hidden_size=33"],
     "train.model_config: the llama config refuses it: ValueError: The hidden size (33) is not a multiple of the "
     "number of attention heads (4)."),
    ("layers a string", None, ["--set", 'train.model_config.num_hidden_layers="two"'],
     "train.model_config.num_hidden_layers: Field 'num_hidden_layers' expected int, got str (value: 'two')"),
    ("kv heads do not divide", None, ["--set", "train.model_config.num_key_value_heads=3"],
     "train.model_config: a llama model with this config fails on a test batch: RuntimeError: The size of tensor"),
    ("zero heads", None, ["--set", "train.model_config.num_attention_heads=0"],
     "train.model_config: the llama config refuses it: ZeroDivisionError"),
    ("unknown model_config key", None, ["--set", "train.model_config.hiden_size=8"],
     "train.model_config: llama config has no key 'hiden_size'"),
    ("examples longer than positions", None, ["--set", "data.max_length=1024"],
     "data.max_length: 1024 tokens per example, but the model (tiny-llama) has 512 positions "
     "(max_position_embeddings); lower data.max_length, or raise train.model_config.max_position_embeddings"),
    ("batch larger than the data", None, ["--set", "train.per_device_train_batch_size=100000"],
     "train.per_device_train_batch_size: 100000 per device x 1 process(es) is more than the "),
    # model sources
    ("config not json", None, ["--set", 'train.model="m.json"'], "train.model: m.json is not valid JSON"),
    ("config a list", None, ["--set", 'train.model="list.json"'],
     "train.model: list.json holds a JSON list, expected an object with a model_type"),
    ("config null", None, ["--set", 'train.model="null.json"'], "train.model: null.json holds a JSON null"),
    ("unknown model_type", None, ["--set", 'train.model="lama.json"'],
     "train.model: lama.json needs a known 'model_type', got 'lama'; did you mean 'llama'"),
    ("factory syntax error", None, ["--set", 'train.model="factory_syntax:build"'],
     "train.model: importing 'factory_syntax' failed: SyntaxError: invalid syntax ("),
    ("factory import raises", None, ["--set", 'train.model="factory_import_raises:build"'],
     "train.model: importing 'factory_import_raises' failed: RuntimeError: set MY_TOKEN first"),
    ("factory missing", None, ["--set", 'train.model="no_such_factory:build"'],
     "train.model: no module named 'no_such_factory' (from 'no_such_factory:build'; is it on PYTHONPATH?)"),
    ("factory wrong arguments", None, ["--set", 'train.model="factory_args:build"'],
     "train.model: factory_args:build takes (), but is called with 1 argument(s)"),
    ("factory raises", None, ["--set", 'train.model="factory_raises:build"'],
     "train.model: factory_raises:build raised ValueError: no GPU here"),
    ("factory returns an int", None, ["--set", 'train.model="factory_not_a_module:build"'],
     "train.model: factory_not_a_module:build returned int, expected a torch.nn.Module"),
    ("factory without input_ids", None, ["--set", 'train.model="factory_no_input_ids:build"'],
     "train.model: Net.forward(x) takes no input_ids; the default loss calls model(input_ids=..."),
    ("folder config garbage", None, ["--set", 'train.model="garbage_folder"', "--set", 'data.tokenizer="tok"'],
     "train.model: garbage_folder/config.json is not a config transformers can read: "),
    ("scheduler argument of the wrong type", None, ["--set", 'train.lr_scheduler_type="cosine"', "--set",
                                                   'train.lr_scheduler_kwargs={num_cycles="half"}'],
     "train.lr_scheduler_kwargs: {'num_cycles': 'half'} do not fit cosine: "),
    ("data function raises", None, ["--set", 'data.train="data_raises:rows"', "--set", 'data.tokenizer="tok"'],
     "data.train: data_raises:rows raised KeyError: 'text'"),
    # data
    ("data file missing", None, ["--set", "data.train=missing.jsonl"], "data.train: file not found: missing.jsonl"),
    ("data glob matches nothing", None, ["--set", 'data.train="shards/*.jsonl"'],
     "data.train: shards/*.jsonl matches no file"),
    ("data column missing", None, ["--set", "data.train=rows.jsonl", "--set", 'data.tokenizer="tok"'],
     "data.text_column: data.train has no column 'text' (nor input_ids, messages, or prompt and completion); "
     "its columns: body, n"),
    ("chat without assistant", None, ["--set", "data.train=chat_user_only.jsonl", "--set", 'data.tokenizer="chattok"'],
     "data.train: chat_user_only.jsonl line 1: no assistant message, so nothing to learn; roles: user"),
    ("chat without template", None, ["--set", "data.train=chat.jsonl", "--set", 'data.tokenizer="tok"'],
     "data.train: chat data (a 'messages' column) needs a tokenizer with a chat template"),
    # the composition and nesting of a run
    ("plugins set to a number", None, ["--set", "plugins=3"], "plugins: expected list of str, got int 3"),
    ("a builtin named as a plugin", None, ["--plugins", "+builtin.optimizers"],
     "unknown plugin 'builtin.optimizers'; builtins are always on and are not named in plugins or --plugins"),
    ("run file nested too deep", "[train]\nmodel_config = " + "[" * 100_000 + "]" * 100_000 + "\n", [],
     "run file run.toml nests tables or arrays more than 32 levels deep"),
    ("--set key nested too deep", None, ["--set", "a." * 100 + "b=1"], "a key of more than 32 parts"),
    ("--set value nested too deep", None, ["--set", "train.model_config=" + "[" * 3000 + "]" * 3000],
     "nests tables or arrays more than 32 levels deep"),
    ("epochs beyond counting", None, ["--set", "train.max_steps=-1", "--set", "train.num_train_epochs=1e308"],
     "train.num_train_epochs: 1e+308 epochs of "),
    # evaluation and generation settings checked before training, not when first used
    ("evaluation without data", None, ["--set", 'train.eval_strategy="steps"'],
     "train.eval_strategy = 'steps' evaluates, but the run has no evaluation data: set data.eval or "
     "data.eval_split (or pass eval_dataset), or set train.eval_strategy = 'no'"),
    ("label_names of no batch key", None, ["--set", 'train.label_names=["nope"]'],
     "train.label_names: 'nope' is not a key of the batches, which hold 'input_ids', 'labels'"),
    ("generation value of the wrong type", None, ["--set", 'train.generation_config={max_new_tokens="lots"}'],
     "train.generation_config.max_new_tokens: expected an int >= 1, got str 'lots'"),
    ("sampling at temperature 0", None, ["--set", "train.predict_with_generate=true",
                                         "--set", "train.generation_config={temperature=0.0, do_sample=true}"],
     "train.generation_config: temperature = 0.0 with do_sample = true cannot sample; set do_sample = false"),
]
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
FILES = {"rows.jsonl": '{"body": "x", "n": 1}\n', "chat.jsonl": json.dumps({"messages": CHAT}) + "\n",
         "chat_user_only.jsonl": json.dumps({"messages": CHAT[:1]}) + "\n", "m.json": "{garbage", "list.json": "[1, 2]", "null.json": "null", "lama.json": '{"model_type": "lama"}',
         **MODEL_FACTORIES}


@pytest.mark.parametrize("name, run_file, argv, fragment", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_exit_2_and_nothing_written(cli, tmp_path, name, run_file, argv, fragment):
    for file_name, content in FILES.items():
        (tmp_path / file_name).write_text(content)
    if "tok" in " ".join(argv):  # a tokenizer folder, for data that is not text
        from engine.builtin.data.tokenizer import train_tokenizer

        tokenizer = train_tokenizer(CORPUS.splitlines(), 300)
        tokenizer.save_pretrained(tmp_path / "tok")
        tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        tokenizer.save_pretrained(tmp_path / "chattok")
    (tmp_path / "garbage_folder").mkdir()
    (tmp_path / "garbage_folder" / "config.json").write_text("{oops")
    tiny_weights = {"w": torch.zeros(2)}
    save_file(tiny_weights, tmp_path / "garbage_folder" / "model.safetensors")
    path = tmp_path / "run.toml"
    if run_file is None:
        path.write_text(to_toml(_config(tmp_path / "out")))
    elif isinstance(run_file, bytes):
        path.write_bytes(run_file)
    else:
        path.write_text(run_file)
    _refused(cli, tmp_path, ["train", "run.toml", *argv], fragment)


def test_a_run_file_that_is_not_a_file_is_refused(cli, tmp_path):
    assert "run file /dev/zero is not a regular file; name a .toml file" in _refused(
        cli, tmp_path, ["plan", "/dev/zero"], "")
    (tmp_path / "folder.toml").mkdir()
    _refused(cli, tmp_path, ["plan", "folder.toml"], "run file folder.toml is a folder")


def test_a_byte_order_mark_is_accepted(cli, tmp_path):
    (tmp_path / "run.toml").write_bytes(b"\xef\xbb\xbf" + to_toml(_config(tmp_path / "out")).encode())
    code, out, err = cli("plan", "run.toml")
    assert code == 0, err
    assert "max_steps = 2" in out


@pytest.mark.parametrize("where, fragment", [
    ("afile", "train.output_dir: {out} is a file, not a folder"),
    ("afile/below", "train.output_dir: cannot create {out}: Not a directory"),
    ("/dev/null", "train.output_dir: /dev/null is a file, not a folder"),
])
def test_an_unusable_output_dir_is_refused_before_anything_loads(cli, tmp_path, where, fragment):
    (tmp_path / "afile").write_text("a file")
    out = Path(where) if where.startswith("/") else tmp_path / where
    (tmp_path / "run.toml").write_text(to_toml(_config(out)))
    code, _, err = cli("train", "run.toml")
    assert code == 2 and err == [f"engine: error: {fragment.format(out=out)}"]
    assert (tmp_path / "afile").read_text() == "a file"


def test_a_read_only_output_dir_is_refused(cli, tmp_path):
    """As root, permissions do not stop writes: a read-only mount does (skipped without mount rights)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {made.stderr.decode().strip()}")
    try:
        (tmp_path / "run.toml").write_text(to_toml(_config(folder / "out")))
        code, _, err = cli("train", "run.toml")
        assert code == 2 and err == [f"engine: error: train.output_dir: cannot create {folder / 'out'}: "
                                     "Read-only file system"]
        (tmp_path / "run2.toml").write_text(to_toml(_config(folder)))
        code, _, err = cli("train", "run2.toml")
        assert code == 2 and err == [f"engine: error: train.output_dir: cannot write in {folder}: Read-only file system"]
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_launcher_variables_that_are_not_numbers_are_refused(cli, tmp_path, monkeypatch):
    (tmp_path / "run.toml").write_text(to_toml(_config(tmp_path / "out")))
    monkeypatch.setenv("RANK", "abc")
    _refused(cli, tmp_path, ["train", "run.toml"], "environment variable RANK='abc' is not an integer")


def test_plugins_minus_name_parses(cli, tmp_path):
    (tmp_path / "run.toml").write_text('plugins = ["lion"]\n' + to_toml(_config(tmp_path / "out")))
    code, out, err = cli("plan", "run.toml", "--plugins", "-lion")
    assert code == 0, err
    assert "lion" not in out.split("hooks (")[0]
    code, out, err = cli("plan", "run.toml", "--plugins", "+grokadamw,-lion")
    assert code == 0, err
    plugins = out.split("hooks (")[0]
    assert "grokadamw" in plugins and "lion" not in plugins


def test_user_code_tracebacks_on_request(cli, tmp_path, monkeypatch):
    (tmp_path / "factory_raises.py").write_text(MODEL_FACTORIES["factory_raises.py"])
    (tmp_path / "run.toml").write_text(to_toml(_config(tmp_path / "out", model="factory_raises:build")))
    code, _, err = cli("train", "run.toml", "--traceback")
    assert code == 2
    assert err[0] == "Traceback (most recent call last):" and 'raise ValueError(\'no GPU here\')' in "\n".join(err)
    assert err[-1] == "engine: error: train.model: factory_raises:build raised ValueError: no GPU here"
    for value in ("1", "yes", "True", "on"):
        monkeypatch.setenv("ENGINE_TRACEBACK", value)
        code, _, err = cli("train", "run.toml")
        assert code == 2 and len(err) > 1, value
    for value in ("0", "no", "false", ""):
        monkeypatch.setenv("ENGINE_TRACEBACK", value)
        code, _, err = cli("train", "run.toml")
        assert code == 2 and len(err) == 1, value


def test_compute_metrics_that_fails_is_one_line(cli, tmp_path):
    (tmp_path / "metrics_code.py").write_text("def broken(prediction):\n    return prediction.nothing\n\n"
                                              "def a_list(prediction):\n    return [1.0]\n")
    for spec, message in (("metrics_code:broken", "train.compute_metrics: metrics_code:broken raised AttributeError"),
                          ("metrics_code:a_list", "train.compute_metrics: metrics_code:a_list returned list, expected a dict")):
        (tmp_path / "run.toml").write_text(to_toml({**_config(tmp_path / spec.split(":")[1], compute_metrics=spec,
                                                              eval_strategy="steps", eval_steps=1),
                                                    "data": {**_config(tmp_path)["data"], "eval_split": 0.1}}))
        code, _, err = cli("train", "run.toml")
        assert code == 2, err
        assert len(err) == 1 and err[0].startswith(f"engine: error: {message}"), err


# ---------------------------------------------------------------------------- corrupt checkpoints


@pytest.fixture
def checkpoint(cli, tmp_path):
    """A run with checkpoints at steps 2 and 4, and a function that resumes the first one (the
    config unchanged, so every file of it is used)."""
    (tmp_path / "run.toml").write_text(to_toml(_config(tmp_path / "out", save_strategy="steps", save_steps=2,
                                                       max_steps=4)))
    code, _, err = cli("train", "run.toml")
    assert code == 0, err
    folder = tmp_path / "out" / "checkpoint-2"

    def resume():
        return cli("train", "run.toml", "--set", f'train.resume_from_checkpoint="{folder}"')

    return folder, resume


def _json(path, value):
    path.write_text(json.dumps(value))


def _safetensors_header(folder, change):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    change(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (size - len(encoded))  # same length: only the structure is wrong
    assert len(encoded) == size
    path.write_bytes(data[:8] + encoded + data[8 + size:])


def _first_tensor(header):
    return next(key for key in header if key != "__metadata__")


CORRUPTIONS = [
    ("trainer_state a list", lambda f: _json(f / "trainer_state.json", [1, 2]),
     "trainer_state.json holds a JSON list, expected an object"),
    ("global_step a string", lambda f: _json(f / "trainer_state.json", {
        **json.loads((f / "trainer_state.json").read_text()), "global_step": "12"}),
     "trainer_state.json: global_step is a str ('12'), expected int"),
    ("header shape", lambda f: _safetensors_header(f, lambda h: h[_first_tensor(h)].update(shape=[7, 7])),
     "model.safetensors has a malformed header: tensor "),
    ("header dtype", lambda f: _safetensors_header(f, lambda h: h[_first_tensor(h)].update(dtype="F33")),
     "has dtype 'F33'"),
    ("optimizer a list", lambda f: torch.save([1, 2], f / "optimizer.pt"),
     "optimizer.pt holds a list, expected a dict with state, param_groups"),
    ("optimizer of another model", lambda f: torch.save(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1.0).state_dict(), f / "optimizer.pt"),
     "optimizer.pt does not fit this run: ValueError: loaded state dict has a different number of parameter groups"),
    ("scheduler an int", lambda f: torch.save(5, f / "scheduler.pt"), "scheduler.pt does not fit this run: "),
    ("rng state of the wrong size", lambda f: torch.save({**torch.load(f / "rng_state.pt", weights_only=True),
                                                          "torch": torch.zeros(3, dtype=torch.uint8)}, f / "rng_state.pt"),
     "rng_state.pt does not fit this run: RuntimeError"),
    ("weights index garbage", lambda f: (f / "model.safetensors.index.json").write_text("{not json"),
     "model.safetensors.index.json is not valid JSON"),
]


@pytest.mark.parametrize("name, corrupt, fragment", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_a_corrupt_checkpoint_is_refused_naming_the_file(checkpoint, name, corrupt, fragment):
    folder, resume = checkpoint
    corrupt(folder)
    damaged = max((p for p in folder.iterdir() if p.name != MARKER), key=lambda p: p.stat().st_mtime_ns).name
    code, _, err = resume()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith((f"engine: error: checkpoint {folder}: {damaged} ",  # its checksum, or worse
                              f"engine: error: checkpoint {folder}: {damaged}: ")), err[0]
    # a manifest that matches the damaged files (as a tool that rewrote them would leave it):
    # then the structure checks name what is wrong
    manifest = ckpt.read_manifest(folder)
    ckpt.write_manifest(folder, MARKER, run_id=manifest["run_id"], step=manifest["step"])
    code, _, err = resume()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"engine: error: checkpoint {folder}") and fragment in err[0], err[0]
    assert "resumed from" not in err[0]


# ---------------------------------------------------------------------------- engine evaluate


def test_engine_evaluate_is_a_job_of_its_own(cli, tmp_path):
    (tmp_path / "run.toml").write_text(to_toml({
        **_config(tmp_path / "out", save_strategy="steps", save_steps=2, max_steps=4),
        "data": {**_config(tmp_path)["data"], "eval_split": 0.1}}))
    code, _, err = cli("train", "run.toml")
    assert code == 0, err
    log = (tmp_path / "out" / "metrics.jsonl").read_text()
    for folder, step in ((tmp_path / "out" / "checkpoint-2", 2), (tmp_path / "out", 4)):
        code, out, err = cli("evaluate", "run.toml", "--checkpoint", folder)
        assert code == 0, err
        printed = json.loads(out.strip().splitlines()[-1])
        assert printed["step"] == step and printed["eval_loss"] > 0
        assert json.loads((folder / "eval_results.json").read_text()) == printed
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == log  # the training log is untouched


# ---------------------------------------------------------------------------- pretrained tokenizers


OTHER_CORPUS = "\n".join(f"zebra {i} quokka wombat {i * 7} yak xylophone vortex" for i in range(300))


@pytest.fixture
def pretrained(cli, tmp_path):
    """A model trained on corpus.txt (its tokenizer learnt there) saved in out/, and other.txt, whose
    text would teach a different tokenizer."""
    (tmp_path / "other.txt").write_text(OTHER_CORPUS)
    (tmp_path / "run.toml").write_text(to_toml({**_config(tmp_path / "out", save_strategy="steps", save_steps=2),
                                                "data": {**_config(tmp_path)["data"], "eval_split": 0.1}}))
    code, _, err = cli("train", "run.toml")
    assert code == 0, err
    return tmp_path / "out"


def test_a_pretrained_model_keeps_its_tokenizer(cli, tmp_path, pretrained):
    from engine.builtin.data.tokenizer import load_tokenizer

    # the tokenizer data.tokenizer = "train" used to pair with the weights: learnt from other.txt
    (tmp_path / "other.toml").write_text(to_toml({**_config(tmp_path / "other"),
                                                  "data": {**_config(tmp_path)["data"], "train": "other.txt"}}))
    assert cli("train", "other.toml")[0] == 0
    own, other = load_tokenizer(str(pretrained), "x"), load_tokenizer(str(tmp_path / "other"), "x")
    assert own.get_vocab() != other.get_vocab()

    # fine-tuning on other.txt, as `engine train --set train.model=...` edits a run: its own tokenizer
    tuned = {**_config(tmp_path / "tuned", model=str(pretrained)), "data": {"train": "other.txt", "max_length": 16}}
    tuned["train"].pop("model_config")
    (tmp_path / "tuned.toml").write_text(to_toml(tuned))
    code, _, err = cli("train", "tuned.toml")
    assert code == 0, err
    assert load_tokenizer(str(tmp_path / "tuned"), "x").get_vocab() == own.get_vocab()

    # a new tokenizer for those weights, or weights without their tokenizer: refused before anything loads
    (tmp_path / "tuned.toml").write_text(to_toml({**tuned, "train": {**tuned["train"],
                                                                     "output_dir": str(tmp_path / "again")}}))
    code, _, err = cli("train", "tuned.toml", "--set", 'data.tokenizer="train"')
    assert code == 2 and err == [f"engine: error: data.tokenizer = 'train' would pair a newly trained tokenizer with "
                                 f"the pretrained weights of train.model '{pretrained}', whose embeddings belong to "
                                 "its own tokenizer; set data.tokenizer = 'auto' (the model folder's tokenizer) or to "
                                 "the folder of the tokenizer the weights were trained with"]
    assert not (tmp_path / "again").exists()
    weights_only = tmp_path / "weights-only"  # the model's files without its tokenizer
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights_only / name).write_bytes((pretrained / name).read_bytes())
    code, _, err = cli("plan", "tuned.toml", "--set", f'train.model="{weights_only}"')
    assert code == 2 and err == [f"engine: error: data.tokenizer: train.model '{weights_only}' holds pretrained weights "
                                 "but no tokenizer (tokenizer.json or tokenizer_config.json); set data.tokenizer to "
                                 "the folder of the tokenizer the weights were trained with"]


def test_engine_evaluate_uses_the_checkpoints_tokenizer(cli, tmp_path, pretrained):
    """With other train data the run file would train another tokenizer: the checkpoint's own evaluates
    (it used to give eval_loss on mismatched ids)."""
    metrics = []
    for train_data in ("corpus.txt", "other.txt"):
        code, out, err = cli("evaluate", "run.toml", "--checkpoint", pretrained / "checkpoint-2",
                             "--set", f"data.train={train_data}", "--set", "data.eval=corpus.txt")
        assert code == 0, err
        metrics.append(json.loads(out.strip().splitlines()[-1])["eval_loss"])
    assert metrics[0] == metrics[1]


# ---------------------------------------------------------------------------- what a folder holds


def test_a_fresh_run_into_a_diverged_runs_folder_is_refused(cli, tmp_path):
    """A diverged run saves no checkpoint: its logs and record used to be replaced without a word."""
    (tmp_path / "run.toml").write_text(to_toml(_config(tmp_path / "out", learning_rate=1e30, logging_steps=1,
                                                       max_steps=6)))
    code, _, err = cli("train", "run.toml")
    assert code == 3, err
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["status"] == "diverged"
    code, _, err = cli("train", "run.toml", "--set", "train.learning_rate=1e-3")
    assert code == 2 and err == [f"engine: error: train.output_dir: {tmp_path / 'out'} holds run {record['run_id']} "
                                 "(its metrics.jsonl, status diverged); choose another train.output_dir, or set "
                                 "train.overwrite_output_dir = true to remove it first"]
    assert json.loads((tmp_path / "out" / "run.json").read_text()) == record
    code, _, err = cli("train", "run.toml", "--set", "train.learning_rate=1e-3", "--set",
                       "train.overwrite_output_dir=true")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "run.json").read_text())["run_id"] != record["run_id"]


def test_evaluation_without_data_from_a_plugin_is_refused_before_anything_is_written(tmp_path):
    """A create_datasets plugin may supply eval data, so the check waits for setup: still before the
    run record, the logs or the report."""
    from engine import Run, hookimpl
    from engine.state import Datasets
    from engine.errors import ConfigError
    from engine.testing import tiny_dataset, tiny_model, tiny_tokenizer

    class TrainOnly:
        @hookimpl
        def create_datasets(self, run):
            return Datasets(tiny_dataset())

    run = Run({"train": {"output_dir": str(tmp_path / "out"), "max_steps": 2, "eval_strategy": "steps"}},
              model=tiny_model(vocab_size=300), tokenizer=tiny_tokenizer(300), plugins={"train_only": TrainOnly()})
    with pytest.raises(ConfigError, match="train.eval_strategy = 'steps' evaluates, but the run has no evaluation data"):
        run.train()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("plugins, fragment", [
    ([], "WORLD_SIZE=2: a launcher started 2 processes, but train.strategy 'single' trains in one; enable a "
         "distributed strategy (plugins ddp, fsdp or deepspeed) or start one process"),
    (["--plugins", "+ddp"], "WORLD_SIZE=2 is set but no launcher started this process (MASTER_ADDR is not set): "
                            "start it with torchrun --nproc-per-node 2 (or deepspeed), or unset WORLD_SIZE"),
])
def test_a_world_size_without_its_launcher_is_refused(cli, tmp_path, monkeypatch, plugins, fragment):
    """Each process used to train alone with no word."""
    (tmp_path / "run.toml").write_text(to_toml(_config(tmp_path / "out")))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    _refused(cli, tmp_path, ["train", "run.toml", *plugins], fragment)


# ---------------------------------------------------------------------------- a quiet start


@pytest.mark.parametrize("level", ["info", "debug"])
def test_log_level_info_shows_the_engines_lines_not_transformers_file_chatter(tmp_path, level):
    """At "info" transformers would print the model config and each file at every save the engine makes (and
    reports itself); "debug" shows them again."""
    code = ("from engine import Run\nfrom engine.testing import tiny_dataset, tiny_model\n"
            f"Run({{'train': {{'max_steps': 2, 'save_strategy': 'steps', 'save_steps': 1, 'log_level': {level!r}, "
            f"'output_dir': {str(tmp_path)!r}, 'disable_tqdm': True}}}}, model=tiny_model(), "
            "train_dataset=tiny_dataset()).train()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "engine: saved the final model" in result.stderr
    chatter = [line for line in result.stderr.splitlines()
               if line.startswith("[transformers] ") and ("saved in" in line or "Model config" in line)]
    assert len(chatter) == (0 if level == "info" else 9), chatter  # 3 files at each of 2 checkpoints and the end


def test_known_import_noise_shows_at_debug(tmp_path):
    code = ("import logging, engine.run\n"
            "from engine.logs import quiet_known_noise\n"
            "quiet_known_noise()\n"
            "logging.getLogger('torchao').warning('Failed to load x.so: it is a CPU build')\n"
            "logging.getLogger('torchao').warning('something else')\n"
            "logging.getLogger('engine').setLevel(logging.DEBUG)\n"
            "logging.getLogger('torchao').warning('Failed to load y.so: shown at debug')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stderr.splitlines() == ["something else", "Failed to load y.so: shown at debug"]


# ---------------------------------------------------------------------------- bad rows in the data


def _lines(*rows):
    return "".join((json.dumps(row) if isinstance(row, dict) else row) + "\n" for row in rows)


TOKENS = [{"input_ids": [1, 2, 3, 4]}] * 6
CHAT_ROWS = [{"messages": CHAT}] * 6
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
BAD_ROWS = [  # (case, data file content, --set overrides, the error line after "engine: error: ")
    # rows of token ids: refused before training, not a crash inside the step
    ("id beyond the vocabulary", _lines(*TOKENS, {"input_ids": [1, 5000]}), [],
     "data.train: rows.jsonl line 7: 'input_ids' holds the id 5000, but the model's embedding has 300 rows "
     "(ids 0 to 299); give ids of the model's tokenizer, or a model with that vocabulary"),
    ("string ids", _lines(*TOKENS, {"input_ids": ["the", "fox"]}), [],
     "data.train: rows.jsonl line 7: 'input_ids' holds a str ('the') among its values, expected a list of token "
     "ids (ints)"),
    ("negative id", _lines(*TOKENS, {"input_ids": [1, -2, 3]}), [],
     "data.train: rows.jsonl line 7: 'input_ids' holds the negative id -2; token ids start at 0"),
    ("labels shorter than the ids", _lines(*[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 6,
                                           {"input_ids": [1, 2, 3], "labels": [1, 2]}), [],
     "data.train: rows.jsonl line 7: 'labels' holds 2 values, 'input_ids' 3: give one label per token "
     "(-100 for no loss)"),
    ("labels longer than the ids", _lines({"input_ids": [1, 2], "labels": [1, 2, 3]}, *TOKENS), [],
     "data.train: rows.jsonl line 1: 'labels' holds 3 values, 'input_ids' 2: give one label per token "
     "(-100 for no loss)"),
    ("a row longer than the positions", _lines(*TOKENS, {"input_ids": [1] * 40}),
     ["train.model_config.max_position_embeddings=32"],
     "data.train: rows.jsonl line 7: 40 tokens, but the model has 32 positions (max_position_embeddings); "
     "shorten the row, or raise train.model_config.max_position_embeddings"),
    ("a length column of strings", _lines(*[{"input_ids": [1, 2, 3], "n": "three"}] * 8),
     ['train.train_sampling_strategy="group_by_length"', 'train.length_column_name="n"'],
     "train.length_column_name: column 'n' of the train dataset holds str 'three' in row 0 (counted from 0), "
     "expected each example's length (an int >= 0); fix the column, or name another"),
    # chat rows, named by their line in the file (blank lines are no rows; held-out rows count)
    ("chat content null", _lines(*CHAT_ROWS[:3], "", {"messages": [CHAT[0], {"role": "assistant", "content": None}]},
                                 *CHAT_ROWS),
     ["data.eval_split=0.3"],
     "data.train: rows.jsonl line 5: message 1 (assistant) has no content (null or missing); give it a string, "
     "or leave the turn out"),
    ("chat role an int", _lines(*CHAT_ROWS, {"messages": [{"role": 1, "content": "hi"}, CHAT[1]]}), [],
     "data.train: rows.jsonl line 7: message 0 has an int (1) as its role, expected a string such as 'user'"),
    ("chat template raises", _lines(*CHAT_ROWS, {"messages": [{"role": "user", "content": "boom"}, CHAT[1]]}),
     ["data.tokenizer=\"raising\""],
     "data.train: rows.jsonl line 7: the chat template raised TemplateError: no boom; fix the row, or the template "
     "(data.chat_template, or the tokenizer's own)"),
    ("chat template broken", _lines(*CHAT_ROWS), ["data.tokenizer=\"broken\""],
     "data.train: rows.jsonl line 1: the chat template raised TemplateSyntaxError: "),
    # empty data, in the engine's words (not StopIteration, SchemaInferenceError, nor blamed on eval_split)
    ("empty file", "", ["data.eval_split=0.1"],
     "data.train: rows.jsonl is empty (0 bytes); give it rows, or name another file"),
    ("blank lines", "\n \n\n", [], "data.train: rows.jsonl is empty (only blank lines); give it rows, or name another file"),
    ("empty eval file", "", ["data.train=corpus.txt", "data.eval=rows.jsonl"],
     "data.eval: rows.jsonl is empty (0 bytes); give it rows, or name another file"),
    # every row left out: truncation leaves no answer to learn (it used to stop as "diverged" at lr 0)
    ("no answer left", _lines(*[{"prompt": "line 1 of a corpus " * 5, "completion": "yes"}] * 8),
     ["data.packing=false"],
     "data.train: none of the 8 examples has a token to learn (a label other than -100 after the first): "
     "data.max_length = 16 cuts the answers away in 8 of 8 examples (their first answer token is at position 30; "
     "data.max_length = 31 keeps one in every example); raise it, or set data.truncation = \"drop\" to leave out "
     "examples longer than it"),
]


def _save_tokenizers(folder):
    """tok (no chat template), chat, raising (raise_exception on 'boom'), broken (a syntax error)."""
    from engine.builtin.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(CORPUS.splitlines(), 300)
    tokenizer.save_pretrained(folder / "tok")
    for name, template in (("chat", CHAT_TEMPLATE), ("broken", "{% for m in messages %}"),
                           ("raising", "{% if messages[0]['content'] == 'boom' %}{{ raise_exception('no boom') }}"
                                       "{% endif %}" + CHAT_TEMPLATE)):
        tokenizer.chat_template = template
        tokenizer.save_pretrained(folder / name)


@pytest.mark.parametrize("name, content, overrides, line", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_a_bad_row_is_one_line_naming_it_before_training(cli, tmp_path, name, content, overrides, line):
    _save_tokenizers(tmp_path)
    (tmp_path / "rows.jsonl").write_text(content)
    tokenizer = "chat" if "chat" in name else "tok"
    (tmp_path / "run.toml").write_text(to_toml({**_config(tmp_path / "out"), "data": {
        **_config(tmp_path)["data"], "train": "rows.jsonl", "tokenizer": tokenizer}}))
    sets = [arg for override in overrides for arg in ("--set", override)]
    assert _refused(cli, tmp_path, ["train", "run.toml", *sets], line).startswith(f"engine: error: {line}")


def test_a_bad_row_met_mid_stream_ends_the_run_with_one_line_and_its_checkpoints_resume(cli, tmp_path):
    """A streamed file read as the run trains: its bad row (past the rows read at the start) stops
    the run with one line naming it; the run is recorded as failed, its checkpoints resume."""
    _save_tokenizers(tmp_path)
    rows = [{"text": f"line {i} of a corpus about clear error messages"} for i in range(2400)]
    good = _lines(*rows)
    (tmp_path / "stream.jsonl").write_text(_lines(*rows[:1500], {"text": None}, *rows[1501:]))
    (tmp_path / "run.toml").write_text(to_toml({
        **_config(tmp_path / "out", max_steps=300, per_device_train_batch_size=8, save_strategy="steps",
                  save_steps=50, logging_steps=50),
        "data": {**_config(tmp_path)["data"], "train": "stream.jsonl", "streaming": True, "shuffle_buffer_size": 1,
                 "packing": False, "tokenizer": "tok"}}))
    code, _, err = cli("train", "run.toml")
    assert code == 2
    assert err[-1] == "engine: error: data.train: stream.jsonl line 1501: 'text' is missing or null, expected a string"
    assert all(line.startswith("engine: ") for line in err), err
    assert not any("Traceback" in line for line in err), err
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "failed"
    saved = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved and all((tmp_path / "out" / name / MARKER).is_file() for name in saved)

    (tmp_path / "stream.jsonl").write_text(good)  # the row fixed, the run resumes from its last checkpoint
    code, _, err = cli("train", "run.toml", "--set", "train.resume_from_checkpoint=true")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "finished"
