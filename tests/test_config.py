"""Config composition: typed sections, unknown keys, overrides, run files."""

from dataclasses import dataclass

import pytest

from engine.config import (
    SECRET_MASK,
    DataConfig,
    TrainConfig,
    apply_overrides,
    compose,
    from_mapping,
    option,
    parse_value,
    read_run_file,
    to_mapping,
    to_toml,
)
from engine.errors import ConfigError


def test_defaults_follow_training_arguments_names():
    train = from_mapping(TrainConfig, {}, "train")
    assert train.optim == "adamw_torch" and train.lr_scheduler_type == "linear"
    assert train.learning_rate == 5e-5 and train.max_grad_norm == 1.0


def test_int_is_accepted_for_float_and_widened():
    train = from_mapping(TrainConfig, {"learning_rate": 1}, "train")
    assert train.learning_rate == 1.0 and isinstance(train.learning_rate, float)


@pytest.mark.parametrize("key, value, expected", [
    ("learning_rate", "fast", "train.learning_rate: expected float, got str 'fast'"),
    ("max_steps", 1.5, "train.max_steps: expected int, got float 1.5"),
    ("max_steps", True, "train.max_steps: expected int, got bool True"),
    ("bf16", "yes", "train.bf16: expected bool, got str 'yes'"),
    ("eval_strategy", "often", "train.eval_strategy: expected 'no' | 'steps' | 'epoch', got str 'often'"),
    ("optim_target_modules", [1], "train.optim_target_modules: expected list of str | str | none, got list [1]"),
])
def test_wrong_type_names_key_and_expected_type(key, value, expected):
    with pytest.raises(ConfigError) as err:
        from_mapping(TrainConfig, {key: value}, "train")
    assert str(err.value) == expected


def test_unknown_key_is_an_error_with_suggestion():
    with pytest.raises(ConfigError, match=r"train.learnin_rate: unknown key; did you mean 'learning_rate'\?"):
        from_mapping(TrainConfig, {"learnin_rate": 1e-3}, "train")
    with pytest.raises(ConfigError, match=r"data.zzz: unknown key; known keys: train, eval"):
        from_mapping(DataConfig, {"zzz": 1}, "data")


def test_parse_value_reads_toml_values_else_strings():
    assert parse_value("1e-4") == 1e-4
    assert parse_value("5") == 5
    assert parse_value("true") is True
    assert parse_value("[1, 2]") == [1, 2]
    assert parse_value('"quoted"') == "quoted"
    assert parse_value("out/dir") == "out/dir"


def test_overrides_set_nested_keys_and_edit_plugins():
    raw = {"plugins": ["a"], "train": {"learning_rate": 1.0}}
    out = apply_overrides(raw, ["train.learning_rate=1e-4", "train.output_dir=out",
                                "neftune.noise_alpha=5", "train.lr_scheduler_kwargs.power=2.0"],
                          ["+neftune,-a"])
    assert out["train"] == {"learning_rate": 1e-4, "output_dir": "out", "lr_scheduler_kwargs": {"power": 2.0}}
    assert out["neftune"] == {"noise_alpha": 5}
    assert out["plugins"] == ["neftune"]
    assert raw == {"plugins": ["a"], "train": {"learning_rate": 1.0}}  # not modified
    assert apply_overrides(raw, [], ["x,y"])["plugins"] == ["x", "y"]


@pytest.mark.parametrize("sets, edits, message", [
    (["train.learning_rate"], [], "expected KEY=VALUE"),
    (["train.max_steps.x=1"], [], "train.max_steps is not a table"),
    ([], ["-missing"], "'missing' is not enabled"),
    ([], ["+a,b"], "mix of names with and without"),
])
def test_bad_overrides(sets, edits, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides({"train": {"max_steps": 3}}, sets, edits)


@dataclass
class NoiseOptions:
    noise_alpha: float = option(5.0, help="noise scale")


def test_compose_validates_plugin_sections_with_their_schema():
    config = compose({"plugins": ["noise"], "noise": {"noise_alpha": 2}}, {"noise": NoiseOptions})
    assert config.section("noise").noise_alpha == 2.0
    with pytest.raises(ConfigError, match="noise.noise_alpha: expected float, got str 'x'"):
        compose({"plugins": ["noise"], "noise": {"noise_alpha": "x"}}, {"noise": NoiseOptions})
    with pytest.raises(ConfigError, match="noise.alpha: unknown key"):
        compose({"plugins": ["noise"], "noise": {"alpha": 1.0}}, {"noise": NoiseOptions})


def test_compose_refuses_sections_of_disabled_or_optionless_plugins():
    with pytest.raises(ConfigError, match=r"noise: unknown section.*enable the plugin"):
        compose({"noise": {"noise_alpha": 1.0}}, {})
    with pytest.raises(ConfigError, match=r"\[quiet\]: plugin 'quiet' takes no options"):
        compose({"plugins": ["quiet"], "quiet": {"x": 1}}, {"quiet": None})
    with pytest.raises(ConfigError, match="plugins: expected list of str"):
        compose({"plugins": "noise"}, {})
    with pytest.raises(ConfigError, match="plugins: a listed twice"):
        compose({"plugins": ["a", "a"]}, {"a": None})


def test_run_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="run file not found: .*nope.toml"):
        read_run_file(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = = 1\n")
    with pytest.raises(ConfigError, match=r"bad.toml: TOML syntax error: .*line 2"):
        read_run_file(bad)


def test_to_toml_round_trips_a_composed_config():
    import tomllib

    config = compose({"plugins": ["noise"], "train": {"optim_args": "a=1"}}, {"noise": NoiseOptions})
    text = to_toml(config.to_mapping())
    parsed = tomllib.loads(text)
    assert parsed["noise"] == {"noise_alpha": 5.0}
    assert parsed["train"]["optim_args"] == "a=1"
    assert "resume_from_checkpoint" not in parsed["train"]  # unset values are comments
    assert compose(parsed, {"noise": NoiseOptions}) .train == config.train


def test_a_secret_option_is_masked_in_the_mapping_but_kept_on_the_instance():
    @dataclass
    class Options:
        token: str | None = option(None, help="a credential", secret=True)
        name: str = option("x", help="not one")

    assert to_mapping(Options(token="hf_abc")) == {"token": SECRET_MASK, "name": "x"}
    assert to_mapping(Options()) == {"token": None, "name": "x"}  # unset stays visible as unset
    assert Options(token="hf_abc").token == "hf_abc"


def test_credentials_inside_tables_are_masked_wherever_the_config_is_shown():
    """A table option (a DeepSpeed config, scheduler arguments) may hold a credential typed into the run
    file: the plan, hyperparams.json and checkpoints show it masked, as options declared secret."""
    from engine.config import SECRET_MASK, DataConfig, RunConfig, TrainConfig

    train = TrainConfig(lr_scheduler_kwargs={"power": 2.0, "comet": {"api_key": "SECRET-1", "project": "p"}},
                        model_config={"hub_token": "SECRET-2"})
    shown = RunConfig(plugins=[], train=train, data=DataConfig()).to_mapping()["train"]
    assert shown["lr_scheduler_kwargs"] == {"power": 2.0, "comet": {"api_key": SECRET_MASK, "project": "p"}}
    assert shown["model_config"] == {"hub_token": SECRET_MASK}
    assert train.lr_scheduler_kwargs["comet"]["api_key"] == "SECRET-1"  # the run itself still has it
