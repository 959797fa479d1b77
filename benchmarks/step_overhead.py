"""Per-step and start-up overhead of engine against a plain PyTorch loop and transformers' Trainer.

The same tiny Llama (same initial weights), the same fixed-length token rows, batch size,
AdamW (lr 1e-3, weight decay 0, max_grad_norm 1.0, linear schedule, no warmup), fp32, no
accumulation, no eval, no checkpoints and (practically) no logging are trained for the same
number of steps by

* ``plain``   a hand-written loop: DataLoader, ``model(**batch).loss``, backward,
              ``clip_grad_norm_``, ``optimizer.step``, ``scheduler.step``, ``zero_grad``;
* ``engine``  ``engine.Run({"train": ...}, model=..., train_dataset=...).train()``, builtins only;
* ``trainer`` ``transformers.Trainer(...).train()``;
* ``callbacks`` the engine given one TrainerCallback that does nothing (the adapter dispatching
              every Trainer event; without callbacks the adapter is not registered at all).

The model's ``config.use_cache`` is off for all (Trainer and the engine turn it off; a training
forward has no use for the key/value cache).

Measured per contender and round:

* step time in the steady state: a timestamp at the end of every optimizer step (a list append
  in the plain loop, an ``on_step_end`` plugin hook / a TrainerCallback otherwise); the first
  ``--warmup`` steps are left out; per run the median step time (robust to the odd step that
  the OS or a busy neighbour stretched) and the mean; steps/s = 1 / median step time;
* CPU time per step the same way, from the thread's CPU clock (``time.thread_time``) at the same
  points: the time a virtual machine's host or another process took from the run is not in it, so
  on a noisy machine (wall-clock step times that swing by 20 % from round to round) its ratio is
  the steadier figure of the work each contender does per step;
* start-up: from just before constructing (optimizer + DataLoader + scheduler / ``Run(...)`` /
  ``TrainingArguments(...)`` + ``Trainer(...)``) to the end of the first optimizer step. Imports
  are done and the model is built (and copied) beforehand, so neither is counted.

The contenders run interleaved, ``--rounds`` short runs each in rotating order, so that drift
on the machine hits all of them alike. The table gives medians over rounds; the ratios are the
medians over rounds of the ratio within a round (neighbouring runs), which cancels slow drift.
Before the first round a few untimed plain steps warm up torch itself (kernels, allocator),
which is nobody's overhead. As a check that the three do the same work (same weights, batches,
order and hyper-parameters), it prints each one's mean training loss and the trained model's
loss on a fixed batch: they should agree to about 4 decimals.

Targets (from the issue): engine >= 0.99x the plain loop's steps/s at a ~20 ms step, and
engine's start-up within +0.1 s of the plain loop's. The script reports whether they are met
but always exits 0.

Run::

    .venv/bin/python benchmarks/step_overhead.py                  # ~1.5 minutes on 2 idle CPU cores
    .venv/bin/python benchmarks/step_overhead.py --rounds 5 --steps 60 --threads 1
    .venv/bin/python benchmarks/step_overhead.py --only plain,engine
    .venv/bin/python benchmarks/step_overhead.py --bar            # the progress bars on (in a pty)
    .venv/bin/python benchmarks/step_overhead.py --only plain,engine --bar --sample-rounds 5

``--bar``: engine and Trainer draw their tqdm bars. When stderr is not a terminal, the script
opens a pseudo-terminal (120x40) and makes it stderr, with a thread reading the screen's bytes,
so the bars are drawn (and their writes paid) as in a terminal whatever runs the script.

``--sample-rounds N``: after the rounds, the cost of one round of the ``samples`` plugin
(``--sample-prompts`` prompts x ``--sample-tokens`` new tokens, greedy, on the same model
shape, in eval mode with the RNG forked) timed N times; reported apart, in seconds and in
engine steps. The step-time contest itself runs without samples.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import transformers

import engine
from engine.builtin.data.collators import DataCollator
from engine.testing import tiny_dataset
from engine_clock import StepClock

LEARNING_RATE = 1e-3
MAX_GRAD_NORM = 1.0
SEED = 42
CONTENDERS = ("plain", "engine", "trainer", "callbacks")


@dataclass
class Result:
    """One contender's run: construction start and the end time of every optimizer step."""

    name: str
    started: float
    stamps: list[float] = field(default_factory=list)
    cpu_stamps: list[float] = field(default_factory=list)  # thread CPU time at the same points
    train_loss: float = float("nan")
    check_loss: float = float("nan")

    @property
    def startup(self) -> float:
        return self.stamps[0] - self.started

    def step_times(self, warmup: int, stamps: list[float] | None = None) -> list[float]:
        """Durations of the steps after the first ``warmup`` (at least the first is left out)."""
        stamps = self.stamps if stamps is None else stamps
        first = max(warmup, 1) - 1  # the end of the last warm-up step
        return [b - a for a, b in zip(stamps[first:], stamps[first + 1:])]

    def step_cpu_times(self, warmup: int) -> list[float]:
        return self.step_times(warmup, self.cpu_stamps)

    def mean_step(self, warmup: int) -> float:
        return statistics.fmean(self.step_times(warmup))


# ---------------------------------------------------------------------------- shared setup


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq_len, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def linear_decay(total: int):
    return lambda step: max(0.0, (total - step) / max(1, total))


@torch.no_grad()
def check_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Loss of the trained model on a fixed batch: all three should land close together."""
    model.eval()
    return float(model(**batch).loss)


# ---------------------------------------------------------------------------- the contenders


def run_plain(model, dataset, collator, args, output_dir) -> Result:
    result = Result("plain", time.perf_counter())
    # the order engine and Trainer use too (a permutation drawn from the seed), so that all three
    # see the same batches and their losses agree
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED)).tolist()
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=order, collate_fn=collator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_decay(args.steps))
    model.train()
    stamps, cpu_stamps = result.stamps, result.cpu_stamps
    total_loss = torch.zeros(())
    step = 0
    while step < args.steps:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            total_loss += loss.detach()
            step += 1
            stamps.append(time.perf_counter())
            cpu_stamps.append(time.thread_time())
            if step == args.steps:
                break
    result.train_loss = float(total_loss) / step
    return result


def run_engine(model, dataset, collator, args, output_dir, callbacks=None) -> Result:
    result = Result("engine" if callbacks is None else "callbacks", time.perf_counter())
    run = engine.Run(
        {"train": {
            "output_dir": output_dir, "max_steps": args.steps, "per_device_train_batch_size": args.batch_size,
            "learning_rate": LEARNING_RATE, "weight_decay": 0.0, "max_grad_norm": MAX_GRAD_NORM,
            "lr_scheduler_type": "linear", "warmup_steps": 0, "optim": "adamw_torch", "seed": SEED,
            "logging_steps": args.steps, "save_strategy": "no", "eval_strategy": "no",
            "disable_tqdm": not args.bar, "use_cpu": True, "dataloader_num_workers": 0,
        }, "data": {"max_length": args.seq_len}},
        model=model, train_dataset=dataset, data_collator=collator,
        plugins=[StepClock(result.stamps, cpu_stamps=result.cpu_stamps)],
        callbacks=callbacks)
    summary = run.train()
    result.train_loss = summary["train_loss"]
    return result


def run_engine_with_a_callback(model, dataset, collator, args, output_dir) -> Result:
    """The engine with the TrainerCallback adapter loaded for one callback that does nothing: every
    Trainer event dispatched (DefaultFlowCallback's included). Without callbacks the adapter is not
    registered at all, so ``engine`` above is the run that has it loaded and unused."""
    return run_engine(model, dataset, collator, args, output_dir, callbacks=[transformers.TrainerCallback()])


def run_trainer(model, dataset, collator, args, output_dir) -> Result:
    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            result.stamps.append(time.perf_counter())
            result.cpu_stamps.append(time.thread_time())

    result = Result("trainer", time.perf_counter())
    training_args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=LEARNING_RATE, weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM,
        lr_scheduler_type="linear", warmup_steps=0, optim="adamw_torch",  # its default is the fused AdamW
        seed=SEED, logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=not args.bar, use_cpu=True, dataloader_num_workers=0, dataloader_pin_memory=False)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[Clock()])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # it prints the final metrics
    output = trainer.train()
    result.train_loss = output.training_loss
    return result


RUNNERS = {"plain": run_plain, "engine": run_engine, "trainer": run_trainer, "callbacks": run_engine_with_a_callback}


def stderr_on_a_pty() -> None:
    """Make stderr a pseudo-terminal (120x40) whose screen a daemon thread reads and counts (the
    report goes to stdout as ever)."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    screen = {"bytes": 0}

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            screen["bytes"] += len(chunk)

    threading.Thread(target=drain, daemon=True).start()
    os.dup2(slave, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    stderr_on_a_pty.screen = screen


def console_step_cost(steps: int = 20000) -> float:
    """Seconds per call of the console plugin's on_step_end with its bar drawn on stderr: the
    bar's whole per-step cost, timed alone so that the machine's noise cannot hide or inflate it."""
    from types import SimpleNamespace

    from engine.builtin.console import Console

    console = Console()
    state = SimpleNamespace(max_steps=steps, global_step=0)
    run = SimpleNamespace(state=state, config=SimpleNamespace(train=SimpleNamespace(disable_tqdm=False)),
                          strategy=SimpleNamespace(is_main_process=True))
    console.on_train_start(run)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        state.global_step = step
        console.on_step_end(run)
    elapsed = time.perf_counter() - started
    console.on_train_end(run)
    return elapsed / steps


def sample_round_cost(args: argparse.Namespace) -> list[float]:
    """Seconds of one samples round (the plugin's generate(), as it runs at an evaluation), N times."""
    from types import SimpleNamespace

    from engine.builtin.samples import generate
    from engine.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer(max(args.vocab_size, 300))
    model = build_model(argparse.Namespace(**{**vars(args), "vocab_size": len(tokenizer),
                                              "seq_len": max(args.seq_len, 256)}))
    run = SimpleNamespace(model=model, tokenizer=tokenizer, state=SimpleNamespace(global_step=0),
                          strategy=SimpleNamespace(autocast=contextlib.nullcontext))
    prompts = [f"record {i}: the quick brown fox" for i in range(args.sample_prompts)]
    times = []
    for _ in range(args.sample_rounds + 1):  # the first is a warm-up (generate's first-call costs)
        started = time.perf_counter()
        generate(run, prompts, max_new_tokens=args.sample_tokens)
        times.append(time.perf_counter() - started)
    return times[1:]


# ---------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="steps of each run left out of the step times (default 10)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch.set_num_threads for all contenders (default: torch's default)")
    parser.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated subset of plain,engine,trainer,callbacks")
    parser.add_argument("--bar", action="store_true", help=(
        "engine and Trainer draw their progress bars (into a pseudo-terminal when stderr is not a terminal)"))
    parser.add_argument("--sample-rounds", type=int, default=0, help="time one samples round N times (default 0)")
    parser.add_argument("--sample-prompts", type=int, default=4, help="prompts per samples round (default 4)")
    parser.add_argument("--sample-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - set(CONTENDERS)
    if unknown or not names:
        parser.error(f"--only: expected names from {', '.join(CONTENDERS)}, got {args.only!r}")
    if args.steps <= args.warmup + 1:
        parser.error("--steps must be larger than --warmup + 1")

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    if args.bar and not sys.stderr.isatty():
        stderr_on_a_pty()
    started = time.perf_counter()
    reference = build_model(args)
    build_time = time.perf_counter() - started
    # one epoch holds all the steps: no epoch boundary inside a run
    dataset = tiny_dataset(size=args.steps * args.batch_size, seq_len=args.seq_len, vocab_size=args.vocab_size)
    collator = DataCollator(0)
    fixed_batch = collator([dataset[i] for i in range(args.batch_size)])
    params = sum(p.numel() for p in reference.parameters())
    print(f"model: Llama {args.layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}, "
          f"{params / 1e6:.2f}M params (built in {build_time:.2f} s, not counted); batch "
          f"{args.batch_size} x {args.seq_len} tokens; {args.steps} steps x {args.rounds} rounds; "
          f"torch threads {torch.get_num_threads()}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}", flush=True)

    # torch's own first-use costs (allocator, kernels) are nobody's overhead: pay them here
    warm = copy.deepcopy(reference)
    warm_args = argparse.Namespace(**{**vars(args), "steps": 5})
    run_plain(warm, dataset, collator, warm_args, None)
    del warm

    results: dict[str, list[Result]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            model = copy.deepcopy(reference)
            with tempfile.TemporaryDirectory(prefix=f"step-overhead-{name}-") as output_dir:
                result = RUNNERS[name](model, dataset, collator, args, output_dir)
            result.check_loss = check_loss(model, fixed_batch)
            assert len(result.stamps) == args.steps, (name, len(result.stamps))
            results[name].append(result)
            times = result.step_times(args.warmup)
            print(f"  round {round_index + 1} {name:8s} start-up {result.startup:6.3f} s   step "
                  f"median {1000 * statistics.median(times):6.2f} ms  mean {1000 * statistics.fmean(times):6.2f} ms"
                  f"  CPU {1000 * statistics.median(result.step_cpu_times(args.warmup)):6.2f} ms", flush=True)
            del model

    report(results, args)
    if args.bar:
        screen = getattr(stderr_on_a_pty, "screen", None)
        where = "into this terminal" if screen is None else f"{screen['bytes']} bytes into a pseudo-terminal"
        print(f"bars drawn {where}")
        per_call = console_step_cost()
        step = statistics.median(statistics.median(r.step_times(args.warmup)) for r in results.get(
            "engine", results.get("plain")))
        print(f"the console's on_step_end with the bar drawn: {1e6 * per_call:.2f} us per step "
              f"({per_call / step:.2e} of a {1000 * step:.1f} ms step, timed alone)")
    if args.sample_rounds:
        times = sample_round_cost(args)
        step = statistics.median(statistics.median(r.step_times(args.warmup)) for r in results.get(
            "engine", results.get("plain")))
        round_s = statistics.median(times)
        print(f"one samples round ({args.sample_prompts} prompts x {args.sample_tokens} new tokens, greedy): median "
              f"{round_s:.3f} s over {len(times)} (min {min(times):.3f}, max {max(times):.3f}) = "
              f"{round_s / step:.1f} training steps")


def report(results: dict[str, list[Result]], args: argparse.Namespace) -> None:
    warmup = args.warmup
    # per run: the median step time (robust to the odd step the OS or a neighbour stretched)
    # and the mean (plain throughput); per contender: medians over rounds
    median_step = {n: [statistics.median(r.step_times(warmup)) for r in rs] for n, rs in results.items()}
    mean_step = {n: [r.mean_step(warmup) for r in rs] for n, rs in results.items()}
    cpu_step = {n: [statistics.median(r.step_cpu_times(warmup)) for r in rs] for n, rs in results.items()}
    startup = {n: statistics.median(r.startup for r in rs) for n, rs in results.items()}
    print()
    print(f"{'':8s} {'steps/s':>8s} {'median ms':>10s} {'mean ms':>8s} {'start-up s':>11s} {'1st round':>10s} "
          f"{'train loss':>11s} {'check loss':>11s} {'CPU ms':>7s}")
    for name, rs in results.items():
        step = statistics.median(median_step[name])
        print(f"{name:8s} {1 / step:8.2f} {1000 * step:10.2f} {1000 * statistics.median(mean_step[name]):8.2f} "
              f"{startup[name]:11.3f} {rs[0].startup:10.3f} {statistics.median(r.train_loss for r in rs):11.4f} "
              f"{statistics.median(r.check_loss for r in rs):11.4f} {1000 * statistics.median(cpu_step[name]):7.2f}")
    print(f"({args.rounds} rounds x {args.steps} steps, the first {warmup} steps of each run left out; medians "
          "over rounds of: steps/s = 1 / median step time, mean step time, start-up = construct + first step; "
          "'1st round' = start-up in round 1; CPU ms = the thread's CPU time per step, median)")
    print()

    def paired(times: dict[str, list[float]], a: str, b: str) -> float:
        """Median over rounds of a's steps/s over b's in the same round: drift between rounds cancels."""
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))

    ratios = {}
    for a, b in (("engine", "plain"), ("trainer", "plain"), ("engine", "trainer"), ("callbacks", "plain")):
        if a in results and b in results:
            ratios[a, b] = paired(median_step, a, b)
            line = (f"{a + '/' + b:15s} steps/s {ratios[a, b]:.4f}x  (from mean step times "
                    f"{paired(mean_step, a, b):.4f}x; per CPU second {paired(cpu_step, a, b):.4f}x)")
            if b == "plain":
                line += f"   start-up {a} - plain {startup[a] - startup['plain']:+.3f} s"
            print(line)
    print("(ratios: median over rounds of the ratio within each round)")
    if "plain" in results:  # how much the machine itself moved the wall clock: the same work, round to round
        plain = median_step["plain"]
        print(f"plain's median step from round to round: {1000 * min(plain):.2f} to {1000 * max(plain):.2f} ms "
              f"({max(plain) / min(plain) - 1:.0%} apart)")
    if ("engine", "plain") in ratios:
        ratio = ratios["engine", "plain"]
        extra = startup["engine"] - startup["plain"]
        print()
        print(f"target engine >= 0.99x plain steps/s:    {'met' if ratio >= 0.99 else 'NOT met'} ({ratio:.4f}x; "
              f"per CPU second {paired(cpu_step, 'engine', 'plain'):.4f}x)")
        print(f"target engine start-up <= plain + 0.1 s: {'met' if extra <= 0.1 else 'NOT met'} ({extra:+.3f} s)")


if __name__ == "__main__":
    main()
