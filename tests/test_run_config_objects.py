"""``engine.Run(training_args)``: a Trainer user's arguments object as the run's config, converted by the
tooling's ``convert_run_config`` with ``engine migrate``'s table."""

import logging

import pytest
from transformers import TrainingArguments

import engine
from engine.errors import ConfigError

STEPS = {"max_steps": 3, "learning_rate": 1e-3, "per_device_train_batch_size": 2, "logging_steps": 1,
         "save_strategy": "no", "seed": 7}


def losses(run):
    run.train()
    return [row["loss"] for row in run.state.log_history if "loss" in row]


def test_a_training_arguments_object_trains_as_the_mapping_engine_migrate_writes(tmp_path):
    arguments = TrainingArguments(output_dir=str(tmp_path / "a"), report_to="none", **STEPS)
    from_object = engine.Run(arguments)
    assert (from_object.config.train.learning_rate, from_object.config.train.max_steps) == (1e-3, 3)
    mapping = engine.migrate(arguments).mapping
    mapping["train"]["output_dir"] = str(tmp_path / "b")
    assert losses(from_object) == losses(engine.Run(mapping))


def test_what_does_not_carry_over_is_one_warning_line(tmp_path, caplog):
    arguments = TrainingArguments(output_dir=str(tmp_path), report_to="none", logging_nan_inf_filter=False, **STEPS)
    with caplog.at_level(logging.WARNING, logger="engine"):
        engine.Run(arguments)
    (line,) = [record.getMessage() for record in caplog.records if "not carried over" in record.getMessage()]
    assert "Run(TrainingArguments)" in line and "logging_nan_inf_filter = false" in line and "\n" not in line


def test_an_object_no_convert_run_config_knows_is_one_line():
    with pytest.raises(ConfigError, match=r"^Run\(config\): expected a run file, a mapping or a "
                                          r"TrainingArguments, got SimpleNamespace$"):
        engine.Run(__import__("types").SimpleNamespace(lr=1))
