"""Resume is the builtin ``builtin.resume``: the kernel reaches it through resolve_checkpoint, check_checkpoint
and restore_checkpoint, which other plugins answer, add to or wrap like any hook."""

import re

import pytest

from engine import CheckpointError, ConfigError, Run, hookimpl
from engine.builtin.data.collators import DataCollator
from engine.testing import run_steps, tiny_dataset, tiny_model

SAVED = {"save_strategy": "steps", "save_steps": 2}
TINY = {"per_device_train_batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1, "disable_tqdm": True}


def _resume(output_dir, objects, max_steps):
    """Resume the run in ``output_dir`` to ``max_steps`` with ``objects`` registered directly (as in
    test_checkpoint: not enabled plugins, so not in the checkpoint's plugin set)."""
    run = Run({"train": {**TINY, **SAVED, "max_steps": max_steps, "resume_from_checkpoint": True,
                         "output_dir": str(output_dir)}},
              model=tiny_model(), train_dataset=tiny_dataset(), data_collator=DataCollator(0))
    for index, plugin in enumerate(objects):
        run.plugin_manager.pm.register(plugin, name=f"test-plugin-{index}")
    run.train()
    return run


@pytest.mark.parametrize("spec", [True, "some/checkpoint-4"])
def test_a_run_that_blocks_builtin_resume_and_resumes_is_refused_before_anything_loads(spec):
    with pytest.raises(ConfigError, match=re.escape(f"train.resume_from_checkpoint = {spec!r}: no plugin of this run "
                                                    "restores checkpoints")):
        Run({"plugins": ["-builtin.resume"], "train": {"max_steps": 1, "resume_from_checkpoint": spec}})


def test_reset_optimizer_belongs_to_builtin_resume(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("train.reset_optimizer is read by builtin.resume, which this run "
                                                    "blocks")):
        Run({"plugins": ["-builtin.resume"], "train": {"max_steps": 1, "reset_optimizer": True}})
    run = run_steps(2, ["-builtin.resume"], output_dir=tmp_path, train=SAVED)  # a fresh run needs no resume
    assert run.state.global_step == 2


class ChecksTheStep:
    """Adds its own check_checkpoint refusal to the builtin's."""

    @hookimpl
    def check_checkpoint(self, run, path):
        if path.name != "checkpoint-4":
            raise CheckpointError(f"resume_from_checkpoint: {path} is not the checkpoint of step 4")


class TakesTheOldest:
    """Answers resolve_checkpoint with the oldest checkpoint instead of the newest."""

    def __init__(self):
        self.asked = []

    @hookimpl
    def resolve_checkpoint(self, run, run_id):
        self.asked.append(run_id)
        return run.output_dir / "checkpoint-2"


class SeesTheRestore:
    """Wraps restore_checkpoint: the builtin's answer and the step it restored."""

    def __init__(self):
        self.restored = []

    @hookimpl(wrapper=True)
    def restore_checkpoint(self, run, path):
        result = yield
        self.restored.append((path.name, run.state.global_step, result))
        return result


def test_plugins_resolve_check_and_wrap_the_restore_of_a_checkpoint(tmp_path):
    first = run_steps(4, output_dir=tmp_path, train=SAVED)
    oldest, seen = TakesTheOldest(), SeesTheRestore()
    with pytest.raises(CheckpointError, match="checkpoint-2 is not the checkpoint of step 4"):
        _resume(tmp_path, [oldest, ChecksTheStep()], max_steps=6)
    assert oldest.asked == [first.run_id]
    resumed = _resume(tmp_path, [seen], max_steps=6)
    assert seen.restored == [("checkpoint-4", 4, True)]
    assert resumed.state.global_step == 6
