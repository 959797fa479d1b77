"""The builtins resolve and check the [train] keys they own in configure (tryfirst): an enabled plugin's
configure already sees the resolved values, and a refusal still comes before anything loads."""

import pytest

import engine
from engine import hookimpl
from engine.errors import ConfigError


class Seen:
    """An enabled plugin that notes what its configure sees."""

    def __init__(self):
        self.train = None

    @hookimpl
    def configure(self, run):
        train = run.config.train
        self.train = (train.metric_for_best_model, train.greater_is_better, train.activation_checkpointing,
                      train.torch_compile)


def test_an_enabled_plugin_sees_the_values_the_builtins_resolved():
    seen = Seen()
    run = engine.Run({"train": {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "best",
                                "gradient_checkpointing": True, "torch_compile_backend": "eager"},
                      "data": {"eval_split": 0.1}},
                     plugins={"seen": seen})
    assert seen.train == ("loss", False, True, True)
    assert run.config.train.gradient_checkpointing is None  # the older name handed over to the newer one


@pytest.mark.parametrize("train, message", [
    ({"save_strategy": "best", "eval_strategy": "steps"}, "train.save_strategy = 'best' saves after evaluations"),
    ({"gradient_checkpointing": True, "activation_checkpointing": False, "gradient_checkpointing_kwargs": {"a": 1},
      "activation_checkpointing_kwargs": {"a": 2}}, "train.gradient_checkpointing_kwargs = {'a': 1} and "
                                                    "train.activation_checkpointing_kwargs = {'a': 2} disagree"),
    ({"include_for_metrics": ["labels"]}, "train.include_for_metrics: 'labels' is not one of"),
    ({"dataloader_persistent_workers": True}, "train.dataloader_persistent_workers needs worker processes"),
])
def test_a_refusal_comes_before_any_enabled_plugin_configures(train, message):
    seen = Seen()
    with pytest.raises(ConfigError, match=message):
        engine.Run({"train": train}, plugins={"seen": seen})
    assert seen.train is None
