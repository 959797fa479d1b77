"""Liger kernels on a GPU: the same loss, and peak memory and tokens/s with and without them.

A Llama-style model built from config (~1B parameters: hidden 2048, 16 layers, vocabulary
128256, as Llama-3.2-1B), bf16 weights, sequence ``--seq-len`` (4096), trained through
``engine.Run`` for ``--steps`` AdamW steps on random tokens, in a fresh process per variant:

* ``stock``  no plugin;
* ``liger``  ``plugins = ["liger"]`` with liger-kernel's defaults for llama (RoPE, RMSNorm,
             SwiGLU, fused linear cross-entropy).

Printed: each step's loss for both (they must agree to ``--tolerance``, 1e-2 in bf16, as the
fused cross-entropy sums in another order), peak CUDA memory and tokens/s after ``--warmup``
steps, and the ratios liger / stock (published: about +20 % throughput and -60 % memory on
Llama-3-8B). The batch is the largest of ``--batches`` that the stock model fits. Needs a CUDA
GPU; exits 1 without one.

Run::

    python benchmarks/gpu_liger.py
    python benchmarks/gpu_liger.py --seq-len 2048 --batches 8,4,2,1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from engine_clock import StepClock

CONFIG = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
          "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def measure(variant: str, batch: int, args, model_config: dict = CONFIG, device: str = "cuda") -> dict:
    """One variant in this process. ``device="cpu"`` (gpu_check.py's logic check: a tiny
    ``model_config``, ``TRITON_INTERPRET=1`` set before Triton loads) trains in fp32 with the
    kernels Triton's CPU interpreter runs (RoPE, fused linear cross-entropy); no peak memory."""
    import torch
    import transformers

    import engine
    from engine.builtin.data.collators import DataCollator
    from engine.testing import TokenDataset

    cuda = device == "cuda"
    clock = StepClock(synchronize=torch.cuda.synchronize if cuda else None)

    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: a 1B model initialises in seconds on a GPU
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model_config))
    model = model.to(torch.bfloat16 if cuda else torch.float32)  # the interpreter computes in numpy: no bf16
    rows = torch.randint(0, model_config["vocab_size"], (batch * (args.steps + 1), args.seq_len))
    # on the CPU, the kernels the interpreter cannot run stay off
    liger = {"plugins": ["liger"], **({} if cuda else {"liger": {"rms_norm": False, "swiglu": False}})}
    config = {**(liger if variant == "liger" else {"plugins": []}), "train": {
        "max_steps": args.steps, "per_device_train_batch_size": batch, "learning_rate": 1e-5, "logging_steps": 1,
        "save_strategy": "no", "save_final_model": False, "disable_tqdm": True, "log_level": "warning",
        "use_cpu": not cuda, "output_dir": tempfile.mkdtemp(prefix="engine-liger-")},
        "data": {"max_length": args.seq_len}}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    engine.Run(config, model=model, train_dataset=TokenDataset(rows), data_collator=DataCollator(0),
               plugins=[clock]).train()
    stamps, losses = clock.stamps, clock.losses
    seconds = stamps[-1] - stamps[args.warmup - 1]
    tokens = batch * args.seq_len * (len(stamps) - args.warmup)
    return {"losses": losses, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "tokens_per_s": tokens / seconds}


def run_variant(variant: str, batch: int, args) -> dict | None:
    command = [sys.executable, __file__, "--variant", variant, "--batch", str(batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--seq-len", str(args.seq_len)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        if "OutOfMemoryError" in result.stderr or "out of memory" in result.stderr:
            return None
        sys.exit(f"{variant} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batches", default="16,8,4,2,1", help="tried largest first; the first the stock model fits")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-2)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.batch, args)))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_liger.py needs a CUDA GPU")
    for batch in (int(b) for b in args.batches.split(",")):
        stock = run_variant("stock", batch, args)
        if stock is not None:
            break
    else:
        sys.exit("the stock model does not fit even batch 1")
    liger = run_variant("liger", batch, args)
    difference = max(abs(a - b) for a, b in zip(stock["losses"], liger["losses"]))
    print(f"Llama ~1B bf16, {torch.cuda.get_device_name()}, batch {batch} x {args.seq_len} tokens, {args.steps} steps")
    print(f"losses stock: {[round(x, 4) for x in stock['losses']]}")
    print(f"losses liger: {[round(x, 4) for x in liger['losses']]}")
    print(f"max |loss difference| {difference:.2e} ({'within' if difference <= args.tolerance else 'OVER'} "
          f"{args.tolerance})")
    print(f"peak memory: stock {stock['peak_gib']:.1f} GiB, liger {liger['peak_gib']:.1f} GiB "
          f"({liger['peak_gib'] / stock['peak_gib']:.2f}x)")
    print(f"tokens/s:    stock {stock['tokens_per_s']:.0f}, liger {liger['tokens_per_s']:.0f} "
          f"({liger['tokens_per_s'] / stock['tokens_per_s']:.2f}x)")


if __name__ == "__main__":
    main()
