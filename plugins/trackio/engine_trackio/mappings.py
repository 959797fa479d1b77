"""What ``engine migrate`` maps onto this plugin (hook ``trainer_argument_mappings``):
TrainingArguments' project and trackio_* fields."""

from __future__ import annotations

from typing import Any

from engine.kit.mappings import Conversion, plugin


def _static_space(c: Conversion, name: str, value: Any) -> None:
    if isinstance(value, str):  # False: none; None: Trainer's default name, which the engine does not make
        c.set(c.answer.keys[0], value)


TRAINER_ARGUMENTS = {
    "project": plugin("trackio", "project"),
    "trackio_space_id": plugin("trackio", "space_id"),
    "trackio_bucket_id": plugin("trackio", "bucket_id"),
    "trackio_static_space_id": plugin("trackio", "static_space_id", convert=_static_space, note=(
        "a name: the snapshot Space made after training; the engine makes none unless named (Trainer's None "
        "makes one with a default name when pushing to the Hub)")),
}
