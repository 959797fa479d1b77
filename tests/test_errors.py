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
    ("folder config garbage", None, ["--set", 'train.model="garbage_folder"'],
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
     "data.train row 0: no assistant message, so nothing to learn; roles: user"),
    ("chat without template", None, ["--set", "data.train=chat.jsonl", "--set", 'data.tokenizer="tok"'],
     "data.train: chat data (a 'messages' column) needs a tokenizer with a chat template"),
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
        from engine.data import train_tokenizer

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
    monkeypatch.setenv("ENGINE_TRACEBACK", "1")
    code, _, err = cli("train", "run.toml")
    assert code == 2 and len(err) > 1


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


# ---------------------------------------------------------------------------- a quiet start


def test_the_default_run_prints_only_the_engines_lines(tmp_path):
    result = subprocess.run([sys.executable, "-m", "engine", "train", "--set", f"train.output_dir={tmp_path}/out",
                             "--set", "train.max_steps=20", "--set", "train.eval_steps=10",
                             "--set", "train.save_steps=10", "--set", "train.logging_steps=10"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    foreign = [line for line in lines if not line.startswith(("engine: ", "step "))]
    assert foreign == [], foreign
    assert any(line.startswith("engine: saved the final model") for line in lines)


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
