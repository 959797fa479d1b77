"""The Hugging Face target without network: real ``huggingface_hub`` calls (create_repo,
create_branch, upload_folder's preupload + commit, list_repo_files, snapshot_download) against the
local server of fake_hub.py, which records what arrives. Checked: the repo id, the branch
(revision), the paths in the repo, the ignore patterns (no training state at the root), the commit
messages, the token only in the Authorization header, and a resume from the repo's last-checkpoint/.

The runs go in a child process: ``huggingface_hub`` reads ``HF_ENDPOINT`` when it is imported.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.kit.checkpoint import verify_manifest
from engine.layout import FINAL_MARKER, MARKER

sys.path.insert(0, str(Path(__file__).parent))  # the fake server next to this file (importlib mode)
from fake_hub import serve  # noqa: E402

TOKEN = "hf_fakeHubTokenNeverWritten"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors"}
CHECKPOINT_FILES = MODEL_FILES | {"optimizer.pt", "scheduler.pt", "rng_state.pt", "engine_state.pt",
                                  "trainer_state.json", MARKER}

CHILD = """
import sys
from engine.testing import run_steps, tiny_model

out, token = sys.argv[1], sys.argv[2]
hub = {"repo": "user/tiny-model", "strategy": "checkpoint", "revision": "dev", "token": token, "always_push": True,
       "private": True}
run_steps(12, plugins=["hub"], output_dir=out + "/first", model=tiny_model(seed=0), sections={"hub": hub},
          train={"save_strategy": "steps", "save_steps": 5, "max_steps": 12})
resumed = run_steps(15, plugins=["hub"], output_dir=out + "/second", model=tiny_model(seed=0),
                    sections={"hub": {**hub, "token": None}},  # from HF_TOKEN this time
                    train={"save_strategy": "steps", "save_steps": 5, "max_steps": 15,
                           "resume_from_checkpoint": "hub"})
print("ended at", resumed.state.global_step)
"""


def test_pushes_and_resume_through_the_hub_api(tmp_path):
    hub, server = serve()
    try:
        # the root conftest sets HF_HUB_OFFLINE=1 for the suite; this endpoint is a local server
        env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
               "HF_HOME": str(tmp_path / "hf"),
               "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), TOKEN], env=env, capture_output=True,
                              text=True, timeout=600)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ended at 15" in done.stdout

    assert list(hub.repos) == ["user/tiny-model"] and hub.private["user/tiny-model"] is True
    assert hub.files("user/tiny-model") == {}  # everything went to the branch
    files = hub.files("user/tiny-model", "dev")
    assert set(files) == MODEL_FILES | {FINAL_MARKER, "README.md"} | {f"last-checkpoint/{n}" for n in CHECKPOINT_FILES}
    second = tmp_path / "second"
    for name in MODEL_FILES | {FINAL_MARKER}:  # the resumed run's final model, byte for byte
        assert files[name] == (second / name).read_bytes(), name
    for name in CHECKPOINT_FILES:
        assert files[f"last-checkpoint/{name}"] == (second / "checkpoint-15" / name).read_bytes(), name

    commits = [(c.branch, c.message, sorted(c.added)) for c in hub.commits]
    at_root = sorted(MODEL_FILES)
    last = sorted(f"last-checkpoint/{n}" for n in CHECKPOINT_FILES)
    assert commits == [
        # first run: per save, the model at the root (training state ignored), then the whole checkpoint
        ("dev", "Training in progress, step 5", at_root), ("dev", "Training in progress, step 5", last),
        ("dev", "Training in progress, step 10", at_root), ("dev", "Training in progress, step 10", last),
        ("dev", "End of training", sorted([*MODEL_FILES, FINAL_MARKER, "README.md"])),
        # the resumed run: step 15 is both its last save and its end
        ("dev", "Training in progress, step 15", at_root), ("dev", "Training in progress, step 15", last),
        ("dev", "End of training", sorted([*MODEL_FILES, FINAL_MARKER, "README.md"])),
    ]
    assert all(not c.deleted for c in hub.commits)  # last-checkpoint/ replaced file for file
    # every call carried the token, and only in its header; nothing the runs wrote holds it
    api_calls = [a for r, a in zip(hub.requests, hub.authorizations) if "/user/tiny-model" in r or "/repos/" in r]
    assert api_calls and all(a == f"Bearer {TOKEN}" for a in api_calls)
    assert TOKEN not in done.stdout + done.stderr
    for folder in (tmp_path / "first", second):
        for path in folder.rglob("*"):
            assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path
    assert all(TOKEN.encode() not in data for data in files.values())
    assert len(hub.validated) == 2 and "library_name: transformers" in hub.validated[0]
    card = files["README.md"].decode()
    assert '# token = (unset)' in card and 'revision = "dev"' in card  # the resumed run read HF_TOKEN
    record = json.loads((second / "run.json").read_text())
    assert record["starts"][0]["step"] == 10  # from the repo's last-checkpoint/ (checkpoint-10)
    assert record["run_id"] == json.loads((tmp_path / "first" / "run.json").read_text())["run_id"]
    verify_manifest(second / "checkpoint-15")
    assert not (second / ".tmp-hub-checkpoint").exists()


def test_an_unreachable_hub_is_one_line_before_training(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    (tmp_path / "run.toml").write_text(
        'plugins = ["hub"]\n[train]\nmax_steps = 2\noutput_dir = "out"\n[hub]\nrepo = "user/model"\n'
        'token = "' + TOKEN + '"\n')
    done = subprocess.run([sys.executable, "-m", "engine", "train", "run.toml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("engine: error: hub.repo: cannot create or reach the Hub repo "
                                               "user/model"), err
    assert TOKEN not in done.stderr + done.stdout
    assert not Path(tmp_path / "out").exists()


BARE_NAME_CHILD = """
import sys
from engine.testing import run_steps, tiny_model

run_steps(2, plugins=["hub"], output_dir=sys.argv[1], model=tiny_model(seed=0),
          sections={"hub": {"repo": "zephyr-7b-sft-full", "strategy": "end"}})
"""


def test_a_bare_repo_name_goes_under_the_token_owners_namespace_as_trainers_hub_model_id(tmp_path):
    hub, server = serve()
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
               "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_TELEMETRY": "1",
               "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", BARE_NAME_CHILD, str(tmp_path / "out")], env=env,
                              capture_output=True, text=True, timeout=600)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine: hub.repo 'zephyr-7b-sft-full' is user/zephyr-7b-sft-full" in done.stderr
    assert list(hub.repos) == ["user/zephyr-7b-sft-full"]
    assert MODEL_FILES | {FINAL_MARKER, "README.md"} <= set(hub.files("user/zephyr-7b-sft-full"))
