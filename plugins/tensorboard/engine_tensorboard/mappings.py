"""What ``engine migrate`` maps onto this plugin (hook ``trainer_argument_mappings``):
the logging_dir of older TrainingArguments."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine.kit.mappings import Conversion, plugin


def _logging_dir(c: Conversion, name: str, value: Any) -> None:
    output_dir = c.arguments.get("output_dir")
    if value is not None and not (output_dir and Path(str(value)).parent == Path(str(output_dir)) / "runs"):
        c.set("tensorboard.logging_dir", value)  # not the folder older Trainers named by time and host


TRAINER_ARGUMENTS = {
    "logging_dir": dataclasses.replace(plugin("tensorboard", "logging_dir", convert=_logging_dir, note=(
        "Trainer's default output_dir/runs/{time}_{host} is the plugin's default too")), legacy_defaults=(None,)),
}
