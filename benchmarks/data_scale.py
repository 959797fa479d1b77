"""Data at scale: time to the first optimizer step and peak memory on a generated corpus.

    python benchmarks/data_scale.py                    # 200 MB JSONL: engine first / cached start vs datasets
    python benchmarks/data_scale.py --streaming-gb 2   # also: 2 GB JSONL, data.streaming = true, 50 steps

Generates a seeded JSONL of documents of 50-400 words (once; kept in --workdir), saves a
1k-token BPE tokenizer trained on its first megabytes, then runs, each in a fresh process:

(a) the engine, first start: ``Run`` with ``data.train`` = the file and an empty cache, until its
    first optimizer step (a plugin exits there); it trains its tokenizer on the corpus
    (``data.tokenizer = "train"``; ``--engine-tokenizer saved`` gives it the yardstick's instead);
(b) the engine, second start: the same run, the cache from (a);
(c) the yardstick: ``datasets.load_dataset("json")`` + ``map(tokenize, batched=True, num_proc=2)``
    with the same tokenizer and an empty cache;
(d) the yardstick's cached start, the floor for (b): (c) again from its cache, then the default
    model built from config and one AdamW step, as a hand-written loop would.

"of which data" is the time the engine spent in create_datasets (reading, tokenizing, packing
or reading the cache); the rest of a start is imports, the model and the first step.
Peak memory is the largest sum of PSS (RSS with shared pages split among the processes that
share them) over the process and its children (the map workers), sampled every 50 ms. Targets (issue 11): (a) peak <= 1.5 GB and time <= 1.2x (c); (b) <= 10 s; streaming peak < 2 GB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil

ENGINE_CHILD = textwrap.dedent("""
    import os, sys, time
    import engine

    class FirstStep:
        name = "first_step"

        @engine.hookimpl(wrapper=True)
        def create_datasets(self, run):
            start = time.perf_counter()
            built = yield
            print(f"data seconds {time.perf_counter() - start:.2f}")
            return built

        @engine.hookimpl
        def on_step_end(self, run):
            if run.state.global_step >= int(sys.argv[5]):
                sys.stdout.flush()
                os._exit(0)

    config = {
        "train": {"max_steps": int(sys.argv[5]) + 1, "per_device_train_batch_size": 8, "save_strategy": "no",
                  "eval_strategy": "no", "disable_tqdm": True, "output_dir": sys.argv[3], "logging_steps": 10,
                  "load_best_model_at_end": False, "save_final_model": False},
        "data": {"train": sys.argv[1], "tokenizer": sys.argv[2], "cache_dir": sys.argv[4], "max_length": 128,
                 "num_proc": 2, "streaming": sys.argv[6] == "1"},
    }
    engine.Run(config, plugins=[FirstStep()]).train()
""")

YARDSTICK_CHILD = textwrap.dedent("""
    import sys
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
    rows = datasets.load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[3])
    tokenized = rows.map(lambda batch: tokenizer(batch["text"]), batched=True, num_proc=2,
                         remove_columns=rows.column_names)
    print(len(tokenized))
""")

# The floor a cached start is measured against: the yardstick's script again (its map now a cache
# hit), then what any loop does before its first step: the engine's default model (tiny-llama) built
# from config and one AdamW step on a batch of 8 rows cut to 128 tokens.
YARDSTICK_STEP_CHILD = YARDSTICK_CHILD + textwrap.dedent("""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, vocab_size=len(tokenizer),
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids = torch.tensor([row[:128] for row in tokenized.select(range(64))["input_ids"] if len(row) >= 128][:8])
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    print("first step")
""")


def generate(path: Path, size_bytes: int, seed: int = 0) -> None:
    """Seeded documents of 50-400 words drawn from a Zipf-like vocabulary of 20k pseudo-words."""
    if path.exists() and path.stat().st_size >= size_bytes:
        return
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
    vocab = np.array(["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(20_000)])
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()
    written = 0
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        while written < size_bytes:
            lengths = rng.integers(50, 401, size=1000)
            words = vocab[rng.choice(len(vocab), size=int(lengths.sum()), p=weights)]
            cuts = np.cumsum(lengths)[:-1]
            lines = "".join(json.dumps({"text": " ".join(doc)}) + "\n" for doc in np.split(words, cuts))
            out.write(lines)
            written += len(lines.encode())
    tmp.rename(path)


def save_tokenizer(corpus: Path, folder: Path) -> None:
    if (folder / "tokenizer.json").exists():
        return
    from engine.builtin.data.tokenizer import train_tokenizer

    with corpus.open(encoding="utf-8") as lines:
        texts = [json.loads(line)["text"] for line, _ in zip(lines, range(2000))]
    train_tokenizer(texts, 1024).save_pretrained(folder)


def measure(argv: list[str], log: Path) -> tuple[float, float, int, float | None]:
    """(seconds, peak memory in GB of the process tree, exit status, seconds in create_datasets
    if the child printed them) of a child process; its output goes to ``log``."""
    start = time.perf_counter()
    with log.open("w") as out:
        process = psutil.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    peak = 0
    while process.poll() is None:
        try:
            tree = [process, *process.children(recursive=True)]
            # PSS: forked workers share the parent's pages; RSS would count them once per process
            peak = max(peak, sum(p.memory_full_info().pss for p in tree if p.is_running()))
        except psutil.Error:
            pass  # a worker ended between listing and reading
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    output = log.read_text(errors="replace")
    if process.returncode != 0:
        print(output[-3000:], file=sys.stderr)
    data = [float(line.split()[-1]) for line in output.splitlines() if line.startswith("data seconds ")]
    return seconds, peak / 1e9, process.returncode, data[0] if data else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/engine-data-scale")
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--streaming-gb", type=float, default=0, help="also the streaming check on a corpus this big")
    parser.add_argument("--engine-tokenizer", choices=("train", "saved"), default="train", help=(
        "train: the engine trains its tokenizer on the corpus (data.tokenizer = 'train', the default for data "
        "without a model folder); saved: it reads the yardstick's"))
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus-{args.size_mb}mb.jsonl"
    generate(corpus, args.size_mb * 10**6)
    tokenizer = work / "tokenizer"
    save_tokenizer(corpus, tokenizer)
    for folder in ("cache-engine", "cache-yardstick", "out"):
        shutil.rmtree(work / folder, ignore_errors=True)
    python = sys.executable
    def engine_argv(name: str, data: Path, steps: int, streaming: bool) -> list[str]:
        engine_tokenizer = "train" if args.engine_tokenizer == "train" else str(tokenizer)
        return [python, "-c", ENGINE_CHILD, str(data), engine_tokenizer, str(work / "out" / name),
                str(work / "cache-engine"), str(steps), "1" if streaming else "0"]

    first = measure(engine_argv("first", corpus, 1, False), work / "first.log")
    second = measure(engine_argv("second", corpus, 1, False), work / "second.log")
    yardstick = measure([python, "-c", YARDSTICK_CHILD, str(corpus), str(tokenizer), str(work / "cache-yardstick")],
                        work / "yardstick.log")
    yardstick_cached = measure([python, "-c", YARDSTICK_STEP_CHILD, str(corpus), str(tokenizer),
                                str(work / "cache-yardstick")], work / "yardstick-cached.log")
    print(f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.0f} MB)")
    print(f"{'':44s} {'seconds':>8s} {'of which data':>13s} {'peak GB':>8s} {'status':>6s}")
    for name, (seconds, peak, status, data) in (
            ("(a) engine, first start", first), ("(b) engine, cached start", second),
            ("(c) datasets load_dataset + map(num_proc=2)", yardstick),
            ("(d) (c) cached + model + first step", yardstick_cached)):
        print(f"{name:44s} {seconds:8.1f} {'' if data is None else f'{data:.1f}':>13s} {peak:8.2f} {status:6d}")
    print(f"first start / yardstick time: {first[0] / yardstick[0]:.2f}x (target <= 1.2x)")
    print(f"first start / yardstick peak RSS: {first[1] / yardstick[1]:.2f}x; engine peak {first[1]:.2f} GB "
          "(target <= 1.5 GB)")
    print(f"cached start: {second[0]:.1f} s (target <= 10 s), {second[0] / first[0]:.2f}x the first start, "
          f"{second[0] / yardstick_cached[0]:.2f}x the plain script's cached start")
    if args.streaming_gb:
        big = work / f"corpus-{args.streaming_gb:g}gb.jsonl"
        generate(big, int(args.streaming_gb * 10**9), seed=1)
        seconds, peak, status, _ = measure(engine_argv("streaming", big, 50, True), work / "streaming.log")
        print(f"streaming {big.stat().st_size / 1e9:.1f} GB, 50 steps: {seconds:.1f} s, peak {peak:.2f} GB "
              f"(target < 2 GB), status {status}")


if __name__ == "__main__":
    main()
