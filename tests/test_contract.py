"""The plugin contract: every hook is documented, called by the loop, tested and in the docs."""

import importlib.util
import re
from pathlib import Path

import pytest

import engine

from engine import hookspecs
from engine.errors import RestartTraining
from engine.testing import HOOK_NAMES, HookRecorder, run_steps, tiny_dataset, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_hook_names_are_the_specs():
    assert len(HOOK_NAMES) >= 20
    assert set(hookspecs.PER_PLUGIN_HOOKS) <= set(HOOK_NAMES)


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_documents_when_and_how_results_combine(name):
    doc = getattr(hookspecs, name).__doc__
    assert doc and "**When**" in doc and "**Combine**" in doc, name


def test_every_hook_is_called_by_a_run(tmp_path):
    """One run that evaluates, saves and resumes fires every hook the spec declares."""
    # samples: log_samples (a generation needs a tokenizer, and the model its vocabulary)
    samples = {"plugins": ["samples"], "tokenizer": tiny_tokenizer(),
               "sections": {"samples": {"prompts": ["a"], "max_new_tokens": 1}}}
    first = HookRecorder()
    run_steps(2, objects=[first], output_dir=tmp_path, eval_dataset=tiny_dataset(4), model=tiny_model(vocab_size=300),
              train={"eval_strategy": "steps", "eval_steps": 1, "save_strategy": "steps", "save_steps": 2},
              **samples)
    resumed = HookRecorder()
    # a path (rather than true) asks locate_checkpoint first
    run = run_steps(3, objects=[resumed], output_dir=tmp_path, model=tiny_model(vocab_size=300),
                    eval_dataset=tiny_dataset(4), train={"resume_from_checkpoint": str(tmp_path / "checkpoint-2"),
                                                         "eval_strategy": "steps", "eval_steps": 1}, **samples)
    run.predict(tiny_dataset(2, vocab_size=300))  # on_predict
    run.plan()  # plan_lines
    from_data = HookRecorder()  # run_steps passes its dataset: the data hook fires for [data] only
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a small corpus" for i in range(50)))
    engine.Run({"train": {"output_dir": str(tmp_path / "data-run")},
                "data": {"train": str(corpus), "max_length": 8, "tokenizer_vocab_size": 280}},
               plugins=[from_data]).setup()
    restarted = HookRecorder()  # on_restart: a training step asks to start again
    run_steps(1, objects=[restarted, RestartOnce()], output_dir=tmp_path / "restarted")
    called = set(first.names()) | set(resumed.names()) | set(from_data.names()) | set(restarted.names())
    assert sorted(set(HOOK_NAMES) - called) == []
    assert resumed.count("load_checkpoint_state") == 1 and resumed.count("training_step") == 1


class RestartOnce:
    """Asks the loop to start training again at the first step."""

    restarted = False

    @engine.hookimpl(wrapper=True)
    def training_step(self, run, batches, num_items_in_batch):
        if not self.restarted:
            self.restarted = True
            raise RestartTraining("once")
        return (yield)


def test_hooks_fire_in_the_documented_order(tmp_path):
    recorder = HookRecorder()
    run_steps(2, objects=[recorder], output_dir=tmp_path, train={"logging_steps": 2})
    names = [n for n in recorder.names() if not n.startswith("register_")]
    # resolve_task: the task builtin's configure reads run.task (the model is given)
    assert names[:6] == ["check_raw_config", "plugin_options", "resolve_task", "configure", "checkpoint_weights",
                         "create_strategy"]
    assert names.index("create_strategy") < names.index("on_build_start") < names.index("create_tokenizer") < \
        names.index("on_model_built") < names.index("on_build_end") < names.index("patch_model")
    assert names.index("patch_model") < names.index("create_optimizer") < names.index("create_scheduler")
    start = names.index("on_train_start")
    assert names[start - 1] == "log_hyperparams"
    assert names[start:start + 4] == ["on_train_start", "on_train_mode", "on_epoch_start", "training_step"]
    step = names.index("training_step")
    assert names[step:step + 3] == ["training_step", "compute_loss", "on_step_end"]
    assert names[-8:] == ["on_epoch_end", "on_train_summary", "log_metrics", "on_eval_mode", "on_before_final_save",
                          "on_train_end", "on_train_exit", "log_finish"]


def test_recorder_sees_hook_arguments(tmp_path):
    recorder = HookRecorder()
    run = run_steps(1, objects=[recorder], output_dir=tmp_path, train={"gradient_accumulation_steps": 2})
    (_, args), = [c for c in recorder.calls if c[0] == "training_step"]
    assert args["run"] is run and len(args["batches"]) == 2
    assert int(args["num_items_in_batch"]) == 2 * 4 * 15  # 2 micro-batches, 4 rows of 16 tokens, shifted


def _test_sources() -> str:
    sources = []
    for path in [*ROOT.glob("tests/test_*.py"), *ROOT.glob("plugins/*/tests/test_*.py"),
                 *ROOT.glob("contrib/*/tests/test_*.py")]:
        if path.name != "test_contract.py":
            sources.append(path.read_text())
    return "\n".join(sources)


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_has_a_test(name):
    """A hook is exercised by name in some test beyond this contract file (datasette's rule)."""
    assert re.search(rf"\b{name}\b", _test_sources()), f"no test mentions hook {name!r}"


def test_hook_reference_is_up_to_date():
    spec = importlib.util.spec_from_file_location("generate_hooks", ROOT / "docs" / "generate_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "hooks.md").read_text() == module.render(), \
        "docs/hooks.md is stale: run python docs/generate_hooks.py"
