"""Do background pushes (engine-hub) slow training down? Step time with pushing on vs off.

The tiny Llama of ``engine.testing`` (same weights, data and hyper-parameters), a checkpoint every
``--save-steps`` steps, trained ``--steps`` steps by three contenders:

* ``off``   no hub plugin (the saves only);
* ``on``    hub ``strategy = "checkpoint"`` to a local folder (each save pushes the model to the
            root and the whole checkpoint to last-checkpoint/);
* ``slow``  the same to an fsspec filesystem that sleeps ``--delay`` s per file written, so a push
            takes far longer than the steps between two saves: steps must not wait for it (a
            push is skipped while the previous one uploads, as in Trainer).

Measured per run from a timestamp at the end of every optimizer step (an ``on_step_end`` hook):
the mean step time over the run (save steps included) after the first ``--warmup`` steps (the
upload process starts with training, ~0.2 s of CPU once per run, which on a busy 2-core machine
slows the first steps of a short run; it is reported in the CPU figure below), the
slowest step, the CPU time of the upload process (engine-hub uploads in a process of its own), and the time from the last step to the end of ``train()`` (the final save, the
push of the final model and the wait for pending pushes). The contenders run interleaved for
``--rounds`` rounds in rotating order; the table gives medians over rounds and the ratio
steps/s on / off (median over rounds of the ratio within a round). Target (from the issue):
on >= 0.97x off; with the slow target the slowest step stays far below one push.

Run::

    .venv/bin/python benchmarks/hub.py                 # ~3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/hub.py --rounds 10 --steps 200 --delay 0.5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import os
import resource
import sys

import fsspec
import torch

from engine import Run, hookimpl
from engine.builtin.data.collators import DataCollator
from engine.testing import tiny_dataset, tiny_model

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
from slow_filesystem import SlowFileSystem  # noqa: E402  (importable by the upload process too)

CONTENDERS = ("off", "on", "slow")


class Stamps:
    name = "stamps"

    def __init__(self):
        self.times: list[float] = []

    @hookimpl
    def on_step_end(self, run):
        self.times.append(time.perf_counter())


def train_once(contender: str, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    stamps = Stamps()
    config = {
        "plugins": [] if contender == "off" else ["hub"],
        "train": {"max_steps": args.steps, "per_device_train_batch_size": 8, "learning_rate": 1e-3,
                  "logging_steps": args.steps, "save_strategy": "steps", "save_steps": args.save_steps,
                  "save_total_limit": 2, "disable_tqdm": True, "output_dir": str(folder / "out")},
    }
    if contender != "off":
        repo = str(folder / "remote") if contender == "on" else f"slow://{folder / 'remote'}"
        config["hub"] = {"repo": repo, "strategy": "checkpoint"}
    run = Run(config, model=tiny_model(seed=0), train_dataset=tiny_dataset(size=256, seq_len=32),
              data_collator=DataCollator(0), plugins=[stamps])
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    run.train()
    ended = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the upload process, ended and waited for
    timed = stamps.times[args.warmup:]  # the upload process starts with training: in the warm-up
    steps = [b - a for a, b in zip(timed, timed[1:])]
    result = {"mean_ms": 1000 * statistics.mean(steps), "max_ms": 1000 * max(steps),
              "end_s": ended - stamps.times[-1]}
    if contender != "off":
        pushed = run.plugin_manager.pm.get_plugin("hub").pushed
        result["pushes"] = len(pushed)
        result["push_cpu_s"] = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
        result["train_s"] = stamps.times[-1] - stamps.times[0]  # all steps: the process runs through them all
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30, help="first steps left out of the step times")
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.5, help="seconds the slow target sleeps per file")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["ENGINE_BENCH_SLOW_DELAY"] = str(args.delay)
    fsspec.register_implementation("slow", SlowFileSystem, clobber=True)

    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="engine-bench-hub-") as tmp:
        train_once("off", args, Path(tmp) / "warmup")  # torch's first-use costs are nobody's
        for round_index in range(args.rounds):
            order = CONTENDERS[round_index % 3:] + CONTENDERS[:round_index % 3]
            for name in order:
                result = train_once(name, args, Path(tmp) / f"{name}-{round_index}")
                results[name].append(result)
                print(f"round {round_index + 1} {name:>4}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()),
                      flush=True)

    print(f"\n{args.steps} steps, a checkpoint every {args.save_steps}, {args.rounds} rounds "
          f"(slow target: {args.delay} s per file)")
    print(f"{'':>5} {'steps/s':>9} {'mean ms':>9} {'max ms':>9} {'end s':>7} {'pushes':>7}")
    for name in CONTENDERS:
        mean = statistics.median(r["mean_ms"] for r in results[name])
        worst = statistics.median(r["max_ms"] for r in results[name])
        end = statistics.median(r["end_s"] for r in results[name])
        pushes = statistics.median(r.get("pushes", 0) for r in results[name])
        print(f"{name:>5} {1000 / mean:>9.2f} {mean:>9.2f} {worst:>9.1f} {end:>7.2f} {pushes:>7g}")
    for name in ("on", "slow"):
        ratio = statistics.median(off["mean_ms"] / other["mean_ms"] for off, other in zip(results["off"], results[name]))
        print(f"steps/s {name} / off: {ratio:.3f}x" + ("  (target >= 0.97x: " + ("met" if ratio >= 0.97 else "NOT met")
                                                        + ")" if name == "on" else ""))
    on = results["on"]
    share = statistics.median(r["push_cpu_s"] / r["train_s"] for r in on)
    print(f"upload process CPU (on): {statistics.median(r['push_cpu_s'] for r in on):.2f} s per run "
          f"(its start included), {100 * share:.1f} % of the training time, on a core of its own")
    files_per_push = 9 + 3  # a checkpoint's files into last-checkpoint/, its model files to the root
    print(f"slow target: one push takes >= {files_per_push * args.delay:.1f} s; the slowest step took "
          f"{statistics.median(r['max_ms'] for r in results['slow']) / 1000:.3f} s")


if __name__ == "__main__":
    main()
