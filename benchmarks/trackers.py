"""Per-step cost of each tracker plugin: steps/s with the tracker over steps/s with none.

The tiny Llama trains the same steps (same weights, same batches) with no tracker, then with
each of ``tensorboard``, ``mlflow`` (against a local ``mlflow server`` over HTTP, started here:
the network case), ``wandb`` (``WANDB_MODE=offline``) and ``trackio`` (a temporary local store),
at ``logging_steps`` 1 and 10. Steady-state speed: timestamps at the end of every optimizer
step; steps/s = steps / time from the end of step ``--warmup`` to the end of the last, so the
steps that log (and what they leave to later steps) are all in it. The contenders run
interleaved, ``--rounds`` runs each in rotating order; the ratio is the median over rounds of
(tracker steps/s) / (none steps/s) within the round. The same per second of this process's CPU
time (all its threads: a tracker's sending thread counts, W&B's separate service process does
not) is printed too, and the stall ratio: the fastest step seen without a tracker over that
plus the extra time per step the training thread spent in ``log_metrics`` (what a tracker adds
to the step itself; its threads' work is in the CPU ratio). On a busy machine, where wall time
jumps between runs, the stall ratio is the figure to read. Target (issue 14): every tracker >= 0.98x
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
        self.times: list[tuple[float, float]] = []

    @engine.hookimpl
    def on_step_end(self, run):
        self.times.append((time.perf_counter(), time.process_time()))


class LogTimer:
    """Wall time the training thread spends in the log_metrics hooks (all plugins, builtins too)."""

    def __init__(self):
        from engine.plugins import IsolatedHooks

        self.seconds = 0.0
        call = IsolatedHooks.call

        def timed(hooks, hook_name, **kwargs):
            start = time.perf_counter()
            try:
                return call(hooks, hook_name, **kwargs)
            finally:
                if hook_name == "log_metrics":
                    self.seconds += time.perf_counter() - start

        IsolatedHooks.call = timed


LOG_TIMER: LogTimer | None = None


def steps_per_second(tracker: str, logging_steps: int, args, folder: Path,
                     mlflow_uri: str) -> tuple[float, float, float]:
    """Steps per second of wall time and of this process's CPU time (all its threads), and the
    seconds per step the training thread spent in log_metrics."""
    from engine.testing import run_steps, tiny_dataset, tiny_model

    clock = StepClock()
    LOG_TIMER.seconds = 0.0
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
    (wall_start, cpu_start), (wall_end, cpu_end) = clock.times[args.warmup - 1], clock.times[-1]
    steps = len(clock.times) - args.warmup
    return steps / (wall_end - wall_start), steps / (cpu_end - cpu_start), LOG_TIMER.seconds / len(clock.times)


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
    global LOG_TIMER
    LOG_TIMER = LogTimer()
    server = None
    if "mlflow" in trackers:
        from engine_mlflow.server import Server

        server = Server(work / "mlflow-server")
    try:
        results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        for round_index in range(args.rounds):
            for logging_steps in (1, 10):
                order = trackers[round_index % len(trackers):] + trackers[:round_index % len(trackers)]
                for tracker in order:
                    folder = work / f"{tracker}-{logging_steps}-{round_index}"
                    measured = steps_per_second(tracker, logging_steps, args, folder, server.uri if server else "")
                    results.setdefault((tracker, logging_steps), []).append(measured)
                    print(f"round {round_index + 1} logging_steps={logging_steps:<3} {tracker:<12} "
                          f"{measured[0]:7.1f} steps/s {measured[1]:7.1f} steps/cpu-s "
                          f"{measured[2] * 1e3:7.3f} ms/step in log_metrics", flush=True)
    finally:
        if server is not None:
            server.kill()
    # the stall a tracker adds to the training thread, against the fastest step seen without one
    fastest_step = min(1 / r[0] for logging_steps in (1, 10) for r in results["none", logging_steps])
    print(f"\n{'tracker':<12} {'logging_steps':>13} {'steps/s':>8} {'ratio':>7} {'steps/cpu-s':>11} {'ratio':>7} "
          f"{'log ms/step':>11} {'stall ratio':>11}")
    for logging_steps in (1, 10):
        base = results["none", logging_steps]
        base_log = statistics.median(b[2] for b in base)
        for tracker in trackers:
            runs = results[tracker, logging_steps]
            ratios = [statistics.median(r[k] / b[k] for r, b in zip(runs, base)) for k in (0, 1)]
            log = statistics.median(r[2] for r in runs)
            stall = fastest_step / (fastest_step + max(0.0, log - base_log))
            verdict = "" if tracker == "none" or logging_steps != 10 else ("  ok" if stall >= 0.98 else "  BELOW 0.98")
            print(f"{tracker:<12} {logging_steps:>13} {statistics.median(r[0] for r in runs):8.1f} {ratios[0]:6.3f}x "
                  f"{statistics.median(r[1] for r in runs):11.1f} {ratios[1]:6.3f}x {log * 1e3:11.3f} "
                  f"{stall:10.3f}x{verdict}")
    print(f"(stall ratio: fastest step without a tracker {fastest_step * 1e3:.2f} ms / that plus the extra time "
          "per step the training thread spent in log_metrics)")


if __name__ == "__main__":
    main()
