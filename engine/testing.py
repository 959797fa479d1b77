"""Helpers for plugin authors' tests: a tiny model and dataset, short runs, a hook recorder, what a
run logged (to compare trackers with), a tracker's checks (a failure mid-run is harmless, a resume
continues its run, no secret written), launching several processes with torchrun, and the two
checks every optimizer plugin makes: resuming is exact, and the optimizer is Trainer's.

Example (a whole plugin test)::

    from engine.testing import HookRecorder, run_steps

    def test_my_plugin_runs(tmp_path):
        recorder = HookRecorder()
        run = run_steps(3, plugins=["myplugin"], objects=[recorder], output_dir=tmp_path)
        assert recorder.count("on_step_end") == 3

An optimizer plugin's two checks (:func:`assert_resume_is_exact`, :func:`assert_matches_trainer`;
both compare optimizer states with :func:`assert_same_state`)::

    from engine.testing import assert_matches_trainer, assert_resume_is_exact

    def test_resume_is_exact(tmp_path):  # 6 steps straight == 3 steps, checkpoint, resume to 6
        runs = assert_resume_is_exact(6, 3, tmp_path, plugins=["bnb"], train={"optim": "adamw_8bit"})
        assert runs.resumed.optimizer.state  # the plugin's own checks on the returned runs

    def test_is_trainers_optimizer(tmp_path):  # Trainer's class, groups, hyper-parameters, updates
        assert_matches_trainer("adamw_8bit", tmp_path, plugins=["bnb"], atol=0, compare_state=True,
                               train={"learning_rate": 3e-3, "weight_decay": 0.1, "adam_beta1": 0.8})
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from . import hookimpl, hookspecs
from .hookspecs import HOOK_NAMES
from .run import Run


def tiny_model(vocab_size: int = 128, seed: int = 0, **config: Any) -> torch.nn.Module:
    """A randomly initialised 2-layer Llama with hidden size 32 (about 40k parameters)."""
    import transformers

    values = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    values.update(config)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**values))


class TokenDataset(torch.utils.data.Dataset):
    """Token rows ``{"input_ids", "labels"}``; ``lengths`` cuts each row short, so batches need padding."""

    def __init__(self, rows: torch.Tensor, lengths: list[int] | None = None):
        self.rows = rows
        self.lengths = lengths

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index] if self.lengths is None else self.rows[index, : self.lengths[index]]
        return {"input_ids": row, "labels": row}


def tiny_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer trained on :data:`TEST_CORPUS` (pair it with
    ``tiny_model(vocab_size=300)``), with a minimal chat template; a fresh copy per call."""
    from .builtin.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([TEST_CORPUS], vocab_size)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tokenizer


# A ChatML-style template whose turn markers the tokenizer of :func:`chatml_tokenizer` holds as tokens
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer(texts: list[str], vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``, with ``<|im_start|>`` / ``<|im_end|>`` as special
    tokens and :data:`CHATML_TEMPLATE` as its chat template (chat, sharegpt and mixture tests)."""
    from .builtin.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(texts, vocab_size)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> str:
    """``rows`` written as JSON lines to ``path``; its path as a string (a data.train value)."""
    import json

    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def tiny_dataset(size: int = 64, seq_len: int = 16, vocab_size: int = 128, seed: int = 0,
                 ragged: bool = False) -> TokenDataset:
    """``size`` rows of ``seq_len`` tokens with a learnable pattern (each token predicts the next).

    ``ragged=True`` gives rows of different lengths, so batches need padding.
    """
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (size, 1), generator=generator)
    rows = (starts + torch.arange(seq_len)) % vocab_size
    lengths = None
    if ragged:
        lengths = torch.randint(seq_len // 2, seq_len + 1, (size,), generator=generator).tolist()
    return TokenDataset(rows, lengths)


def run_steps(steps: int = 3, plugins: list[str] = (), *, objects: list[Any] = (),
              output_dir: str | Path | None = None, train: dict[str, Any] | None = None,
              sections: dict[str, dict[str, Any]] | None = None, model: torch.nn.Module | None = None,
              dataset: Any = None, **run_kwargs: Any) -> Run:
    """Train ``steps`` optimizer steps of the tiny model on the tiny dataset and return the run.

    ``plugins`` are entry-point names, ``objects`` plugin objects, ``train`` extra ``[train]``
    keys, ``sections`` the enabled plugins' sections. Other keywords go to :class:`Run`.
    """
    from .builtin.data.collators import DataCollator

    config: dict[str, Any] = {
        "plugins": list(plugins),
        "train": {"max_steps": steps, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
                  "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True,
                  "output_dir": str(output_dir or tempfile.mkdtemp(prefix="engine-test-")),
                  **(train or {})},
        **(sections or {}),
    }
    run = Run(config, model=model if model is not None else tiny_model(),
              train_dataset=dataset if dataset is not None else tiny_dataset(),
              data_collator=run_kwargs.pop("data_collator", DataCollator(0)),
              plugins=list(objects), **run_kwargs)
    run.train()
    return run


def logged_scalars(output_dir: str | Path) -> dict[tuple[str, int], float]:
    """Every number ``output_dir/metrics.jsonl`` holds, by ``(name, step)``: the reference that a
    tracker's own read-back is compared with (non-finite values are null there, so left out)."""
    import json

    found = {}
    for line in (Path(output_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        step = record.pop("step")
        for name, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found[name, step] = float(value)
    return found


class FailAt:
    """A plugin object that calls ``fail()`` at the end of optimizer step ``step``: an outage injected
    in the middle of a run (kill a server, make a client's call raise or hang)."""

    name = "fail-at"

    def __init__(self, step: int, fail: Callable[[], Any]):
        self.step, self.fail = step, fail

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.step:
            self.fail()


SAMPLES_AT_3 = [{"step": 3, "prompt": "the quick", "completion": " brown fox"},
                {"step": 3, "prompt": [{"role": "user", "content": "Hi!"}], "completion": "Hello | there"}]


class LogSamples:
    """A plugin object that logs ``samples`` (default :data:`SAMPLES_AT_3`: a text prompt and a chat
    prompt, a pipe in a completion) through the ``log_samples`` hook at optimizer step 3, as the builtin
    ``samples`` plugin logs what it generated: a tracker's table without a tokenizer or generation."""

    name = "log-samples"

    def __init__(self, samples: list[dict[str, Any]] = SAMPLES_AT_3):
        self.samples = samples

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.samples[0]["step"]:
            run.isolated_hooks.call("log_samples", samples=self.samples, step=run.state.global_step)


def raising_at(step: int) -> FailAt:
    """A plugin object whose ``on_step_end`` raises ``RuntimeError("boom")`` at optimizer step ``step``:
    training that raised, for what a tracker records then (a failed status)."""

    def boom():
        raise RuntimeError("boom")

    return FailAt(step, boom)


def assert_tracker_failure_is_harmless(plugin: str, output_dir: str | Path, fail: Callable[[], Any], *,
                                       steps: int = 6, at: int = 3,
                                       sections: dict[str, dict[str, Any]] | None = None) -> Run:
    """Assert that a tracker failing mid-run changes nothing in training.

    Trains ``steps`` steps without ``plugin`` (``output_dir/plain``), then with it
    (``output_dir/tracked``), calling ``fail()`` after step ``at`` (:class:`FailAt`). Asserts the
    same final weights and as many logged rows, exactly one warning ``plugin '<plugin>': ...``
    (it is switched off), and ``run.json`` saying the run finished with ``plugin`` switched off.
    Returns the tracked run, for the plugin's own checks of what reached its service.
    """
    import json
    import logging

    output_dir = Path(output_dir)
    plain = run_steps(steps, output_dir=output_dir / "plain")
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Collect()
    logging.getLogger("engine").addHandler(handler)
    try:
        tracked = run_steps(steps, [plugin], objects=[FailAt(at, fail)], output_dir=output_dir / "tracked",
                            sections=sections)
    finally:
        logging.getLogger("engine").removeHandler(handler)
    assert same_weights(plain.model, tracked.model) == [], "the tracker's failure changed the weights"
    switched_off = [message for message in warnings if message.startswith(f"plugin {plugin!r}: ")]
    assert len(switched_off) == 1, warnings
    record = json.loads((output_dir / "tracked" / "run.json").read_text(encoding="utf-8"))
    assert record["status"] == "finished" and list(record["switched_off"]) == [plugin], record
    assert len(logged_scalars(output_dir / "tracked")) == len(logged_scalars(output_dir / "plain"))
    return tracked


def run_and_resume(plugins: list[str], output_dir: str | Path, *, steps: int = 4, save_at: int = 2,
                   sections: dict[str, dict[str, Any]] | None = None) -> dict[tuple[str, int], float]:
    """Train ``save_at`` steps with a checkpoint, then resume from it to ``steps`` in the same
    ``output_dir`` (a new :class:`Run`, as a restarted process would); return what ``metrics.jsonl``
    holds then (:func:`logged_scalars`, one row per step ``1..steps``): the rows a tracker that
    continues its run on resume shows, read back to compare."""
    output_dir = Path(output_dir)
    save = {"save_strategy": "steps", "save_steps": save_at}
    run_steps(save_at, plugins, output_dir=output_dir, sections=sections, train=save)
    run_steps(steps, plugins, output_dir=output_dir, sections=sections, model=tiny_model(seed=1),
              train={**save, "resume_from_checkpoint": str(output_dir / f"checkpoint-{save_at}")})
    reference = logged_scalars(output_dir)
    assert {step for _, step in reference} == set(range(1, steps + 1)), sorted(reference)
    return reference


def assert_not_written(secret: str, folders: list[str | Path], *texts: str) -> None:
    """Assert that ``secret`` (an API key) is in no file under ``folders`` and in none of ``texts``
    (captured output)."""
    for text in texts:
        assert secret not in text, "the secret was printed"
    for folder in folders:
        for path in Path(folder).rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), f"the secret was written to {path}"


def assert_one_line_error(result: Any, fragment: str) -> None:
    """``result`` (a ``subprocess.CompletedProcess`` of an ``engine`` command) refused bad input the
    engine's way: exit status 2 and, on stderr, one line ``engine: error: ...`` holding ``fragment``,
    without a traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("engine: error: "), result.stderr
    assert fragment in lines[0], lines[0]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """The names of the parameters that differ between two models ([] when all are equal)."""
    others = dict(b.named_parameters())
    return [name for name, value in a.named_parameters() if not torch.equal(value, others[name])]


class HookRecorder:
    """A plugin implementing every hook: records ``(hook name, arguments)`` and returns None.

    Pass it in ``plugins=[HookRecorder()]`` (or ``objects=`` of :func:`run_steps`).
    """

    name = "recorder"

    def __init__(self):
        self.calls: list[tuple[str, dict[str, Any]]] = []
        for hook_name in HOOK_NAMES:
            setattr(self, hook_name, self._recording(hook_name))

    def _recording(self, hook_name: str) -> Any:
        spec = getattr(hookspecs, hook_name)

        def record(*args: Any) -> None:
            self.calls.append((hook_name, dict(zip(arg_names, args))))

        # pluggy reads the argument names through __wrapped__, so the recorder takes exactly
        # the spec's arguments without one hand-written method per hook.
        arg_names = spec.__code__.co_varnames[: spec.__code__.co_argcount]
        record.__wrapped__ = spec
        return hookimpl(record)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def count(self, hook_name: str) -> int:
        return sum(1 for name, _ in self.calls if name == hook_name)


# ---------------------------------------------------------------------------- optimizer plugins


def assert_same_state(ours: Any, theirs: Any, atol: float = 0.0, path: str = "state") -> None:
    """Assert that two optimizer state dicts (any nest of dicts, lists, tuples, tensors and plain
    values) are the same, naming the first difference by its path (``state.3.exp_avg``).

    Tensors need the same class, dtype and shape and equal values (``torch.equal``); with
    ``atol > 0`` floating-point values may differ by up to ``atol``. Tensor subclasses (torchao's
    quantized state) are compared through their inner tensors (``__tensor_flatten__``).
    """
    if isinstance(ours, torch.Tensor):
        assert type(theirs) is type(ours), f"{path}: {type(ours).__name__} != {type(theirs).__name__}"
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), \
            f"{path}: {ours.dtype} {tuple(ours.shape)} != {theirs.dtype} {tuple(theirs.shape)}"
        if type(ours) is not torch.Tensor and hasattr(ours, "__tensor_flatten__"):
            (names, context), (their_names, their_context) = ours.__tensor_flatten__(), theirs.__tensor_flatten__()
            assert (names, context) == (their_names, their_context), f"{path}: {context!r} != {their_context!r}"
            for name in names:
                assert_same_state(getattr(ours, name), getattr(theirs, name), atol, f"{path}.{name}")
        elif atol and ours.is_floating_point() and ours.numel():
            difference = (ours.detach().double() - theirs.detach().double()).abs().max().item()
            assert difference <= atol, f"{path}: differs by {difference:.3g} (more than {atol})"
        else:
            assert torch.equal(ours, theirs), f"{path}: values differ"
    elif isinstance(ours, dict):
        assert isinstance(theirs, dict) and ours.keys() == theirs.keys(), \
            f"{path}: keys {list(ours)} != {list(theirs) if isinstance(theirs, dict) else theirs!r}"
        for key in ours:
            assert_same_state(ours[key], theirs[key], atol, f"{path}.{key}")
    elif isinstance(ours, (list, tuple)):
        assert type(theirs) is type(ours) and len(ours) == len(theirs), f"{path}: {ours!r} != {theirs!r}"
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            assert_same_state(mine, other, atol, f"{path}[{index}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


class _OptimizerAtStart:
    """Keeps a copy of the optimizer state at train start (after a resume restored it), as saved."""

    name = "optimizer_at_start"  # both runs of a resume check enable it, as checkpoints require

    def __init__(self):
        self.state: Any = None

    @hookimpl
    def on_train_start(self, run):
        buffer = io.BytesIO()  # a copy through torch.save: deepcopy fails on some state (torchao's)
        torch.save(run.optimizer.state_dict(), buffer)
        buffer.seek(0)
        self.state = torch.load(buffer, weights_only=True)


class ResumeCheck(NamedTuple):
    """What :func:`assert_resume_is_exact` ran, for a plugin's own checks."""

    straight: Run
    resumed: Run
    checkpoint: Path
    restored: Any  # the optimizer state the resumed run started from


_TIMINGS = ("per_second", "time", "runtime")  # logged values that measure time, not training


def _logged_values(run: Run) -> list[dict[str, Any]]:
    return [{key: value for key, value in entry.items() if not any(t in key for t in _TIMINGS)}
            for entry in run.state.log_history]


def assert_resume_is_exact(steps: int, save_at: int, output_dir: str | Path, *, plugins: list[str] = (),
                           train: dict[str, Any] | None = None, model_config: dict[str, Any] | None = None,
                           objects: list[Any] = (), make_model: Callable[[int], torch.nn.Module] | None = None,
                           resumed_model_seed: int = 1, **run_kwargs: Any) -> ResumeCheck:
    """Assert that stopping at a checkpoint and resuming changes nothing.

    Trains :func:`tiny_model` ``steps`` steps straight, with a checkpoint every ``save_at`` steps
    (``output_dir/straight``), then a differently initialised model resumed from
    ``checkpoint-<save_at>`` to ``steps`` (``output_dir/resumed``; ``resumed_model_seed=0`` builds
    the same model, for checkpoints that hold only part of it, such as an adapter), and asserts, with
    ``torch.equal`` (:func:`assert_same_state`):

    * the resumed run started from the optimizer state the checkpoint holds;
    * every value both runs logged at every step (loss, grad_norm, learning_rate, eval_loss, ...;
      timings aside), one loss per step;
    * the final weights and the final optimizer state (``state_dict()``).

    ``train`` adds ``[train]`` keys, ``model_config`` goes to :func:`tiny_model`; ``make_model(seed)``
    builds another model instead (a classifier, a seq2seq model); the other keywords go to
    :func:`run_steps` for both runs. Returns both runs, the checkpoint folder and the
    restored optimizer state, for the plugin's own checks.
    """
    output_dir = Path(output_dir)
    train = {**(train or {}), "save_strategy": "steps", "save_steps": save_at}
    checkpoint = output_dir / "straight" / f"checkpoint-{save_at}"
    at_start = _OptimizerAtStart()
    if make_model is None:
        def make_model(seed: int) -> torch.nn.Module:
            return tiny_model(seed=seed, **(model_config or {}))

    straight = run_steps(steps, plugins, objects=[*objects, _OptimizerAtStart()], output_dir=output_dir / "straight",
                         train=train, model=make_model(0), **run_kwargs)
    resumed = run_steps(steps, plugins, objects=[*objects, at_start], output_dir=output_dir / "resumed",
                        train={**train, "resume_from_checkpoint": str(checkpoint)}, model=make_model(resumed_model_seed),
                        **run_kwargs)
    assert straight.state.global_step == resumed.state.global_step == steps
    assert_same_state(at_start.state, torch.load(checkpoint / "optimizer.pt", weights_only=True),
                      path="optimizer state at the resume")
    logged, logged_resumed = _logged_values(straight), _logged_values(resumed)
    assert sum("loss" in entry for entry in logged) == steps, logged
    assert len(logged_resumed) == len(logged), f"resumed logged {logged_resumed}, straight {logged}"
    for mine, other in zip(logged_resumed, logged):
        assert mine == other, f"logged at step {other.get('step')}: resumed {mine} != straight {other}"
    assert same_weights(resumed.model, straight.model) == [], "weights differ after the resume"
    assert_same_state(resumed.optimizer.state_dict(), straight.optimizer.state_dict(), path="optimizer state")
    return ResumeCheck(straight, resumed, checkpoint, at_start.state)


def trainer_optimizer(optim: str, output_dir: str | Path, model: torch.nn.Module, *, optim_args: str | None = None,
                      optim_target_modules: Any = None, **training_args: Any) -> torch.optim.Optimizer:
    """The optimizer transformers' ``Trainer.create_optimizer`` makes for ``model`` (on the CPU)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(output_dir), optim=optim, optim_args=optim_args,
                             optim_target_modules=optim_target_modules, report_to=[], use_cpu=True, **training_args)
    return Trainer(model=model, args=args).create_optimizer()


class TrainerPair(NamedTuple):
    """The optimizers (and models) :func:`assert_matches_trainer` compared, after its steps."""

    ours: Any
    theirs: Any
    our_model: torch.nn.Module
    their_model: torch.nn.Module


def trainer_step(model: torch.nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> None:
    """One step as Trainer takes it: ``optimizer.train()`` where there is one (Schedule-Free),
    backward, ``step()``, ``zero_grad()`` (a layerwise optimizer steps inside backward)."""
    model.train()
    if callable(getattr(optimizer, "train", None)):
        optimizer.train()
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _groups(optimizer: Any, names: dict[int, str], ignore: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{**{key: value for key, value in group.items() if key not in ignore},
             "params": [names[id(p)] for p in group["params"]]} for group in optimizer.param_groups]


def _per_parameter(ours: Any, theirs: Any, names: tuple[dict[int, str], dict[int, str]]) -> list[tuple[Any, Any]]:
    """(our, Trainer's) optimizer pairs: one per parameter for layerwise names, else the optimizers themselves."""
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    from .kit.lowrank import LayerwiseOptimizer

    if not isinstance(theirs, LayerWiseDummyOptimizer):
        return [(ours, theirs)]
    assert isinstance(ours, LayerwiseOptimizer), f"Trainer's optimizer is layerwise, ours is {type(ours).__name__}"
    assert [names[0][id(p)] for p in ours.optimizers] == [names[1][id(p)] for p in theirs.optimizer_dict]
    return list(zip(ours.optimizers.values(), theirs.optimizer_dict.values()))


def assert_matches_trainer(optim: str, output_dir: str | Path, *, plugins: list[str] = (),
                           train: dict[str, Any] | None = None, optim_args: str | None = None,
                           optim_target_modules: Any = None, model_config: dict[str, Any] | None = None,
                           trainer_optim: str | None = None, steps: int = 2, atol: float = 5e-6,
                           compare_state: bool = False, ignore: tuple[str, ...] = (), our_class: type | None = None,
                           step: Callable[[torch.nn.Module, Any, dict[str, torch.Tensor]], None] = trainer_step,
                           ours: tuple[torch.nn.Module, Any] | None = None,
                           adjust_reference: Callable[[Any], None] | None = None) -> TrainerPair:
    """Assert that the engine's optimizer for ``optim`` is the one transformers' Trainer makes.

    Ours: a set-up run of :func:`tiny_model` (``model_config``) with ``plugins``, ``train``
    (``[train]`` keys), ``optim_args`` and ``optim_target_modules``; or ``ours=(model,
    optimizer)`` built otherwise. Trainer's: :func:`trainer_optimizer` for the same model
    (seed 0), with ``train`` as TrainingArguments and Trainer's name ``trainer_optim`` where it
    differs; ``adjust_reference(theirs)`` may first change what the engine changes on purpose.
    Asserted, per parameter for layerwise names:

    * the class is ``our_class`` (default: Trainer's), a subclass of Trainer's;
    * the parameter groups hold the same parameters (by name, in order) and the same
      hyper-parameters, ``ignore`` aside; our scheduler's ``initial_lr`` is Trainer's ``lr``;
      the ``defaults`` are the same;
    * after ``steps`` steps on the same batches (``step(model, optimizer, batch)``, default
      :func:`trainer_step`), every weight is within ``atol`` (0: equal), and with
      ``compare_state`` the optimizer states (:func:`assert_same_state`) too. Ours steps at its
      initial learning rate: Trainer's optimizer has no scheduler here.

    Returns both optimizers and models, for the plugin's own checks.
    """
    output_dir = Path(output_dir)
    train, model_config = dict(train or {}), dict(model_config or {})
    if ours is None:
        run = Run({"plugins": list(plugins), "train": {
            "optim": optim, "optim_args": optim_args, "optim_target_modules": optim_target_modules, "max_steps": 1,
            "output_dir": str(output_dir / "engine"), "save_strategy": "no", "disable_tqdm": True, **train}},
            model=tiny_model(**model_config), train_dataset=tiny_dataset())
        run.setup()
        ours = (run.model, run.optimizer)
    our_model, our_optimizer = ours
    their_model = tiny_model(**model_config)
    theirs = trainer_optimizer(trainer_optim or optim, output_dir / "trainer", their_model, optim_args=optim_args,
                               optim_target_modules=optim_target_modules, **train)
    if adjust_reference is not None:
        adjust_reference(theirs)

    for group in our_optimizer.param_groups:  # back to the learning rate it was built with
        if "initial_lr" in group:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].copy_(group["initial_lr"])
            else:
                group["lr"] = group["initial_lr"]
    names = ({id(p): n for n, p in our_model.named_parameters()}, {id(p): n for n, p in their_model.named_parameters()})
    for mine, other in _per_parameter(our_optimizer, theirs, names):
        assert type(mine) is (our_class or type(other)) and isinstance(mine, type(other)), \
            f"{optim}: ours is {type(mine).__qualname__}, Trainer's {type(other).__qualname__}"
        our_groups = _groups(mine, names[0], ignore)
        their_groups = _groups(other, names[1], ignore)
        for group, their_group in zip(our_groups, their_groups):
            if "initial_lr" in group:
                assert_same_state(group.pop("initial_lr"), their_group["lr"], path=f"{optim}: initial_lr")
        assert_same_state(our_groups, their_groups, path=f"{optim}: param_groups")
        assert_same_state({k: v for k, v in mine.defaults.items() if k not in ignore},
                          {k: v for k, v in other.defaults.items() if k not in ignore}, path=f"{optim}: defaults")

    before = {name: weight.detach().clone() for name, weight in our_model.named_parameters()}
    rows = torch.stack([row["input_ids"] for row in tiny_dataset(size=4 * max(steps, 1),
                                                                  vocab_size=our_model.config.vocab_size)])
    for batch_rows in rows.split(4)[:steps]:
        for model, optimizer in ((our_model, our_optimizer), (their_model, theirs)):
            step(model, optimizer, {"input_ids": batch_rows, "labels": batch_rows.clone()})
    if steps:
        assert any(not torch.equal(before[name], weight) for name, weight in our_model.named_parameters()), \
            f"{optim}: no weight changed in {steps} steps"
    their_weights = dict(their_model.named_parameters())
    for name, weight in our_model.named_parameters():
        assert_same_state(weight.detach(), their_weights[name].detach(), atol,
                          path=f"{optim}: {name} after {steps} steps")
    if compare_state and steps:
        mine, other = our_optimizer.state_dict(), theirs.state_dict()
        for state, skip in ((mine, (*ignore, "initial_lr")), (other, ignore)):
            state["param_groups"] = [{k: v for k, v in group.items() if k not in skip}
                                     for group in state["param_groups"]]
        assert_same_state(mine, other, atol, path=f"{optim}: optimizer state")
    return TrainerPair(our_optimizer, theirs, our_model, their_model)


def free_port() -> int:
    """A TCP port on localhost that is free now (for a rendezvous endpoint)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(args: list[str], nproc: int = 2, *, nnodes: int = 1, node_rank: int = 0, endpoint: str | None = None,
             timeout: float = 600, env: dict[str, str] | None = None, cwd: Any = None,
             popen: bool = False) -> Any:
    """Run ``torchrun ... args`` (e.g. ``["-m", "engine", "train", "run.toml"]`` or a script and its
    arguments) with ``nproc`` processes per node, one torch thread each, under ``timeout``.

    One node uses a standalone rendezvous on a free port; several nodes (one call per node, with
    ``node_rank``) meet through a c10d rendezvous at ``endpoint`` ("localhost:PORT"). Returns the
    ``subprocess.CompletedProcess`` (stdout and stderr as text), or the ``Popen`` with ``popen=True``
    (its own session: ``os.killpg`` stops the whole job).
    """
    import os
    import subprocess
    import sys

    if nnodes == 1:
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint or f"localhost:{free_port()}"]
    else:
        rendezvous = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", endpoint, "--rdzv-id", "engine-test"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *rendezvous, *args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if popen:
        return subprocess.Popen(command, env=environment, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    return subprocess.run(command, env=environment, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def launch_cases(cases: list[dict[str, Any]], out_dir: str | Path, nproc: int = 2, nnodes: int = 1,
                 env: dict[str, str] | None = None, timeout: float = 600,
                 **torchrun_kwargs: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Train ``cases`` (see :func:`run_cases`) in one torchrun job of ``nproc`` processes on each
    of ``nnodes`` nodes (several nodes: one torchrun per node on this machine, meeting through a
    c10d rendezvous); returns each case's final full weights by name. A failed job is an
    AssertionError showing its stderr."""
    import json

    out_dir = Path(out_dir)
    (out_dir / "cases.json").write_text(json.dumps(cases))
    args = ["-m", "engine.testing", str(out_dir / "cases.json"), str(out_dir)]
    if nnodes == 1:
        result = torchrun(args, nproc=nproc, env=env, timeout=timeout, **torchrun_kwargs)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        endpoint = f"localhost:{free_port()}"
        nodes = [torchrun(args, nproc=nproc, nnodes=nnodes, node_rank=rank, endpoint=endpoint, env=env, popen=True,
                          **torchrun_kwargs) for rank in range(nnodes)]
        for node in nodes:
            _, err = node.communicate(timeout=timeout)
            assert node.returncode == 0, err[-3000:]
    return {case["name"]: torch.load(out_dir / f"{case['name']}.pt", weights_only=True) for case in cases}


def max_difference(weights: dict[str, torch.Tensor], model: torch.nn.Module | dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between ``weights`` and ``model``'s (same names required)."""
    reference = model if isinstance(model, dict) else model.state_dict()
    assert sorted(weights) == sorted(reference), (sorted(weights), sorted(reference))
    return max((weights[name] - value.detach().cpu()).abs().max().item() for name, value in reference.items())


# ---------------------------------------------------------------------------- preference plugins' parity tests

# word reversals (the first rows of examples/data/reversals.jsonl): preference rows prefer the reversal
REVERSALS = ("the food great", "great day", "it film and great", "food it bright and fine", "quite and a lovely quite",
             "fine food", "and lovely quite the", "it day very", "and food", "quite the quite", "the it",
             "the and was and", "very very lovely food", "lovely great", "great great very",
             "great lovely bright bright")
# the schedule a parity test gives both sides: two logged steps of 8 rows, read in order
PARITY_SCHEDULE = {"max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-3, "logging_steps": 1,
                   "optim": "adamw_torch", "save_strategy": "no", "train_sampling_strategy": "sequential", "seed": 0,
                   "disable_tqdm": True, "lr_scheduler_type": "linear", "warmup_steps": 0}


def reversed_words(source: str) -> str:
    return " ".join(reversed(source.split()))


def preference_rows(count: int = 16, layout: str = "text") -> list[dict[str, Any]]:
    """``count`` (at most 16) preference pairs, the reversal of some words chosen over the words as they came:
    ``layout`` "text" (prompt, chosen, rejected), "chat" (the same as conversations) or "implicit" (text
    without a prompt column: chosen and rejected start with it, TRL's implicit prompt)."""
    rows = []
    for source in REVERSALS[:count]:
        target = reversed_words(source)
        if layout == "chat":
            rows.append({"prompt": [{"role": "user", "content": f"reverse {source}"}],
                         "chosen": [{"role": "assistant", "content": target}],
                         "rejected": [{"role": "assistant", "content": source}]})
        elif layout == "implicit":
            rows.append({"chosen": f"{source} reversed is {target}", "rejected": f"{source} reversed is {source}"})
        else:
            rows.append({"prompt": f"{source} reversed ", "chosen": f"is {target}", "rejected": f"is {source}"})
    return rows


def preference_tokenizer() -> Any:
    """A :func:`chatml_tokenizer` trained on the text of :func:`preference_rows`."""
    return chatml_tokenizer([f"{source} reversed is {reversed_words(source)}" for source in REVERSALS] +
                            ["user assistant reverse"])


def llama_for(tokenizer: Any, seed: int = 0, num_labels: int | None = None) -> torch.nn.Module:
    """A 2-layer Llama (hidden size 32) of ``tokenizer``'s vocabulary and pad/eos ids, seeded: a causal LM, or
    with ``num_labels`` a sequence classifier."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, **({"num_labels": num_labels} if num_labels else {}))
    if num_labels:
        return transformers.LlamaForSequenceClassification(config)
    return transformers.LlamaForCausalLM(config)


def logged_rows(log_history: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The training log rows (Trainer's ``state.log_history`` or the engine's), ``keys`` of each."""
    return [{k: v for k, v in entry.items() if k in keys} for entry in log_history
            if "loss" in entry and "train_loss" not in entry]


def refusal(config: dict[str, Any], **run_kwargs: Any) -> str:
    """The ``ConfigError`` that ``Run(config, **run_kwargs).train()`` raises, asserted to be one line and to come
    before anything was trained into ``train.output_dir``."""
    import pytest

    from .errors import ConfigError

    with pytest.raises(ConfigError) as error:
        Run(config, **run_kwargs).train()
    assert not (Path(config["train"]["output_dir"]) / "checkpoint-1").exists()
    message = str(error.value)
    assert "\n" not in message, message
    return message


def assert_same_rows(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], keys: tuple[str, ...],
                     tolerance: float, steps: int = PARITY_SCHEDULE["max_steps"]) -> None:
    """Both sides logged ``steps`` rows holding every one of ``keys``, equal within ``tolerance``; it trained."""
    import numpy as np

    assert len(ours) == len(theirs) == steps, (ours, theirs)
    assert ours[0] != ours[-1], "nothing changed from the first step to the last"
    for mine, other in zip(ours, theirs):
        assert set(mine) == set(other) == set(keys), (sorted(set(keys) - set(mine)), sorted(set(keys) - set(other)))
        np.testing.assert_allclose([mine[k] for k in keys], [other[k] for k in keys], rtol=0, atol=tolerance,
                                   err_msg=str([(k, mine[k], other[k]) for k in keys]))


TEST_CORPUS = "\n".join(f"record {i}: the quick brown fox {i % 7} jumps over {i % 13} lazy dogs" for i in range(1500))


def write_run_file(folder: str | Path, plugins: list[str], sections: dict[str, Any] | None = None,
                   **train: Any) -> Path:
    """``folder/run.toml`` for an ``engine train`` of a small Llama on a generated corpus (tokenizer
    trained on it), output in ``folder/out``, 8 steps, checkpoint every 4; ``train`` overrides keys."""
    from .config import to_toml

    folder = Path(folder)
    (folder / "corpus.txt").write_text(TEST_CORPUS)
    path = folder / "run.toml"
    path.write_text(to_toml({
        "plugins": list(plugins),
        "train": {"model": "tiny-llama", "output_dir": str(folder / "out"), "max_steps": 8,
                  "per_device_train_batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1, "save_steps": 4,
                  "disable_tqdm": True, "model_config": {"hidden_size": 32, "intermediate_size": 64}, **train},
        "data": {"train": str(folder / "corpus.txt"), "max_length": 32, "tokenizer": "train",
                 "tokenizer_vocab_size": 300},
        **(sections or {})}))
    return path


def write_evaluated_run_file(folder: str | Path, **train: Any) -> Path:
    """:func:`write_run_file`'s run (no plugins), evaluated every 4 steps on 5% of the corpus: a fast base run
    for ``engine sweep`` (``train`` overrides keys)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return write_run_file(folder, [], sections={"data": {
        "train": str(folder / "corpus.txt"), "max_length": 32, "tokenizer": "train", "tokenizer_vocab_size": 300,
        "eval_split": 0.05}}, **{"eval_strategy": "steps", "eval_steps": 4, "logging_steps": 4, **train})


def run_cases(cases_file: str | Path, out_dir: str | Path) -> None:
    """Train every case of a JSON list in this (torchrun-launched) job; the main process saves each
    case's full weights to ``out_dir/<name>.pt``. One launch, many cases: the process group is
    made once and every run's strategy uses it.

    A case: ``{"name", "steps", "plugins", "train", "sections", "objects" (["module:attr"] plugin
    objects), "size", "seq_len", "ragged"}``; the model is :func:`tiny_model` (seed 0), the data
    :func:`tiny_dataset`. Run it as ``torchrun ... -m engine.testing CASES.json OUT_DIR``.
    """
    import json
    import os

    import torch.distributed as dist

    out_dir = Path(out_dir)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    for case in json.loads(Path(cases_file).read_text()):
        objects = [_load_object(spec) for spec in case.get("objects", [])]
        data = tiny_dataset(size=case.get("size", 64), seq_len=case.get("seq_len", 16), ragged=case.get("ragged", False))
        run = run_steps(case["steps"], plugins=case.get("plugins", []), objects=objects,
                        output_dir=out_dir / case["name"], train=case.get("train"), sections=case.get("sections"),
                        model=tiny_model(seed=0), dataset=data)
        weights = run.strategy.model_state_dict(run.model)
        if run.strategy.is_main_process:
            torch.save({name: tensor.detach().cpu() for name, tensor in weights.items()}, out_dir / f"{case['name']}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def _load_object(spec: str) -> Any:
    import importlib

    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


if __name__ == "__main__":
    import sys

    run_cases(sys.argv[1], sys.argv[2])
