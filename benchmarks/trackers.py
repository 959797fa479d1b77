"""Per-step cost of each tracker plugin: steps/s with the tracker over steps/s with none.

The tiny Llama trains the same steps (same weights, same batches) with no tracker, then with
each of ``tensorboard``, ``mlflow`` (against a local ``mlflow server`` over HTTP, started here:
the network case), ``wandb`` (``WANDB_MODE=offline``) and ``trackio`` (a temporary local store),
at ``logging_steps`` 1 and 10. Steady-state speed: timestamps at the end of every optimizer
step; steps/s = steps / time from the end of step ``--warmup`` to the end of the last, so the
steps that log (and what they leave to later steps) are all in it. The contenders run
interleaved, ``--rounds`` runs each in rotating order; the ratio is the median over rounds of
(tracker steps/s) / (none steps/s) within the round. Target (issue 14): every tracker >= 0.98x
at logging_steps=10. Always exits 0.

Run::

    .venv/bin/python benchmarks/trackers.py               # ~3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/trackers.py --rounds 5 --steps 300 --only none,mlflow
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import engine

TRACKERS = ("none", "tensorboard", "mlflow", "wandb", "trackio")


class StepClock:
    name = "clock"

    def __init__(self):
        self.times: list[float] = []

    @engine.hookimpl
    def on_step_end(self, run):
        self.times.append(time.perf_counter())


def steps_per_second(tracker: str, logging_steps: int, args, folder: Path, mlflow_uri: str) -> float:
    from engine.testing import run_steps, tiny_dataset, tiny_model

    clock = StepClock()
    sections = {}
    if tracker == "mlflow":
        sections["mlflow"] = {"tracking_uri": mlflow_uri, "experiment_name": "benchmark"}
    if tracker == "tensorboard":
        sections["tensorboard"] = {"logging_dir": str(folder / "tb")}
    if tracker == "trackio":
        sections["trackio"] = {"project": "benchmark"}
    run_steps(args.steps, plugins=[] if tracker == "none" else [tracker], objects=[clock], output_dir=folder,
              sections=sections, model=tiny_model(), dataset=tiny_dataset(size=args.steps * args.batch_size,
                                                                          seq_len=args.seq_len),
              train={"logging_steps": logging_steps, "per_device_train_batch_size": args.batch_size,
                     "save_final_model": False})
    steady = clock.times[args.warmup - 1:]
    return (len(steady) - 1) / (steady[-1] - steady[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default=",".join(TRACKERS), help="comma-separated, from " + ", ".join(TRACKERS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trackers = [name for name in args.only.split(",") if name]
    if "none" not in trackers:
        trackers.insert(0, "none")
    work = Path(tempfile.mkdtemp(prefix="engine-bench-trackers-"))
    os.environ.setdefault("TRACKIO_DIR", str(work / "trackio"))
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    server = None
    if "mlflow" in trackers:
        from engine_mlflow.server import Server

        server = Server(work / "mlflow-server")
    try:
        results: dict[tuple[str, int], list[float]] = {}
        for round_index in range(args.rounds):
            for logging_steps in (1, 10):
                order = trackers[round_index % len(trackers):] + trackers[:round_index % len(trackers)]
                for tracker in order:
                    folder = work / f"{tracker}-{logging_steps}-{round_index}"
                    speed = steps_per_second(tracker, logging_steps, args, folder, server.uri if server else "")
                    results.setdefault((tracker, logging_steps), []).append(speed)
                    print(f"round {round_index + 1} logging_steps={logging_steps:<3} {tracker:<12} "
                          f"{speed:7.1f} steps/s", flush=True)
    finally:
        if server is not None:
            server.kill()
    print(f"\n{'tracker':<12} {'logging_steps':>13} {'steps/s':>9} {'ratio vs none':>14}")
    for logging_steps in (1, 10):
        base = results["none", logging_steps]
        for tracker in trackers:
            speeds = results[tracker, logging_steps]
            ratio = statistics.median(s / b for s, b in zip(speeds, base))
            verdict = "" if tracker == "none" or logging_steps != 10 else ("  ok" if ratio >= 0.98 else "  BELOW 0.98")
            print(f"{tracker:<12} {logging_steps:>13} {statistics.median(speeds):9.1f} {ratio:13.3f}x{verdict}")


if __name__ == "__main__":
    main()
