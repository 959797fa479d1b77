"""Full fine-tune vs LoRA vs QLoRA, side by side: peak memory, optimizer state, checkpoint size, speed.

The same base (``--model``, built from config with seeded weights and saved once to a temporary
folder, so QLoRA has weights to quantize) trains ``--steps`` AdamW steps (``adamw_torch``, lr 1e-4,
fp32 on the CPU) on the same batches through ``engine.Run`` in three ways, each in a fresh
worker process (this script with ``--worker``), so memory figures are per mode:

* ``full``: every weight trains;
* ``lora``: plugin peft, ``r = 8`` (peft's default), ``lora_alpha = 16``, ``target_modules = "all-linear"``;
* ``qlora``: the same adapter on the base loaded 4-bit (NF4, double quantization, compute dtype
  float32 on the CPU and bfloat16 on a GPU).

Measured per mode (the helpers of ``optimizer_memory.py``):

* ``peak MiB``: on the CPU, the resident-memory high-water mark of the timed steps above the
  resident memory before the model loaded (every library imported first); on a GPU,
  ``torch.cuda.max_memory_allocated`` over the timed steps above what was allocated before;
* ``state MiB``: bytes of the tensors in ``optimizer.state_dict()``;
* ``ckpt MiB``: bytes of the files of the checkpoint written after the last step (weights or
  adapter, optimizer, scheduler, RNG, trainer state);
* ``steps/s``: 1 / the median step time after ``--warmup`` steps.

Each figure is also given as a ratio to the full fine-tune, and the checks the issue expects
are printed: checkpoints at least 50x smaller, optimizer state under 2 % of the full one.

``--gpu`` runs on CUDA a ~1.1B Llama-style model from config (hidden 2048, 22 layers, 32k
vocabulary: TinyLlama's shape) with ``train.bf16``, batch 4 x 512 tokens. **The GPU mode has
not been run** (no GPU where it was written); the CPU mode was. Always exits 0.

Run::

    .venv/bin/python benchmarks/peft_memory.py                       # small-llama (58.5M) on the CPU, ~3 min
    .venv/bin/python benchmarks/peft_memory.py --model tiny-llama    # quick check of the script
    .venv/bin/python benchmarks/peft_memory.py --gpu                 # a lent GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import optimizer_memory as om  # benchmarks/optimizer_memory.py: this script's folder is on sys.path
import torch

import engine
from engine.builtin.data.collators import DataCollator
from engine.testing import tiny_dataset

MODES = ("full", "lora", "qlora")
ADAPTER = {"r": 8, "lora_alpha": 16.0, "target_modules": "all-linear"}  # r: peft's default
# ~1.1B parameters, TinyLlama-1.1B's shape, for --gpu
GPU_MODEL = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
             "vocab_size": 32000, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over the model's vocabulary (built, not trained): the batches are token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0")


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def measure(mode: str, args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    """Train the saved base in ``mode`` in this process; its figures."""
    import peft  # noqa: F401  (imported before the memory baseline, like the optimizer libraries)

    torch.set_num_threads(args.threads)
    meter = om.CudaPeak() if args.gpu else om.rss_meter(args.model)
    probe = om.Probe(meter, args.warmup, args.steps)
    config = json.loads((Path(args.base) / "config.json").read_text())
    sections = {} if mode == "full" else {"peft": {**ADAPTER, **({"quantize": "4bit", "bnb_4bit_compute_dtype": (
        "bfloat16" if args.gpu else "float32")} if mode == "qlora" else {})}}
    run = engine.Run({
        "plugins": [] if mode == "full" else ["peft"], **sections,
        "train": {"model": args.base, "output_dir": output_dir, "seed": om.SEED, "max_steps": args.steps,
                  "per_device_train_batch_size": args.batch_size, "learning_rate": 1e-4, "weight_decay": 0.0,
                  "lr_scheduler_type": "constant", "optim": "adamw_torch", "use_cpu": not args.gpu, "bf16": args.gpu,
                  "logging_steps": 1, "save_strategy": "steps", "save_steps": args.steps, "save_final_model": False,
                  "disable_tqdm": True, "log_level": "warning"}},
        tokenizer=word_tokenizer(config["vocab_size"]), plugins=[probe], data_collator=DataCollator(0),
        train_dataset=tiny_dataset(size=args.steps * args.batch_size, seq_len=args.seq_len,
                                   vocab_size=config["vocab_size"], seed=om.SEED))
    run.train()
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    return {"peak": probe.peak, "state": om.state_bytes(run.optimizer), "steps_per_s": probe.steps_per_second(),
            "checkpoint": folder_bytes(Path(output_dir) / f"checkpoint-{args.steps}"), "trainable": trainable,
            "losses": om.losses(run)}


def print_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The table, ratios to the full fine-tune; returns the failed checks."""
    full = results["full"]
    mib = om.MIB

    def ratio(result: dict[str, Any], key: str) -> str:
        return f"{result[key] / full[key]:.4f}x" if "failed" not in full and full[key] else "-"

    print(f"{'mode':6s} {'trainable':>12s} {'peak MiB':>9s} {'x full':>8s} {'state MiB':>9s} {'x full':>8s} "
          f"{'ckpt MiB':>9s} {'x full':>8s} {'steps/s':>7s} {'x full':>7s} {'loss first, last':>17s}")
    for mode, result in results.items():
        if "failed" in result or "refused" in result:
            print(f"{mode:6s} {result.get('failed') or result.get('refused')}")
            continue
        loss = result["losses"]
        print(f"{mode:6s} {result['trainable']:12,d} {result['peak'] / mib:9.1f} {ratio(result, 'peak'):>8s} "
              f"{result['state'] / mib:9.2f} {ratio(result, 'state'):>8s} {result['checkpoint'] / mib:9.2f} "
              f"{ratio(result, 'checkpoint'):>8s} {result['steps_per_s']:7.2f} {ratio(result, 'steps_per_s'):>7s} "
              f"{loss[0]:8.3f},{loss[-1]:8.3f}")
    failed = []
    if "failed" in full or "refused" in full:
        return ["the full fine-tune did not run"]
    for mode in ("lora", "qlora"):
        result = results[mode]
        if "failed" in result or "refused" in result:
            failed.append(f"{mode} did not run")
            continue
        if result["checkpoint"] * 50 > full["checkpoint"]:
            failed.append(f"{mode}: checkpoint only {full['checkpoint'] / result['checkpoint']:.1f}x smaller")
        if result["state"] > 0.02 * full["state"]:
            failed.append(f"{mode}: optimizer state {100 * result['state'] / full['state']:.2f} % of the full one")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    om.add_arguments(parser, steps=6, warmup=2, batch_size=2)
    parser.add_argument("--gpu", action="store_true", help="CUDA, a ~1.1B Llama-style model from config (untested)")
    parser.add_argument("--base", help=argparse.SUPPRESS)  # the saved base folder (workers)
    args = parser.parse_args()
    if args.worker:
        om.worker(args, measure)
        return
    if args.gpu and not torch.cuda.is_available():
        print("--gpu: no CUDA device here; nothing measured")
        return
    with tempfile.TemporaryDirectory(prefix="peft-memory-base-") as base:
        if args.gpu:
            config_file = Path(base) / "gpu-model.json"
            config_file.write_text(json.dumps(GPU_MODEL))
            args.model = str(config_file)
            if "--seq-len" not in sys.argv:
                args.seq_len = 512
            if "--batch-size" not in sys.argv:
                args.batch_size = 4
        model = om.new_model(args.model)
        model.save_pretrained(Path(base) / "model")
        parameters = sum(p.numel() for p in model.parameters())
        del model
        print(f"model: {args.model}, {parameters / 1e6:.1f}M parameters; batch {args.batch_size} x {args.seq_len} "
              f"tokens; {args.steps} steps per mode, the first {args.warmup} warm-up; "
              f"{torch.cuda.get_device_name() if args.gpu else 'CPU'}; torch {torch.__version__}", flush=True)
        # the workers get this process's arguments, and where the base is
        sys.argv += ["--base", str(Path(base) / "model"), "--model", args.model, "--seq-len", str(args.seq_len),
                     "--batch-size", str(args.batch_size)]
        results = om.run_workers(__file__, list(MODES), timeout=1800)
    print()
    failed = print_table(results)
    peak = "torch.cuda.max_memory_allocated" if args.gpu else "resident memory high-water mark"
    print(f"(peak: {peak} over the timed steps above the memory before the model loaded; state: tensors in "
          "optimizer.state_dict(); ckpt: the files of the checkpoint after the last step; ratios to the full "
          "fine-tune)")
    print("checks (checkpoint >= 50x smaller, optimizer state < 2 %): " + ("all passed" if not failed else
                                                                          "; ".join(failed)))


if __name__ == "__main__":
    main()
