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

What generating needs is checked before the run writes anything, not found after training and
the final save: the options and the prompts (a file's lines, UTF-8) at configure time, with
``max_new_tokens`` against the model's positions when its config is known then (``engine plan``
says it); the tokenizer, ``generate()``, each prompt's tokens plus ``max_new_tokens`` against the
positions once the model and tokenizer are built (``patch_model``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from engine import hookimpl, option
from engine.errors import ConfigError
from engine.kit.models import max_positions, model_config
from engine.util import decode_utf8, describe_exception, is_callable_spec

PLUGIN = "samples"


@dataclass
class SamplesOptions:
    """``[samples]``: what to generate from, how, and when."""

    prompts: list[str | dict[str, Any]] | str = option(default_factory=list, help=(
        "prompts: a list of strings or {messages = [...]} chats, or a file with one per line (text, or a "
        "JSON object with 'messages' or 'prompt')"))
    max_new_tokens: int = option(32, min=1, help=(
        "tokens generated per prompt at most; a prompt and its completion must fit the model's positions"))
    do_sample: bool = option(False, help="sample (with seed) instead of greedy decoding")
    temperature: float = option(1.0, min=0, help="sampling temperature, > 0 (do_sample = true)")
    top_p: float = option(1.0, min=0, max=1, help="nucleus sampling (do_sample = true)")
    seed: int | None = option(None, min=0, help="seed of each prompt's sampling (default train.seed)")
    every: Literal["evaluation", "end"] = option("evaluation", help=(
        "'evaluation': after each evaluation and at the end of training; 'end': only at the end"))


class Prompt(NamedTuple):
    """A prompt and where it was given (``samples.prompts[2]``, or a file and line), for messages."""

    where: str
    value: str | dict[str, Any]


def _shown(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def read_prompts(value: list[Any] | str, key: str = f"{PLUGIN}.prompts") -> list[Prompt]:
    """The prompts of ``[samples] prompts``: each a string or ``{"messages": [...]}``.

    A string value is a file: one prompt per line; a line holding a JSON object is a chat
    (``messages``) or a ``prompt``; blank lines are skipped.
    """
    if isinstance(value, str):
        path = Path(value)
        if not path.is_file():
            raise ConfigError(f"{key}: {value!r} is not a file (give a list of prompts or a file with one per line)")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{key}: cannot read {value}: {exc.strerror}") from None
        items: list[Prompt] = []
        for number, line in enumerate(decode_utf8(data, f"{key}: {value}").splitlines(), 1):
            where = f"{key} ({value} line {number})"
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise ConfigError(f"{where}: not valid JSON: {exc}") from None
                if "prompt" in row and "messages" not in row:
                    row = row["prompt"]
                items.append(Prompt(where, row))
            else:
                items.append(Prompt(where, line))
    else:
        items = [Prompt(f"{key}[{index}]", item) for index, item in enumerate(value)]
    for where, item in items:
        if isinstance(item, dict):
            messages = item.get("messages")
            if not messages or not isinstance(messages, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise ConfigError(f"{where}: a chat prompt is {{messages = [{{role = ..., content = ...}}, ...]}} "
                                  f"with string roles and contents, got {_shown(item)}")
        elif not isinstance(item, str) or not item:
            raise ConfigError(f"{where}: expected a non-empty string or {{messages = [...]}}, got {_shown(item)}")
    if not items:
        raise ConfigError(f"{key}: no prompts; give a list of prompts or a file with one per line")
    return [Prompt(where, item if isinstance(item, str) else {"messages": item["messages"]}) for where, item in items]


def prompt_ids(tokenizer: Any, prompt: str | dict[str, Any]) -> torch.Tensor:
    """The token ids (1 x length) a prompt is generated from: a chat through the tokenizer's template."""
    text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(
        prompt["messages"], tokenize=False, add_generation_prompt=True)
    # as the engine tokenizes training text: the template or the text carries any special tokens
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def _too_long(config: Any, prompt_tokens: int, max_new_tokens: int) -> tuple[int, int, str] | None:
    """(positions needed, the model's positions, its config attribute) when a prompt and its
    completion do not fit the model's positions (one sequence, or for an encoder-decoder model each
    its own); None when they fit or the model declares no limit."""
    found = max_positions(config)
    encoder_decoder = getattr(config, "is_encoder_decoder", False)
    needed = max(prompt_tokens, max_new_tokens) if encoder_decoder else prompt_tokens + max_new_tokens
    return (needed, *found) if found is not None and needed > found[0] else None


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
                ids = prompt_ids(tokenizer, prompt).to(device)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)
                completion = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                rows.append({"step": run.state.global_step,
                             "prompt": prompt if isinstance(prompt, str) else prompt["messages"],
                             "completion": completion})
    finally:
        model.train(was_training)
    return rows


def _configured_model(run: Any) -> tuple[Any, str] | None:
    """(config, what to call the model) when the model's config is known before anything loads: a
    model given to Run, or one built from a config (a builtin name, a .json file). A model folder or
    factory is checked once built."""
    if run.model is not None:
        return getattr(run.model, "config", None), "the model"
    spec = run.config.train.model
    if run.model_init is not None or is_callable_spec(spec) or Path(spec).is_dir():
        return None
    return model_config(run.config.train), f"the model ({spec})"


class Samples:
    """One instance per run: the prompts read at configure time, the last step sampled."""

    name = PLUGIN

    def __init__(self):
        self.prompts: list[Prompt] = []
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
        if options.do_sample and options.temperature == 0:
            raise ConfigError(f"{PLUGIN}.temperature = 0 with {PLUGIN}.do_sample = true: sampling divides by the "
                              f"temperature; set {PLUGIN}.do_sample = false for greedy decoding, or "
                              f"{PLUGIN}.temperature > 0")
        if not options.do_sample:  # greedy decoding: a sampling setting would be silently ignored
            for key, neutral in (("temperature", (0.0, 1.0)), ("top_p", (1.0,))):
                if getattr(options, key) not in neutral:
                    raise ConfigError(f"{PLUGIN}.{key} = {getattr(options, key)} applies only when sampling, and "
                                      f"{PLUGIN}.do_sample = false (greedy decoding): set {PLUGIN}.do_sample = true, "
                                      f"or leave {PLUGIN}.{key} out")
        known = _configured_model(run)
        too_long = known and _too_long(known[0], 1, options.max_new_tokens)  # a prompt has a token at least
        if too_long:
            needed, positions, name = too_long
            raise ConfigError(f"{PLUGIN}.max_new_tokens = {options.max_new_tokens}: a prompt and its completion "
                              f"need {needed} positions at least, but {known[1]} has {positions} ({name}); lower "
                              f"{PLUGIN}.max_new_tokens")

    @hookimpl
    def patch_model(self, run, model):
        # the first hook with the model and tokenizer built, before the run writes anything: what
        # generating will need is checked here, not found after training and the final save
        if run.tokenizer is None:
            raise ConfigError(f"plugin {PLUGIN} needs a tokenizer to encode its prompts: set data.tokenizer, "
                              "or pass tokenizer= to Run")
        if not callable(getattr(model, "generate", None)):
            raise ConfigError(f"plugin {PLUGIN} needs a model with generate() (a transformers model); "
                              f"{type(model).__name__} has none")
        if any(isinstance(p.value, dict) for p in self.prompts) and not getattr(run.tokenizer, "chat_template", None):
            raise ConfigError(f"{PLUGIN}.prompts: chat prompts (messages) need a tokenizer with a chat template, "
                              "and this tokenizer has none")
        max_new_tokens = run.config.section(PLUGIN).max_new_tokens
        for where, prompt in self.prompts:
            try:
                length = prompt_ids(run.tokenizer, prompt).shape[1]
            except Exception as exc:  # the tokenizer's chat template is code: name the prompt it failed on
                raise ConfigError(f"{where}: the tokenizer cannot encode it: {describe_exception(exc)}") from None
            if not length:
                raise ConfigError(f"{where}: {_shown(prompt)} encodes to no token; give a prompt with text")
            too_long = _too_long(getattr(model, "config", None), length, max_new_tokens)
            if too_long:
                needed, positions, name = too_long
                raise ConfigError(f"{where}: {length} tokens and {PLUGIN}.max_new_tokens = {max_new_tokens} need "
                                  f"{needed} positions, but the model has {positions} ({name}); shorten the prompt "
                                  f"or lower {PLUGIN}.max_new_tokens")

    def _sample(self, run) -> None:
        options = run.config.section(PLUGIN)
        rows = generate(run, [p.value for p in self.prompts], max_new_tokens=options.max_new_tokens,
                        do_sample=options.do_sample, temperature=options.temperature, top_p=options.top_p,
                        seed=options.seed if options.seed is not None else run.config.train.seed)
        self.sampled_step = run.state.global_step
        if run.strategy.is_main_process:
            run.isolated_hooks.call("log_samples", samples=rows, step=run.state.global_step)

    @hookimpl
    def on_evaluate(self, run, metrics):
        # once per step: Run.evaluate() called after training is at the step the end sampled
        if run.config.section(PLUGIN).every == "evaluation" and self.sampled_step != run.state.global_step:
            self._sample(run)

    @hookimpl
    def on_restart(self, run):
        self.sampled_step = None

    @hookimpl
    def on_train_end(self, run):
        if self.sampled_step != run.state.global_step:
            self._sample(run)
