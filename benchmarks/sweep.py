"""What does ``engine sweep`` cost over running the same trials by hand? Time per trial, side by side.

A small run (the tiny Llama of ``engine.testing`` on a generated corpus, ``--steps`` steps, evaluated
and saved every ``--steps / 2``) and a space over the learning rate (log) and the warmup:

* ``sweep``    ``engine sweep --trials N`` (Optuna, its SQLite study, one trial process at a time);
* ``by hand``  the same N run files (the sweep's ``trial-<n>/run.toml``), each ``engine train`` in turn,
               as a user would run them without a search.

Prints the time per trial of each and the ratio sweep / by hand: the search's own overhead (the study,
the sampler, the reports to the study, the trial's process). The objectives of the sweep and by hand are
checked equal (the same runs).

Run::

    .venv/bin/python benchmarks/sweep.py               # ~4 minutes on 2 CPU cores
    .venv/bin/python benchmarks/sweep.py --trials 8 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.testing import write_evaluated_run_file
from engine.tooling.sweep import trial_objective

SPACE = """\
seed = 0
pruner = "none"
[train]
learning_rate = {{ low = 1e-3, high = 3e-2, log = true }}
warmup_steps = {{ low = 0, high = {warmup} }}
"""


def engine(*args: str) -> float:
    """Seconds one ``engine`` command line took (its output dropped; a failure stops the benchmark)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "engine", *args], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env={**os.environ, "ENGINE_REPORT": "off"})
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    arguments = parser.parse_args()
    steps = arguments.steps
    folder = Path(tempfile.mkdtemp(prefix="engine-bench-sweep-"))
    run_file = write_evaluated_run_file(folder / "base", max_steps=steps, eval_steps=steps // 2,
                                        save_steps=steps // 2, logging_steps=steps // 2)
    space = folder / "space.toml"
    space.write_text(SPACE.format(warmup=steps // 2))
    out = folder / "sweep"

    sweep_seconds = engine("sweep", str(run_file), "--space", str(space), "--trials", str(arguments.trials),
                           "--out", str(out)) / arguments.trials
    summary = json.loads((out / "sweep.json").read_text())
    by_hand = []
    for trial in summary["trials"]:
        again = folder / "by-hand" / trial["folder"]
        by_hand.append(engine("train", str(out / trial["folder"] / "run.toml"), "--set",
                              f"train.output_dir={json.dumps(str(again))}"))
        assert trial_objective(again, None)[0] == trial["objective"], "by hand, the trial found another objective"
    hand_seconds = sum(by_hand) / len(by_hand)

    print(f"{arguments.trials} trials of {steps} steps (tiny Llama, 2-core CPU figures in the closing notes)")
    print(f"{'contender':<34}{'s per trial':>12}")
    print(f"{'engine sweep (a process per trial)':<34}{sweep_seconds:>12.2f}")
    print(f"{'by hand (engine train each)':<34}{hand_seconds:>12.2f}")
    print(f"sweep / by hand: {sweep_seconds / hand_seconds:.3f}x the time per trial")


if __name__ == "__main__":
    main()
