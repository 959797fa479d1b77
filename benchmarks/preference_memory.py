"""DPO's memory, side by side: the full model with a frozen copy as its reference, the full model with the
reference's log-probs precomputed (the copy freed before training), and LoRA with the base (adapter off) as the
reference (no second copy), against TRL 1.16's DPOTrainer full and LoRA, the anchor.

The same base (``--model``, built from config with seeded weights and saved once) trains ``--steps`` AdamW steps
(lr 1e-6, fp32 on the CPU) on the same preference pairs (random words of a word-level tokenizer: prompt
``--seq-len`` / 2 tokens, chosen and rejected ``--seq-len`` / 4 each), each mode in a fresh worker process
(this script with ``--worker``), so memory figures are per mode:

* ``peak MiB``: the resident-memory high-water mark of the timed steps (after ``--warmup``) above the resident
  memory before the model loaded (every library imported first);
* ``state MiB``: bytes of the tensors in ``optimizer.state_dict()``;
* ``steps/s``: 1 / the median step time after the warm-up steps.

Each figure is also a ratio to the engine's full DPO, and the engine's modes to TRL's same mode. Always exits 0.

Run::

    .venv/bin/python benchmarks/preference_memory.py                      # small-llama (58.5M), ~4 min on 2 cores
    .venv/bin/python benchmarks/preference_memory.py --model tiny-llama   # a quick check of the script
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optimizer_memory as om  # benchmarks/optimizer_memory.py: this script's folder is on sys.path
import torch
from transformers import TrainerCallback

import engine

MODES = ("dpo-full", "dpo-precomputed", "dpo-lora", "trl-full", "trl-lora")
ADAPTER = {"r": 8, "lora_alpha": 16.0, "target_modules": "all-linear"}  # r: peft's default


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over the model's vocabulary (built, not trained): t0 pads, t1 ends."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0", eos_token="t1")


def pairs(count: int, seq_len: int, vocab_size: int) -> list[dict[str, str]]:
    rng = random.Random(om.SEED)

    def words(n: int) -> str:
        return " ".join(f"t{rng.randrange(2, vocab_size)}" for _ in range(n))

    return [{"prompt": words(seq_len // 2) + " ", "chosen": words(seq_len // 4), "rejected": words(seq_len // 4)}
            for _ in range(count)]


def measure(mode: str, args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    """Train the saved base in ``mode`` in this process; its figures."""
    import datasets
    import peft
    import trl
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    meter = om.rss_meter(args.model)
    probe = om.Probe(meter, args.warmup, args.steps)
    config = json.loads((Path(args.base) / "config.json").read_text())
    tokenizer = word_tokenizer(config["vocab_size"])
    rows = datasets.Dataset.from_list(pairs(args.steps * args.batch_size, args.seq_len, config["vocab_size"]))
    schedule = {"max_steps": args.steps, "per_device_train_batch_size": args.batch_size, "learning_rate": 1e-6,
                "lr_scheduler_type": "constant", "optim": "adamw_torch", "weight_decay": 0.0, "logging_steps": 1,
                "save_strategy": "no", "seed": om.SEED, "disable_tqdm": True}
    if mode.startswith("trl"):
        model = AutoModelForCausalLM.from_pretrained(args.base)
        lora = peft.LoraConfig(**{**ADAPTER, "lora_alpha": int(ADAPTER["lora_alpha"])}) if mode == "trl-lora" else None
        trainer = trl.DPOTrainer(
            model=model, ref_model=None if lora else copy.deepcopy(model), peft_config=lora,
            args=trl.DPOConfig(output_dir=output_dir, report_to=[], use_cpu=True, bf16=False,
                               gradient_checkpointing=False, max_length=args.seq_len, **schedule),
            train_dataset=rows, processing_class=tokenizer, callbacks=[TrainerProbe(probe)])
        trainer.train()
        optimizer, losses = trainer.optimizer, [e["loss"] for e in trainer.state.log_history if "loss" in e]
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    else:
        plugins = ["dpo", "peft"] if mode == "dpo-lora" else ["dpo"]
        run = engine.Run({
            "plugins": plugins, **({"peft": ADAPTER} if mode == "dpo-lora" else {}),
            "dpo": {"precompute_ref_log_probs": mode == "dpo-precomputed"},
            "data": {"packing": False, "max_length": args.seq_len},
            "train": {"model": args.base, "output_dir": output_dir, "use_cpu": True, "save_final_model": False,
                      "log_level": "warning", **schedule}},
            tokenizer=tokenizer, train_dataset=rows, plugins=[probe])
        run.train()
        optimizer, losses = run.optimizer, om.losses(run)
        trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    return {"peak": probe.peak, "state": om.state_bytes(optimizer), "steps_per_s": probe.steps_per_second(),
            "trainable": trainable, "losses": losses}


class TrainerProbe(TrainerCallback):
    """The engine probe's step-end timing and memory reading, at Trainer's step ends."""

    def __init__(self, probe: om.Probe):
        self.probe = probe

    def on_step_end(self, args, state, control, **kwargs):
        self.probe.on_step_end(SimpleNamespace(state=state, strategy=SimpleNamespace(device=torch.device("cpu"))))


def print_table(results: dict[str, dict[str, Any]]) -> None:
    mib = om.MIB
    full = results.get("dpo-full", {})

    def ratio(result: dict[str, Any], other: dict[str, Any], key: str) -> str:
        ok = all("failed" not in r and "refused" not in r and r.get(key) for r in (result, other))
        return f"{result[key] / other[key]:.3f}x" if ok else "-"

    print(f"{'mode':16s} {'trainable':>12s} {'peak MiB':>9s} {'x dpo-full':>10s} {'x TRL':>7s} {'state MiB':>9s} "
          f"{'steps/s':>7s} {'x TRL':>7s} {'loss first, last':>17s}")
    for mode, result in results.items():
        if "failed" in result or "refused" in result:
            print(f"{mode:16s} {result.get('failed') or result.get('refused')}")
            continue
        anchor = results.get({"dpo-full": "trl-full", "dpo-lora": "trl-lora"}.get(mode, ""), {})
        loss = result["losses"]
        print(f"{mode:16s} {result['trainable']:12,d} {result['peak'] / mib:9.1f} {ratio(result, full, 'peak'):>10s} "
              f"{ratio(result, anchor, 'peak') if anchor else '':>7s} {result['state'] / mib:9.2f} "
              f"{result['steps_per_s']:7.2f} {ratio(result, anchor, 'steps_per_s') if anchor else '':>7s} "
              f"{loss[0]:8.4f},{loss[-1]:8.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    om.add_arguments(parser, steps=6, warmup=2, batch_size=2)
    parser.add_argument("--base", help=argparse.SUPPRESS)  # the saved base folder (workers)
    args = parser.parse_args()
    if args.worker:
        om.worker(args, measure)
        return
    with tempfile.TemporaryDirectory(prefix="preference-memory-base-") as base:
        model = om.new_model(args.model)
        model.save_pretrained(Path(base) / "model")
        parameters = sum(p.numel() for p in model.parameters())
        del model
        print(f"model: {args.model}, {parameters / 1e6:.1f}M parameters; batch {args.batch_size} pairs of "
              f"{args.seq_len} tokens; {args.steps} steps per mode, the first {args.warmup} warm-up; CPU; "
              f"torch {torch.__version__}", flush=True)
        sys.argv += ["--base", str(Path(base) / "model"), "--model", args.model]
        results = om.run_workers(__file__, list(MODES), timeout=1800)
    print()
    print_table(results)
    print("(peak: resident memory high-water mark over the timed steps above the memory before the model loaded; "
          "state: tensors in optimizer.state_dict(); x TRL: the engine's mode over TRL's same mode)")


if __name__ == "__main__":
    main()
