"""What a command imports, and what it keeps between runs: the start-up costs benchmarks/startup.py measures.

Each check runs in a fresh interpreter, since what a process has imported is the thing checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _modules_after(code: str, cwd, env: dict[str, str] | None = None) -> set[str]:
    """The top-level modules a fresh interpreter holds after running ``code``."""
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_training_and_saving_the_default_run_imports_neither_deepspeed_nor_peft(tmp_path):
    # save_pretrained unwraps through accelerate, which imported DeepSpeed (and MLflow) to test for a
    # DeepSpeedEngine; Trainer's RemoveColumnsCollator imported peft. Both are installed here.
    modules = _modules_after(
        "from engine.cli import main\n"
        "assert main(['train', '--set', 'train.max_steps=2', '--set', 'train.output_dir=out']) == 0\n", tmp_path)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not {"deepspeed", "mlflow", "peft"} & modules


def test_a_save_after_deepspeed_was_imported_still_unwraps_for_it(tmp_path):
    # the DeepSpeed test is skipped only while deepspeed is not imported, and restored after each save
    modules = _modules_after(
        "import deepspeed, accelerate.utils.other as other\n"
        "from engine.kit.checkpoint import save_pretrained\n"
        "import transformers\n"
        "model = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=16, intermediate_size=32, "
        "num_hidden_layers=1, num_attention_heads=2, vocab_size=64))\n"
        "save_pretrained(model, __import__('pathlib').Path('saved'), model.state_dict())\n"
        "assert other.is_deepspeed_available(), 'the test was left off'\n", tmp_path)
    assert "deepspeed" in modules and (tmp_path / "saved" / "model.safetensors").is_file()


def test_plan_builds_no_optimizer_so_imports_no_dynamo(tmp_path):
    # the scheduler's arguments are checked on the optimizer's defaults: a torch optimizer's first
    # add_param_group imports torch._dynamo (~2 s), which a plan has no use for
    modules = _modules_after("from engine.cli import main\nassert main(['plan']) == 0\n", tmp_path)
    assert "torch" in modules and "torch._dynamo" not in modules


def test_migrate_keeps_the_libraries_defaults_per_version(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": "out", "learning_rate": 3e-5}))
    code = "from engine.cli import main\nassert main(['migrate', 'args.json', '-o', 'run.toml', '--force']) == 0\n"
    first = _modules_after(code, tmp_path, env)
    kept = list((tmp_path / "cache" / "engine").glob("_trainer_defaults-transformers*.json"))
    assert len(kept) == 1 and "transformers.training_args" in first
    written = (tmp_path / "run.toml").read_text()
    again = _modules_after(code, tmp_path, env)
    assert "transformers.training_args" not in again  # read back, not computed
    assert (tmp_path / "run.toml").read_text() == written

    from engine.tooling.migration import _trainer_defaults

    assert json.loads(kept[0].read_text()) == json.loads(json.dumps(_trainer_defaults(), default=str))
