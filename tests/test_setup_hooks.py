"""Run.setup as a sequence of hooks: the tokenizer, data, model and collator come from hooks that a plugin
may answer instead of the builtins, the checks around them fire in order, and the model's
from_pretrained keywords come from model_load_kwargs (merged; one key from two plugins refused)."""

import pytest
import torch

import engine
from engine import hookimpl
from engine.errors import ConfigError
from engine.testing import HookRecorder, tiny_dataset, tiny_model, tiny_tokenizer

SETUP_ORDER = ["on_build_start", "create_tokenizer", "create_datasets", "prepare_dataset", "create_model",
               "model_load_kwargs", "on_model_built", "create_collator", "on_build_end", "patch_model"]


def _corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a small corpus about foxes and owls" for i in range(60)))
    return corpus


def _config(tmp_path, **data):
    return {"train": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "disable_tqdm": True},
            "data": {"train": str(_corpus(tmp_path)), "max_length": 8, "tokenizer_vocab_size": 280, **data}}


def test_setup_calls_the_construction_hooks_in_order(tmp_path):
    recorder = HookRecorder()
    run = engine.Run(_config(tmp_path), plugins=[recorder])
    run.setup()
    names = recorder.names()
    assert [names.index(name) for name in SETUP_ORDER] == sorted(names.index(name) for name in SETUP_ORDER)
    assert names.count("resolve_task") == 1  # read once, then cached
    (_, arguments), = [call for call in recorder.calls if call[0] == "create_tokenizer"]
    assert arguments["checkpoint"] is None
    assert run.task == "causal-lm" and run.tokenizer is not None and run.data_collator is not None


def test_a_plugin_answers_tokenizer_model_collator_and_task(tmp_path):
    tokenizer, model = tiny_tokenizer(300), tiny_model(vocab_size=300)

    def collate(examples):
        return {"input_ids": torch.stack([e["input_ids"] for e in examples]),
                "labels": torch.stack([e["labels"] for e in examples])}

    class Builder:
        @hookimpl
        def create_tokenizer(self, run):
            return tokenizer

        @hookimpl
        def create_model(self, run):
            return model

        @hookimpl
        def create_collator(self, run):
            return collate

        @hookimpl
        def resolve_task(self, run):
            return "causal-lm"

    run = engine.Run(_config(tmp_path), train_dataset=tiny_dataset(8, vocab_size=300), plugins={"builder": Builder()})
    run.train()
    assert run.tokenizer is tokenizer and run.model is model and run.data_collator is collate
    assert run.state.global_step == 1


def test_prepare_dataset_answers_for_a_plugins_own_rows(tmp_path):
    class Records:  # a plugin's own kind of data, made examples by its prepare_dataset
        def __init__(self, rows):
            self.rows = rows

    class RecordsPlugin:
        @hookimpl(tryfirst=True)
        def prepare_dataset(self, run, dataset, key):
            if isinstance(dataset, Records):
                return tiny_dataset(len(dataset.rows), vocab_size=300)
            return None

    run = engine.Run(_config(tmp_path), model=tiny_model(vocab_size=300), tokenizer=tiny_tokenizer(300),
                     train_dataset=Records(range(8)), plugins={"records": RecordsPlugin()})
    run.setup()
    assert len(run.train_dataset) == 8 and "input_ids" in run.train_dataset[0]
    assert len(run.predict(Records(range(4))).predictions) == 4  # Run.predict prepares its dataset the same way


def test_a_refusal_in_on_build_start_comes_before_anything_loads(tmp_path):
    calls = []

    class Refuse:
        @hookimpl
        def on_build_start(self, run):
            raise ConfigError("refuse: nothing loads")

        @hookimpl
        def create_tokenizer(self, run):
            calls.append("create_tokenizer")

    run = engine.Run(_config(tmp_path), plugins={"refuse": Refuse()})
    with pytest.raises(ConfigError, match="refuse: nothing loads"):
        run.setup()
    assert calls == [] and run.model is None and run.train_dataset is None


def test_on_model_built_and_on_build_end_see_the_built_pieces(tmp_path):
    seen = {}

    class Watch:
        @hookimpl
        def on_model_built(self, run):
            seen["on_model_built"] = (run.model is not None, run.data_collator)

        @hookimpl
        def on_build_end(self, run):
            seen["on_build_end"] = (run.data_collator is not None, list(run.label_names))

    engine.Run(_config(tmp_path), plugins={"watch": Watch()}).setup()
    assert seen == {"on_model_built": (True, None), "on_build_end": (True, ["labels"])}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    tiny_model(vocab_size=300).save_pretrained(folder)
    tiny_tokenizer(300).save_pretrained(folder)
    return folder


def _loads(name, kwargs):
    class LoadKwargs:
        @hookimpl
        def model_load_kwargs(self, run):
            return kwargs

    return name, LoadKwargs()


def test_model_load_kwargs_reach_from_pretrained(tmp_path, saved_model):
    config = _config(tmp_path)
    config["train"]["model"] = str(saved_model)
    run = engine.Run(config, plugins=dict([_loads("eager", {"attn_implementation": "eager"})]))
    run.setup()
    assert run.model.config._attn_implementation == "eager"


def test_one_load_keyword_from_two_plugins_is_refused_naming_both(tmp_path, saved_model):
    config = _config(tmp_path)
    config["train"]["model"] = str(saved_model)
    plugins = dict([_loads("first", {"attn_implementation": "eager"}),
                    _loads("second", {"attn_implementation": "sdpa"})])
    run = engine.Run(config, plugins=plugins)
    with pytest.raises(ConfigError, match="model_load_kwargs: plugins '(first|second)' and '(first|second)' both set "
                                          "'attn_implementation'"):
        run.setup()


@pytest.mark.parametrize("old, new, name", [("engine.data", "engine.builtin.data.collators", "DataCollator"),
                                            ("engine.models", "engine.builtin.models", "build_model"),
                                            ("engine.tasks", "engine.builtin.tasks", "label_settings")])
def test_the_old_module_paths_work_for_a_release_with_a_warning(old, new, name):
    import subprocess
    import sys

    moved_to = old.replace("engine.", "engine.builtin.")
    code = (f"import warnings\nwith warnings.catch_warnings(record=True) as caught:\n"
            f"    warnings.simplefilter('always')\n    from {old} import {name}\n"
            f"assert any(w.category is DeprecationWarning and {moved_to!r} in str(w.message) for w in caught), caught\n"
            f"from {new} import {name} as moved\nassert {name} is moved\n")
    subprocess.run([sys.executable, "-c", code], check=True)
