"""Optimizer-state bytes, peak memory and speed of a training step for every optimizer name.

Every name the engine knows (the builtins plus each first-party optimizer plugin's names, from
``engine.catalogue.FIRST_PARTY``) trains the same 58.5M-parameter Llama built from config
(``small-llama``: hidden 512, 8 layers, 32k vocabulary; random weights, same seed) through
``engine.Run`` with its plugin enabled, for ``--steps`` optimizer steps on the same batches.
Each name runs in a fresh worker process (this script with ``--worker``), so memory figures
are per name. Settings shared by all names: fp32, lr 1e-3, no weight decay (LOMO refuses it),
no clipping (``max_grad_norm = 0``: LOMO would run a second backward, layerwise names cannot
clip), constant schedule, no accumulation, no checkpoints. GaLore and APOLLO names project
``optim_target_modules = [".*attn.*", ".*mlp.*"]`` at ``rank=128`` (Trainer's default), with a
new projection every 200 steps (so only the first step, a warm-up step, computes one); the
embeddings and ``lm_head`` (32.8M of the 58.5M parameters) keep full AdamW state.

Measured per name:

* ``state MiB``: bytes of all tensors in ``optimizer.state_dict()`` after training, nested
  entries included, each tensor counted once (torchao's quantized state, a tensor subclass,
  by the packed tensors it holds). That is ``state`` for most names; layerwise names hold
  every per-parameter optimizer's state there; GaLore/APOLLO projection matrices are
  included (the plugins save them as tensors). LOMO keeps no state (0); the library's
  AdaLomo keeps its factored second moments outside ``optimizer.state``, and engine-lomo's
  ``state_dict()`` carries them under ``"adalomo"``, which is what is counted.
* ``peak MiB``: the process's peak resident memory during the timed steps, minus its resident
  memory just before the model was built. Linux's high-water mark ``VmHWM`` in
  ``/proc/self/status`` is reset (``echo 5 > /proc/self/clear_refs``) at the end of the last
  warm-up step and read at the end of the last step, so it is the peak of the steady-state
  steps: weights, gradients, optimizer state, activations and whatever freed memory the
  allocator keeps, as the OS sees it. Every worker imports all optimizer libraries and the
  model's modules (building it once on the meta device) before that baseline, so no name pays
  for an import (bitsandbytes alone is ~115 MiB resident).
* ``steps/s``: 1 / the median time between the ends of consecutive steps after the first
  ``--warmup`` steps (an ``on_step_end`` plugin hook takes the timestamps).
* ``loss``: the first and the last step's training loss, a sanity check (names that do the
  same arithmetic agree), not a comparison: in a few steps at lr 1e-3 the loss need not fall.

Each figure is also given relative to ``adamw_torch`` (always run, as the baseline). Names
the engine refuses here (e.g. the GaLore 8-bit names need CUDA) are listed with the engine's
own error message, a worker that fails with its exception, and the engine's warnings (paged
names train unpaged on the CPU) once each under the table. Step times on a shared machine are
noisy (a busy neighbour slows some names several-fold); the memory columns are not. The
script always exits 0. ``benchmarks/gpu_optimizers.py`` reuses this code on a CUDA device.

Run::

    .venv/bin/python benchmarks/optimizer_memory.py                      # ~10 min on 2 CPU cores
    .venv/bin/python benchmarks/optimizer_memory.py --model tiny-llama   # quick check of the script
    .venv/bin/python benchmarks/optimizer_memory.py --names adamw_torch,galore_adamw,lomo --steps 6
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import engine
from engine.catalogue import FIRST_PARTY
from engine.config import TrainConfig
from engine.builtin.data.collators import DataCollator
from engine.builtin.models import build_model
from engine.testing import tiny_dataset

SEED = 42
BASELINE = "adamw_torch"
MIB = 2**20
# train keys per plugin: GaLore and APOLLO need target modules
PLUGIN_TRAIN = {
    plugin: {"optim_target_modules": [".*attn.*", ".*mlp.*"], "optim_args": "rank=128,update_proj_gap=200"}
    for plugin in ("galore", "apollo")
}
# imported by every worker before its memory baseline, so that imports cost every name the same
LIBRARIES = ("bitsandbytes", "galore_torch", "apollo_torch", "lomo_optim", "grokadamw", "schedulefree", "torchao.optim",
             "optimi")


@functools.cache
def optimizer_names() -> dict[str, str | None]:
    """Every optimizer name -> the plugin that provides it (None for the engine's builtins)."""
    builtin = engine.Run({"train": {"save_strategy": "no"}}).registries["optimizer"].names()
    names: dict[str, str | None] = dict.fromkeys(builtin)
    for plugin, info in FIRST_PARTY.items():
        names.update(dict.fromkeys(info.provides.get("optimizer", ()), plugin))
    return names


def add_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int, batch_size: int) -> None:
    """Options shared with gpu_optimizers.py (and the hidden ones its workers take)."""
    parser.add_argument("--names", help=f"comma-separated optimizer names (default: all; {BASELINE} always runs)")
    parser.add_argument("--steps", type=int, default=steps, help=f"optimizer steps per name (default {steps})")
    parser.add_argument("--warmup", type=int, default=warmup,
                        help=f"steps left out of the timing and the peak (default {warmup})")
    parser.add_argument("--model", default="small-llama",
                        help="builtin model name (small-llama, tiny-llama) or a .json config (default small-llama)")
    parser.add_argument("--batch-size", type=int, default=batch_size, help=f"default {batch_size}")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch.set_num_threads in each worker (default: torch's default)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # an optimizer name: run it, write --result
    parser.add_argument("--result", help=argparse.SUPPRESS)


def selected_names(parser: argparse.ArgumentParser, args: argparse.Namespace, default: list[str]) -> list[str]:
    """--names (else ``default``) checked against the engine's names; the baseline first."""
    if args.warmup < 1 or args.steps < args.warmup + 2:
        parser.error("--warmup must be at least 1 and --steps at least --warmup + 2")
    known = optimizer_names()
    names = [n.strip() for n in args.names.split(",") if n.strip()] if args.names else default
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--names: unknown optimizer {', '.join(unknown)}; known: {', '.join(known)}")
    return [BASELINE] + [n for n in names if n != BASELINE]


# ---------------------------------------------------------------------------- one name (worker)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


class RssPeak:
    """Peak resident memory since :meth:`reset`, above the resident memory at construction."""

    def __init__(self):
        self.baseline = _status_bytes("VmRSS")

    def reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current resident size

    def peak(self) -> int:
        return _status_bytes("VmHWM") - self.baseline


def rss_meter(model_spec: str) -> RssPeak:
    """An :class:`RssPeak` whose baseline includes every optimizer library and the model's modules."""
    for library in LIBRARIES:
        try:
            importlib.import_module(library)
        except ImportError:
            pass  # its plugin's names are refused, naming the missing package
    with torch.device("meta"):
        new_model(model_spec)  # imports the model's modules; allocates nothing
    return RssPeak()


class CudaPeak:
    """Peak memory allocated by torch on the current CUDA device since :meth:`reset`."""

    def __init__(self):
        self.baseline = torch.cuda.memory_allocated()

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() - self.baseline


class Probe:
    """An engine plugin: the end time of every step, and the peak memory over steps
    ``warmup + 1`` .. ``last``."""

    name = "benchmark_probe"

    def __init__(self, meter: RssPeak | CudaPeak | None = None, warmup: int = 0, last: int = 0):
        self.meter, self.warmup, self.last = meter, warmup, last
        self.stamps: list[float] = []
        self.peak: int | None = None

    @engine.hookimpl
    def on_step_end(self, run):
        if run.strategy.device.type == "cuda":
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        if self.meter is not None:
            if run.state.global_step == self.warmup:
                self.meter.reset()
            elif run.state.global_step == self.last:
                self.peak = self.meter.peak()

    def steps_per_second(self) -> float:
        """1 / median duration of steps ``warmup + 1`` .. ``last``."""
        stamps = self.stamps[self.warmup - 1: self.last]
        return 1 / statistics.median(b - a for a, b in itertools.pairwise(stamps))


class WarningLog(logging.Handler):
    """Keeps the messages of the engine's (and its plugins') warnings."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() not in self.messages:
            self.messages.append(record.getMessage())


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state_dict()``, nested ones too, each once; a tensor
    subclass that wraps others (``__tensor_flatten__``) counts the tensors it holds."""
    seen: set[tuple[int, int]] = set()

    def visit(value: Any) -> int:
        if hasattr(value, "__tensor_flatten__"):  # a wrapper tensor subclass (torchao's quantized
            inner, _ = value.__tensor_flatten__()  # state): its own nbytes are the logical fp32 size
            return sum(visit(getattr(value, name)) for name in inner)
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.nbytes)
            if key in seen:
                return 0
            seen.add(key)
            return value.nbytes
        if isinstance(value, dict):
            return sum(visit(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(visit(v) for v in value)
        return 0

    return visit(optimizer.state_dict())


def new_model(spec: str) -> torch.nn.Module:
    """The model ``spec`` names (as ``train.model``), built from its config with seeded weights."""
    return build_model(TrainConfig(model=spec, seed=SEED))


def new_run(name: str, args: argparse.Namespace, model: torch.nn.Module, output_dir: str, probe: Probe,
            device: str, **train: Any) -> engine.Run:
    """An ``engine.Run`` of ``args.steps`` steps of optimizer ``name`` on ``model``; ``train``: extra keys."""
    plugin = optimizer_names()[name]
    config = {
        "plugins": [plugin] if plugin else [],
        "train": {
            "model": args.model, "output_dir": output_dir, "seed": SEED, "max_steps": args.steps,
            "per_device_train_batch_size": args.batch_size, "learning_rate": 1e-3, "weight_decay": 0.0,
            "max_grad_norm": 0.0, "lr_scheduler_type": "constant", "optim": name,
            "use_cpu": device == "cpu", "logging_steps": 1, "save_strategy": "no",
            "save_final_model": False, "eval_strategy": "no", "disable_tqdm": True,
            "log_level": "warning", "dataloader_num_workers": 0,
            **PLUGIN_TRAIN.get(plugin, {}), **train,
        },
    }
    dataset = tiny_dataset(size=args.steps * args.batch_size, seq_len=args.seq_len,
                           vocab_size=model.config.vocab_size, seed=SEED)
    return engine.Run(config, model=model, train_dataset=dataset, data_collator=DataCollator(0), plugins=[probe])


def class_name(optimizer: torch.optim.Optimizer) -> str:
    """``package.Class``, e.g. ``torch.AdamW``, ``galore_torch.AdamW``, ``bitsandbytes.AdamW``."""
    return f"{type(optimizer).__module__.split('.')[0]}.{type(optimizer).__name__}"


def losses(run: engine.Run) -> list[float]:
    return [entry["loss"] for entry in run.state.log_history if "loss" in entry]


def measure(name: str, args: argparse.Namespace, output_dir: str, device: str = "cpu",
            last: int | None = None, **train: Any) -> tuple[dict[str, Any], engine.Run]:
    """Train ``name`` in this process; its figures (see the module docstring) and the finished run.

    Steps ``args.warmup + 1`` .. ``last`` (default: the last step) are timed and give the peak.
    """
    torch.set_num_threads(args.threads)
    warnings = WarningLog()
    logging.getLogger("engine").addHandler(warnings)
    meter = CudaPeak() if device == "cuda" else rss_meter(args.model)
    probe = Probe(meter, args.warmup, last or args.steps)
    run = new_run(name, args, new_model(args.model), output_dir, probe, device, **train)
    run.train()
    result = {
        "state": state_bytes(run.optimizer), "peak": probe.peak, "steps_per_s": probe.steps_per_second(),
        "losses": losses(run), "optimizer": class_name(run.optimizer), "warnings": warnings.messages,
    }
    return result, run


def worker(args: argparse.Namespace, work: Callable[[str, argparse.Namespace, str], dict[str, Any]]) -> None:
    """Run ``work(name, args, output_dir)`` for ``args.worker``; write its result (or the
    engine's refusal) as JSON to ``args.result``."""
    with tempfile.TemporaryDirectory(prefix=f"optimizer-memory-{args.worker}-") as output_dir:
        try:
            result = work(args.worker, args, output_dir)
        except engine.EngineError as exc:
            result = {"refused": f"{type(exc).__name__}: {exc}"}
    Path(args.result).write_text(json.dumps(result))


def error_message(output: str) -> str:
    """The exception at the end of a traceback (its unindented last lines), else the last line."""
    lines = output.strip().splitlines() or ["no output"]
    message = list(itertools.takewhile(lambda line: not line.startswith(" "), reversed(lines)))
    return " ".join(reversed(message)) or lines[-1]


def run_workers(script: str, names: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Each name in a fresh ``script --worker NAME`` process (with this process's arguments)."""
    results = {}
    for name in names:
        started = time.perf_counter()
        with tempfile.NamedTemporaryFile(suffix=".json") as result_file:
            command = [sys.executable, script, *sys.argv[1:], "--worker", name, "--result", result_file.name]
            try:
                done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout)
                text = Path(result_file.name).read_text()
                if done.returncode == 0 and text:
                    result = json.loads(text)
                else:
                    result = {"failed": f"exit status {done.returncode}: {error_message(done.stderr or done.stdout)}"}
            except subprocess.TimeoutExpired:
                result = {"failed": f"no result within {timeout:.0f} s"}
        result["wall_s"] = time.perf_counter() - started
        results[name] = result
        outcome = result.get("refused") or result.get("failed") or f"{result['steps_per_s']:.2f} steps/s"
        print(f"  {name:28s} {result['wall_s']:5.1f} s  {outcome}", flush=True)
    return results


# ---------------------------------------------------------------------------- the table


def generic(note: str, name: str) -> str:
    """``note`` with the optimizer name written ``<name>``, so that names can share a note."""
    return re.sub(rf"(?<!\w){re.escape(name)}(?!\w)", "<name>", note)


def print_table(results: dict[str, dict[str, Any]],
                extra: dict[str, Callable[[dict[str, Any]], str]] | None = None) -> None:
    """One row per name: figures and ratios to the baseline; then refusals, failures, warnings.

    ``extra``: more columns, header -> function of a name's result giving the cell.
    """
    extra = extra or {}
    base = results[BASELINE]
    names = optimizer_names()

    def ratio(value: float | None, key: str) -> str:
        if value is None or "refused" in base or "failed" in base or not base[key]:
            return "-"
        return f"{value / base[key]:.2f}x"

    head = (f"{'name':28s} {'plugin':12s} {'optimizer':32s} {'state MiB':>9s} {'x adamw':>7s} {'peak MiB':>8s} "
            f"{'x adamw':>7s} {'steps/s':>7s} {'x adamw':>7s} {'loss first, last':>16s}")
    print(head + "".join(f"  {header}" for header in extra))
    notes: dict[str, list[str]] = {}  # note, with the name written <name> -> the names it is about
    for name, result in results.items():
        plugin = names[name] or "builtin"
        if "refused" in result or "failed" in result:
            kind = "refused" if "refused" in result else "FAILED"
            print(f"{name:28s} {plugin:12s} {kind} (below)")
            notes.setdefault(generic(f"{kind}: {result.get('refused') or result.get('failed')}", name),
                             []).append(name)
            continue
        peak = result["peak"]
        loss = result["losses"]
        print(f"{name:28s} {plugin:12s} {result['optimizer'][:32]:32s} {result['state'] / MIB:9.1f} "
              f"{ratio(result['state'], 'state'):>7s} {peak / MIB:8.1f} {ratio(peak, 'peak'):>7s} "
              f"{result['steps_per_s']:7.2f} {ratio(result['steps_per_s'], 'steps_per_s'):>7s} "
              f"{loss[0]:8.3f},{loss[-1]:7.3f}" + "".join(f"  {cell(result):{len(header)}s}"
                                                         for header, cell in extra.items()))
        for message in result["warnings"]:
            notes.setdefault(generic(f"warning: {message}", name), []).append(name)
    if notes:
        print()
    for note, about in notes.items():
        print(f"{', '.join(about)}: {note}")


def benchmark(script: str, args: argparse.Namespace, names: list[str], device: str,
              extra: dict[str, Callable[[dict[str, Any]], str]] | None = None) -> dict[str, dict[str, Any]]:
    """Print what is measured, run ``names`` in workers of ``script``, print the table."""
    with torch.device("meta"):
        parameters = sum(p.numel() for p in new_model(args.model).parameters())
    print(f"model: {args.model}, {parameters / 1e6:.1f}M parameters; batch {args.batch_size} x {args.seq_len} "
          f"tokens; {args.steps} steps per name, the first {args.warmup} warm-up; {device}; torch threads "
          f"{args.threads}; torch {torch.__version__}", flush=True)
    started = time.perf_counter()
    results = run_workers(script, names, timeout=1200)
    print(f"({len(names)} names in {time.perf_counter() - started:.0f} s)")
    print()
    print_table(results, extra)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, steps=6, warmup=2, batch_size=2)
    args = parser.parse_args()
    if args.worker:
        worker(args, lambda name, args, output_dir: measure(name, args, output_dir)[0])
        return
    names = selected_names(parser, args, list(optimizer_names()))
    benchmark(__file__, args, names, "CPU")
    print("(state: tensors in optimizer.state_dict(); peak: resident memory high-water mark of the timed "
          "steps above the resident memory before the model was built; steps/s: 1 / median step time; "
          "ratios to adamw_torch)")


if __name__ == "__main__":
    main()
