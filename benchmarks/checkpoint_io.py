"""Checkpoint save and load time and bytes: engine against transformers' Trainer, two models:

* ``tiny``  the default run's ``tiny-llama``, built by ``engine.builtin.models.build_model`` from the
            builtin config with the default run's vocabulary size (1024);
* ``100m``  a LlamaForCausalLM built from a LlamaConfig: hidden 768, 12 layers (12 heads, 4
            KV heads), intermediate 2048, vocab 32000, tied embeddings (100,092,672 params).

Each model is built once and deep-copied for both contenders. Each gets AdamW (``adamw_torch``,
lr 1e-3, weight decay 0) and a linear schedule and trains one step on the same batch, so the
optimizer state is populated and the weights stay identical. Then, per round:

* ``engine``   save: ``checkpoint.save(run)`` on a set-up ``engine.Run`` (with the finite-weights
               check and the manifest's xxh3-64 checksum of every file); load: ``check_checkpoint``
               (which verifies every checksum) + ``restore_checkpoint`` (weights, optimizer,
               scheduler, RNG, state) into a fresh set-up Run;
* ``trainer``  save: ``trainer._save_checkpoint(model, trial=None)`` (what ``Trainer.train``
               calls) after ``create_optimizer_and_scheduler``; load: what ``Trainer.train``
               does on resume: ``_load_from_checkpoint``, ``TrainerState.load_from_json``,
               ``_load_optimizer_and_scheduler``, ``_load_rng_state``, into a fresh Trainer.

Building the fresh Run / Trainer (model copy, optimizer) is not timed. Bytes are per checkpoint
folder: weights (``model.safetensors*``), ``optimizer.pt`` and the rest (config, scheduler, RNG,
state, Trainer's ``training_args.bin``). Neither contender fsyncs: saves write into the page
cache and loads read what was just written, so the times compare the work, not the disk; an
untimed ``os.sync()`` before each save and load keeps one's write-back out of the next's time, and an
untimed ``gc.collect()`` frees the previous round's Run or Trainer for both alike (a Run is freed by the
collector, a Trainer as its last reference goes: without it a Trainer's load reused freed pages that an
engine load had to fault in, and the ratio measured the heap, 0.3-2.0 s for the same load).

Round 0 is an untimed warm-up, then ``--repeats`` rounds alternate which contender goes first;
checkpoints are deleted once measured. The table gives medians over rounds (time ratios: of the
ratio within a round). The integrity work inside the engine's times (finite check and checksums at
save, verification at load) is also timed on its own and printed per model. Checks: both
checkpoints' safetensors weights are compared tensor by tensor, and each load must restore the
trained weights and the optimizer's step. Exits 0.

Run::

    .venv/bin/python benchmarks/checkpoint_io.py                  # ~2 minutes on 2 CPU cores
    .venv/bin/python benchmarks/checkpoint_io.py --only tiny --repeats 5 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

import engine
from engine import checkpoint
from engine.config import default_run_mapping
from engine.builtin.data.collators import DataCollator
from engine.builtin.models import build_model
from engine.kit.checkpoint import verify_manifest
from engine.testing import tiny_dataset

LEARNING_RATE, MAX_STEPS, BATCH_SIZE, SEQ_LEN = 1e-3, 10, 4, 64
MB = 1e6


def build_tiny() -> torch.nn.Module:
    return build_model(engine.Run(default_run_mapping()).config.train)  # no tokenizer: vocab 1024


def build_100m() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=True))


MODELS = {"tiny": build_tiny, "100m": build_100m}


class Contender:
    """A copy of the model trained one step in a Run / Trainer (``owner``), saved and restored."""

    name = scheduler_attr = ""

    def __init__(self, model, dataset, batch, root: Path):
        self.dataset, self.output_dir = dataset, root / self.name
        self.owner = self.fresh(copy.deepcopy(model))
        self.owner.model.train()
        self.owner.model(**batch).loss.backward()
        self.owner.optimizer.step()
        getattr(self.owner, self.scheduler_attr).step()
        self.owner.optimizer.zero_grad(set_to_none=True)
        self.owner.state.global_step = 1

    def restored(self, fresh) -> bool:
        """Whether a load gave back the trained weights and an optimizer state after one step."""
        pairs = zip(fresh.model.state_dict().values(), self.owner.model.state_dict().values())
        steps = {float(s["step"]) for s in fresh.optimizer.state.values()}
        return all(torch.equal(a, b) for a, b in pairs) and steps == {1.0}


class EngineContender(Contender):
    name, scheduler_attr = "engine", "scheduler"

    def fresh(self, model) -> engine.Run:
        run = engine.Run({"train": {
            "output_dir": str(self.output_dir), "max_steps": MAX_STEPS, "per_device_train_batch_size": BATCH_SIZE,
            "learning_rate": LEARNING_RATE, "weight_decay": 0.0, "lr_scheduler_type": "linear",
            "warmup_steps": 0, "optim": "adamw_torch", "save_strategy": "no", "disable_tqdm": True,
            "use_cpu": True, "log_level": "error"}},
            model=model, train_dataset=self.dataset, data_collator=DataCollator(0))
        run.setup()
        return run

    def save(self) -> Path:
        return checkpoint.save(self.owner)

    def restore(self, run: engine.Run, path: Path) -> None:
        run.hook.check_checkpoint(run=run, path=path)  # what a resume does: builtin.resume's checks and restore
        run.hook.restore_checkpoint(run=run, path=path)


class TrainerContender(Contender):
    name, scheduler_attr = "trainer", "lr_scheduler"

    def fresh(self, model) -> transformers.Trainer:
        # safetensors is the only format in transformers 5 (TrainingArguments has no save_safetensors)
        args = transformers.TrainingArguments(
            output_dir=str(self.output_dir), max_steps=MAX_STEPS, per_device_train_batch_size=BATCH_SIZE,
            learning_rate=LEARNING_RATE, weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0,
            optim="adamw_torch", report_to=[], disable_tqdm=True, use_cpu=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=self.dataset, data_collator=DataCollator(0))
        trainer.create_optimizer_and_scheduler(num_training_steps=MAX_STEPS)
        return trainer

    def save(self) -> Path:
        self.owner._save_checkpoint(self.owner.model, trial=None)
        return self.output_dir / f"checkpoint-{self.owner.state.global_step}"

    def restore(self, trainer: transformers.Trainer, path: Path) -> None:
        """What ``Trainer.train(resume_from_checkpoint=path)`` loads."""
        trainer._load_from_checkpoint(str(path))
        trainer.state = transformers.TrainerState.load_from_json(str(path / "trainer_state.json"))
        trainer._load_optimizer_and_scheduler(str(path))
        trainer._load_rng_state(str(path))


def integrity_work(run: engine.Run, path: Path) -> dict[str, float]:
    """The parts of the engine's save and load that a plain save does not do, timed alone.

    Save: the check that the weights are finite and the xxh3-64 checksum of every file (for the manifest);
    load: verifying the manifest (sizes and checksums, part of ``validate``).
    """
    parts = {}
    started = time.perf_counter()
    checkpoint.check_finite_weights(run, run.strategy.model_state_dict(run.model), path.name)
    parts["finite check at save"] = time.perf_counter() - started
    names = sorted(f.name for f in path.iterdir() if f.name != checkpoint.MARKER)
    started = time.perf_counter()
    checkpoint.file_checksums(path, names)
    parts["checksums at save"] = time.perf_counter() - started
    started = time.perf_counter()
    verify_manifest(path)
    parts["verify at load"] = time.perf_counter() - started
    return parts


def folder_bytes(path: Path) -> dict[str, int]:
    sizes = {"total": 0, "weights": 0, "optimizer": 0, "rest": 0}
    for file in path.iterdir():
        kind = ("weights" if file.name.startswith("model.safetensors") else
                "optimizer" if file.name == "optimizer.pt" else "rest")
        for key in (kind, "total"):
            sizes[key] += file.stat().st_size
    return sizes


def compare_weights(a: Path, b: Path) -> str:
    wa, wb = ({k: v for f in sorted(p.glob("*.safetensors")) for k, v in load_file(f).items()} for p in (a, b))
    if wa.keys() != wb.keys():
        return f"DIFFERENT tensor names: {sorted(wa.keys() ^ wb.keys())}"
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    return f"identical ({len(wa)} tensors)" if not differ else f"DIFFERENT in {len(differ)} of {len(wa)} tensors"


def bench_model(key: str, args: argparse.Namespace, root: Path) -> list[tuple[str, ...]]:
    started = time.perf_counter()
    model = MODELS[key]()
    params, config = sum(p.numel() for p in model.parameters()), model.config
    dataset = tiny_dataset(size=4 * BATCH_SIZE, seq_len=SEQ_LEN, vocab_size=config.vocab_size)
    batch = DataCollator(0)([dataset[i] for i in range(BATCH_SIZE)])
    contenders = [cls(model, dataset, batch, root / key) for cls in (EngineContender, TrainerContender)]
    del model
    print(f"\n{key}: {params:,} parameters (hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab "
          f"{config.vocab_size}, tied embeddings {config.tie_word_embeddings}); built and trained one step in "
          f"{time.perf_counter() - started:.1f} s (not counted)", flush=True)

    times = {c.name: {"save": [], "load": []} for c in contenders}
    integrity: dict[str, list[float]] = {}
    sizes = {}
    for round_index in range(args.repeats + 1):
        order = contenders if round_index % 2 else contenders[::-1]
        kept = {}  # the warm-up keeps both checkpoints for the comparison; timed rounds delete at once
        for contender in order:
            os.sync()
            gc.collect()
            started = time.perf_counter()
            path = contender.save()
            save_s = time.perf_counter() - started
            sizes[contender.name] = folder_bytes(path)
            fresh = contender.fresh(copy.deepcopy(contender.owner.model))
            os.sync()
            gc.collect()
            started = time.perf_counter()
            contender.restore(fresh, path)
            load_s = time.perf_counter() - started
            if not contender.restored(fresh):
                print(f"  WARNING: {contender.name}'s load did not restore the trained weights and optimizer step")
            del fresh
            if round_index:
                times[contender.name]["save"].append(save_s)
                times[contender.name]["load"].append(load_s)
                if contender.name == "engine":
                    for part, seconds in integrity_work(contender.owner, path).items():
                        integrity.setdefault(part, []).append(seconds)
                shutil.rmtree(path)
            else:
                kept[contender.name] = path
            print(f"  round {round_index}{' (warm-up)' if not round_index else ''} {contender.name:8s} "
                  f"save {save_s:7.3f} s  load {load_s:7.3f} s", flush=True)
        for name, path in kept.items():
            print(f"  {name} files: " + ", ".join(
                f"{f.name} {f.stat().st_size / MB:.3f}" for f in sorted(path.iterdir())) + " (MB)")
        if kept:
            print(f"  weights in both checkpoints: {compare_weights(kept['engine'], kept['trainer'])}")
            for path in kept.values():
                shutil.rmtree(path)

    total_mb = sizes["engine"]["total"] / MB
    print("  integrity work inside the engine's times (medians): " + ", ".join(
        f"{part} {statistics.median(values):.3f} s" for part, values in integrity.items())
        + f"; checksums at {total_mb / statistics.median(integrity['checksums at save']):.0f} MB/s", flush=True)
    rows = [(key, f"{params:,}", name, *(f"{statistics.median(times[name][op]):.3f}" for op in ("save", "load")),
             *(f"{sizes[name][kind] / MB:.3f}" for kind in ("total", "weights", "optimizer", "rest"))) for name in times]
    ratio = {op: statistics.median(e / t for e, t in zip(times["engine"][op], times["trainer"][op]))
             for op in ("save", "load")}
    rows.append((key, "", "engine/trainer", f"{ratio['save']:.3f}x", f"{ratio['load']:.3f}x",
                 *(f"{sizes['engine'][kind] / sizes['trainer'][kind]:.3f}x"
                   for kind in ("total", "weights", "optimizer", "rest"))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="Checkpoint save and load time and bytes: engine against Trainer.")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per model (default 3)")
    parser.add_argument("--only", choices=list(MODELS), help="one model only (default: both)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch.set_num_threads (default: torch's default)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, torch threads {args.threads}; "
          f"{args.repeats} timed rounds after 1 warm-up round", flush=True)

    rows = [("model", "params", "contender", "save s", "load s", "total MB", "weights MB", "optimizer MB", "rest MB")]
    with tempfile.TemporaryDirectory(prefix="checkpoint-io-") as root:
        for key in [args.only] if args.only else list(MODELS):
            rows += bench_model(key, args, Path(root))

    widths = [max(len(cell) for cell in column) for column in zip(*rows)]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    print(f"(medians over {args.repeats} rounds; MB = 10^6 bytes; 'rest' = config, scheduler, RNG, state and "
          "other small files; time ratios are medians of the ratio within a round)")


if __name__ == "__main__":
    main()
