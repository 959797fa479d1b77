"""The offline install: scripts/wheelhouse.py builds a wheelhouse of engine, galore and the contrib
plugin lion with all their dependencies; a fresh virtual environment installs it with --no-index,
lists exactly those plugins (and the engine's own, early_stopping), trains two steps with
galore as the development install does, migrates TrainingArguments and runs a TrainerCallback."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

import engine
from engine.testing import logged_scalars, write_run_file

ROOT = Path(__file__).resolve().parents[1]
GALORE = {"optim": "galore_adamw", "optim_target_modules": [r".*attn.*", r".*mlp.*"],
          "optim_args": "rank=4,update_proj_gap=50,scale=0.5,proj_type=std"}


# two steps with a TrainerCallback, which gets Trainer's args (a TrainingArguments)
CALLBACK_RUN = """
from transformers import TrainerCallback
from engine import Run
from engine.testing import tiny_dataset, tiny_model

class Steps(TrainerCallback):
    seen = []
    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(str(state.global_step))

Run({"train": {"max_steps": 2, "output_dir": "callback-run", "save_strategy": "no", "disable_tqdm": True}},
    model=tiny_model(), train_dataset=tiny_dataset(), callbacks=[Steps()]).train()
open("callback-steps.txt", "w").write(" ".join(Steps.seen))
"""


def _run(command, **kwargs):
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=900, **kwargs)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _pin_installed(path: Path) -> Path:
    """Constraints with the version of every distribution here that came from an index (not the
    editable plugins): the wheelhouse holds the libraries this suite tests, which pip's cache has."""
    pins = {f"{dist.metadata['Name']}=={dist.version}" for dist in importlib.metadata.distributions()
            if dist.read_text("direct_url.json") is None}
    path.write_text("".join(f"{pin}\n" for pin in sorted(pins)))
    return path


def _offline_environment(venv: Path) -> dict[str, str]:
    """The environment of a machine with only the wheelhouse: no PYTHONPATH or other PYTHON*
    setting, nothing of this test's virtualenv on PATH, no ENGINE_* plugin selection, and none of
    this machine's pip configuration (its find-links hold a torch wheel)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTHON", "PIP_", "ENGINE_")) and key != "VIRTUAL_ENV"}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no configuration file at all
    path = [entry for entry in env.get("PATH", os.defpath).split(os.pathsep) if not entry.startswith(sys.prefix)]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    return env


def _listed_plugins(output: str) -> dict[str, str]:
    """``engine plugins``' installed plugins: name -> distribution."""
    listed, section = {}, None
    for line in output.splitlines():
        if not line.startswith(" "):
            section = line
        elif section == "installed plugins:":
            name, distribution = line.split()[:2]
            listed[name] = distribution
    return listed


def _two_galore_steps(folder: Path) -> Path:
    folder.mkdir()
    return write_run_file(folder, plugins=["galore", "lion"], sections={"lion": {"z_loss": 1e-4}},
                          max_steps=2, save_strategy="no", **GALORE)


@pytest.mark.alone  # pip resolves against the index: not beside another worker (see pyproject's markers)
def test_a_wheelhouse_installs_offline_into_a_fresh_venv_and_trains(tmp_path):
    # the wheelhouse (~350 MB) and the environment (~1.3 GB) go when the test ends
    with tempfile.TemporaryDirectory(prefix="engine-wheelhouse-test-") as scratch:
        wheelhouse, venv = Path(scratch) / "wheelhouse", Path(scratch) / "venv"
        _run([sys.executable, ROOT / "scripts" / "wheelhouse.py", "--out", wheelhouse,
              "-c", _pin_installed(tmp_path / "installed.txt"), "galore", "lion"], cwd=tmp_path)
        files = {path.name.split("-")[0].lower() for path in wheelhouse.iterdir()}
        assert all(path.suffix == ".whl" for path in wheelhouse.iterdir())
        assert {"engine", "engine_galore", "engine_lion", "galore_torch", "torch", "transformers"} <= files
        assert {name for name in files if name.startswith("engine_")} == {"engine_galore", "engine_lion"}

        env = _offline_environment(venv)
        _run([sys.executable, "-m", "venv", "--without-pip", venv], env=env)
        # this suite's pip installs into it (--python): the same as the venv's own pip, without
        # the seconds ensurepip takes; --no-compile skips byte-compiling torch (a minute on 2 cores)
        _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-compile",
              "--no-index", "--find-links", wheelhouse, "engine[galore]", "engine-lion"], env=env, cwd=tmp_path)

        listed = _listed_plugins(_run([venv / "bin" / "engine", "plugins"], env=env, cwd=tmp_path))
        builtin = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["engine.plugins"]
        assert listed == {**dict.fromkeys(builtin, "engine"), "galore": "engine-galore", "lion": "engine-lion"}
        # where its python finds them (found, not imported: importing torch again takes seconds)
        modules = _run([venv / "bin" / "python", "-c", "from importlib.util import find_spec\n"
                        "for name in ('engine', 'engine_galore', 'engine_lion', 'galore_torch', 'torch'):\n"
                        "    print(find_spec(name).origin)"], env=env, cwd=tmp_path).split()
        assert len(modules) == 5 and all(Path(module).is_relative_to(venv) for module in modules), modules

        _run([venv / "bin" / "engine", "train", _two_galore_steps(tmp_path / "offline")], env=env, cwd=tmp_path)
        # what builds transformers' TrainingArguments (which needs accelerate) works there too
        (tmp_path / "args.json").write_text('{"learning_rate": 0.001, "max_steps": 2, "output_dir": "migrated"}')
        migrated = _run([venv / "bin" / "engine", "migrate", "args.json"], env=env, cwd=tmp_path)
        assert "learning_rate = 0.001" in migrated
        _run([venv / "bin" / "python", "-c", CALLBACK_RUN], env=env, cwd=tmp_path)
        assert (tmp_path / "callback-steps.txt").read_text() == "1 2"

    # the same run with the development install (editable engine, galore and lion, in this
    # process): the same losses and gradient norms
    engine.Run(_two_galore_steps(tmp_path / "dev")).train()
    offline, dev = logged_scalars(tmp_path / "offline" / "out"), logged_scalars(tmp_path / "dev" / "out")
    compared = {key: value for key, value in offline.items() if key[0] in ("loss", "grad_norm")}
    assert sorted(compared) == [("grad_norm", 1), ("grad_norm", 2), ("loss", 1), ("loss", 2)]
    assert compared == pytest.approx({key: dev[key] for key in compared}, rel=1e-5)
