"""The train loader comes from the create_train_loader hook: builtin.loaders answers it, a plugin may
answer instead, and blocking the builtin without another answer is refused."""

import re

import pytest
import torch

import engine
from engine import hookimpl
from engine.kit.loaders import loader_data, loader_options
from engine.testing import HookRecorder, run_steps


def test_the_train_loader_is_made_after_the_model_is_prepared_and_before_the_optimizer(tmp_path):
    recorder = HookRecorder()
    run = run_steps(1, objects=[recorder], output_dir=tmp_path)
    names = recorder.names()
    assert names.index("patch_model") < names.index("create_train_loader") < names.index("create_optimizer")
    assert run.plugin_manager.call_order("create_train_loader")[-1] == "builtin.loaders"
    assert isinstance(run.train_loader.sampler, engine.kit.loaders.EpochSampler)


def test_a_plugin_answers_create_train_loader(tmp_path):
    class Sequential:
        calls = 0

        @hookimpl
        def create_train_loader(self, run):
            Sequential.calls += 1
            dataset, collator = loader_data(run, run.train_dataset, "train dataset")
            return torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=collator,
                                               generator=torch.Generator(), **loader_options(run))

    run = run_steps(3, objects=[Sequential()], output_dir=tmp_path)
    assert Sequential.calls == 1 and run.state.global_step == 3
    assert run.train_loader.batch_size == 2 and isinstance(run.train_loader.sampler, torch.utils.data.SequentialSampler)


def test_blocking_builtin_loaders_without_another_answer_is_refused():
    with pytest.raises(engine.EngineError, match=re.escape("'-builtin.loaders' leaves no plugin answering "
                                                           "create_train_loader")):
        engine.Run({"plugins": ["-builtin.loaders"]})
