"""How long the engine's commands take to start, against a bare ``python -c "import torch, transformers"``.

Each command runs ``--repeats`` times (default 5) in a fresh process, interleaved in rotating order so
that load on the machine falls on all of them alike, and the table gives the median wall time, the
median extra seconds over the bare import and their ratio:

* ``import torch, transformers``  the yardstick: what any training script pays before its first line;
* ``engine --help``;
* ``engine plugins``              every installed plugin listed;
* ``engine plan``                 the embedded default run's plan (no weights loaded);
* ``engine plan (all plugins)``   a run enabling every first-party plugin that composes with the others
                                  (all but the ones named in ``CONFLICTING``);
* ``engine migrate``              a ``TrainingArguments.to_json_file()`` dump converted to a run file;
* ``engine train (2 steps)``      the default run, 2 steps, its final model and report written: a
                                  process that trains and saves once (as every subprocess test does).

``--compare REV`` also times a checkout of git revision ``REV`` (a temporary worktree whose engine and
plugin folders go first on ``PYTHONPATH``) in the same rounds: the before / after table.

Run::

    .venv/bin/python benchmarks/startup.py                      # ~3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/startup.py --compare e5fcb42    # before (e5fcb42) and after, ~6 minutes
    .venv/bin/python benchmarks/startup.py --only plan,migrate --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.catalogue import FIRST_PARTY

ROOT = Path(__file__).resolve().parent.parent
BARE = "import torch, transformers"
# Plugins that take the place of another of the same kind, so a run may enable one of each group only.
CONFLICTING = {"kto", "orpo", "cpo", "reward",  # dpo stands for the preference plugins
               "fsdp", "deepspeed",  # ddp for the strategies
               "liger",  # patches a model for a GPU kernel library (triton)
               "kubeflow",  # reports to a Kubeflow controller: only inside a TrainJob
               "flyte"}  # only inside a Flyte task
# What the plugins of that run need to plan it: dpo preference pairs, hub a target (a local folder: no network),
# dagshub its repository.
ALL_PLUGIN_OPTIONS = """
[train]
output_dir = "all-out"
[data]
train = "{pairs}"
packing = false
[hub]
repo = "{hub}"
[dagshub]
repo_owner = "someone"
repo_name = "something"
"""
ARGS_JSON = {"output_dir": "out", "learning_rate": 2e-5, "num_train_epochs": 1, "per_device_train_batch_size": 4,
             "gradient_accumulation_steps": 2, "warmup_ratio": 0.1, "logging_steps": 5, "report_to": "none"}


def commands(work: Path) -> dict[str, list[str]]:
    """Each measured command, as arguments to the Python interpreter."""
    (work / "args.json").write_text(json.dumps(ARGS_JSON))
    every = sorted(name for name in FIRST_PARTY if name not in CONFLICTING)
    (work / "all.toml").write_text(f"plugins = {json.dumps(every)}\n" + ALL_PLUGIN_OPTIONS.format(
        pairs=ROOT / "examples" / "data" / "reversal_preferences.jsonl", hub=work / "hub-repo"))
    return {
        BARE: ["-c", "import torch, transformers"],
        "engine --help": ["-m", "engine", "--help"],
        "engine plugins": ["-m", "engine", "plugins"],
        "engine plan": ["-m", "engine", "plan"],
        "engine plan (all plugins)": ["-m", "engine", "plan", "all.toml"],
        "engine migrate": ["-m", "engine", "migrate", "args.json", "-o", "run.toml", "--force"],
        "engine train (2 steps)": ["-m", "engine", "train", "--set", "train.max_steps=2",
                                   "--set", "train.output_dir=train-out", "--set", "train.overwrite_output_dir=true"],
    }


def timed(arguments: list[str], work: Path, source: Path | None) -> float:
    """Seconds one fresh interpreter takes to run ``arguments`` in ``work``; exits non-zero are fatal."""
    env = dict(os.environ)
    if source is not None:  # that checkout's engine and plugins ahead of the installed ones (same entry points)
        paths = [str(source), *map(str, sorted((source / "plugins").glob("*"))), env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *arguments], cwd=work, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(arguments)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def worktree(revision: str, folder: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), revision],
                   check=True, capture_output=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", help="comma-separated words a command's name must contain (e.g. plan,migrate)")
    parser.add_argument("--compare", metavar="REV", help="also time git revision REV (before / after)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        measured = commands(work)
        if args.only:
            words = args.only.split(",")
            measured = {name: argv for name, argv in measured.items()
                        if name == BARE or any(word in name for word in words)}
        checkouts = {"now": None}
        if args.compare:
            checkouts = {args.compare: worktree(args.compare, work / "before"), "now": None}
        times: dict[tuple[str, str], list[float]] = {}
        try:
            for repeat in range(args.repeats):
                order = [(label, name) for label in checkouts for name in measured
                         if label == "now" or name != BARE]  # the bare import is the same in both
                shift = repeat % len(order)
                for label, name in order[shift:] + order[:shift]:
                    seconds = timed(measured[name], work, checkouts[label])
                    times.setdefault((label, name), []).append(seconds)
                print(f"round {repeat + 1}/{args.repeats} done", file=sys.stderr)
        finally:
            if args.compare:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "before")],
                               capture_output=True)

    bare = statistics.median(times[("now", BARE)])
    print(f"\nmedian of {args.repeats}, seconds; extra = over the bare import ({bare:.2f} s)")
    header = ["command"] + [f"{label} {column}" for label in checkouts for column in ("s", "extra s", "x bare")]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for name in measured:
        cells = [name]
        for label in checkouts:
            median = statistics.median(times[(label if name != BARE else "now", name)])
            cells += [f"{median:.2f}", f"{median - bare:+.2f}", f"{median / bare:.2f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
