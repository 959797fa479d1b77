"""engine-hub against the filesystem target: each strategy leaves exactly the promised tree, a run
resumed from the remote last-checkpoint/ continues bit for bit, a target that goes away never
stops training, the token is written nowhere, and bad input is one line before training."""

import logging
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import hookimpl
from engine.kit.checkpoint import verify_manifest
from engine.cli import main
from engine.config import to_toml
from engine.errors import PluginError
from engine.layout import FINAL_MARKER, MARKER
from engine.testing import run_steps, tiny_model

TOKEN = "hf_engineHubTestTokenDoNotLeak"
FINAL_FILES = {"config.json", "generation_config.json", "model.safetensors", FINAL_MARKER, "README.md"}
CHECKPOINT_FILES = {"config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                    "rng_state.pt", "engine_state.pt", "trainer_state.json", MARKER}


class Stopper:
    """Asks the loop to stop after step ``stop_at`` (None: never); enabled in every run of a resume
    test, so the checkpoints' plugin lists match."""

    name = "stopper"

    def __init__(self, stop_at=None):
        self.stop_at = stop_at

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.stop_at:
            run.control.request_stop("test")


def tree(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def hub_run(tmp_path, steps=12, name="out", objects=(), train=None, **hub):
    sections = {"hub": {"repo": str(tmp_path / "remote"), "token": TOKEN, "always_push": True, **hub}}
    return run_steps(steps, plugins=["hub"], objects=list(objects), output_dir=tmp_path / name,
                     train={"save_strategy": "steps", "save_steps": 5, **(train or {})}, sections=sections,
                     model=tiny_model(seed=0))


def hub_plugin(run):
    return run.plugin_manager.pm.get_plugin("hub")


@pytest.mark.parametrize("strategy, url", [("end", False), ("every_save", False), ("checkpoint", False),
                                           ("all_checkpoints", False), ("checkpoint", True)])
def test_each_strategy_leaves_exactly_its_tree(tmp_path, strategy, url):
    repo = f"file://{tmp_path / 'remote'}" if url else str(tmp_path / "remote")  # a path or an fsspec URL
    run = hub_run(tmp_path, strategy=strategy, repo=repo)
    out, remote = tmp_path / "out", tmp_path / "remote"
    expected = set(FINAL_FILES)
    if strategy == "checkpoint":
        expected |= {f"last-checkpoint/{name}" for name in CHECKPOINT_FILES}
    if strategy == "all_checkpoints":
        expected |= {f"checkpoint-{step}/{name}" for step in (5, 10) for name in CHECKPOINT_FILES}
    assert tree(remote) == expected
    # the root holds the final model, byte for byte, and its manifest checks out there
    for name in FINAL_FILES - {"README.md"}:
        assert (remote / name).read_bytes() == (out / name).read_bytes(), name
    verify_manifest(remote, FINAL_MARKER)
    for folder in ["last-checkpoint"] * (strategy == "checkpoint") + ["checkpoint-5", "checkpoint-10"] * (
            strategy == "all_checkpoints"):
        local = out / ("checkpoint-10" if folder == "last-checkpoint" else folder)
        assert all((remote / folder / n).read_bytes() == (local / n).read_bytes() for n in CHECKPOINT_FILES)
        verify_manifest(remote / folder)
    # pushed during training at each save (always_push), then the final model at step 12
    assert hub_plugin(run).pushed == ([12] if strategy == "end" else [5, 10, 12])
    card = (remote / "README.md").read_text()
    assert "hub" in card and "train_loss" in card and 'strategy = "' + strategy in card
    assert not (out / ".tmp-hub").exists()  # the snapshots pushed are gone


def test_every_save_pushes_the_model_not_the_training_state_while_training(tmp_path):
    seen = {}

    class Peek:
        name = "peek"

        @hookimpl
        def on_step_end(self, run):  # the push of step 5 has landed before step 9 looks
            if run.state.global_step == 9:
                hub_plugin(run).pusher.wait()
                weights = load_file(tmp_path / "remote" / "model.safetensors")
                seen.update(files=tree(tmp_path / "remote"), weights={k: v.clone() for k, v in weights.items()})

    run = hub_run(tmp_path, objects=[Peek()], strategy="every_save")
    assert seen["files"] == {"config.json", "generation_config.json", "model.safetensors"}
    at_step_5 = load_file(tmp_path / "out" / "checkpoint-5" / "model.safetensors")
    assert all(torch.equal(seen["weights"][k], at_step_5[k]) for k in at_step_5)
    assert hub_plugin(run).pushed == [5, 10, 12]


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_resume_from_the_remote_last_checkpoint_is_bit_exact(tmp_path):
    train = {"save_steps": 5, "max_steps": 20}
    hub_run(tmp_path, 20, name="whole", objects=[Stopper()], train=train, strategy="checkpoint",
            repo=str(tmp_path / "remote-whole"))
    hub_run(tmp_path, 20, name="first", objects=[Stopper(10)], train=train, strategy="checkpoint")
    remote = tmp_path / "remote"
    assert (remote / "last-checkpoint" / MARKER).is_file()
    resumed = hub_run(tmp_path, 20, name="second", objects=[Stopper()], strategy="checkpoint",
                      train={**train, "resume_from_checkpoint": "hub"})
    assert resumed.state.global_step == 20
    whole, second = final_weights(tmp_path / "whole"), final_weights(tmp_path / "second")
    assert whole.keys() == second.keys() and all(torch.equal(whole[k], second[k]) for k in whole)
    import json

    record = json.loads((tmp_path / "second" / "run.json").read_text())
    first_record = json.loads((tmp_path / "first" / "run.json").read_text())
    assert record["run_id"] == first_record["run_id"]  # the same run, continued elsewhere
    assert record["starts"][0]["step"] == 10
    assert not (tmp_path / "second" / ".tmp-hub-checkpoint").exists()  # the download is removed at the end
    # the repo now holds the resumed run's last checkpoint
    assert json.loads((remote / "last-checkpoint" / "trainer_state.json").read_text())["global_step"] == 20


class Saboteur:
    """Replaces the target folder with a file once the first push has landed: every later push fails."""

    name = "saboteur"

    def __init__(self, remote: Path, at_step: int):
        self.remote, self.at_step = remote, at_step

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.at_step:
            hub_plugin(run).pusher.wait()
            shutil.rmtree(self.remote)
            self.remote.write_text("not a folder any more")


def test_a_target_gone_mid_run_never_stops_training(tmp_path, caplog, capfd):
    remote = tmp_path / "remote"
    with caplog.at_level(logging.DEBUG, logger="engine"):
        run = hub_run(tmp_path, 15, objects=[Saboteur(remote, 7)], strategy="checkpoint", retries=2,
                      retry_delay=0.01)
    out = tmp_path / "out"
    assert run.state.global_step == 15
    for step in (5, 10, 15):  # every local checkpoint and the final model intact
        verify_manifest(out / f"checkpoint-{step}")
    verify_manifest(out, FINAL_MARKER)
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "hub" in r.getMessage()]
    assert len(failed) == 1, failed
    assert "3 push(es)" in failed[0] and "intact" in failed[0] and "step 10" in failed[0]
    assert hub_plugin(run).pushed == [5]
    assert run.isolated_hooks.failed == {}  # reported, not switched off
    captured = capfd.readouterr()
    logs = "\n".join(r.getMessage() for r in caplog.records) + captured.out + captured.err
    assert TOKEN not in logs
    for path in [*out.rglob("*"), *tmp_path.glob("*")]:
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


class Killer:
    """Kills the upload process after step ``at_step``, once the pushes before are done."""

    name = "killer"

    def __init__(self, at_step):
        self.at_step = at_step

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.at_step:
            hub_plugin(run).pusher.wait()
            process = hub_plugin(run).pusher.process
            process.kill()
            process.wait()


def test_an_upload_process_killed_mid_run_is_reported_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="engine"):
        run = hub_run(tmp_path, 15, objects=[Killer(7)], strategy="checkpoint")
    assert run.state.global_step == 15
    verify_manifest(tmp_path / "out" / "checkpoint-15")
    failed = [r.getMessage() for r in caplog.records if "hub" in r.getMessage()]
    assert len(failed) == 1 and "3 push(es)" in failed[0] and "the upload process ended" in failed[0], failed
    assert hub_plugin(run).pushed == [5]


def test_strict_makes_a_failed_push_end_the_run(tmp_path):
    remote = tmp_path / "remote"
    with pytest.raises(PluginError, match="hub"):
        hub_run(tmp_path, 15, objects=[Saboteur(remote, 7)], strategy="checkpoint", retries=0, strict=True)
    verify_manifest(tmp_path / "out" / "checkpoint-5")


def test_the_token_is_masked_in_every_file_the_run_writes(tmp_path):
    run = hub_run(tmp_path, 6, strategy="checkpoint")
    assert run.config.section("hub").token == TOKEN  # the plugin still has it
    assert "***" in run.plan() and TOKEN not in run.plan()
    for folder in (tmp_path / "out", tmp_path / "remote"):
        for path in folder.rglob("*"):
            if path.is_file():
                assert TOKEN.encode() not in path.read_bytes(), path
    assert '"token": "***"' in (tmp_path / "out" / "hyperparams.json").read_text()


# ---------------------------------------------------------------------------- bad input


@pytest.fixture
def cli(tmp_path, capfd, monkeypatch):
    """``cli(hub_section, **train)`` runs ``engine train`` in-process: (status, stderr lines)."""
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))

    def run(hub, **train):
        config = {"plugins": ["hub"], "train": {"max_steps": 2, "output_dir": str(tmp_path / "out"),
                                                "disable_tqdm": True, **train},
                  "data": {"train": "missing-corpus.txt"}, "hub": hub}
        (tmp_path / "run.toml").write_text(to_toml(config))
        capfd.readouterr()
        status = main(["train", "run.toml"])
        return status, [line for line in capfd.readouterr().err.splitlines() if line.strip()]

    return run


@pytest.mark.parametrize("hub, train, fragment", [
    ({"repo": "not a repo id!"}, {}, "hub.repo: 'not a repo id!' is neither a Hub repo id"),
    ({"repo": "user/../model"}, {}, "is neither a Hub repo id"),
    ({"repo": "./blocker/remote"}, {}, "hub.repo: cannot write to ./blocker/remote"),
    ({"repo": "user/model", "private": True}, {}, "hub.private = true needs a token"),
    ({"repo": "zephyr-7b-sft-full"}, {}, "hub.repo: 'zephyr-7b-sft-full' goes under your Hub namespace (as "
     "Trainer's hub_model_id does), which needs a token to know"),
    ({"repo": "./remote", "strategy": "checkpoint"}, {"resume_from_checkpoint": "hub"},
     "has no last-checkpoint/ (pushed by hub.strategy = 'checkpoint')"),
])
def test_bad_input_is_one_line_before_training(cli, tmp_path, hub, train, fragment):
    (tmp_path / "blocker").write_text("a file where the target's parent folder should be")
    (tmp_path / "remote").mkdir()
    status, err = cli(hub, **train)
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("engine: error: "), err
    assert fragment in err[0], err[0]
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written


def test_a_hub_that_never_answers_is_refused_within_connect_timeout(cli, tmp_path, monkeypatch):
    """huggingface_hub's API calls have no timeout: create_repo used to wait forever, saying nothing."""
    import huggingface_hub.constants

    silent = socket.socket()  # connections queue up in its backlog; nothing ever answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # a user's online setup
    try:
        status, err = cli({"repo": "user/model", "token": TOKEN, "connect_timeout": 2})
    finally:
        silent.close()
    assert status == 2
    assert err == [f"engine: hub: connecting to {url} (timeout 2 s)",
                   "engine: error: hub.repo: cannot create or reach the Hub repo user/model: ConnectionError: hub: "
                   f"{url} did not answer within 2 s (hub.connect_timeout)"]
    assert not (tmp_path / "out").exists()


def test_the_upload_process_starts_without_torch():
    # it unpickles the plugin's jobs, so it imports this package: torch there cost ~3 s of CPU taken from the
    # steps of every run (0.957x steps/s with a push every 10 steps in benchmarks/hub.py, 0.986x without)
    import json
    import subprocess
    import sys

    code = "import engine_hub.worker, sys, json; print(json.dumps(sorted(sys.modules)))"
    modules = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                        check=True).stdout)
    assert "engine_hub.targets" in modules and "torch" not in modules
