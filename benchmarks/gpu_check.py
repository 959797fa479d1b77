"""One GPU check for a short window: throughput, Liger, LoRA/QLoRA, 8-bit and paged optimizers, document
packing and a 1-GPU DDP/FSDP smoke run, in one table.

Each section runs in a fresh process under a hard time cap (``CAPS``: 460 s in all, so that the whole check
ends within 8 minutes on one H200; its step counts are meant to take well under the cap: not yet run on a
GPU). Within a section the contenders train one after another (the optimizers: a worker process each). A
section that raises or runs past its cap is one FAILED row with the first line of its error, and the next one
starts. ``--only`` picks sections:

* ``throughput``: a ~1B Llama built from config (``gpu_liger.CONFIG``: Llama-3.2-1B's shape, 1.24B
  parameters) with bf16 weights (no autocast), batch 8 x 4096 random tokens, AdamW (lr 1e-5, no weight
  decay, clipping at 1.0, constant schedule), trained by a hand-written loop, ``engine.Run`` and
  ``transformers.Trainer`` (which shuffle the rows the loop reads in order): tokens/s (1 / the median step
  after the warm-up steps), peak memory, and
  MFU = 6 x parameters x tokens/s / 989e12 (H200 SXM bf16 dense peak, no sparsity; the 6N rule counts every
  parameter, the tied embedding once, and leaves attention's score FLOPs out);
* ``liger``: the same model and batch through ``gpu_liger.measure``, without and with ``plugins = ["liger"]``:
  tokens/s, peak memory and their ratios, against Liger's published +20 % throughput and -60 % memory;
* ``peft``: LoRA and QLoRA (``peft_memory``'s adapter: r 8, alpha 16, all linear layers; QLoRA's base NF4,
  double quantization) on TinyLlama's 1.1B shape, bf16 autocast, batch 4 x 512, trained by the engine
  (``peft_memory.measure``) and by Trainer on ``peft.get_peft_model`` of the same saved base;
* ``optimizers``: adamw_torch, adamw_8bit, paged_adamw_8bit and paged_adamw_32bit through
  ``gpu_optimizers.check`` on small-llama (58.5M), a worker process each: optimizer-state bytes (paged state
  lives in unified memory, outside the peak column), loss falls, a resumed checkpoint gives the same step;
* ``packing``: text documents of 1/16 to all of 2048 tokens, ``data.packing = false`` (padded per batch)
  against ``"document"`` (padding-free, attention kept within each document) with sdpa and, when
  ``flash_attn`` imports, flash_attention_2: tokens/s of real (non-padding) tokens;
* ``distributed``: ``torchrun --nproc-per-node 1`` training a small Llama a few steps with the ddp and the
  fsdp plugin on nccl: the backend, tokens/s, and whether every loss is finite.

Peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps above what was allocated before the
model was built (liger: over the whole run, as gpu_liger.py measures it). Written to ``--out`` (default
``benchmarks/out/gpu-<UTC time>/``): ``<section>.json`` (the raw numbers, or ``failed``), ``<section>.log``
(the section's output) and ``table.txt``. Exits 0; 1 when there is no CUDA device, unless ``--device cpu``.

``--device cpu --tiny`` runs every section on the CPU with tiny Llamas for a few steps: a check of this
script's logic, not a benchmark. Flash attention, nccl and the paged optimizers are skipped there (they need
CUDA), peak memory is the resident-memory high-water mark, and liger runs only the kernels Triton's CPU
interpreter can (RoPE, fused linear cross-entropy).

Run::

    bash benchmarks/gpu_check.sh                          # set up a venv with CUDA torch and the plugins, then this
    bash benchmarks/gpu_check.sh --only liger,peft --out /tmp/check
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpu_check.py --device cpu --tiny   # the logic: ~3.5 min, 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import gpu_liger  # benchmarks/: this script's folder is on sys.path
import gpu_optimizers
import optimizer_memory as om
import peft_memory
import torch
import transformers

import engine
from engine.builtin.data.collators import DataCollator
from engine.testing import TokenDataset, tiny_dataset, torchrun

H200_BF16_PEAK = 989e12  # FLOP/s: NVIDIA's H200 SXM bf16 dense figure (the same as H100 SXM's)
PUBLISHED_LIGER = {"tokens_per_s": 1.20, "peak": 0.40}  # liger-kernel's README: +20 % throughput, -60 % memory
SEED = 42
LEARNING_RATE = 1e-5
CAPS = {"throughput": 90, "liger": 75, "peft": 90, "optimizers": 100, "packing": 55, "distributed": 50}
OPTIMIZERS = ("adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
NEEDS_CUDA = "skipped: needs CUDA"
EOS = "t1"  # packing: the word tokenizer's word that ends each document
MIB = 2**20
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
              "tie_word_embeddings": True}
SMALL_LLAMA = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096}


@dataclass(frozen=True)
class Settings:
    """What the sections train: the GPU sizes, or ``--tiny``'s."""

    device: str
    tiny: bool
    llama: dict[str, Any]  # throughput, liger, packing
    batch: int
    seq_len: int
    steps: int
    warmup: int
    packing_length: int
    peft_model: str | dict[str, Any]  # a builtin model name, or a config
    peft_batch: int
    peft_seq_len: int
    optimizer_model: str
    distributed_llama: dict[str, Any]

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def settings(device: str, tiny: bool) -> Settings:
    if tiny:
        return Settings(device, tiny, TINY_LLAMA, batch=2, seq_len=64, steps=5, warmup=2, packing_length=64,
                        peft_model="tiny-llama", peft_batch=2, peft_seq_len=32, optimizer_model="tiny-llama",
                        distributed_llama=TINY_LLAMA)
    return Settings(device, tiny, gpu_liger.CONFIG, batch=8, seq_len=4096, steps=10, warmup=3, packing_length=2048,
                    peft_model=peft_memory.GPU_MODEL, peft_batch=4, peft_seq_len=512, optimizer_model="small-llama",
                    distributed_llama=SMALL_LLAMA)


# ---------------------------------------------------------------------------- shared helpers


def new_llama(values: dict[str, Any], device: str, attention: str = "sdpa") -> torch.nn.Module:
    """A seeded Llama of ``values`` with bf16 weights, built on ``device`` (a 1B model initialises in seconds
    on a GPU, in a minute on a CPU)."""
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**values, use_cache=False)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                             attn_implementation=attention)


def parameter_count(values: dict[str, Any]) -> int:
    return sum(p.numel() for p in new_llama(values, "meta").parameters())


def random_rows(values: dict[str, Any], rows: int, seq_len: int) -> TokenDataset:
    generator = torch.Generator().manual_seed(SEED)
    return TokenDataset(torch.randint(0, values["vocab_size"], (rows, seq_len), generator=generator))


def train_keys(s: Settings, batch: int, output_dir: Path, **more: Any) -> dict[str, Any]:
    """The [train] keys of every engine run here (the Trainer runs get the same values)."""
    return {"output_dir": str(output_dir), "max_steps": s.steps, "per_device_train_batch_size": batch,
            "learning_rate": LEARNING_RATE, "weight_decay": 0.0, "max_grad_norm": 1.0,
            "lr_scheduler_type": "constant", "optim": "adamw_torch", "seed": SEED, "logging_steps": 1,
            "save_strategy": "no", "save_final_model": False, "disable_tqdm": True, "log_level": "warning",
            "use_cpu": not s.cuda, "dataloader_num_workers": 0, **more}


def note_step(probe: om.Probe, device: str, step: int) -> None:
    """om.Probe's end-of-step measurement, taken from a loop that is not an engine run."""
    probe.on_step_end(SimpleNamespace(strategy=SimpleNamespace(device=torch.device(device)),
                                      state=SimpleNamespace(global_step=step)))


class TrainerProbe(transformers.TrainerCallback):
    """om.Probe inside transformers.Trainer (its global_step counts the step when on_step_end comes)."""

    def __init__(self, probe: om.Probe, device: str):
        self.probe, self.device = probe, device

    def on_step_end(self, args, state, control, **kwargs):
        note_step(self.probe, self.device, state.global_step)


def trainer_train(model: torch.nn.Module, dataset: Any, s: Settings, probe: om.Probe, batch: int,
                  output_dir: Path, **arguments: Any) -> transformers.Trainer:
    """``model`` trained by transformers.Trainer with the engine runs' settings (``arguments``: others)."""
    keys = train_keys(s, batch, output_dir)
    keys.pop("save_final_model")  # the engine's own key
    training_args = transformers.TrainingArguments(**{**keys, "report_to": "none", "eval_strategy": "no",
                                                      **arguments})
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=dataset,
                                   data_collator=DataCollator(0), callbacks=[TrainerProbe(probe, s.device)])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # it prints every log
    trainer.train()
    return trainer


def trainer_losses(trainer: transformers.Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def measured(s: Settings, tokens_per_step: int | None, train: Callable[[om.Probe], dict[str, Any]]) -> dict[str, Any]:
    """``train(probe)``'s figures (it builds its model after the memory baseline is taken) with steps/s,
    tokens/s (``tokens_per_step`` per step, unless ``train`` counts them) and the peak."""
    gc.collect()  # the last contender's model and optimizer leave the allocator before the baseline
    if s.cuda:
        torch.cuda.empty_cache()
    probe = om.Probe(om.CudaPeak() if s.cuda else om.RssPeak(), s.warmup, s.steps)
    result = train(probe)
    result.update(steps_per_s=probe.steps_per_second(), peak=probe.peak)
    if tokens_per_step:
        result["tokens_per_s"] = result["steps_per_s"] * tokens_per_step
    return result


def loss_span(losses: list[float]) -> str:
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no loss logged"


def row(variant: str, result: dict[str, Any] | None = None, note: str = "", **figures: Any) -> dict[str, Any]:
    """A table row: ``tokens_per_s``, ``peak``, ``state`` (bytes) and ``mfu`` from ``result`` or ``figures``."""
    values = {key: (result or {}).get(key) for key in ("tokens_per_s", "peak", "state")}
    return {"variant": variant, **values, "mfu": None, **figures, "note": note}


# ---------------------------------------------------------------------------- the sections


def plain_loop(s: Settings, dataset: TokenDataset, probe: om.Probe) -> dict[str, Any]:
    """The hand-written loop: what engine and Trainer do per step, and nothing else."""
    model = new_llama(s.llama, s.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=s.batch, collate_fn=DataCollator(0))
    losses = []
    for step, batch in enumerate(loader, 1):
        loss = model(**{key: value.to(s.device) for key, value in batch.items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # engine and Trainer read the loss at every step too (logging_steps 1)
        note_step(probe, s.device, step)
        if step == s.steps:
            break
    return {"losses": losses}


def throughput(s: Settings, scratch: Path) -> dict[str, Any]:
    dataset = random_rows(s.llama, s.batch * s.steps, s.seq_len)

    def engine_run(probe: om.Probe) -> dict[str, Any]:
        run = engine.Run({"train": train_keys(s, s.batch, scratch / "engine"), "data": {"max_length": s.seq_len}},
                         model=new_llama(s.llama, s.device), train_dataset=dataset, data_collator=DataCollator(0),
                         plugins=[probe])
        run.train()
        return {"losses": om.losses(run)}

    def trainer_run(probe: om.Probe) -> dict[str, Any]:
        trainer = trainer_train(new_llama(s.llama, s.device), dataset, s, probe, s.batch, scratch / "trainer")
        return {"losses": trainer_losses(trainer)}

    tokens = s.batch * s.seq_len
    results = {"plain": measured(s, tokens, lambda probe: plain_loop(s, dataset, probe)),
               "engine": measured(s, tokens, engine_run), "trainer": measured(s, tokens, trainer_run)}
    parameters = parameter_count(s.llama)
    rows = []
    for name, result in results.items():
        mfu = 6 * parameters * result["tokens_per_s"] / H200_BF16_PEAK if s.cuda else None
        ratio = result["tokens_per_s"] / results["plain"]["tokens_per_s"]
        rows.append(row(name, result, mfu=mfu, note=f"{ratio:.3f}x plain; {loss_span(result['losses'])}"))
    return {"rows": rows, "raw": {"parameters": parameters, "peak_flops": H200_BF16_PEAK, "batch": s.batch,
                                  "seq_len": s.seq_len, "steps": s.steps, "warmup": s.warmup, "results": results}}


def liger(s: Settings, scratch: Path) -> dict[str, Any]:
    # Triton's CPU interpreter takes seconds a step: there one warm-up step and one timed step
    steps, warmup = (s.steps, s.warmup) if s.cuda else (2, 1)
    args = argparse.Namespace(steps=steps, warmup=warmup, seq_len=s.seq_len)
    results = {}
    for variant in ("stock", "liger"):
        gc.collect()
        results[variant] = gpu_liger.measure(variant, s.batch, args, s.llama, s.device)
        peak_gib = results[variant]["peak_gib"]
        results[variant].update(peak=None if peak_gib is None else peak_gib * 2**30)
    stock, patched = results["stock"], results["liger"]
    difference = max(abs(a - b) for a, b in zip(stock["losses"], patched["losses"]))
    speed = patched["tokens_per_s"] / stock["tokens_per_s"]
    memory = f"{patched['peak'] / stock['peak']:.2f}x" if s.cuda else "-"
    note = (f"{speed:.2f}x tokens/s, {memory} peak (published {PUBLISHED_LIGER['tokens_per_s']:.2f}x, "
            f"{PUBLISHED_LIGER['peak']:.2f}x); max |loss diff| {difference:.1e}")
    if not s.cuda:
        note += "; CPU: RoPE + fused CE on Triton's interpreter, rms_norm/swiglu " + NEEDS_CUDA
    return {"rows": [row("stock", stock, note=loss_span(stock["losses"])), row("liger", patched, note=note)],
            "raw": {"batch": s.batch, "seq_len": s.seq_len, "max_loss_difference": difference, "results": results}}


def trainer_peft(mode: str, args: argparse.Namespace, s: Settings, output_dir: Path) -> dict[str, Any]:
    """LoRA / QLoRA by Trainer + peft on the saved base, as ``peft_memory.measure`` trains them."""
    import peft

    def train(probe: om.Probe) -> dict[str, Any]:
        quantized = {"quantization_config": transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if s.cuda else torch.float32)} if mode == "qlora" else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(args.base, **quantized)
        if mode == "qlora":
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = peft.get_peft_model(model, peft.LoraConfig(**peft_memory.ADAPTER, task_type="CAUSAL_LM"))
        dataset = tiny_dataset(size=args.steps * args.batch_size, seq_len=args.seq_len,
                               vocab_size=model.config.vocab_size, seed=om.SEED)
        trainer = trainer_train(model, dataset, s, probe, args.batch_size, output_dir, learning_rate=1e-4,
                                bf16=s.cuda)
        return {"losses": trainer_losses(trainer), "state": om.state_bytes(trainer.optimizer),
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}

    return measured(s, args.batch_size * args.seq_len, train)


def peft(s: Settings, scratch: Path) -> dict[str, Any]:
    spec = s.peft_model
    if isinstance(spec, dict):
        (scratch / "model.json").write_text(json.dumps(spec))
        spec = str(scratch / "model.json")
    with torch.device(s.device):
        base = om.new_model(spec)
    base.save_pretrained(scratch / "base")  # QLoRA quantizes saved weights
    del base
    args = argparse.Namespace(threads=torch.get_num_threads(), gpu=s.cuda, model=spec, steps=s.steps,
                              warmup=s.warmup, base=str(scratch / "base"), batch_size=s.peft_batch,
                              seq_len=s.peft_seq_len)
    results, rows = {}, []
    for mode in ("lora", "qlora"):
        gc.collect()
        ours = results[f"{mode} engine"] = peft_memory.measure(mode, args, str(scratch / f"{mode}-engine"))
        ours["tokens_per_s"] = ours["steps_per_s"] * args.batch_size * args.seq_len
        theirs = results[f"{mode} trainer"] = trainer_peft(mode, args, s, scratch / f"{mode}-trainer")
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
        rows += [row(f"{mode} engine", ours, note=f"{ratio:.3f}x Trainer; trainable {ours['trainable']:,}; "
                                                  f"{loss_span(ours['losses'])}"),
                 row(f"{mode} Trainer+peft", theirs, note=f"trainable {theirs['trainable']:,}; "
                                                          f"{loss_span(theirs['losses'])}")]
    return {"rows": rows, "raw": {"model": s.peft_model, "batch": args.batch_size, "seq_len": args.seq_len,
                                  "adapter": peft_memory.ADAPTER, "results": results}}


def optimizers(s: Settings, scratch: Path) -> dict[str, Any]:
    names = [name for name in OPTIMIZERS if s.cuda or name not in gpu_optimizers.PAGED_NAMES]
    batch, seq_len = (2, 32) if s.tiny else (8, 64)
    script = gpu_optimizers.__file__
    # om.run_workers hands its workers this process's arguments: gpu_optimizers.py's options
    sys.argv = [script, "--device", s.device, "--model", s.optimizer_model, "--steps", str(s.steps), "--warmup",
                str(s.warmup), "--batch-size", str(batch), "--seq-len", str(seq_len)]
    results = om.run_workers(script, names, timeout=CAPS["optimizers"])
    base = results[om.BASELINE]
    rows = []
    for name in OPTIMIZERS:
        result = results.get(name)
        if result is None:
            rows.append(row(name, note=NEEDS_CUDA + " (paged state lives in CUDA unified memory)"))
        elif "refused" in result or "failed" in result:
            rows.append(row(name, note=result.get("refused") or result.get("failed")))
        else:
            result["tokens_per_s"] = result["steps_per_s"] * batch * seq_len
            ratio = f"{result['state'] / base['state']:.2f}x" if "state" in base else "-"
            rows.append(row(name, result, note=f"state {ratio} adamw_torch; loss falls "
                                               f"{'yes' if gpu_optimizers.loss_falls(result) else 'NO'}; resume "
                                               f"{gpu_optimizers.resume_cell(result)}"))
    return {"rows": rows, "raw": {"model": s.optimizer_model, "batch": batch, "seq_len": seq_len,
                                  "results": results}}


class TokensSeen:
    """An engine plugin: ``num_input_tokens_seen`` at every logged step."""

    name = "tokens_seen"

    def __init__(self):
        self.seen: list[int] = []

    @engine.hookimpl
    def log_metrics(self, run, metrics):
        if "num_input_tokens_seen" in metrics:
            self.seen.append(metrics["num_input_tokens_seen"])


def packing(s: Settings, scratch: Path) -> dict[str, Any]:
    import datasets

    length, vocab = s.packing_length, s.llama["vocab_size"]
    generator = torch.Generator().manual_seed(SEED)
    # documents of 1/16 to all of data.max_length tokens, their eos included; twice as many as padding uses
    sizes = torch.randint(length // 16, length, (2 * s.steps * s.batch,), generator=generator).tolist()
    words = torch.randint(2, vocab, (sum(sizes),), generator=generator).tolist()
    starts = [0, *itertools.accumulate(sizes)]
    documents = datasets.Dataset.from_dict({"text": [" ".join(f"t{word}" for word in words[start:start + size])
                                                     for start, size in zip(starts, sizes)]})
    tokenizer = peft_memory.word_tokenizer(vocab)
    flash = "flash_attention_2"
    variants = {"padding (sdpa)": (False, "sdpa"), "document (sdpa)": ("document", "sdpa")}
    skipped = None
    if not s.cuda:
        skipped = NEEDS_CUDA
    elif importlib.util.find_spec("flash_attn") is None:
        skipped = "skipped: flash_attn not installed"
    else:
        variants[f"document ({flash})"] = ("document", flash)

    def packed_run(name: str, mode: Any, attention: str) -> Callable[[om.Probe], dict[str, Any]]:
        def train(probe: om.Probe) -> dict[str, Any]:
            seen = TokensSeen()
            run = engine.Run({"train": train_keys(s, s.batch, scratch / f"{mode}-{attention}",
                                                  include_num_input_tokens_seen="non_padding"),
                              "data": {"max_length": length, "packing": mode, "eos_token": EOS}},
                             model=new_llama(s.llama, s.device, attention), tokenizer=tokenizer,
                             train_dataset=documents, plugins=[probe, seen])
            run.train()
            first, last = s.warmup - 1, s.steps - 1  # the end of the last warm-up step, of the last step
            tokens_per_s = (seen.seen[last] - seen.seen[first]) / (probe.stamps[last] - probe.stamps[first])
            return {"losses": om.losses(run), "tokens_per_s": tokens_per_s, "tokens_seen": seen.seen}
        return train

    results = {name: measured(s, None, packed_run(name, *variant)) for name, variant in variants.items()}
    padding = results["padding (sdpa)"]["tokens_per_s"]
    rows = [row(name, result, note=f"real tokens; {result['tokens_per_s'] / padding:.2f}x padding; "
                                   f"{loss_span(result['losses'])}") for name, result in results.items()]
    if skipped:
        rows.append(row(f"document ({flash})", note=skipped))
    return {"rows": rows, "raw": {"max_length": length, "batch": s.batch, "documents": len(sizes),
                                  "document_tokens": sum(sizes), "results": results}}


def distributed_worker(s: Settings, out: Path) -> None:
    """In ``torchrun``: each strategy plugin trains in this job's process group; rank 0 writes the figures."""
    import torch.distributed as dist

    if s.cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if s.cuda else "gloo")  # made once; every run's strategy uses it
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-distributed-") as scratch:
        for strategy in ("ddp", "fsdp"):
            def train(probe: om.Probe) -> dict[str, Any]:
                run = engine.Run({"plugins": [strategy], "train": train_keys(s, s.batch, Path(scratch) / strategy),
                                  "data": {"max_length": s.seq_len}},
                                 model=new_llama(s.distributed_llama, s.device),
                                 train_dataset=random_rows(s.distributed_llama, s.batch * s.steps, s.seq_len),
                                 data_collator=DataCollator(0), plugins=[probe])
                run.train()
                return {"losses": om.losses(run), "backend": dist.get_backend(), "world_size": dist.get_world_size()}

            results[strategy] = measured(s, s.batch * s.seq_len, train)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


def distributed(s: Settings, scratch: Path) -> dict[str, Any]:
    out = scratch / "distributed.json"
    command = [__file__, "--distributed-worker", "--device", s.device, "--out", str(out)] + ["--tiny"] * s.tiny
    done = torchrun(command, nproc=1, timeout=CAPS["distributed"] - 5)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exit status {done.returncode}: {om.error_message(done.stderr)}")
    results = json.loads(out.read_text())
    rows = []
    for strategy, result in results.items():
        finite = all(math.isfinite(loss) for loss in result["losses"]) and len(result["losses"]) == s.steps
        note = f"losses finite: {'yes' if finite else 'NO'}; {loss_span(result['losses'])}"
        if not s.cuda:
            note += f"; nccl {NEEDS_CUDA} (gloo here)"
        rows.append(row(f"{strategy} ({result['backend']}, 1 process)", result, note=note))
    return {"rows": rows, "raw": {"model": s.distributed_llama, "batch": s.batch, "seq_len": s.seq_len,
                                  "results": results}}


SECTIONS = {"throughput": throughput, "liger": liger, "peft": peft, "optimizers": optimizers, "packing": packing,
            "distributed": distributed}


# ---------------------------------------------------------------------------- the driver


def run_section(name: str, s: Settings, out: Path) -> None:
    """In the section's own process: run it, write ``<name>.json``."""
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as scratch:
        result = SECTIONS[name](s, Path(scratch))
    (out / f"{name}.json").write_text(json.dumps({"section": name, **result}, indent=1, default=str))


def spawn_section(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``name`` in a fresh process (its own session, so that its workers die with it) under its cap; its
    result, or ``failed`` with the first line of its error."""
    command = [sys.executable, __file__, "--section", name, "--device", args.device, "--out", str(out)]
    command += ["--tiny"] * args.tiny
    # Triton's CPU interpreter, set before Triton loads; on a GPU the kernels compile
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if name == "liger" and args.device == "cpu" else {})}
    log, result_file = out / f"{name}.log", out / f"{name}.json"
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            status = process.wait(timeout=CAPS[name])
            failure = None if status == 0 else f"exit status {status}: {om.error_message(log.read_text())}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            failure = f"no result within its cap of {CAPS[name]} s"
    result = json.loads(result_file.read_text()) if failure is None else {"section": name, "failed": failure}
    result["seconds"] = time.perf_counter() - started
    result_file.write_text(json.dumps(result, indent=1, default=str))
    print(f"  {name:12s} {result['seconds']:5.0f} s  {'FAILED: ' + failure if failure else 'done'}", flush=True)
    return result


def table(results: dict[str, dict[str, Any]], device: str) -> str:
    def cell(value: float | None, scale: float = 1, digits: int = 0) -> str:
        return "-" if value is None else f"{value / scale:.{digits}f}"

    lines = [f"{'section':12s} {'variant':32s} {'tokens/s':>10s} {'peak MiB':>9s} {'state MiB':>9s} {'MFU':>6s}  note"]
    for name, result in results.items():
        entries = [row("FAILED", note=result["failed"][:200])] if "failed" in result else result["rows"]
        for entry in entries:
            mfu = "-" if entry["mfu"] is None else f"{100 * entry['mfu']:.1f}%"
            lines.append(f"{name:12s} {entry['variant']:32s} {cell(entry['tokens_per_s']):>10s} "
                         f"{cell(entry['peak'], MIB):>9s} {cell(entry['state'], MIB, 2):>9s} {mfu:>6s}  "
                         f"{entry['note']}")
    peak = "torch.cuda.max_memory_allocated" if device == "cuda" else "resident-memory high-water mark"
    lines += ["", f"(tokens/s: after the warm-up steps; peak: {peak} over the timed steps above the memory before "
              "the model was built (liger: the whole run); state: tensors in optimizer.state_dict(); MFU: 6 x "
              "parameters x tokens/s / 989e12 FLOP/s, the H200's bf16 dense peak)",
              "seconds per section: " + ", ".join(f"{name} {result['seconds']:.0f}"
                                                  for name, result in results.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated of {', '.join(SECTIONS)}")
    parser.add_argument("--out", help="folder for the raw numbers (default benchmarks/out/gpu-<UTC time>/)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu checks the script's logic where no GPU is lent (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny models, few steps: a check of the logic")
    parser.add_argument("--section", choices=tuple(SECTIONS), help=argparse.SUPPRESS)  # run one, in this process
    parser.add_argument("--distributed-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    s = settings(args.device, args.tiny)
    if args.distributed_worker:
        return distributed_worker(s, Path(args.out))
    if args.section:
        return run_section(args.section, s, Path(args.out))
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        parser.error(f"--only: expected names from {', '.join(SECTIONS)}, got {args.only!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (gpu_check.py needs a GPU; --device cpu --tiny checks its logic)")
        sys.exit(1)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or Path(__file__).parent / "out" / f"gpu-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (a logic check, not a benchmark)"
    print(f"gpu_check: {', '.join(names)} on {device}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; caps {sum(CAPS[name] for name in names)} s in all; raw numbers in {out}",
          flush=True)
    results = {name: spawn_section(name, args, out) for name in names}
    text = table(results, args.device)
    print()
    print(text)
    (out / "table.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
