"""Helpers for plugin authors' tests: a tiny model and dataset, short runs, a hook recorder, what a
run logged (to compare trackers with), and launching several processes with torchrun.

Example (a whole plugin test)::

    from engine.testing import HookRecorder, run_steps

    def test_my_plugin_runs(tmp_path):
        recorder = HookRecorder()
        run = run_steps(3, plugins=["myplugin"], objects=[recorder], output_dir=tmp_path)
        assert recorder.count("on_step_end") == 3
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

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
    from .data import DataCollator

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
