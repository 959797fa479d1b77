"""What ``engine migrate`` maps onto this plugin (hook ``trainer_argument_mappings``):
TrainingArguments' ddp_* options."""

from __future__ import annotations

from typing import Any

from engine.kit.mappings import Conversion, plugin

_DDP_NOTE = "a value enables the plugin (the Trainer run used DDP), unless fsdp or deepspeed is used"


def _ddp_option(c: Conversion, name: str, value: Any) -> None:
    if value is not None:  # set: the Trainer run used DDP (unless fsdp or deepspeed, which win)
        c.enable("ddp")
        c.set(c.answer.keys[0], value)


TRAINER_ARGUMENTS = {
    "ddp_find_unused_parameters": plugin("ddp", "find_unused_parameters", convert=_ddp_option, note=_DDP_NOTE),
    "ddp_bucket_cap_mb": plugin("ddp", "bucket_cap_mb", convert=_ddp_option, note=_DDP_NOTE),
    "ddp_broadcast_buffers": plugin("ddp", "broadcast_buffers", convert=_ddp_option, note=_DDP_NOTE),
    "ddp_static_graph": plugin("ddp", "static_graph", convert=_ddp_option, note=_DDP_NOTE),
}
