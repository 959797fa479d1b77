"""Sample generations: what the model says, at each evaluation or at the end of training.

Shipped with the engine as the plugin ``samples`` (enable it by name, like any other)::

    plugins = ["samples"]

    [samples]
    prompts = ["The quick brown fox", {messages = [{role = "user", content = "Hi!"}]}]
    # or a file: one prompt per line, or one JSON object per line with "messages" (a chat,
    # rendered with the tokenizer's chat template) or "prompt"
    # prompts = "prompts.jsonl"
    max_new_tokens = 32
    do_sample = false                   # greedy; true samples with seed (default train.seed)
    every = "evaluation"                # or "end": only when training ends

At each chosen point the model (``run.model``: the module the run trains, not a strategy's
wrapper; an adapter model when a plugin made one) generates in eval mode, one prompt at a time,
and the rows ``{"step", "prompt", "completion"}`` go to the ``log_samples`` hook: the builtin
writes ``output_dir/samples.jsonl``, trackers show them. With ``every = "evaluation"`` the end of
training generates too, unless the last step was just sampled, so the last model always speaks.

Generating never draws from the training RNG stream: it runs inside ``torch.random.fork_rng``
(CPU and the model's CUDA device), seeded afresh for each prompt, so a run with samples trains
exactly like one without, and a resumed run generates what an uninterrupted one does. Under a
distributed strategy every process generates the same tokens (a sharded model, FSDP or ZeRO-3,
needs every process in its forwards) and the main process logs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from engine import hookimpl, option
from engine.errors import ConfigError

PLUGIN = "samples"


@dataclass
class SamplesOptions:
    """``[samples]``: what to generate from, how, and when."""

    prompts: list[str | dict[str, Any]] | str = option(default_factory=list, help=(
        "prompts: a list of strings or {messages = [...]} chats, or a file with one per line (text, or a "
        "JSON object with 'messages' or 'prompt')"))
    max_new_tokens: int = option(32, min=1, help="tokens generated per prompt at most")
    do_sample: bool = option(False, help="sample (with seed) instead of greedy decoding")
    temperature: float = option(1.0, min=0, help="sampling temperature (do_sample = true)")
    top_p: float = option(1.0, min=0, max=1, help="nucleus sampling (do_sample = true)")
    seed: int | None = option(None, min=0, help="seed of each prompt's sampling (default train.seed)")
    every: Literal["evaluation", "end"] = option("evaluation", help=(
        "'evaluation': after each evaluation and at the end of training; 'end': only at the end"))


def read_prompts(value: list[Any] | str, key: str = f"{PLUGIN}.prompts") -> list[str | dict[str, Any]]:
    """The prompts of ``[samples] prompts``: each a string or ``{"messages": [...]}``.

    A string value is a file: one prompt per line; a line holding a JSON object is a chat
    (``messages``) or a ``prompt``; blank lines are skipped.
    """
    if isinstance(value, str):
        path = Path(value)
        if not path.is_file():
            raise ConfigError(f"{key}: {value!r} is not a file (give a list of prompts or a file with one per line)")
        items: list[Any] = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise ConfigError(f"{key}: {value} line {number} is not valid JSON: {exc}") from None
                if "prompt" in row and "messages" not in row:
                    row = row["prompt"]
                items.append(row)
            else:
                items.append(line)
        where = f"{key} ({value})"
    else:
        items, where = value, key
    for index, item in enumerate(items):
        if isinstance(item, dict):
            messages = item.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages) \
                    or not messages:
                raise ConfigError(f"{where}[{index}]: a chat prompt is {{messages = [{{role = ..., content = ...}}, "
                                  f"...]}}, got {item!r}")
        elif not isinstance(item, str) or not item:
            raise ConfigError(f"{where}[{index}]: expected a non-empty string or {{messages = [...]}}, got {item!r}")
    if not items:
        raise ConfigError(f"{key}: no prompts; give a list of prompts or a file with one per line")
    return [item if isinstance(item, str) else {"messages": item["messages"]} for item in items]


def generate(run: Any, prompts: list[str | dict[str, Any]], *, max_new_tokens: int, do_sample: bool = False,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> list[dict[str, Any]]:
    """Rows ``{"step", "prompt", "completion"}`` from ``run.model`` for ``prompts``, in eval mode,
    without touching the global RNG streams (the model's mode is restored afterwards)."""
    model, tokenizer = run.model, run.tokenizer
    device = next(model.parameters()).device
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": do_sample,
                               "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                               else tokenizer.eos_token_id}
    if do_sample:
        options.update(temperature=temperature, top_p=top_p, top_k=0)
    was_training = model.training
    model.eval()
    rows = []
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.no_grad(), \
                run.strategy.autocast():
            for prompt in prompts:
                torch.manual_seed(seed)  # each prompt its own draws: independent of order and of the others
                text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(
                    prompt["messages"], tokenize=False, add_generation_prompt=True)
                # as the engine tokenizes training text: the template or the text carries any special tokens
                ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)
                completion = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                rows.append({"step": run.state.global_step,
                             "prompt": prompt if isinstance(prompt, str) else prompt["messages"],
                             "completion": completion})
    finally:
        model.train(was_training)
    return rows


class Samples:
    """One instance per run: the prompts read at configure time, the last step sampled."""

    name = PLUGIN

    def __init__(self):
        self.prompts: list[str | dict[str, Any]] = []
        self.sampled_step: int | None = None

    @hookimpl
    def plugin_options(self):
        return SamplesOptions

    @hookimpl
    def configure(self, run):
        options = run.config.section(PLUGIN)
        self.prompts = read_prompts(options.prompts)
        if options.every == "evaluation" and run.config.train.eval_strategy == "no":
            raise ConfigError(f"{PLUGIN}.every = 'evaluation' but train.eval_strategy = 'no': set "
                              f"train.eval_strategy to 'steps' or 'epoch', or {PLUGIN}.every = 'end'")

    def _check(self, run) -> None:
        """What generating needs, once the model and tokenizer exist (before the first step)."""
        if run.tokenizer is None:
            raise ConfigError(f"plugin {PLUGIN} needs a tokenizer to encode its prompts: set data.tokenizer, "
                              "or pass tokenizer= to Run")
        if not callable(getattr(run.model, "generate", None)):
            raise ConfigError(f"plugin {PLUGIN} needs a model with generate() (a transformers model); "
                              f"{type(run.model).__name__} has none")
        if any(isinstance(p, dict) for p in self.prompts) and not getattr(run.tokenizer, "chat_template", None):
            raise ConfigError(f"{PLUGIN}.prompts: chat prompts (messages) need a tokenizer with a chat template, "
                              "and this tokenizer has none")

    def _sample(self, run) -> None:
        self._check(run)
        options = run.config.section(PLUGIN)
        rows = generate(run, self.prompts, max_new_tokens=options.max_new_tokens, do_sample=options.do_sample,
                        temperature=options.temperature, top_p=options.top_p,
                        seed=options.seed if options.seed is not None else run.config.train.seed)
        self.sampled_step = run.state.global_step
        if run.strategy.is_main_process:
            run.isolated_hooks.call("log_samples", samples=rows, step=run.state.global_step)

    @hookimpl
    def on_train_start(self, run):
        self._check(run)

    @hookimpl
    def on_evaluate(self, run, metrics):
        # once per step: Run.evaluate() called after training is at the step the end sampled
        if run.config.section(PLUGIN).every == "evaluation" and self.sampled_step != run.state.global_step:
            self._sample(run)

    @hookimpl
    def on_train_end(self, run):
        if self.sampled_step != run.state.global_step:
            self._sample(run)
