"""Peak memory and steps/s of the builtin model patches against the unpatched run.

Each variant trains the ~50M-parameter ``small-llama`` (built from config, same initial weights)
for ``--steps`` steps of ``--batch`` x ``--seq-len`` tokens in a fresh process, through
``engine.Run``:

* ``plain``        no patch;
* ``checkpointing`` ``train.activation_checkpointing = true`` (each decoder layer recomputed in backward);
* ``compile``      ``train.torch_compile = true`` (inductor; the first steps compile).

Measured per variant: the process's peak resident memory (``ru_maxrss``, on CPU) or the peak
CUDA memory (``torch.cuda.max_memory_allocated``, on GPU) after training, and steps/s over the
steps after ``--warmup``, plus the last logged loss (the variants should agree to ~1e-5).
Printed as ratios to ``plain``. Always exits 0.

Run::

    .venv/bin/python benchmarks/model_patches.py                         # CPU, ~3 minutes
    .venv/bin/python benchmarks/model_patches.py --variants plain,checkpointing --seq-len 1024
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from engine_clock import StepClock

VARIANTS = {"plain": {}, "checkpointing": {"activation_checkpointing": True}, "compile": {"torch_compile": True}}


def measure(args) -> dict:
    import resource

    import torch

    import engine
    from engine.builtin.data.collators import DataCollator
    from engine.testing import tiny_dataset

    clock = StepClock()

    import transformers

    from engine.kit.models import BUILTIN_CONFIGS

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BUILTIN_CONFIGS["small-llama"]))
    dataset = tiny_dataset(size=args.batch * (args.steps + 1), seq_len=args.seq_len, vocab_size=32000)
    train = {"max_steps": args.steps, "per_device_train_batch_size": args.batch,
             "learning_rate": 1e-4, "logging_steps": 1, "save_strategy": "no", "save_final_model": False,
             "disable_tqdm": True, "log_level": "warning", "output_dir": tempfile.mkdtemp(prefix="engine-patches-"),
             **VARIANTS[args.variant]}
    run = engine.Run({"train": train, "data": {"max_length": args.seq_len}}, model=model, train_dataset=dataset,
                     data_collator=DataCollator(0), plugins=[clock])
    run.train()
    stamps = clock.stamps
    steps = [b - a for a, b in zip(stamps[args.warmup:], stamps[args.warmup + 1:])]
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak, "steps_per_s": len(steps) / sum(steps), "loss": clock.losses[-1]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="plain,checkpointing,compile")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args)))
        return
    results = {}
    for variant in args.variants.split(","):
        command = [sys.executable, __file__, "--variant", variant, "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--batch", str(args.batch), "--seq-len", str(args.seq_len)]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results[variant] = json.loads(output.strip().splitlines()[-1])
    base = results.get("plain")
    print(f"small-llama, batch {args.batch} x {args.seq_len} tokens, {args.steps} steps ({args.warmup} warm-up)")
    print(f"{'variant':<14} {'peak MiB':>9} {'vs plain':>9} {'steps/s':>8} {'vs plain':>9} {'last loss':>10}")
    for variant, result in results.items():
        memory = f"{result['peak_mib'] / base['peak_mib']:.2f}x" if base else "-"
        speed = f"{result['steps_per_s'] / base['steps_per_s']:.2f}x" if base else "-"
        print(f"{variant:<14} {result['peak_mib']:>9.0f} {memory:>9} {result['steps_per_s']:>8.3f} {speed:>9} "
              f"{result['loss']:>10.5f}")


if __name__ == "__main__":
    main()
