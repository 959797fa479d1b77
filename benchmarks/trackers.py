"""Per-step cost of each tracker plugin: steps/s with the tracker over steps/s with none.

The tiny Llama trains the same steps (same weights, same batches) with no tracker, then with
each tracker plugin installed, offline where the client has an offline mode: ``tensorboard``,
``mlflow`` and ``dagshub`` (against a local ``mlflow server`` over HTTP, started here: the
network case), ``wandb`` (``WANDB_MODE=offline``), ``trackio`` (a temporary local store),
``comet`` (an offline archive), ``clearml`` (an offline session), ``neptune`` and ``swanlab``
(offline mode), ``dvclive`` and ``codecarbon`` (their files), ``azureml`` (the offline run, its
printing silenced), ``flyte`` (inside a local Flyte task) and ``kubeflow`` (a local HTTP server
answering as the controller), at ``logging_steps`` 1 and 10. Steady-state speed: timestamps at the end of every optimizer
step; steps/s = steps / time from the end of step ``--warmup`` to the end of the last, so the
steps that log (and what they leave to later steps) are all in it. The contenders run
interleaved, ``--rounds`` runs each in rotating order; the ratio is the median over rounds of
(tracker steps/s) / (none steps/s) within the round. The same per second of this process's CPU
time (all its threads: a tracker's sending thread counts, W&B's separate service process does
not) is printed too, and the stall ratio: the fastest step seen without a tracker over that
plus the extra time per step the training thread spent in ``log_metrics`` (what a tracker adds
to the step itself; its threads' work is in the CPU ratio), and that time per logged row. On a busy machine, where wall time
jumps between runs, the stall ratio is the figure to read (the CPU ratio, which counts a tracker's
threads, needs a quiet machine and more rounds). Target (issues 14, 32): every tracker >= 0.98x at
logging_steps=10. Always exits 0.

Run::

    .venv/bin/python benchmarks/trackers.py               # ~12 minutes on 2 CPU cores
    .venv/bin/python benchmarks/trackers.py --rounds 5 --steps 300 --only none,mlflow
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import io
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import engine

TRACKERS = ("none", "tensorboard", "mlflow", "wandb", "trackio", "comet", "clearml", "neptune", "swanlab", "dvclive",
            "codecarbon", "dagshub", "azureml", "flyte", "kubeflow")


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

        self.seconds, self.rows = 0.0, 0
        call = IsolatedHooks.call

        def timed(hooks, hook_name, **kwargs):
            start = time.perf_counter()
            try:
                return call(hooks, hook_name, **kwargs)
            finally:
                if hook_name == "log_metrics":
                    self.seconds += time.perf_counter() - start
                    self.rows += 1

        IsolatedHooks.call = timed


LOG_TIMER: LogTimer | None = None


class Controller(http.server.BaseHTTPRequestHandler):
    """Answers the kubeflow plugin's progress updates as the Kubeflow Trainer controller does (200)."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


FLYTE_BODY = None  # what flyte_task trains (flytekit runs only module-level functions as tasks)


def flyte_task() -> None:
    FLYTE_BODY()


def in_flyte_task(train):
    """``train()`` inside a local Flyte task with decks on (the flyte plugin's place)."""
    import flytekit

    global FLYTE_BODY
    FLYTE_BODY = train
    flytekit.task(enable_deck=True, deck_fields=())(flyte_task)()


def tracker_setup(tracker: str, folder: Path, servers: dict[str, str]):
    """(the run's sections, a wrapper the run is called through) for one tracker's offline or local setup."""
    sections = {
        "mlflow": {"mlflow": {"tracking_uri": servers.get("mlflow"), "experiment_name": "benchmark"}},
        "dagshub": {"dagshub": {"tracking_uri": servers.get("mlflow"), "repo_owner": "bench", "repo_name": "bench"}},
        "tensorboard": {"tensorboard": {"logging_dir": str(folder / "tb")}},
        "trackio": {"trackio": {"project": "benchmark"}},
        "comet": {"comet": {"online": False}},
        "clearml": {"clearml": {"offline": True}},
        "neptune": {"neptune": {"mode": "offline"}},
        "swanlab": {"swanlab": {"mode": "offline"}},
        "codecarbon": {"codecarbon": {"country_iso_code": "FRA"}},
        "kubeflow": {"kubeflow": {"server_url": servers.get("kubeflow"), "token_file": servers.get("kubeflow-token")}},
    }.get(tracker, {})
    if tracker == "azureml":  # the offline run prints every metric
        def call(train):
            with contextlib.redirect_stdout(io.StringIO()):
                train()
        return sections, call
    return sections, in_flyte_task if tracker == "flyte" else (lambda train: train())


def steps_per_second(tracker: str, logging_steps: int, args, folder: Path,
                     servers: dict[str, str]) -> tuple[float, float, float, float]:
    """Steps per second of wall time and of this process's CPU time (all its threads), the seconds per
    step the training thread spent in log_metrics, and those seconds per logged row."""
    from engine.testing import run_steps, tiny_dataset, tiny_model

    clock = StepClock()
    LOG_TIMER.seconds, LOG_TIMER.rows = 0.0, 0
    sections, call = tracker_setup(tracker, folder, servers)
    call(lambda: run_steps(
        args.steps, plugins=[] if tracker == "none" else [tracker], objects=[clock], output_dir=folder,
        sections=sections, model=tiny_model(),
        dataset=tiny_dataset(size=args.steps * args.batch_size, seq_len=args.seq_len),
        train={"logging_steps": logging_steps, "per_device_train_batch_size": args.batch_size,
               "save_final_model": False}))
    (wall_start, cpu_start), (wall_end, cpu_end) = clock.times[args.warmup - 1], clock.times[-1]
    steps = len(clock.times) - args.warmup
    return (steps / (wall_end - wall_start), steps / (cpu_end - cpu_start), LOG_TIMER.seconds / len(clock.times),
            LOG_TIMER.seconds / max(LOG_TIMER.rows, 1))


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
    # every client's own folders in the work folder, never the user's home; offline, no account
    (work / "clearml.conf").write_text("sdk.development.report_use_subprocess: false\n")
    os.environ.setdefault("TRACKIO_DIR", str(work / "trackio"))
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", CLEARML_CACHE_DIR=str(work / "clearml"),
                      CLEARML_CONFIG_FILE=str(work / "clearml.conf"), SWANLAB_ROOT=str(work / "swanlab-root"),
                      DVC_SITE_CACHE_DIR=str(work / "dvc-site"), ENGINE_REPORT="off")
    global LOG_TIMER
    LOG_TIMER = LogTimer()
    servers: dict[str, str] = {}
    mlflow_server = controller = None
    if {"mlflow", "dagshub"} & set(trackers):
        from engine_mlflow.server import Server

        mlflow_server = Server(work / "mlflow-server")
        servers["mlflow"] = mlflow_server.uri
    if "kubeflow" in trackers:
        controller = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Controller)
        threading.Thread(target=controller.serve_forever, daemon=True).start()
        servers["kubeflow"] = f"http://127.0.0.1:{controller.server_port}"
        (work / "kubeflow-token").write_text("benchmark-token")
        servers["kubeflow-token"] = str(work / "kubeflow-token")
    cwd = os.getcwd()
    os.chdir(work)  # dvclive makes a git repository's root a DVC repository: not this checkout's
    try:
        results: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
        for round_index in range(args.rounds):
            for logging_steps in (1, 10):
                order = trackers[round_index % len(trackers):] + trackers[:round_index % len(trackers)]
                for tracker in order:
                    folder = work / f"{tracker}-{logging_steps}-{round_index}"
                    measured = steps_per_second(tracker, logging_steps, args, folder, servers)
                    results.setdefault((tracker, logging_steps), []).append(measured)
                    print(f"round {round_index + 1} logging_steps={logging_steps:<3} {tracker:<12} "
                          f"{measured[0]:7.1f} steps/s {measured[1]:7.1f} steps/cpu-s "
                          f"{measured[2] * 1e3:7.3f} ms/step in log_metrics", flush=True)
    finally:
        os.chdir(cwd)
        if mlflow_server is not None:
            mlflow_server.kill()
        if controller is not None:
            controller.shutdown()
    print_table(trackers, results)


def print_table(trackers: list[str], results: dict[tuple[str, int], list[tuple[float, float, float, float]]]) -> None:
    """One row per tracker: its cost per logged row, then each ratio at logging_steps 1 and 10 side by side."""
    # the stall a tracker adds to the training thread, against the fastest step seen without one
    fastest_step = min(1 / r[0] for logging_steps in (1, 10) for r in results["none", logging_steps])
    print(f"\n{'':<12} {'log ms':>7} | {'wall ratio':^17} | {'CPU ratio':^17} | {'stall ratio':^17} |")
    print(f"{'tracker':<12} {'per row':>7} | {'ls=1':>8} {'ls=10':>8} | {'ls=1':>8} {'ls=10':>8} | {'ls=1':>8} "
          f"{'ls=10':>8} | stall >= 0.98x at 10")
    for tracker in trackers:
        per_row = statistics.median(r[3] for r in results[tracker, 1])
        cells = {}
        for logging_steps in (1, 10):
            runs, base = results[tracker, logging_steps], results["none", logging_steps]
            wall, cpu = (statistics.median(r[k] / b[k] for r, b in zip(runs, base)) for k in (0, 1))
            extra = statistics.median(r[2] for r in runs) - statistics.median(b[2] for b in base)
            cells[logging_steps] = wall, cpu, fastest_step / (fastest_step + max(0.0, extra))
        verdict = "" if tracker == "none" else "ok" if cells[10][2] >= 0.98 else "BELOW"  # the stall: see above
        print(f"{tracker:<12} {per_row * 1e3:7.3f} | " + " | ".join(
            f"{cells[1][k]:7.3f}x {cells[10][k]:7.3f}x" for k in range(3)) + f" | {verdict}")
    print(f"(stall ratio: fastest step without a tracker {fastest_step * 1e3:.2f} ms / that plus the extra time "
          "per step the training thread spent in log_metrics; log ms per row includes the builtins' ~0.2 ms)")

if __name__ == "__main__":
    main()
