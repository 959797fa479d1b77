"""train.auto_find_batch_size: an out-of-memory error in a training step starts the run again with the
batch size x 0.9 (accelerate's find_executable_batch_size, which Trainer uses), and the run then
equals one started with the batch size that fit.

A real out-of-memory error on the CPU: a process whose address space is capped (RLIMIT_AS) after the
model and optimizer are built, so the allocator fails ("DefaultCPUAllocator: can't allocate memory",
one of the errors accelerate retries). The in-process cases raise the CUDA error a GPU raises
(torch.OutOfMemoryError), from a chosen step on, to check what a restart puts back.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engine import hookimpl
from engine.testing import assert_one_line_error, logged_scalars, run_steps, same_weights


class OutOfMemoryAbove:
    """Raises CUDA's out-of-memory error in forward for a batch of more than ``rows`` rows, from step ``from_step``."""

    name = "out_of_memory_above"

    def __init__(self, rows: int, from_step: int = 0):
        self.rows, self.from_step = rows, from_step
        self.failed_sizes: list[int] = []

    @hookimpl
    def patch_model(self, run, model):
        def check(module, args, kwargs):
            size = kwargs["input_ids"].shape[0]
            if size > self.rows and run.state.global_step >= self.from_step:
                self.failed_sizes.append(size)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                             "capacity of 79.11 GiB")

        return model.register_forward_pre_hook(check, with_kwargs=True).remove


def test_a_step_out_of_memory_starts_the_run_again_with_a_smaller_batch(tmp_path, capfd):
    # batch 6 trains steps 1-2 (and saves them), runs out of memory at step 3; 5 the same; 4 fits
    fault = OutOfMemoryAbove(rows=4, from_step=2)
    train = {"per_device_train_batch_size": 6, "auto_find_batch_size": True, "save_strategy": "steps",
             "save_steps": 2}
    found = run_steps(6, objects=[fault], output_dir=tmp_path / "auto", train=train)
    assert fault.failed_sizes == [6, 5]
    printed = capfd.readouterr().err
    assert "per_device_train_batch_size 6 ran out of memory at step 3; starting again with 5" in printed
    assert printed.count("removing checkpoint-2 of the failed attempt") == 2
    assert found.config.train.per_device_train_batch_size == 4

    reference = run_steps(6, output_dir=tmp_path / "reference", train={"per_device_train_batch_size": 4})
    assert same_weights(found.model, reference.model) == []  # the failed attempts left nothing behind
    losses = {step: value for (name, step), value in logged_scalars(tmp_path / "auto").items() if name == "loss"}
    assert losses == {step: value for (name, step), value in logged_scalars(tmp_path / "reference").items()
                      if name == "loss"}
    # the failed attempts' checkpoints are gone; those kept hold the batch size found
    state = json.loads((tmp_path / "auto" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["config"]["train"]["per_device_train_batch_size"] == 4
    assert state["steps_per_epoch"] == 16  # 64 rows / 4

    # a resume continues with the checkpoint's batch size, as Trainer restores train_batch_size
    resumed = run_steps(6, objects=[OutOfMemoryAbove(rows=4, from_step=2)], output_dir=tmp_path / "auto",
                        train={**train, "resume_from_checkpoint": str(tmp_path / "auto" / "checkpoint-4")})
    assert resumed.config.train.per_device_train_batch_size == 4
    assert same_weights(resumed.model, reference.model) == []


def test_without_auto_find_batch_size_the_error_stops_the_run(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        run_steps(2, objects=[OutOfMemoryAbove(rows=2)], output_dir=tmp_path / "a",
                  train={"per_device_train_batch_size": 4})
    # and with it, a batch of 1 that does not fit ends the search in one line
    with pytest.raises(Exception) as raised:
        run_steps(2, objects=[OutOfMemoryAbove(rows=0)], output_dir=tmp_path / "b",
                  train={"per_device_train_batch_size": 2, "auto_find_batch_size": True})
    assert "train.auto_find_batch_size: no batch size fits, even 1 ran out of memory" in str(raised.value)


def test_given_optimizer_objects_are_refused(tmp_path):
    from engine.testing import tiny_model

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Exception, match="auto_find_batch_size: Run\\(optimizers=\\(optimizer, scheduler\\)\\)"):
        run_steps(1, model=model, output_dir=tmp_path, train={"auto_find_batch_size": True},
                  optimizers=(optimizer, None))


REAL_OUT_OF_MEMORY = textwrap.dedent("""
    import json, resource, sys
    import torch
    from engine import hookimpl
    from engine.testing import run_steps, same_weights, tiny_dataset, tiny_model

    torch.set_num_threads(1)  # no new threads (their stacks) once the address space is capped

    def address_space():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    class CapMemory:
        name = "cap_memory"

        @hookimpl
        def on_train_start(self, run):  # model, optimizer and data are built: cap what steps may add
            resource.setrlimit(resource.RLIMIT_AS, (address_space() + (150 << 20), resource.RLIM_INFINITY))

        @hookimpl
        def on_train_end(self, run):
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    # a row of 64 tokens x 32768 logits is 8 MB per copy of the logits, and a step holds several copies:
    # 150 MB more fit a few rows, never 16
    data = tiny_dataset(size=64, seq_len=64, vocab_size=32768)
    train = {"per_device_train_batch_size": 16, "auto_find_batch_size": True, "save_final_model": False,
             "logging_steps": 1}
    found = run_steps(3, objects=[CapMemory()], model=tiny_model(vocab_size=32768), dataset=data,
                      output_dir=sys.argv[1] + "/auto", train=train)
    size = found.config.train.per_device_train_batch_size
    reference = run_steps(3, model=tiny_model(vocab_size=32768), dataset=data, output_dir=sys.argv[1] + "/ref",
                          train={**train, "per_device_train_batch_size": size, "auto_find_batch_size": False})
    print(json.dumps({"size": size, "differ": same_weights(found.model, reference.model)}))
""")


def test_a_real_cpu_out_of_memory_error_finds_a_batch_that_fits(tmp_path):
    script = tmp_path / "capped.py"
    script.write_text(REAL_OUT_OF_MEMORY)
    # large blocks mapped afresh and returned when freed, in one arena: the address space then follows
    # what the tensors hold, not what the allocator kept for later
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "1"}
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert 1 <= outcome["size"] < 16
    assert outcome["differ"] == []
    assert "per_device_train_batch_size 16 ran out of memory at step" in result.stderr
    assert "; starting again with 14" in result.stderr


class CountingCallback:
    """A stateful TrainerCallback (ExportableState): the events it saw, as Trainer's callbacks count them."""

    @staticmethod
    def make():
        from transformers import TrainerCallback
        from transformers.trainer_callback import ExportableState

        class Counting(TrainerCallback, ExportableState):
            def __init__(self):
                self.evaluations = self.steps = 0

            def on_evaluate(self, args, state, control, **kwargs):
                self.evaluations += 1

            def on_step_end(self, args, state, control, **kwargs):
                self.steps += 1

            def state(self):
                return {"args": {}, "attributes": {"evaluations": self.evaluations, "steps": self.steps}}

        return Counting()


def _plugin_states(run):
    """Early stopping's counter and best value, the TrainerCallbacks' TrainerState and the callback's own counts."""
    stopping = run.plugin_manager.pm.get_plugin("early_stopping")
    adapter = run.plugin_manager.pm.get_plugin("builtin.callbacks")
    theirs = adapter.state
    callback, = adapter.callbacks
    return {"early_stopping": (stopping.best, stopping.evaluations_without_improvement),
            "trainer_state": (theirs.global_step, theirs.max_steps, theirs.train_batch_size, theirs.num_train_epochs,
                              theirs.best_metric, theirs.best_global_step),
            "callback": (callback.evaluations, callback.steps)}


def test_a_restart_puts_the_plugins_state_back_as_a_run_started_with_the_batch_that_fit(tmp_path):
    """Early stopping's patience counter, the TrainerCallbacks' TrainerState and a stateful callback
    after restarts equal those of a run started with the batch size found (on_restart)."""
    from engine.testing import tiny_dataset

    # every evaluation after the first misses the threshold: the patience counter counts them all
    train = {"eval_strategy": "steps", "eval_steps": 1, "metric_for_best_model": "loss",
             "per_device_eval_batch_size": 4}  # evaluation batches fit
    sections = {"early_stopping": {"patience": 100, "threshold": 10.0}}
    found = run_steps(6, ["early_stopping"], objects=[OutOfMemoryAbove(rows=4, from_step=2)],
                      output_dir=tmp_path / "auto", eval_dataset=tiny_dataset(8, seed=1), sections=sections,
                      callbacks=[CountingCallback.make()],
                      train={**train, "per_device_train_batch_size": 6, "auto_find_batch_size": True})
    assert found.config.train.per_device_train_batch_size == 4
    reference = run_steps(6, ["early_stopping"], output_dir=tmp_path / "reference", sections=sections,
                          eval_dataset=tiny_dataset(8, seed=1), callbacks=[CountingCallback.make()],
                          train={**train, "per_device_train_batch_size": 4})
    assert _plugin_states(found) == _plugin_states(reference)
    assert _plugin_states(reference)["early_stopping"][1] == 5 and _plugin_states(reference)["callback"] == (6, 6)
